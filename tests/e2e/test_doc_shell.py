"""Every shell snippet of README.md and docs/ as a reader finds it.

Each ``sh`` block is run as written by a test: here, or by the test ``RUN_BY`` names for it. The
only blocks no test runs say why on the line above their fence (``<!-- not run: REASON -->``):
they change the machine itself (system users, packages).

The README's blocks run here inside a network namespace of their own with only a loopback, so
the documented addresses (``127.0.0.1:8090`` for the MetaServer, ``20881`` and on for brokers)
are free and are used as written, while other tests run at the same time.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import netns
from tests.docblocks import fenced_blocks
from tests.harness import _LISTEN, _UP_READY, wait_until

_NOT_RUN = re.compile(r"<!-- not run: .+ -->$")
BLOCK_TIMEOUT_S = 120
VENV_BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class ShellBlock:
    """One fenced ``sh`` block: where it is, its text, and whether it says it is not run."""

    where: str
    code: str
    not_run: bool

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0]


def shell_blocks() -> list[ShellBlock]:
    """The ``sh`` blocks of README.md and docs/*.md, in file order."""
    return [ShellBlock(b.where, b.code, bool(_NOT_RUN.search(b.line_above)))
            for b in fenced_blocks("sh")]


def block(first_line_start: str) -> ShellBlock:
    """The one block whose first line starts with ``first_line_start``."""
    matches = [b for b in shell_blocks() if b.first_line.startswith(first_line_start)]
    assert len(matches) == 1, (first_line_start, [b.where for b in matches])
    return matches[0]


# The README's blocks this file runs, by the start of their first line.
QUICK_START = "python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/qmq up"
SCHEDULES = ".venv/bin/qmq schedule create standup"
HTTP = "curl -sS http://127.0.0.1:8090/api/send"
AUTH = "ADMIN=$(qmq admin tokens create --app ops --admin"
PARTS = "qmq metaserver --db sqlite+aiosqlite:///./meta.db --port 8090"

# Blocks other tests run as written, by the start of their first line (or their file, for a
# file whose every block one test runs).
RUN_BY = {
    "python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]'":
        ".ci/run (tests/unit/test_twins.py holds it to the README)",
    ".venv/bin/qmq send order.created": "tests/e2e/test_doc_snippets.py (the CLI tour)",
    "export QMQ_META=http://10.0.0.1:8090": "tests/e2e/test_deploy_netns.py",
    "docs/HTTP.md": "tests/e2e/test_http_doc.py",
}
RUN_HERE = (QUICK_START, SCHEDULES, HTTP, AUTH, PARTS)


def run_by(b: ShellBlock) -> str | None:
    """The test that runs ``b`` as written, or None."""
    if b.first_line.startswith(RUN_HERE):
        return __name__
    for key, test in RUN_BY.items():
        if b.first_line.startswith(key) or b.where.startswith(key + ":"):
            return test
    return None


def test_every_shell_block_is_run_by_a_test_or_says_why_not() -> None:
    orphans = [b.where for b in shell_blocks() if not b.not_run and run_by(b) is None]
    assert orphans == [], f"sh blocks no test runs (run one, or mark it not run): {orphans}"
    assert all(run_by(b) is None for b in shell_blocks() if b.not_run)


@pytest.fixture
def box(tmp_path: Path) -> Iterator[tuple[netns.Network, Path]]:
    """A namespace with only a loopback (``box``) and a directory laid out as the README's
    clone is after the quick start: ``.venv`` is this test run's virtualenv."""
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    (tmp_path / ".venv").symlink_to(VENV_BIN.parent)
    with netns.Network(["box"]) as net:
        yield net, tmp_path


def sh(net: netns.Network, cwd: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in ``sh -e`` inside the box, from ``cwd``, with the virtualenv's ``qmq`` on
    the PATH as an activated virtualenv has it."""
    env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run(["ip", "netns", "exec", net.namespace("box"), "sh", "-e", "-c", script],
                          capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, cwd=cwd,
                          env=env)


def start(net: netns.Network, cwd: Path, name: str, command: str,
          ready: re.Pattern[str]) -> None:
    """Start a long-running ``command`` of a block in the box (killed by ``net.close``)."""
    net.run("box", name, ["sh", "-c", f"cd {cwd} && exec {command}"], ready,
            env={"PATH": f"{VENV_BIN}:/usr/bin:/bin"})


def json_documents(text: str) -> list[object]:
    """The JSON documents of ``text``, one after the other."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        value, at = decoder.raw_decode(text, at)
        found.append(value)
    return found


def brokers(net: netns.Network, cwd: Path) -> dict[str, str]:
    """``qmq admin brokers --json`` in the box, as ``{group: state}``."""
    done = sh(net, cwd, "qmq admin brokers --json")
    rows = json.loads(done.stdout) if done.returncode == 0 else []
    return {row["group"]: row["state"] for row in rows}


@pytest.mark.timeout(6 * BLOCK_TIMEOUT_S)
def test_the_readme_blocks_run_as_written_against_qmq_up_on_its_documented_ports(box) -> None:
    net, cwd = box
    # The quick start's install is .ci/run's install; this directory already has the result.
    command = block(QUICK_START).code.strip().rsplit("&& ", 1)[1]
    assert command == ".venv/bin/qmq up"
    start(net, cwd, "qmq up", command, _UP_READY)
    assert (cwd / "qmq-data").is_dir()  # where the README says the data goes

    done = sh(net, cwd, block(SCHEDULES).code)
    assert done.returncode == 0, done.stdout + done.stderr
    fires = [line for line in done.stdout.splitlines() if "Europe/Berlin" in line or "+0" in line]
    assert len(fires) >= 5, done.stdout  # `next standup -n 5` printed five fire times

    done = sh(net, cwd, block(HTTP).code)
    assert done.returncode == 0, done.stdout + done.stderr
    answers = json_documents(done.stdout)  # curl prints each answer with no newline after it
    assert answers[0]["results"][0]["status"] == "stored", answers
    assert answers[1]["messages"][0]["body"] == "hi", answers  # the pull got the send

    done = sh(net, cwd, block(AUTH).code)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "forbidden" in done.stdout, done.stdout  # the shop token cannot send payment.x


@pytest.mark.timeout(4 * BLOCK_TIMEOUT_S)
def test_the_readme_servers_started_each_in_its_own_shell_register_under_their_groups(box) -> None:
    net, cwd = box
    meta, *servers = [line.split("#", 1)[0].strip() for line in block(PARTS).code.splitlines()]
    start(net, cwd, "metaserver", meta, _LISTEN)
    with ThreadPoolExecutor(len(servers)) as pool:  # each in its own shell, as a reader would
        list(pool.map(lambda command: start(net, cwd, command.split()[1], command, _LISTEN),
                      servers))
    wait_until(lambda: brokers(net, cwd) == {"rt1": "rw", "rt2": "rw", "dl1": "rw"}, 60,
               "rt1, rt2 and dl1 to register with the MetaServer on port 8090")
