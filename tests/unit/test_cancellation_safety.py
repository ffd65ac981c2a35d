"""The packages and their tests wait with ``asyncio.timeout``, never ``asyncio.wait_for``: in
Python 3.11, ``wait_for`` returns the result and drops a cancel that arrives in the same turn as
the result (a poke, an event set at shutdown), so a loop built on it can outlive the stop that
cancelled it. That hung a MetaServer's schedule runner at shutdown."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The tests too: a test that waits with wait_for can hang on a cancel it dropped, as a server can.
PACKAGES = ("wire", "sdk", "serverkit", "tracelog", "logstore", "pulllog", "realtime",
            "delayserver", "metaserver", "spark_audit", "qmq", "tests")


def test_no_package_module_waits_with_asyncio_wait_for() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\basyncio\.wait_for\(|^\s*from asyncio import .*\bwait_for\b", line):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == [], "use asyncio.timeout instead:\n" + "\n".join(offenders)
