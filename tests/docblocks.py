"""The fenced code blocks of README.md and docs/*.md, as the doc tests read them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.harness import REPO_ROOT


@dataclass(frozen=True)
class Fenced:
    """One fenced block: ``file:line`` of its first line, its text, and the line above its
    fence (where a ``<!-- ... -->`` marker says how a test treats it)."""

    where: str
    code: str
    line_above: str


def fenced_blocks(language: str) -> list[Fenced]:
    """Every block fenced as ``language`` in README.md and docs/*.md, in file order."""
    fence = re.compile(rf"^(?P<before>[^\n]*)\n```{language}\n(?P<code>.*?)^```$", re.M | re.S)
    found = []
    for path in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for match in fence.finditer(text):
            line = text[:match.start("code")].count("\n")
            found.append(Fenced(f"{Path(path).relative_to(REPO_ROOT)}:{line}",
                                match.group("code"),
                                match.group("before").rsplit("\n", 1)[-1]))
    return found
