"""Every protocol limit at max-1, max and max+1, checked by a LIVE realtime server and a live delay
server (in-process on port 0, fake clock), through a raw client that bypasses the SDK's own checks.

max-1 and max are accepted; max+1 is refused with the code docs/LIMITS.md names and a message
quoting the value and the limit; the server keeps serving afterwards. The few cases with
multi-MiB payloads (body, frame) are kept to one test each so the module stays quick.
"""

from __future__ import annotations

import asyncio
import itertools
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from realtime.sends import DELIVER_AT_SKEW_MS_MAX
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.limits import (
    MAX_ACK_RANGES,
    MAX_BODY_BYTES,
    MAX_CLIENT_ID_CHARS,
    MAX_DELAY_MS,
    MAX_FRAME_BYTES,
    MAX_MESSAGE_ID_CHARS,
    MAX_PROPERTIES,
    MAX_PROPERTY_KEY_BYTES,
    MAX_PROPERTY_VALUE_BYTES,
    MAX_PULL_BATCH_MESSAGES,
    MAX_PULL_WAIT_MS,
    MAX_SEND_BATCH_MESSAGES,
    MAX_SUBJECT_CHARS,
    MAX_TAG_BYTES,
    MAX_TAGS,
    MAX_TOKEN_CHARS,
)
from tests.rawclient import FakeClock, RawClient

_ids = itertools.count()


def raw_payload(clock: FakeClock, **fields: Any) -> bytes:
    """A message payload made with plain msgpack (no SDK validation); ``fields`` override keys."""
    payload: dict[str, Any] = {"i": f"lim-{next(_ids)}", "s": "limits", "b": b"x",
                               "c": clock()}
    payload.update(fields)
    return msgpack.packb(payload, use_bin_type=True)


async def _dispatched(subject: str, payloads: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    """Stands in for the realtime brokers a delay server dispatches to: accepts everything."""
    return "rt-limits", [{"id": "", "status": "stored"} for _ in payloads]


@dataclass
class Live:
    """A running server of one kind and a raw client greeted on it."""

    kind: str
    server: RealtimeServer | DelayServer
    client: RawClient
    clock: FakeClock

    async def send(self, *payloads: bytes) -> dict[str, Any]:
        """One send request carrying ``payloads``."""
        return await self.client.request({"op": "send", "messages": list(payloads)})

    async def assert_still_serving(self) -> None:
        """A normal message is still stored on the same connection and on a new one."""
        answer = await self.send(raw_payload(self.clock))
        assert answer["results"][0]["status"] == "stored", answer
        fresh = await RawClient.connect(self.server.port)
        try:
            answer = await fresh.request({"op": "send", "messages": [raw_payload(self.clock)]})
            assert answer["results"][0]["status"] == "stored", answer
        finally:
            await fresh.close()


@pytest.fixture(params=["realtime", "delay"])
async def live(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Live]:
    """A realtime or a delay server with a raw client (the test runs once with each)."""
    yield_from = _realtime if request.param == "realtime" else _delay
    async for value in yield_from(tmp_path):
        yield value


@pytest.fixture
async def realtime(tmp_path: Any) -> AsyncIterator[Live]:
    """A realtime server with a raw client."""
    async for value in _realtime(tmp_path):
        yield value


@pytest.fixture
async def delay(tmp_path: Any) -> AsyncIterator[Live]:
    """A delay server with a raw client."""
    async for value in _delay(tmp_path):
        yield value


async def _realtime(tmp_path: Any) -> AsyncIterator[Live]:
    clock = FakeClock()
    server = RealtimeServer(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0, trace=False,
                                           expiry_check_interval_ms=3_600_000), clock)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        yield Live("realtime", server, client, clock)
    finally:
        await client.close()
        await server.stop()


async def _delay(tmp_path: Any) -> AsyncIterator[Live]:
    clock = FakeClock()
    server = DelayServer(DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=1000,
                                     trace=False), clock=clock, dispatch=_dispatched)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        yield Live("delay", server, client, clock)
    finally:
        await client.close()
        await server.stop()


def assert_refused(error: dict[str, Any], code: str, value: int, limit: int) -> None:
    """The error has ``code`` and its message quotes both the value and the limit."""
    assert error["code"] == code, error
    assert str(value) in error["message"] and str(limit) in error["message"], error


def around(limit: int) -> tuple[int, int, int]:
    """max-1, max, max+1."""
    return limit - 1, limit, limit + 1


# --- one message's limits: both servers check every field of every payload they are sent ---------

MESSAGE_LIMITS = [
    pytest.param(MAX_TAGS, "bad_request", lambda n: {"t": [f"t{i}" for i in range(n)]},
                 id="tags-count"),
    pytest.param(MAX_TAG_BYTES, "bad_request", lambda n: {"t": ["t" * n]}, id="tag-bytes"),
    pytest.param(MAX_PROPERTIES, "too_large", lambda n: {"p": {f"k{i}": "v" for i in range(n)}},
                 id="properties-count"),
    pytest.param(MAX_PROPERTY_KEY_BYTES, "too_large", lambda n: {"p": {"k" * n: "v"}},
                 id="property-key-bytes"),
    # Two-byte characters: the limit counts UTF-8 bytes, not characters.
    pytest.param(MAX_PROPERTY_VALUE_BYTES, "too_large",
                 lambda n: {"p": {"k": "é" * (n // 2) + "v" * (n % 2)}},
                 id="property-value-bytes"),
    pytest.param(MAX_SUBJECT_CHARS, "bad_request", lambda n: {"s": "s" * n}, id="subject-chars"),
    pytest.param(MAX_MESSAGE_ID_CHARS, "bad_request",
                 lambda n: {"i": f"{n}-".ljust(n, "i")}, id="message-id-chars"),
]


@pytest.mark.parametrize(("limit", "code", "fields"), MESSAGE_LIMITS)
async def test_a_message_field_at_its_limit_is_stored_and_one_over_is_refused_naming_both(
    live: Live, limit: int, code: str, fields: Callable[[int], dict[str, Any]]
) -> None:
    below, at, over = (raw_payload(live.clock, **fields(n)) for n in around(limit))
    answer = await live.send(below, at, over)
    results = answer["results"]
    assert [r.get("status") for r in results[:2]] == ["stored", "stored"], results
    assert_refused(results[2]["error"], code, limit + 1, limit)
    await live.assert_still_serving()


async def test_a_body_of_max_body_bytes_is_stored_intact_and_one_byte_more_is_too_large(
    realtime: Live,
) -> None:
    below, at, over = (raw_payload(realtime.clock, s="bodies", b=b"b" * n)
                       for n in around(MAX_BODY_BYTES))
    results = [(await realtime.send(p))["results"][0] for p in (below, at, over)]
    assert [r.get("status") for r in results[:2]] == ["stored", "stored"], results
    assert_refused(results[2]["error"], "too_large", MAX_BODY_BYTES + 1, MAX_BODY_BYTES)
    pulled: list[bytes] = []
    for _ in range(4):  # each 4 MiB message needs a pull of its own
        answer = await realtime.client.pull("bodies", "g", "c", start="earliest")
        pulled += answer["payloads"]
    assert pulled == [below, at]
    await realtime.assert_still_serving()


async def test_a_delay_server_takes_a_body_of_max_body_bytes_and_refuses_one_byte_more(
    delay: Live,
) -> None:
    results = [(await delay.send(raw_payload(delay.clock, b=b"b" * n)))["results"][0]
               for n in around(MAX_BODY_BYTES)]
    assert [r.get("status") for r in results[:2]] == ["stored", "stored"], results
    assert_refused(results[2]["error"], "too_large", MAX_BODY_BYTES + 1, MAX_BODY_BYTES)
    await delay.assert_still_serving()


# --- request limits both servers share -------------------------------------------------------------


async def test_a_send_batch_of_max_messages_is_stored_and_one_more_is_too_large(live: Live) -> None:
    for n in around(MAX_SEND_BATCH_MESSAGES):
        answer = await live.send(*(raw_payload(live.clock) for _ in range(n)))
        if n <= MAX_SEND_BATCH_MESSAGES:
            assert [r["status"] for r in answer["results"]] == ["stored"] * n
        else:
            assert_refused(answer["error"], "too_large", n, MAX_SEND_BATCH_MESSAGES)
    await live.assert_still_serving()


def padded_hello(rid: int, payload_bytes: int) -> bytes:
    """A framed ``hello`` whose msgpack payload is exactly ``payload_bytes`` long (an unknown
    ``pad`` field fills it: servers ignore unknown keys)."""
    base = {"op": "hello", "rid": rid, "client_id": "pad", "app": "tests", "protocol": 1}
    probe_bytes = 100_000  # any pad long enough to take msgpack's 5-byte bin32 header
    overhead = len(msgpack.packb({**base, "pad": b"\0" * probe_bytes})) - probe_bytes
    payload = msgpack.packb({**base, "pad": b"\0" * (payload_bytes - overhead)})
    assert len(payload) == payload_bytes
    return struct.pack(">I", payload_bytes) + payload


async def test_a_frame_of_max_frame_bytes_is_answered_and_a_longer_header_closes_at_once(
    live: Live,
) -> None:
    client = live.client
    for rid, size in ((1001, MAX_FRAME_BYTES - 1), (1002, MAX_FRAME_BYTES)):
        future = asyncio.get_running_loop().create_future()
        client.pending[rid] = future
        client.writer.write(padded_hello(rid, size))
        await client.writer.drain()
        async with asyncio.timeout(30):
            assert (await future).get("ok") is True
    # Only the 4-byte header of a MAX_FRAME_BYTES + 1 frame: the server must refuse it from the
    # header alone, without waiting for (or allocating) the payload, and close the connection.
    bad = await RawClient.connect(live.server.port)
    bad.writer.write(struct.pack(">I", MAX_FRAME_BYTES + 1))
    await bad.writer.drain()
    async with asyncio.timeout(10):
        await bad.closed.wait()
    assert len(bad.unmatched) == 1 and bad.unmatched[0]["rid"] is None, bad.unmatched
    assert_refused(bad.unmatched[0]["error"], "too_large", MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES)
    await bad.close()
    await live.assert_still_serving()


@pytest.mark.parametrize("field", ["client_id", "app"])
async def test_a_hello_client_id_or_app_of_max_chars_is_taken_and_one_more_is_refused(
    live: Live, field: str
) -> None:
    for n in around(MAX_CLIENT_ID_CHARS):
        hello = {"op": "hello", "client_id": "c", "app": "tests", "protocol": 1, field: "n" * n}
        answer = await live.client.request(hello)
        if n <= MAX_CLIENT_ID_CHARS:
            assert answer.get("ok") is True, answer
        else:
            assert_refused(answer["error"], "bad_request", n, MAX_CLIENT_ID_CHARS)
    await live.assert_still_serving()


async def test_a_hello_token_of_max_chars_is_taken_and_one_char_more_is_refused(
    live: Live,
) -> None:
    for n in around(MAX_TOKEN_CHARS):
        answer = await live.client.request({"op": "hello", "client_id": "tok", "app": "tests",
                                            "protocol": 1, "token": "t" * n})
        if n <= MAX_TOKEN_CHARS:
            assert answer.get("ok") is True, answer
        else:
            assert_refused(answer["error"], "bad_request", n, MAX_TOKEN_CHARS)
            assert "t" * 16 not in answer["error"]["message"]  # the token is not echoed
    await live.assert_still_serving()


# --- realtime-only requests ----------------------------------------------------------------------

CONSUMER = {"subject": "limits", "group": "g", "consumer_id": "c"}

REALTIME_REQUEST_LIMITS = [
    pytest.param(MAX_PULL_BATCH_MESSAGES, "bad_request",
                 lambda n: {"op": "pull", **CONSUMER, "max_count": n}, "payloads",
                 id="pull-max-count"),
    # A message is waiting, so even a pull allowed to wait 60 s answers at once.
    pytest.param(MAX_PULL_WAIT_MS, "bad_request",
                 lambda n: {"op": "pull", **CONSUMER, "group": f"w{n}", "start": "earliest",
                            "max_count": 1, "wait_ms": n}, "payloads",
                 id="pull-wait-ms"),
    pytest.param(MAX_TAGS, "bad_request",
                 lambda n: {"op": "pull", **CONSUMER, "max_count": 1,
                            "tags": [f"t{i}" for i in range(n)]}, "payloads",
                 id="pull-tags-count"),
    pytest.param(MAX_TAG_BYTES, "bad_request",
                 lambda n: {"op": "pull", **CONSUMER, "max_count": 1, "tags": ["t" * n]},
                 "payloads", id="pull-tag-bytes"),
    pytest.param(MAX_SUBJECT_CHARS, "bad_request",
                 lambda n: {"op": "pull", **CONSUMER, "group": "g" * n, "max_count": 1},
                 "payloads", id="pull-group-chars"),
    pytest.param(MAX_CLIENT_ID_CHARS, "bad_request",
                 lambda n: {"op": "pull", **CONSUMER, "consumer_id": "c" * n, "max_count": 1},
                 "payloads", id="pull-consumer-id-chars"),
    pytest.param(MAX_CLIENT_ID_CHARS, "bad_request",
                 lambda n: {"op": "heartbeat", "consumer_id": "c" * n,
                            "subscriptions": [["limits", "g"]]},
                 "ok", id="heartbeat-consumer-id-chars"),
    pytest.param(MAX_CLIENT_ID_CHARS, "bad_request",
                 lambda n: {"op": "leave", "consumer_id": "c" * n,
                            "subscriptions": [["limits", "g"]]},
                 "released", id="leave-consumer-id-chars"),
    pytest.param(MAX_ACK_RANGES, "too_large",
                 lambda n: {"op": "ack", **CONSUMER, "ranges": [[i, i] for i in range(n)]},
                 "acked", id="ack-ranges"),
    pytest.param(MAX_ACK_RANGES, "too_large",
                 lambda n: {"op": "nack", **CONSUMER, "pull_seqs": list(range(10**6, 10**6 + n))},
                 "nacked", id="nack-pull-seqs"),
    pytest.param(MAX_DELAY_MS, "delay_out_of_range",
                 lambda n: {"op": "nack", **CONSUMER, "pull_seqs": [10**6], "retry_after_ms": n},
                 "nacked", id="nack-retry-after-ms"),
]


@pytest.mark.parametrize(("limit", "code", "request_of", "answer_key"), REALTIME_REQUEST_LIMITS)
async def test_a_realtime_request_at_its_limit_is_answered_and_one_over_is_refused_naming_both(
    realtime: Live, limit: int, code: str, request_of: Callable[[int], dict[str, Any]],
    answer_key: str,
) -> None:
    await realtime.send(raw_payload(realtime.clock))
    await realtime.client.pull("limits", "g", "c", start="earliest")  # the group exists
    for n in around(limit):
        answer = await realtime.client.request(request_of(n))
        if n <= limit:
            assert answer_key in answer, (n, answer)
        else:
            assert_refused(answer["error"], code, n, limit)
    await realtime.assert_still_serving()


async def test_a_realtime_broker_refuses_a_message_due_beyond_the_clock_skew_it_allows(
    realtime: Live,
) -> None:
    now_ms = realtime.clock()
    below, at, over = (raw_payload(realtime.clock, d=now_ms + n)
                       for n in around(DELIVER_AT_SKEW_MS_MAX))
    results = (await realtime.send(below, at, over))["results"]
    assert [r.get("status") for r in results[:2]] == ["stored", "stored"], results
    assert_refused(results[2]["error"], "bad_request", DELIVER_AT_SKEW_MS_MAX + 1,
                   DELIVER_AT_SKEW_MS_MAX)


# --- delay-only requests --------------------------------------------------------------------------


async def test_a_message_due_at_the_horizon_is_kept_and_one_ms_later_is_delay_out_of_range(
    delay: Live,
) -> None:
    now_ms = delay.clock()
    below, at, over = (raw_payload(delay.clock, d=now_ms + n) for n in around(MAX_DELAY_MS))
    results = (await delay.send(below, at, over))["results"]
    assert [r.get("status") for r in results[:2]] == ["stored", "stored"], results
    assert results[1]["deliver_at_ms"] == now_ms + MAX_DELAY_MS
    assert_refused(results[2]["error"], "delay_out_of_range", MAX_DELAY_MS + 1, MAX_DELAY_MS)
    await delay.assert_still_serving()


async def test_a_delay_server_configured_with_a_shorter_horizon_refuses_one_ms_beyond_it(
    tmp_path: Any,
) -> None:
    clock = FakeClock()
    horizon_ms = 40 * 86_400_000  # 40 days, the shortest horizon users need
    server = DelayServer(DelayConfig(data_dir=str(tmp_path / "d40"), port=0, bucket_ms=1000,
                                     trace=False, max_delay_ms=horizon_ms),
                         clock=clock, dispatch=_dispatched)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        payloads = [raw_payload(clock, d=clock() + n) for n in around(horizon_ms)]
        results = (await client.request({"op": "send", "messages": payloads}))["results"]
        assert [r.get("status") for r in results[:2]] == ["stored", "stored"], results
        assert_refused(results[2]["error"], "delay_out_of_range", horizon_ms + 1, horizon_ms)
    finally:
        await client.close()
        await server.stop()


def cancel_of(ids: list[str], due_ms: int) -> dict[str, Any]:
    """A cancel request for ``ids``, all due at ``due_ms``."""
    return {"op": "cancel", "ids": ids, "deliver_at_ms": [due_ms] * len(ids)}


async def test_a_cancel_of_max_ids_is_answered_and_one_more_is_too_large(delay: Live) -> None:
    due_ms = delay.clock() + 60_000
    for n in around(MAX_SEND_BATCH_MESSAGES):
        answer = await delay.client.request(cancel_of([f"c{n}-{i}" for i in range(n)], due_ms))
        if n <= MAX_SEND_BATCH_MESSAGES:
            assert [r["status"] for r in answer["results"]] == ["unknown"] * n
        else:
            assert_refused(answer["error"], "too_large", n, MAX_SEND_BATCH_MESSAGES)
    await delay.assert_still_serving()


async def test_a_cancel_of_an_id_of_max_chars_is_answered_and_one_char_more_is_refused(
    delay: Live,
) -> None:
    due_ms = delay.clock() + 60_000
    sent = (await delay.send(raw_payload(delay.clock, i="k" * MAX_MESSAGE_ID_CHARS,
                                         d=due_ms)))["results"][0]
    assert sent["status"] == "stored"
    for n in around(MAX_MESSAGE_ID_CHARS):
        answer = await delay.client.request(cancel_of(["k" * n], due_ms))
        if n < MAX_MESSAGE_ID_CHARS:
            assert answer["results"][0]["status"] == "unknown"
        elif n == MAX_MESSAGE_ID_CHARS:
            assert answer["results"][0]["status"] == "cancelled"
        else:
            assert_refused(answer["error"], "bad_request", n, MAX_MESSAGE_ID_CHARS)
    await delay.assert_still_serving()
