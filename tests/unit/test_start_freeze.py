"""A server command moves its start-up state out of the garbage collector's way once every server
it runs has started (``serverkit.server.freeze_started``), so the first passes after start-up
do not scan and promote it."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from qmq import launcher
from tests.harness import wait_for


def test_freeze_started_collects_then_freezes_what_exists_and_nothing_made_later():
    # In a process of its own: a freeze in the test process would keep every earlier test's
    # unreachable cycles for good.
    code = (
        "import gc\n"
        "from serverkit.server import freeze_started\n"
        "held = [[n] for n in range(50_000)]\n"
        "cycle = []; cycle.append(cycle); del cycle\n"
        "freeze_started()\n"
        "assert gc.get_freeze_count() >= 50_000, gc.get_freeze_count()\n"
        "assert len(gc.get_objects()) < 1_000, len(gc.get_objects())\n"
        "later = [[n] for n in range(100)]\n"
        "assert len(gc.get_objects()) >= 100\n"
        "gc.unfreeze()\n"
        "assert not any(type(o) is list and len(o) == 1 and o[0] is o for o in gc.get_objects())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


async def test_qmq_up_freezes_once_every_server_has_started_before_it_says_it_is_up(
        tmp_path, monkeypatch):
    said: list[str] = []
    stop = asyncio.Event()
    monkeypatch.setattr(launcher, "_stop_on_signal", lambda: stop)
    monkeypatch.setattr(launcher, "say", said.append)
    monkeypatch.setattr(launcher, "freeze_started", lambda: said.append("<freeze_started>"))
    up = asyncio.create_task(launcher.run_up(str(tmp_path), 0, 0, 0, "127.0.0.1", trace=False))
    await wait_for(lambda: "pyqmq is up:" in said or up.done(), 60, "qmq up to start")
    stop.set()
    await up
    assert said.count("<freeze_started>") == 1
    assert said.index("<freeze_started>") == said.index("pyqmq is up:") - 1
