"""Every Python snippet of README.md and docs/ as a reader finds it.

A snippet is a complete program unless the line above its fence is ``<!-- fragment: REASON -->``
(it goes on from the snippet before, or uses names the application defines). Programs run as
written, each in a fresh interpreter, against one ``qmq up``: the only change is the MetaServer
URL ``http://127.0.0.1:8090`` becoming the test's. Fragments are compiled (top-level ``await``
allowed), so a typo still fails here.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.docblocks import fenced_blocks
from tests.harness import REPO_ROOT, UpProcess

DOCUMENTED_META_URL = "http://127.0.0.1:8090"
SNIPPET_TIMEOUT_S = 120
_FRAGMENT = re.compile(r"<!-- fragment: .+ -->$")


@dataclass(frozen=True)
class Snippet:
    """One fenced Python block: where it is, its code, and whether it is a fragment."""

    where: str
    code: str
    fragment: bool


def snippets() -> list[Snippet]:
    """The Python snippets of README.md and docs/*.md, in file order."""
    return [Snippet(b.where, b.code, bool(_FRAGMENT.search(b.line_above)))
            for b in fenced_blocks("python")]


SNIPPETS = snippets()
PROGRAMS = [s for s in SNIPPETS if not s.fragment]


@pytest.fixture(scope="module")
def up(module_up: UpProcess) -> UpProcess:
    return module_up


def test_the_readme_and_the_sdk_guide_have_complete_programs() -> None:
    where = {s.where.split(":")[0] for s in PROGRAMS}
    assert {"README.md", "docs/SDK.md"} <= where, where


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.where for s in SNIPPETS])
def test_every_snippet_compiles(snippet: Snippet) -> None:
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT if snippet.fragment else 0
    compile(snippet.code, snippet.where, "exec", flags=flags)


@pytest.mark.timeout(SNIPPET_TIMEOUT_S * len(PROGRAMS) + 60)
def test_every_program_snippet_runs_as_written_against_qmq_up(up: UpProcess,
                                                             tmp_path: Path) -> None:
    failed = []
    for snippet in PROGRAMS:  # in file order: the README's sends come first
        code = snippet.code.replace(DOCUMENTED_META_URL, up.meta_url)
        try:
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                  timeout=SNIPPET_TIMEOUT_S, cwd=tmp_path)
        except subprocess.TimeoutExpired:
            failed.append(f"{snippet.where}: still running after {SNIPPET_TIMEOUT_S} s")
            continue
        if done.returncode != 0:
            failed.append(f"{snippet.where}: exit {done.returncode}\n{done.stderr[-1500:]}")
    assert failed == [], "\n\n".join(failed)


def readme_shell_block() -> str:
    """The README's "Using it" shell block (the CLI tour a new user types first)."""
    text = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("## Using it"):]
    return re.search(r"^```sh\n(.*?)^```$", section, re.M | re.S).group(1)


@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 60)
def test_the_readme_cli_tour_runs_as_written_against_qmq_up(up: UpProcess, tmp_path: Path) -> None:
    # As written, but from this test's virtualenv and with QMQ_META naming the test's qmq up.
    script = readme_shell_block().replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    done = subprocess.run(["sh", "-e", "-c", script], capture_output=True, text=True,
                          timeout=SNIPPET_TIMEOUT_S, cwd=tmp_path,
                          env={**os.environ, "QMQ_META": up.meta_url})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cancelled" in done.stdout, done.stdout
    # The shared qmq up also holds the Python snippets' messages: any order.created may come.
    assert '"subject": "order.created"' in done.stdout, done.stdout
