"""serverkit.periodic.run_every: a background round survives a failing round."""

from __future__ import annotations

import asyncio
import logging

import pytest

from serverkit.periodic import run_every

WAIT_TIMEOUT_S = 10.0


async def test_a_round_that_raises_is_logged_and_the_next_round_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    rounds: list[int] = []
    third = asyncio.Event()

    async def step() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 3:
            third.set()
        if len(rounds) == 1:
            raise OSError("disk hiccup")

    logger = logging.getLogger("test.periodic")
    task = asyncio.create_task(run_every(1, step, logger, "test round"))
    try:
        async with asyncio.timeout(WAIT_TIMEOUT_S):
            await third.wait()
    finally:
        task.cancel()
    assert rounds[:3] == [0, 1, 2]
    failures = [r for r in caplog.records if r.name == "test.periodic"]
    assert failures and failures[0].getMessage().startswith("test round failed")
    assert failures[0].exc_info is not None
