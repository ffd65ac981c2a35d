"""A consumer group's own retry policy, set in the ``[realtime]`` table of ``--config``: a real
broker (in-process, port 0) started from the file plans a nacked message by its group's policy."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

import qmq
from metaserver import MetaConfig, sqlite_url, start_metaserver
from qmq import cli, config_file, server_cli
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from tests.harness import wait_for

CONFIG = """
[realtime]
retries_max = 16
retries_max_by_group = { billing = 0 }
retry_backoff_ms_by_group = { shipping = [250] }
"""


def realtime_config(tmp_path, meta_url: str) -> RealtimeConfig:
    """The RealtimeConfig ``qmq realtime --config FILE`` would start with."""
    path = tmp_path / "qmq.toml"
    path.write_text(CONFIG)
    argv = ["realtime", "--config", str(path), "--data-dir", str(tmp_path / "rt"), "--port", "0",
            "--meta", meta_url, "--group", "rt1", "--no-metrics"]
    args = cli.build_parser().parse_args(argv)
    args.explicit = config_file.explicit_flags(argv)
    args.config_data = config_file.load(str(path))
    return server_cli.server_settings(args, RealtimeConfig, "realtime", dict(
        data_dir=args.data_dir, meta_url=args.meta, group=args.group, port=args.port,
        retries_max=args.retries_max), args.port)


def test_the_config_file_sets_a_groups_retry_policy_and_the_rest_keep_the_brokers(tmp_path):
    config = realtime_config(tmp_path, "http://127.0.0.1:1")
    assert config.retries_max_by_group == {"billing": 0}
    assert config.retry_backoff_ms_by_group == {"shipping": (250,)}  # a TOML array: the tuple
    assert config.retries_max == 16


@pytest.mark.parametrize("text, said", [
    ("retries_max_by_group = { billing = -1 }",
     "retries_max_by_group['billing'] must be an integer >= 0, got -1"),
    ("retry_backoff_ms_by_group = { billing = [] }",
     "retry_backoff_ms_by_group['billing'] must be non-negative integers, at least one, got ()"),
    ("retry_backoff_ms_by_group = { billing = [\"1s\"] }",
     "retry_backoff_ms_by_group.billing = '1s': must be int"),
])
def test_a_bad_group_retry_policy_fails_at_start_naming_the_key_and_the_value(tmp_path, text,
                                                                               said):
    path = tmp_path / "bad.toml"
    path.write_text(f"[realtime]\n{text}\n")
    with pytest.raises(ValueError) as failed:
        RealtimeConfig(data_dir=str(tmp_path), **config_file.settings(
            RealtimeConfig, str(path), "realtime", config_file.load(str(path))))
    assert said in str(failed.value)


@pytest.mark.timeout(60)
async def test_a_group_with_retries_max_0_sends_a_nacked_message_to_its_dead_letters_at_once(
        tmp_path):
    meta_config = MetaConfig(db_url=sqlite_url(str(tmp_path / "meta.db")), port=0)
    async with start_metaserver(meta_config) as meta:
        broker = RealtimeServer(realtime_config(tmp_path, meta.url))
        await broker.start()
        try:
            async with qmq.Producer(meta.url) as producer:
                sent = await producer.send("orders", b"charge 42")
            async with qmq.Consumer(meta.url, group="billing", start="earliest") as consumer:
                async with asyncio.timeout(30):
                    message = await consumer.subscribe("orders").__aiter__().__anext__()
                await message.nack()  # billing's policy: no retries, dead at once

            async def dead_letters() -> list:
                async with aiohttp.ClientSession() as http, http.get(
                        f"{meta.url}/api/admin/dead", params={"group": "billing"}) as answer:
                    return (await answer.json())["dead"]

            [dead] = await wait_for(dead_letters, 30, "billing's dead letter")
            assert (dead["origin_id"], dead["subject"], dead["retries"]) == (
                sent.message_id, "orders", 1)
        finally:
            await broker.stop()
