"""A server's ``preallocate_step_bytes`` reaches its store: the realtime server's message log
(and the delay server's delay log, through the same ``ServerConfig`` field) is allocated that far
ahead of its data, and 0 leaves every segment file exactly as long as its data (an operator on
a filesystem where allocating costs; review rv21-L4). A bad value is refused naming the key."""

from __future__ import annotations

import glob
import os

import pytest

from delayserver.config import DelayConfig
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from tests.rawclient import FakeClock, RawClient, message

STEP_BYTES = 1 << 20


async def stored_segment_bytes(data_dir: str, step_bytes: int) -> tuple[int, int]:
    """Start a realtime server with ``step_bytes`` and store one message: (the segment file's
    size while it runs, its size after a clean stop, which cuts it back to its data)."""
    config = RealtimeConfig(data_dir=data_dir, port=0, expiry_check_interval_ms=3_600_000,
                            preallocate_step_bytes=step_bytes)
    server = RealtimeServer(config, FakeClock())
    await server.start()
    try:
        client = await RawClient.connect(server.port)
        answer = await client.send(message("orders", b"one", FakeClock()))
        assert "error" not in answer["results"][0]
        await client.close()
        (path,) = glob.glob(os.path.join(data_dir, "messagelog", "*.log"))
        size_bytes = os.path.getsize(path)
    finally:
        await server.stop()
    return size_bytes, os.path.getsize(path)


async def test_a_realtime_server_allocates_its_message_log_ahead_by_its_step(tmp_path):
    size_bytes, data_end = await stored_segment_bytes(str(tmp_path / "rt"), STEP_BYTES)
    assert data_end < STEP_BYTES <= size_bytes


async def test_a_realtime_server_set_to_zero_keeps_its_segment_file_as_long_as_its_data(
        tmp_path):
    size_bytes, data_end = await stored_segment_bytes(str(tmp_path / "rt"), 0)
    assert size_bytes == data_end > 0


@pytest.mark.parametrize("config_class", [RealtimeConfig, DelayConfig])
def test_a_negative_step_is_refused_naming_the_key(tmp_path, config_class):
    with pytest.raises(ValueError, match="preallocate_step_bytes must be an integer >= 0, got -1"):
        config_class(data_dir=str(tmp_path), port=0, preallocate_step_bytes=-1)
