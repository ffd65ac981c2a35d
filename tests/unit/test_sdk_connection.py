"""sdk.connection: pipelined requests by rid, error answers, drops, timeouts and the pool."""

from __future__ import annotations

import asyncio

import pytest

import sdk.connection as connection_module
from sdk.connection import Connection, ConnectionPool, RequestTimeout, parse_address
from wire.errors import BadRequest, ConnectionLost, Forbidden, NotSupported
from wire.protocol import FrameDecoder, encode_frame
from tests.unit.test_sdk_fakes import FakeBroker, broker_a  # noqa: F401  (fixture)


def pull_op(wait_ms: int) -> dict:
    return {"op": "pull", "subject": "s", "group": "g", "consumer_id": "c", "max_count": 1,
            "wait_ms": wait_ms, "tags": [], "start": "latest", "broadcast": False}


async def test_hello_tells_which_broker_group_answered(broker_a):
    conn = await Connection.open(broker_a.address, client_id="c1", app="shop", token="t")
    await conn.close()
    assert conn.server["group"] == "group-a"
    hello = broker_a.ops("hello")[0]
    assert (hello["client_id"], hello["app"], hello["token"], hello["protocol"]) == (
        "c1", "shop", "t", 1)


async def test_a_later_request_is_answered_while_a_long_poll_is_pending(broker_a):
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    pull = asyncio.create_task(conn.request(pull_op(wait_ms=10_000), None))
    await broker_a.wait_until(lambda: broker_a.ops("pull"))
    answer = await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000)
    assert answer == {"ok": True}
    assert not pull.done()
    broker_a.publish("s", b"now")
    pulled = await pull
    await conn.close()
    assert len(pulled["payloads"]) == 1


@pytest.mark.asyncio_internals  # wraps or reads asyncio transport attributes uvloop lacks
async def test_a_request_sent_alone_is_written_at_once_and_keeps_its_place_behind_queued_ones(
        broker_a, monkeypatch):
    # A consumer's pull or ack (coalesce=False) goes out in its own write with no end-of-turn
    # callback (a loop iteration per request); sent after requests its loop turn queued to
    # share one write, it goes out behind them, in order.
    ends: list[int] = []
    end_turn = Connection._end_turn
    monkeypatch.setattr(Connection, "_end_turn", lambda self: (ends.append(1), end_turn(self)))
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    ends.clear()  # the hello's
    writes: list[bytes] = []
    transport = conn._transport
    write = transport.write
    monkeypatch.setattr(transport, "write", lambda data: (writes.append(data), write(data))[1])
    heartbeat = {"op": "heartbeat", "consumer_id": "c", "subscriptions": []}
    assert await conn.request(heartbeat, 5000, coalesce=False) == {"ok": True}
    assert (len(writes), ends) == (1, [])
    tasks = [asyncio.create_task(conn.request(heartbeat, 5000, coalesce=coalesce))
             for coalesce in (True, True, False)]  # started in one loop turn
    assert [await task for task in tasks] == [{"ok": True}] * 3
    await conn.close()
    assert (len(writes), ends) == (3, [1]), "the first at once, the other two together"
    rids = [op["rid"] for op in broker_a.ops("heartbeat")]
    assert rids == sorted(rids) and len(rids) == 4


async def test_an_error_answer_raises_its_error_with_the_code_and_rid(broker_a):
    broker_a.fail_next("heartbeat", "error", ("forbidden", "app a may not consume s"))
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    with pytest.raises(Forbidden) as caught:
        await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000)
    assert caught.value.code == "forbidden"
    assert caught.value.rid == broker_a.ops("heartbeat")[0]["rid"]
    # The connection survives an error answer.
    assert await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000)
    await conn.close()


async def test_on_answer_gets_the_answer_as_it_is_read_before_the_caller_resumes(broker_a):
    broker_a.publish("s", b"now")
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    seen: list[tuple[str, object]] = []
    resumed = asyncio.Event()

    async def pull() -> None:
        answer = await conn.request(pull_op(wait_ms=10_000), 5000,
                                    lambda answer: seen.append(("on_answer", answer)))
        seen.append(("resumed", answer))
        resumed.set()

    task = asyncio.create_task(pull())
    async with asyncio.timeout(10):
        await resumed.wait()
    await task
    await conn.close()
    assert [what for what, _ in seen] == ["on_answer", "resumed"]
    assert seen[0][1] is seen[1][1] and len(seen[0][1]["payloads"]) == 1


async def test_on_answer_is_not_called_for_an_error_answer_nor_after_a_timeout(broker_a):
    broker_a.fail_next("heartbeat", "error", ("forbidden", "app a may not consume s"))
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    called: list[dict] = []
    with pytest.raises(Forbidden):
        await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000,
                           called.append)
    with pytest.raises(RequestTimeout):
        await conn.request(pull_op(wait_ms=10_000), 50, called.append)
    broker_a.publish("s", b"late")  # answers the timed-out pull: its caller has left
    async with asyncio.timeout(10):
        await broker_a.wait_until(lambda: broker_a._next_pull_seq.get("s", 1) > 1)
        # A request after it on the same connection: its answer comes after the late one.
        await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000)
    await conn.close()
    assert called == []


async def test_an_on_answer_that_raises_is_logged_and_the_caller_still_gets_its_answer(
        broker_a, caplog):
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)

    def broken(answer: dict) -> None:
        raise RuntimeError("a bug in the callback")

    answer = await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []},
                                5000, broken)
    assert answer == {"ok": True}
    assert "a bug in the callback" in caplog.text
    # The connection goes on.
    assert await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000)
    await conn.close()


async def test_request_nowait_calls_back_once_with_the_answer_or_the_error(broker_a):
    broker_a.fail_next("heartbeat", "error", ("forbidden", "app a may not consume s"))
    broker_a.publish("s", b"now")
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    seen: list[tuple[str, object]] = []
    done = asyncio.Event()

    def noted(what: str):
        return lambda value: (seen.append((what, value)), done.set())

    heartbeat = {"op": "heartbeat", "consumer_id": "c", "subscriptions": []}
    async with asyncio.timeout(10):
        conn.request_nowait(heartbeat, 5000, noted("answer"), noted("error"))
        await done.wait()
        done.clear()
        conn.request_nowait(pull_op(wait_ms=10_000), 5000, noted("answer"), noted("error"))
        await done.wait()
        done.clear()
        conn.request_nowait(pull_op(wait_ms=10_000), 50, noted("answer"), noted("error"))
        await done.wait()
        done.clear()
        conn.request_nowait(pull_op(wait_ms=10_000), None, noted("answer"), noted("error"))
        await broker_a.wait_until(lambda: len(broker_a.ops("pull")) == 3)
        broker_a.drop_connections()
        await done.wait()
    assert [what for what, _ in seen] == ["error", "answer", "error", "error"]
    assert isinstance(seen[0][1], Forbidden)
    assert len(seen[1][1]["payloads"]) == 1 and "rid" not in seen[1][1]
    assert isinstance(seen[2][1], RequestTimeout) and "within 50 ms" in str(seen[2][1])
    assert isinstance(seen[3][1], ConnectionLost)
    assert conn.pending_count == 0
    with pytest.raises(ConnectionLost):  # a dead connection: raised at once, no callback
        conn.request_nowait(heartbeat, 5000, noted("answer"), noted("error"))
    assert len(seen) == 4


async def test_a_forgotten_request_nowait_calls_nothing_and_a_broken_callback_reports_its_error(
        broker_a):
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    seen: list[object] = []
    rid = conn.request_nowait(pull_op(wait_ms=10_000), 50, seen.append, seen.append)
    conn.forget(rid)

    def broken(answer: dict) -> None:
        raise RuntimeError("a bug in the callback")

    errors: list[BaseException] = []
    heartbeat = {"op": "heartbeat", "consumer_id": "c", "subscriptions": []}
    conn.request_nowait(heartbeat, 5000, broken, errors.append)
    async with asyncio.timeout(10):
        while not errors:
            await asyncio.sleep(0.01)
        # Past the forgotten pull's deadline, and its late answer read: neither called back.
        await asyncio.sleep(0.1)
        broker_a.publish("s", b"late")
        await broker_a.wait_until(lambda: broker_a._next_pull_seq.get("s", 1) > 1)
        assert await conn.request(heartbeat, 5000) == {"ok": True}  # the connection goes on
    assert seen == [] and conn.pending_count == 0
    assert isinstance(errors[0], RuntimeError)
    await conn.close()


async def test_a_refused_hello_raises_and_leaves_no_connection(broker_a):
    broker_a.fail_next("hello", "error", ("not_supported", "protocol 1 unknown"))
    with pytest.raises(NotSupported):
        await Connection.open(broker_a.address, client_id="c", app="a", token=None)


async def test_a_dropped_connection_fails_every_pending_request_with_connection_lost(broker_a):
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    pulls = [asyncio.create_task(conn.request(pull_op(10_000), None)) for _ in range(3)]
    await broker_a.wait_until(lambda: len(broker_a.ops("pull")) == 3)
    broker_a.drop_connections()
    for pull in pulls:
        with pytest.raises(ConnectionLost):
            await pull
    await conn.wait_closed()
    assert conn.closed
    with pytest.raises(ConnectionLost):
        await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []}, 5000)


async def test_pending_requests_each_time_out_at_their_own_deadline_the_earliest_first(broker_a):
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    long_pull = asyncio.create_task(conn.request(pull_op(wait_ms=60_000), timeout_ms=60_000))
    later = asyncio.create_task(conn.request(pull_op(wait_ms=60_000), timeout_ms=300))
    sooner = asyncio.create_task(conn.request(pull_op(wait_ms=60_000), timeout_ms=50))
    async with asyncio.timeout(30):  # a hang, not a measure: each waits for its own deadline
        # Answered in time: nothing of it is left to expire.
        assert await conn.request({"op": "heartbeat", "consumer_id": "c", "subscriptions": []},
                                  5000) == {"ok": True}
        with pytest.raises(RequestTimeout, match="within 50 ms"):
            await sooner
        assert not later.done() and not long_pull.done()
        with pytest.raises(RequestTimeout, match="within 300 ms"):
            await later
    assert not long_pull.done() and conn.pending_count == 1
    long_pull.cancel()
    await asyncio.gather(long_pull, return_exceptions=True)
    assert conn.pending_count == 0 and not conn.closed
    await conn.close()


async def test_no_answer_within_the_timeout_raises_request_timeout_and_keeps_the_connection(broker_a):
    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    with pytest.raises(RequestTimeout) as caught:
        await conn.request(pull_op(wait_ms=10_000), timeout_ms=50)
    assert caught.value.retriable
    assert "50 ms" in str(caught.value)
    assert f"broker {broker_a.address} to pull" in str(caught.value)  # worded when it fired
    assert not conn.closed
    assert conn.pending_count == 0
    await conn.close()


async def test_a_request_to_a_broker_that_stops_reading_times_out_and_close_does_not_hang(
        monkeypatch):
    """A broker that answers hello and then reads nothing: requests fill the socket, wait for
    room like a drain, and still end at their timeout; close gives up flushing in time."""
    monkeypatch.setattr(connection_module, "CLOSE_FLUSH_TIMEOUT_MS", 200)
    held: list[asyncio.StreamWriter] = []

    async def hello_then_deaf(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = FrameDecoder()
        frames: list[dict] = []
        while not frames:
            frames += decoder.feed(await reader.read(65536))
        writer.write(encode_frame({"rid": frames[0]["rid"], "ok": True, "server": {}}))
        writer.transport.pause_reading()
        held.append(writer)

    server = await asyncio.start_server(hello_then_deaf, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await Connection.open(f"127.0.0.1:{port}", client_id="c", app="a", token=None)
        big = {"op": "send", "messages": [b"x" * (6 * 1024 * 1024)]}
        async with asyncio.timeout(30):
            results = await asyncio.gather(
                *(conn.request(big, timeout_ms=300) for _ in range(4)), return_exceptions=True)
        assert [type(r) for r in results] == [RequestTimeout] * 4
        # The socket is full now: the next request waits for room, and only for its timeout.
        with pytest.raises(RequestTimeout):
            async with asyncio.timeout(30):
                await conn.request(big, timeout_ms=300)
        assert conn.pending_count == 0
        async with asyncio.timeout(30):
            await conn.close()
        assert conn.closed
    finally:
        for writer in held:
            writer.transport.abort()
        server.close()
        await server.wait_closed()


async def test_connecting_to_a_closed_port_raises_connection_lost():
    broker = await FakeBroker("gone").start()
    address = broker.address
    await broker.stop()
    with pytest.raises(ConnectionLost):
        await Connection.open(address, client_id="c", app="a", token=None, connect_timeout_ms=1000)


async def test_the_pool_reuses_one_connection_and_reconnects_after_a_drop(broker_a):
    pool = ConnectionPool(client_id="c", app="a", token=None)
    first, again = await asyncio.gather(pool.get(broker_a.address), pool.get(broker_a.address))
    assert first is again
    broker_a.drop_connections()
    await first.wait_closed()
    second = await pool.get(broker_a.address)
    assert second is not first and not second.closed
    assert len(broker_a.ops("hello")) == 2
    await pool.close()
    with pytest.raises(ConnectionLost):
        await pool.get(broker_a.address)


@pytest.mark.parametrize("address", ["nohost", ":1", "h:", "h:0", "h:65536", "h:x"])
def test_an_address_that_is_not_host_and_port_is_a_bad_request(address):
    with pytest.raises(BadRequest):
        parse_address(address)


def test_an_ipv6_address_in_brackets_is_understood():
    assert parse_address("[::1]:20881") == ("::1", 20881)
    assert parse_address("127.0.0.1:65535") == ("127.0.0.1", 65535)


@pytest.mark.parametrize(("field", "chars", "limit"), [
    ("client_id", 200, "MAX_CLIENT_ID_CHARS 200"),
    ("app", 200, "MAX_CLIENT_ID_CHARS 200"),
    ("token", 512, "MAX_TOKEN_CHARS 512"),
])
def test_a_client_id_app_or_token_over_its_limit_is_refused_when_the_pool_is_built(
        field, chars, limit):
    identity = {"client_id": "c1", "app": "shop", "token": None}
    for length in (chars - 1, chars):  # max-1 and max are fine
        ConnectionPool(**{**identity, field: "x" * length})
    with pytest.raises(BadRequest) as refused:
        ConnectionPool(**{**identity, field: "x" * (chars + 1)})
    assert f"{field} of {chars + 1} characters exceeds {limit}" in refused.value.message
    assert "xxxx" not in refused.value.message  # a token is a secret: never quoted


def test_an_empty_client_id_is_refused_when_the_pool_is_built():
    with pytest.raises(BadRequest, match="client_id must not be empty"):
        ConnectionPool(client_id="", app="shop", token=None)
