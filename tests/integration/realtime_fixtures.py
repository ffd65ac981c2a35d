"""The fixtures of the realtime server's inline-path tests (test_realtime_direct_send,
test_realtime_ack_now, test_realtime_reentry): a ``RealtimeServer`` on a ``FakeClock`` with its
expiry check out of the way, and a ``RawClient`` connected to it. A test module takes them with
``from tests.integration.realtime_fixtures import client, server``."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from tests.rawclient import FakeClock, RawClient


@pytest.fixture
async def server(tmp_path) -> AsyncIterator[RealtimeServer]:
    """A started realtime server (data in tmp_path/rt), stopped after the test."""
    config = RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0,
                            expiry_check_interval_ms=3_600_000)
    server = RealtimeServer(config, FakeClock())
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(server: RealtimeServer) -> AsyncIterator[RawClient]:
    """A raw frame client connected to ``server``, closed after the test."""
    client = await RawClient.connect(server.port)
    yield client
    await client.close()
