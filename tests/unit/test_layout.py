"""The shape of the code: which package may import which, what a client loads, and the calls
that storage and servers must not make (docs/ARCHITECTURE.md, "Packages and import direction").

Every module of every package is parsed, and every import in it counts, including the lazy
ones inside functions, so a dependency cannot hide behind a deferred import.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Package -> the packages of ours it may import. The same table is in docs/ARCHITECTURE.md, and
# a test below holds the two equal.
ALLOWED_IMPORTS: dict[str, frozenset[str]] = {
    "wire": frozenset(),
    "logstore": frozenset(),
    "migrations": frozenset(),
    "tracelog": frozenset({"wire"}),
    "sdk": frozenset({"wire"}),
    # wire: its per-thread msgpack Packer (wire.packing) only; a test below holds that.
    "pulllog": frozenset({"logstore", "wire"}),
    # logstore: the group committer triages its errors (DiskFull, LogWriteFailed) and the
    # common server config takes its FLUSH_MODES.
    "serverkit": frozenset({"sdk", "wire", "tracelog", "logstore"}),
    "realtime": frozenset({"pulllog", "logstore", "serverkit", "wire", "tracelog"}),
    "delayserver": frozenset({"logstore", "serverkit", "wire", "tracelog"}),
    "metaserver": frozenset({"migrations", "serverkit", "sdk", "wire", "tracelog"}),
    "spark_audit": frozenset({"tracelog"}),
    "qmq": frozenset({"sdk", "wire", "serverkit", "tracelog", "logstore", "pulllog", "realtime",
                      "delayserver", "metaserver", "migrations", "spark_audit"}),
}
PACKAGES = frozenset(ALLOWED_IMPORTS)

# Modules that must stay free of asyncio and of reading the clock: time is passed in.
STORAGE_DIRS = ("logstore", "pulllog", "realtime/storage", "delayserver/storage")
STORAGE_FILES = ("delayserver/wheel.py", "delayserver/window.py", "realtime/consumers.py")
CLOCK_CALLS = {("time", "time"), ("time", "monotonic"), ("time", "time_ns"),
               ("time", "monotonic_ns"), ("datetime", "now"), ("datetime", "utcnow")}
# Packages whose processes log rather than print (the CLI in qmq prints on purpose).
SERVER_PACKAGES = ("wire", "sdk", "serverkit", "tracelog", "logstore", "pulllog", "realtime",
                   "delayserver", "metaserver")


def modules_of(package: str) -> list[Path]:
    """Every Python file of one of our packages."""
    return sorted((ROOT / package).rglob("*.py"))


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package of ours, line) for every absolute import in ``path``, lazy ones too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and getattr(node.func, "attr", getattr(node.func, "id", "")) in
              ("import_module", "__import__") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names = [node.args[0].value]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in PACKAGES:
                found.add((top, node.lineno))
    return found


def test_every_import_between_our_packages_is_in_the_allowed_table() -> None:
    wrong = []
    for package, allowed in ALLOWED_IMPORTS.items():
        for path in modules_of(package):
            for imported, line in imported_packages(path):
                if imported != package and imported not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert wrong == []


def test_the_pull_log_takes_only_the_per_thread_packer_of_wire() -> None:
    # wire imports nothing of ours, so wire.packing is a leaf the pull log and the protocol
    # share; the rest of wire (frames, requests, errors) is not the storage layer's business.
    taken = set()
    for path in modules_of("pulllog"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            taken |= {f"{path.relative_to(ROOT)}: {name}" for name in names
                      if name.split(".")[0] == "wire"}
    assert taken == {"pulllog/actions.py: wire.packing"}


def test_the_import_finder_sees_lazy_imports_inside_functions(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from realtime.broker import Broker\n"
                      "    import importlib\n    importlib.import_module('metaserver.app')\n")
    assert {top for top, _ in imported_packages(module)} == {"realtime", "metaserver"}


def test_every_package_directory_of_ours_is_in_the_table() -> None:
    skipped = {"tests", "bench", "docs", "examples", "contrib", "build"}
    found = {p.parent.name for p in ROOT.glob("*/__init__.py")} - skipped
    assert found == set(PACKAGES)


def architecture_table() -> dict[str, frozenset[str]]:
    """The package table of docs/ARCHITECTURE.md: package -> its `imports` column."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = {}
    for line in text.splitlines():
        match = re.match(r"\| `(\w+)` \|.*\| ([^|]*) \|$", line)
        if match and match.group(1) in PACKAGES:
            cell = match.group(2)
            table[match.group(1)] = frozenset(re.findall(r"`(\w+)`", cell)) & PACKAGES
    return table


def test_the_table_in_architecture_md_is_the_one_this_test_holds() -> None:
    table = architecture_table()
    expected = dict(ALLOWED_IMPORTS)
    expected["qmq"] = frozenset()  # its row says "all of the above" in words
    assert table == expected


def loaded_module_names(code: str) -> set[str]:
    """Every module a fresh interpreter has loaded after running ``code``."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def loaded_modules(code: str) -> set[str]:
    """Top-level names of every module a fresh interpreter has loaded after running ``code``."""
    return {name.split(".")[0] for name in loaded_module_names(code)}


def test_importing_the_client_loads_no_server_code() -> None:
    loaded = loaded_modules("import qmq\nqmq.Producer, qmq.Consumer, qmq.errors.NoRoute")
    ours = loaded & PACKAGES
    assert ours == {"qmq", "sdk", "wire"}
    assert "sqlalchemy" not in loaded and "alembic" not in loaded and "aiohttp" not in loaded


def test_the_outbox_and_the_idempotent_consumer_load_only_client_code() -> None:
    # They need SQLAlchemy, so ``import qmq`` does not load them; imported by name, they bring
    # the SDK and nothing of the servers.
    loaded = loaded_modules("import qmq.outbox, qmq.outbox_relay, qmq.idempotent")
    assert loaded & PACKAGES == {"qmq", "sdk", "wire"}


def test_the_audit_loads_the_trace_schema_without_any_server_or_client_code() -> None:
    loaded = loaded_module_names("import spark_audit.schema, spark_audit.load")
    # The trace format only: not even the writer (tracelog.writer, which brings wire's clock).
    assert {name.split(".")[0] for name in loaded} & PACKAGES == {"spark_audit", "tracelog"}
    assert "tracelog.writer" not in loaded


def storage_modules() -> list[Path]:
    """Every module of the synchronous storage layer."""
    paths = [p for d in STORAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    return paths + [ROOT / f for f in STORAGE_FILES if (ROOT / f).exists()]


@pytest.mark.parametrize("path", storage_modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_storage_neither_uses_asyncio_nor_reads_the_clock(path: Path) -> None:
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.AsyncFunctionDef, ast.Await)):
            bad.append(f"line {node.lineno}: async code")
        elif isinstance(node, ast.Import) and any(a.name == "asyncio" for a in node.names):
            bad.append(f"line {node.lineno}: imports asyncio")
        elif isinstance(node, ast.ImportFrom) and node.module == "asyncio":
            bad.append(f"line {node.lineno}: imports asyncio")
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and (node.value.id, node.attr) in CLOCK_CALLS):
            bad.append(f"line {node.lineno}: reads the clock ({node.value.id}.{node.attr})")
    assert bad == []


@pytest.mark.parametrize("package", SERVER_PACKAGES)
def test_servers_and_libraries_log_instead_of_printing(package: str) -> None:
    printing = []
    for path in modules_of(package):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                printing.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert printing == []


# Client commands as a user runs them, against a MetaServer that is not there: each fails at
# once, having loaded everything it loads to do its work.
CLIENT_COMMANDS = (
    ["send", "demo", "hi"], ["send", "demo", "later", "--delay-ms", "1000"],
    ["cancel", "demo", "ID", "--group", "delay-1", "--deliver-at-ms", "1"],
    ["consume", "demo", "--group", "g", "--count", "1"], ["admin", "brokers"],
    ["admin", "dead", "list"], ["admin", "tokens", "list"], ["schedule", "list"],
)
# Third-party packages of the servers and the audit that a client command must not load
# (aiohttp too: the client asks the MetaServer through sdk.http1, and importing aiohttp was
# 0.25 s of a one-shot `qmq send`; uvloop: only a server command picks the process's loop).
SERVER_LIBRARIES = {"sqlalchemy", "alembic", "aiosqlite", "asyncpg", "apscheduler", "pyspark",
                    "jinja2", "prometheus_client", "aiohttp", "uvloop"}


def test_client_commands_load_no_server_code() -> None:
    code = ("import sys\nfrom qmq import cli\n"
            f"for argv in {CLIENT_COMMANDS!r}:\n"
            "    cli.main([*argv, '--meta', 'http://127.0.0.1:9'])\n")
    loaded = loaded_modules(code)
    assert loaded & PACKAGES == {"qmq", "sdk", "wire"}
    assert loaded & SERVER_LIBRARIES == set()


def test_qmq_send_loads_neither_the_other_commands_nor_the_consumer() -> None:
    # Without bytecode caches (PYTHONDONTWRITEBYTECODE=1 in a checkout) every module of ours a
    # command imports is compiled on every run: a one-shot send loads only what it uses.
    loaded = loaded_module_names(
        "from qmq import cli\ncli.main(['send', 'demo', 'hi', '--meta', 'http://127.0.0.1:9'])")
    assert loaded & {"qmq.admin_cli", "qmq.admin_commands", "qmq.audit", "qmq.schedule_cli",
                     "sdk.consumer", "sdk.consumer_handlers", "sdk.consumer_presence", "sdk.schedules",
                     "wire.replication", "aiohttp"} == set()


def test_the_qmq_package_names_the_sdks_public_names_without_importing_the_sdk() -> None:
    import qmq
    import sdk

    assert sorted(qmq.__all__) == sorted(["sync", *sdk.__all__])
    assert qmq.Producer is sdk.Producer and qmq.NoRoute is sdk.NoRoute
    star: dict[str, object] = {}
    exec("from qmq import *", star)
    assert star["sync"] is qmq.sync and star["Consumer"] is sdk.Consumer
    loaded = loaded_modules("import qmq")
    assert loaded & PACKAGES == {"qmq", "wire"} and "aiohttp" not in loaded
