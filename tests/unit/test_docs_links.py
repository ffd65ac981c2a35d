"""The documentation stands alone: nothing in the repository points at a file outside it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# A relative Markdown link's target: [text](target) or [text](target#anchor).
_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)#\s]+)")
# A document named in prose or in a comment: DESIGN.md, docs/SDK.md.
_MENTION = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[A-Z][A-Z_]*\.md)\b")


def tracked(*patterns: str) -> list[Path]:
    """The files git tracks (or would add) under ROOT matching ``patterns``."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--",
                          *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def test_every_relative_link_of_the_markdown_files_names_a_file_of_the_repository() -> None:
    broken = []
    for path in tracked("*.md"):
        for target in _LINK.findall(path.read_text(encoding="utf-8")):
            if not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_every_document_named_in_code_or_docs_is_in_the_repository() -> None:
    names = {p.name for p in tracked("*.md")}
    missing = []
    for path in tracked("*.md", "*.py", "*.toml", "*.c", "contrib/*"):
        for name in _MENTION.findall(path.read_text(encoding="utf-8", errors="replace")):
            if Path(name).name not in names:
                missing.append(f"{path.relative_to(ROOT)}: {name}")
    assert missing == []
