"""The choice between the C twins and their Python twins (logstore.twins), and what CI relies on
to prove both (tests/twins.py, .ci/run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from logstore.twins import NO_EXTENSIONS_ENV, c_twin, extensions_disabled
from tests import twins
from tests.twins import (
    ROOT, choosing_modules, extension_names, in_second_pass, unbuilt_extensions, uses_twins)

# Each twin a module chooses: (the module, the name it keeps the chosen function under) and the
# extension it asks for (a module may choose more than one).
CHOSEN = {
    ("logstore.record", "frame_records"): "logstore._framing",
    ("logstore.record", "split_records"): "logstore._framing",
    ("logstore.fileio", "_write_sync_c"): "logstore._framing",
    ("serverkit.send_check", "_check_many_c"): "serverkit._send_check",
    ("serverkit.io_thread", "new_call_queue"): "serverkit._call_queue",
    ("realtime.storage.consumer_log", "_encode_entries_c"): "realtime.storage._codecs",
    ("realtime.storage.message_record", "_encode_subject_records_c"): "realtime.storage._codecs",
    ("realtime.storage.message_record", "_decode_message_headers_c"): "realtime.storage._codecs",
    ("realtime.storage.control_record", "_encode_visible_records_c"): "realtime.storage._codecs",
    ("realtime.storage.store_checkpoint", "_encode_held_entries_c"): "realtime.storage._codecs",
    ("realtime.storage.write_batch", "_check_run_c"): "realtime.storage._codecs",
    ("realtime.storage.commit_run", "encode_run"): "realtime.storage._codecs",
    ("realtime.storage.commit_run", "write_run"): "realtime.storage._codecs",
    ("delayserver.storage.due_records", "parse_due_run"): "delayserver._due_records",
    ("delayserver.storage.delay_record", "encode_delay_records"): "delayserver._commit_codecs",
    ("delayserver.storage.delay_record", "frame_delay_records"): "delayserver._commit_codecs",
    ("delayserver.storage.schedule_entry", "encode_schedule_entries"): "delayserver._commit_codecs",
}


def test_every_extension_setup_py_builds_is_chosen_by_a_module_and_only_those():
    expected: dict[str, list[str]] = {}
    for (module, _name), extension in CHOSEN.items():
        expected.setdefault(module, []).append(extension)
    assert {".".join(path.relative_to(ROOT).with_suffix("").parts): extensions
            for path, extensions in choosing_modules().items()} == expected
    assert sorted(set(extension_names())) == sorted(set(CHOSEN.values()))


def chosen_in_a_fresh_interpreter(environment: dict[str, str]) -> dict[str, str]:
    """Each chosen twin's "module.name" -> the type name of what its module took, in a new
    interpreter (the choice is made once, at import)."""
    names = list(CHOSEN)
    script = ("import importlib, json\n"
              f"names = {names!r}\n"
              "print(json.dumps({m + '.' + n: type(getattr(importlib.import_module(m), n))"
              ".__name__ for m, n in names}))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=True, env=environment).stdout
    return json.loads(out.splitlines()[-1])


def test_no_extensions_in_the_environment_makes_every_module_take_its_python_twin(monkeypatch):
    monkeypatch.setenv(NO_EXTENSIONS_ENV, "1")
    assert c_twin("logstore._framing", "frame_records") is None
    chosen = chosen_in_a_fresh_interpreter(dict(os.environ))
    # A Python twin is a function, or None where the module keeps "no C twin" as None.
    assert set(chosen.values()) <= {"function", "NoneType"}, chosen


@pytest.mark.parametrize("value", [None, "0"])
def test_without_the_variable_each_built_c_twin_is_the_one_chosen(value):
    environment = {k: v for k, v in os.environ.items() if k != NO_EXTENSIONS_ENV}
    if value is not None:
        environment[NO_EXTENSIONS_ENV] = value
    unbuilt = {line.split(":")[0] for line in unbuilt_extensions()}
    chosen = chosen_in_a_fresh_interpreter(environment)
    assert chosen == {f"{module}.{name}": "function" if extension in unbuilt
                      else "builtin_function_or_method"
                      for (module, name), extension in CHOSEN.items()
                      } | {f"{module}.{name}": "NoneType"
                           for (module, name), extension in CHOSEN.items()
                           if extension in unbuilt and name.endswith("_c")}


@pytest.mark.parametrize("value, disabled", [("", False), ("0", False), ("1", True),
                                             ("yes", True)])
def test_only_an_empty_or_zero_value_leaves_the_extensions_on(monkeypatch, value, disabled):
    monkeypatch.setenv(NO_EXTENSIONS_ENV, value)
    assert extensions_disabled() is disabled


def test_the_build_check_names_each_extension_that_cannot_be_imported(monkeypatch):
    monkeypatch.setattr(twins, "extension_names",
                        lambda: ["logstore.twins", "logstore._no_such_twin"])
    (missing,) = twins.unbuilt_extensions()
    assert missing.startswith("logstore._no_such_twin: ")


def test_the_second_pass_keeps_the_twin_tests_and_leaves_out_tests_that_load_no_twin():
    tests = ROOT / "tests"
    for kept in ("unit/test_logstore_codecs.py", "unit/test_send_check.py",
                 "unit/test_due_records.py", "unit/test_realtime_storage_codecs.py",
                 "integration/test_realtime_server.py", "integration/test_delay_server.py"):
        assert uses_twins(tests / kept), kept
    for left_out in ("spark/test_load.py", "integration/test_metaserver.py"):
        assert not uses_twins(tests / left_out), left_out


def test_the_second_pass_runs_the_unit_tests_of_the_twins_and_not_the_servers_around_them():
    tests = ROOT / "tests"
    for kept in ("unit/test_logstore_codecs.py", "unit/test_send_check.py",
                 "unit/test_due_records.py", "unit/test_realtime_storage_codecs.py"):
        assert in_second_pass(tests / kept), kept
    for left_out in ("integration/test_realtime_server.py", "integration/test_delay_server.py"):
        assert not in_second_pass(tests / left_out), left_out


def test_the_import_graph_follows_imports_made_inside_functions(tmp_path):
    lazy = tmp_path / "test_lazy.py"
    lazy.write_text("def f():\n    from realtime.storage import store\n")
    plain = tmp_path / "test_plain.py"
    plain.write_text("import json\nfrom wire.message import Message\n")
    assert uses_twins(lazy)
    assert not uses_twins(plain)


def test_ci_runs_the_readme_command_then_the_build_check_the_python_twins_and_uvloop():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    commands = [line for line in ci.splitlines()
                if line and not line.startswith(("#", " ", "if", "fi", "rc=", "exit", "set",
                                                  "cd"))]
    assert commands[0] in readme
    assert commands[1:] == [".venv/bin/python -m tests.twins --check-built || exit 1",
                            f"{NO_EXTENSIONS_ENV}=1 .venv/bin/python -m pytest -q -n 2 "
                            "--dist loadfile --twin-users",
                            # The in-process server tests again on uvloop (tests/uvloop_loop.py).
                            '.venv/bin/python -m pytest -q -n 2 --dist loadfile -p '
                            'tests.uvloop_loop -m "not asyncio_internals" \\']
