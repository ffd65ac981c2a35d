"""The delay server over the wire, in-process on port 0, with a fake clock and a recording
dispatch function standing in for the realtime brokers."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from wire.errors import Overloaded
from wire.message import decode_message, encode_message
from tests.rawclient import FakeClock, RawClient, message

DAY_MS = 86_400_000


class Realtime:
    """Records what the delay server dispatched, and when (by the fake clock)."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.received: list[tuple[int, Any]] = []
        self.fail_next = 0
        self.arrived = asyncio.Event()

    async def dispatch(self, subject: str, payloads: list[bytes]):
        if self.fail_next:
            self.fail_next -= 1
            raise Overloaded("realtime is busy")
        for payload in payloads:
            self.received.append((self.clock(), decode_message(payload)))
        self.arrived.set()
        return "rt-test", [{"id": decode_message(p).id, "status": "stored"} for p in payloads]

    def bodies(self) -> list[bytes]:
        return [m.body for _, m in self.received]

    async def wait_for(self, count: int, server: DelayServer, timeout_s: float = 10) -> None:
        async def loop():
            while len(self.received) < count:
                self.arrived.clear()
                server.scheduler.poke()
                try:
                    async with asyncio.timeout(0.2):
                        await self.arrived.wait()
                except asyncio.TimeoutError:
                    pass
        async with asyncio.timeout(timeout_s):
            await loop()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def start(tmp_path, clock, realtime, **overrides) -> DelayServer:
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=1000, **overrides)
    server = DelayServer(config, clock=clock, dispatch=realtime.dispatch)
    await server.start()
    return server


async def settle(server: DelayServer) -> None:
    """Let the dispatcher run with the current (fake) time and finish what it started."""
    for _ in range(3):
        server.scheduler.poke()
        await asyncio.sleep(0.02)
        tasks = set(server.scheduler.dispatcher.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=5)


@pytest.fixture
def realtime(clock) -> Realtime:
    return Realtime(clock)


@pytest.fixture
async def server(tmp_path, clock, realtime):
    server = await start(tmp_path, clock, realtime)
    yield server
    await server.stop()


@pytest.fixture
async def client(server):
    client = await RawClient.connect(server.port)
    yield client
    await client.close()


async def test_a_delayed_message_is_dispatched_at_its_time_and_not_before(server, client, clock, realtime):
    due = clock() + 30_000
    sent = await client.send(message("orders", b"cancel 42", clock, deliver_at_ms=due))
    assert sent["results"][0]["status"] == "stored"
    assert sent["results"][0]["deliver_at_ms"] == due
    clock.advance(29_999)
    await settle(server)
    assert realtime.received == []
    clock.advance(1)
    await realtime.wait_for(1, server)
    at, msg = realtime.received[0]
    assert msg.body == b"cancel 42" and at >= due


async def test_a_message_due_in_the_past_is_dispatched_at_once(server, client, clock, realtime):
    await client.send(message("s", b"late", clock, deliver_at_ms=clock() - 5_000))
    await realtime.wait_for(1, server)
    assert realtime.bodies() == [b"late"]


async def test_a_message_beyond_the_horizon_is_refused_never_clamped(server, client, clock, realtime):
    too_far = clock() + server.config.max_delay_ms + 1
    result = (await client.send(message("s", b"x", clock, deliver_at_ms=too_far)))["results"][0]
    assert result["error"]["code"] == "delay_out_of_range"
    assert str(server.config.max_delay_ms) in result["error"]["message"]
    at_limit = clock() + server.config.max_delay_ms
    assert (await client.send(message("s", b"y", clock, deliver_at_ms=at_limit)))["results"][0]["status"] == "stored"


async def test_messages_are_dispatched_in_due_order_with_none_early(server, client, clock, realtime):
    import random

    rng = random.Random(7)
    dues = [clock() + rng.randrange(0, 10_000) for _ in range(300)]
    await client.send(*(message("s", b"%d" % d, clock, deliver_at_ms=d) for d in dues[:200]))
    await client.send(*(message("s", b"%d" % d, clock, deliver_at_ms=d) for d in dues[200:]))
    for _ in range(20):
        clock.advance(500)
        await settle(server)
    await realtime.wait_for(300, server)
    assert sorted(int(b) for b in realtime.bodies()) == sorted(dues)
    assert all(at >= m.deliver_at_ms for at, m in realtime.received)
    assert server.scheduler.stats.early == 0


async def test_a_cancelled_message_is_never_delivered(server, client, clock, realtime):
    doomed = message("s", b"doomed", clock, deliver_at_ms=clock() + 60_000)
    kept = message("s", b"kept", clock, deliver_at_ms=clock() + 60_000)
    await client.send(doomed, kept)
    answer = await client.request({"op": "cancel", "ids": [doomed.id],
                                   "deliver_at_ms": [doomed.deliver_at_ms]})
    assert answer["results"] == [{"id": doomed.id, "status": "cancelled"}]
    clock.advance(61_000)
    await realtime.wait_for(1, server)
    await settle(server)
    assert realtime.bodies() == [b"kept"]


async def test_a_cancel_of_a_message_already_in_the_window_removes_it(server, client, clock, realtime):
    soon = message("s", b"soon", clock, deliver_at_ms=clock() + 500)  # inside the loaded window
    await client.send(soon)
    answer = await client.request({"op": "cancel", "ids": [soon.id], "deliver_at_ms": [soon.deliver_at_ms]})
    assert answer["results"][0]["status"] == "cancelled"
    clock.advance(1_000)
    await settle(server)
    assert realtime.received == []


async def test_cancel_after_dispatch_and_of_an_unknown_id_say_so(server, client, clock, realtime):
    gone = message("s", b"gone", clock, deliver_at_ms=clock() + 100)
    await client.send(gone)
    clock.advance(200)
    await realtime.wait_for(1, server)
    await settle(server)
    answer = await client.request({"op": "cancel", "ids": [gone.id, "never-sent"],
                                   "deliver_at_ms": [gone.deliver_at_ms, clock()]})
    assert [r["status"] for r in answer["results"]] == ["already_dispatched", "unknown"]


async def test_a_failed_dispatch_is_retried_and_still_never_early(server, client, clock, realtime):
    realtime.fail_next = 2
    due = clock() + 1_000
    await client.send(message("s", b"x", clock, deliver_at_ms=due))
    for _ in range(10):
        clock.advance(1_000)
        await settle(server)
        if realtime.received:
            break
    assert realtime.bodies() == [b"x"]
    assert realtime.received[0][0] >= due


async def test_pending_messages_survive_a_restart_and_overdue_ones_go_at_once(tmp_path, clock, realtime):
    server = await start(tmp_path, clock, realtime)
    client = await RawClient.connect(server.port)
    await client.send(message("s", b"while-down", clock, deliver_at_ms=clock() + 10_000),
                      message("s", b"later", clock, deliver_at_ms=clock() + 3_600_000))
    await client.close()
    await server.stop()
    clock.advance(60_000)  # the server is down when "while-down" falls due
    server = await start(tmp_path, clock, realtime)
    try:
        await realtime.wait_for(1, server)
        await settle(server)
        assert realtime.bodies() == [b"while-down"]
        clock.advance(3_600_000)
        await realtime.wait_for(2, server)
        assert realtime.bodies() == [b"while-down", b"later"]
    finally:
        await server.stop()


async def test_a_dispatched_message_is_not_dispatched_again_after_a_restart(tmp_path, clock, realtime):
    server = await start(tmp_path, clock, realtime)
    client = await RawClient.connect(server.port)
    await client.send(message("s", b"once", clock, deliver_at_ms=clock() + 100))
    clock.advance(200)
    await realtime.wait_for(1, server)
    await client.close()
    await server.stop()
    server = await start(tmp_path, clock, realtime)
    try:
        clock.advance(10_000)
        await settle(server)
        assert realtime.bodies() == [b"once"]
    finally:
        await server.stop()


@pytest.mark.parametrize("ahead_ms", [40 * DAY_MS, 729 * DAY_MS], ids=["40 days", "2 years"])
async def test_a_long_delay_is_kept_and_delivered_on_time(server, client, clock, realtime, ahead_ms):
    due = clock() + ahead_ms
    await client.send(message("reminder", b"far", clock, deliver_at_ms=due))
    clock.advance(ahead_ms - 1_000)
    await settle(server)
    assert realtime.received == []
    stats = await server.scheduler.report()
    assert stats["pending_total"] == 1
    clock.advance(1_000)
    await realtime.wait_for(1, server)
    assert realtime.received[0][0] >= due


async def test_stats_report_pending_per_hour_and_subject_and_lateness(server, client, clock, realtime):
    await client.send(message("a", b"1", clock, deliver_at_ms=clock() + 3_600_000),
                      message("b", b"2", clock, deliver_at_ms=clock() + 100))
    clock.advance(100)
    await realtime.wait_for(1, server)
    # Received is not yet recorded: the worker records the dispatch once it has the answer.
    await settle(server)
    report = await server.scheduler.report()
    assert report["pending_total"] == 1
    assert report["pending_per_subject"] == {"a": 1}
    assert sum(report["pending_per_hour"].values()) == 1
    assert report["dispatched"] == 1 and report["early"] == 0


async def test_a_message_sent_after_idle_housekeeping_is_still_dispatched_on_time(
    server, client, clock, realtime
):
    # With nothing pending, housekeeping retires old buckets; it must not retire the current
    # or future ones, or a message due soon would be filed where nothing is loaded yet.
    clock.advance(5_000)
    await server.scheduler.advance_done()
    assert server.scheduler.store.done_before() <= server.scheduler.bucket_of(clock())
    due = clock() + 500
    await client.send(message("s", b"soon", clock, deliver_at_ms=due))
    clock.advance(500)
    await realtime.wait_for(1, server, timeout_s=3)
    assert realtime.received[0][0] - due < server.config.bucket_ms


async def test_a_write_failure_keeps_the_delay_server_read_only_whatever_the_metaserver_says(
    tmp_path, clock, realtime
):
    from logstore.faults import FaultPlan

    plan = FaultPlan()
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=1000)
    server = DelayServer(config, clock=clock, dispatch=realtime.dispatch, opener=plan.opener)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        plan.fail_sync_at = plan.syncs + 1
        # A compact send that fails is answered with a result per message all the same.
        failed = await client.request({"op": "send", "compact": True, "messages": [
            encode_message(message("s", b"x", clock, deliver_at_ms=clock() + 10))]})
        assert failed["results"][0]["error"]["code"] == "internal"
        server._on_state("rw")  # the MetaServer's heartbeat answer
        refused = (await client.send(message("s", b"y", clock, deliver_at_ms=clock() + 10)))
        assert refused["results"][0]["error"]["code"] == "readonly"
    finally:
        await client.close()
        await server.stop()


async def wait_until(condition, server: DelayServer, timeout_s: float = 10) -> None:
    """Poke the dispatcher until ``condition()`` holds (bounded by ``timeout_s``)."""
    async def loop():
        while not condition():
            server.scheduler.poke()
            await asyncio.sleep(0.01)
    async with asyncio.timeout(timeout_s):
        await loop()


async def test_while_the_realtime_side_is_slow_due_messages_go_in_fewer_larger_requests_and_records(
    server, client, clock, realtime, monkeypatch
):
    from delayserver.dispatch import DISPATCH_CONCURRENCY

    gate = asyncio.Event()
    requests: list[int] = []
    answer = realtime.dispatch

    async def slow_dispatch(subject, payloads):
        requests.append(len(payloads))
        await gate.wait()
        return await answer(subject, payloads)

    server.scheduler.dispatcher.send = slow_dispatch
    store = server.scheduler.store
    recorded: list[int] = []
    record = store.record_dispatched
    monkeypatch.setattr(store, "record_dispatched", lambda entries, subjects=None: (
        recorded.append(len(entries)), record(entries, subjects))[1])
    base = clock()
    count = 3 * DISPATCH_CONCURRENCY
    await client.send(*(message("s", b"%d" % i, clock, deliver_at_ms=base + 10 * (i + 1))
                        for i in range(count)))
    # One message falls due per tick until every dispatch worker is waiting on the broker.
    for i in range(DISPATCH_CONCURRENCY):
        clock.advance(10)
        await wait_until(lambda: len(requests) == i + 1, server)
    # The rest fall due one per tick while every worker waits.
    for _ in range(count - DISPATCH_CONCURRENCY):
        clock.advance(10)
        server.scheduler.poke()
        await asyncio.sleep(0.005)
    gate.set()
    await realtime.wait_for(count, server)
    await settle(server)
    assert requests == [1] * DISPATCH_CONCURRENCY + [count - DISPATCH_CONCURRENCY]
    assert sum(recorded) == count
    assert len(recorded) < len(requests)  # confirmations share dispatch-log writes
    assert all(at >= m.deliver_at_ms for at, m in realtime.received)


async def test_a_cancel_after_the_watermark_passed_the_bucket_says_already_past_not_unknown(
    server, client, clock, realtime
):
    gone = message("s", b"gone", clock, deliver_at_ms=clock() + 100)
    await client.send(gone)
    clock.advance(200)
    await realtime.wait_for(1, server)
    await settle(server)
    clock.advance(5 * server.config.bucket_ms)
    await server.scheduler.advance_done()
    assert server.scheduler.store.done_before() > gone.deliver_at_ms  # its bucket is retired
    answer = await client.request({"op": "cancel", "ids": [gone.id, "never-sent"],
                                   "deliver_at_ms": [gone.deliver_at_ms, clock() + 60_000]})
    assert [r["status"] for r in answer["results"]] == ["already_past", "unknown"]


async def test_the_quick_check_stores_what_the_full_check_accepts_and_refuses_the_rest_alike(
    server, client, clock, realtime
):
    import msgpack

    due = clock() + 1_000
    good = message("s", b"good", clock, deliver_at_ms=due, tags=("t",), properties={"k": "v"})
    retry = message("%retry%s%g", b"retry copy", clock, deliver_at_ms=due)
    fields = {"i": "bad-subject", "s": "bad subject!", "b": b"x", "c": clock(), "d": due}
    nil_due = {"i": "nil-due", "s": "s", "b": b"x", "c": clock(), "d": None}
    too_far = {"i": "too-far", "s": "s", "b": b"x", "c": clock(),
               "d": clock() + server.config.max_delay_ms + 1}
    payloads = [encode_message(good), encode_message(retry)] + [
        msgpack.packb(f, use_bin_type=True) for f in (fields, nil_due, too_far)]
    answer = await client.request({"op": "send", "messages": payloads})
    assert [r.get("status") or r["error"]["code"] for r in answer["results"]] == [
        "stored", "stored", "bad_request", "bad_request", "delay_out_of_range"]
    assert [r["id"] for r in answer["results"]] == [
        good.id, retry.id, "bad-subject", "nil-due", "too-far"]
    clock.advance(1_000)
    await realtime.wait_for(2, server)
    assert sorted(m.body for _, m in realtime.received) == [b"good", b"retry copy"]
    assert [m for _, m in realtime.received if m.id == good.id][0] == good


async def test_a_hot_slot_backlog_is_read_in_chunks_and_each_message_sent_once_in_small_batches(
    tmp_path, clock, realtime, monkeypatch
):
    import delayserver.dispatch as dispatch_module

    monkeypatch.setattr(dispatch_module, "HOT_BACKLOG_ENTRIES", 32)
    monkeypatch.setattr(dispatch_module, "HOT_CHUNK_ENTRIES_MAX", 100)
    server = await start(tmp_path, clock, realtime, dispatch_batch_max=16)
    client = await RawClient.connect(server.port)
    requests: list[int] = []
    answer = realtime.dispatch

    async def counting_dispatch(subject, payloads):
        requests.append(len(payloads))
        return await answer(subject, payloads)

    server.scheduler.dispatcher.send = counting_dispatch
    store = server.scheduler.store
    reads: list[int] = []
    read_payloads = store.read_payloads
    monkeypatch.setattr(store, "read_payloads", lambda entries: (
        reads.append(len(entries)), read_payloads(entries))[1])
    try:
        due = clock() + 500
        for start_at in range(0, 300, 100):
            await client.send(*(message("hot", b"%d" % i, clock, deliver_at_ms=due + i % 7)
                                for i in range(start_at, start_at + 100)))
        clock.advance(1_000)
        await realtime.wait_for(300, server)
        await settle(server)
        assert sorted(int(b) for b in realtime.bodies()) == list(range(300))
        assert all(at >= m.deliver_at_ms for at, m in realtime.received)
        assert max(requests) <= 16
        assert max(reads) == 100  # a chunk, read in one store call
    finally:
        await client.close()
        await server.stop()


async def test_a_dispatch_a_full_disk_kept_from_being_recorded_is_recorded_later_not_resent(
    tmp_path, clock, realtime
):
    from logstore.faults import FaultPlan

    plan = FaultPlan()
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=1000)
    server = DelayServer(config, clock=clock, dispatch=realtime.dispatch, opener=plan.opener)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        stored = await client.send(message("s", b"once", clock, deliver_at_ms=clock() + 100))
        assert stored["results"][0]["status"] == "stored"
        plan.disk_capacity_bytes = plan.bytes_written  # the dispatch record will not fit
        clock.advance(200)
        await realtime.wait_for(1, server)
        await wait_until(lambda: server.scheduler.dispatcher.unrecorded, server)
        assert await server.scheduler.record_unrecorded() == 0, "still full"
        plan.free_space(1 << 20)
        assert await server.scheduler.record_unrecorded() == 1
    finally:
        await client.close()
        await server.stop()
    server = await start(tmp_path, clock, realtime)
    try:
        clock.advance(10_000)
        await settle(server)
        assert realtime.bodies() == [b"once"], "recorded, so never dispatched again"
    finally:
        await server.stop()


@pytest.mark.parametrize("sent", ["into_the_loaded_window", "before_its_bucket_is_loaded"])
async def test_a_hot_slot_larger_than_the_window_cap_is_delivered_completely_and_on_time(
    tmp_path, clock, realtime, sent
):
    cap = 10
    server = await start(tmp_path, clock, realtime, wheel_entries_max=cap)
    client = await RawClient.connect(server.port)
    scheduler = server.scheduler
    largest = 0
    window = scheduler.window
    track = window.track

    def counting_track(entries):
        nonlocal largest
        track(entries)
        largest = max(largest, len(window))

    window.track = counting_track
    try:
        ahead_ms = 1_500 if sent == "into_the_loaded_window" else 10_000
        due = clock() + ahead_ms
        hot = [message("hot", b"h%d" % i, clock, deliver_at_ms=due) for i in range(50)]
        after = [message("hot", b"a%d" % i, clock, deliver_at_ms=due + 1_000 + i)
                 for i in range(15)]
        for start_at in range(0, 50, 25):
            answer = await client.send(*hot[start_at:start_at + 25])
            assert {r["status"] for r in answer["results"]} == {"stored"}
        await client.send(*after)
        clock.advance(ahead_ms - 1)
        await settle(server)
        assert realtime.received == [], "nothing early"
        clock.advance(1)
        await realtime.wait_for(50, server)  # the clock does not move: on time
        assert sorted(m.body for _, m in realtime.received) == sorted(m.body for m in hot)
        assert {at for at, _ in realtime.received} == {due}
        clock.advance(1_000 + 15)
        await realtime.wait_for(65, server)
        assert len({m.id for _, m in realtime.received}) == 65, "each message once"
        assert all(at >= m.deliver_at_ms for at, m in realtime.received)
        assert largest <= cap
        await settle(server)
        assert window.resume_at == {}
    finally:
        await client.close()
        await server.stop()


async def test_stop_finishes_even_when_the_dispatcher_is_woken_in_the_same_turn(
        tmp_path, clock, realtime):
    # A wakeup and the stop's cancel reaching the dispatcher together once made the cancel
    # vanish (asyncio.wait_for on 3.11) and stop() wait for ever; try every few loop turns apart.
    for turns_between in range(4):
        server = await start(tmp_path / str(turns_between), clock, realtime)
        server.scheduler.poke()
        for _ in range(turns_between):
            await asyncio.sleep(0)
        async with asyncio.timeout(30):
            await server.stop()


async def test_a_dispatch_refused_for_good_is_traced_as_given_up_and_counted(tmp_path, clock):
    from tracelog.reading import read_events

    class Refusing(Realtime):
        async def dispatch(self, subject, payloads):
            await super().dispatch(subject, payloads)
            return "rt-test", [{"error": {"code": "bad_request", "message": "no"}}
                               if decode_message(p).id == "doomed" else
                               {"id": decode_message(p).id, "status": "stored"}
                               for p in payloads]

    realtime = Refusing(clock)
    server = await start(tmp_path, clock, realtime)
    client = await RawClient.connect(server.port)
    try:
        for msg_id in ("kept", "doomed"):
            await client.send(message("s", msg_id.encode(), clock, id=msg_id,
                                      deliver_at_ms=clock() + 100))
        clock.advance(200)
        await realtime.wait_for(2, server)
        await wait_until(lambda: server.scheduler.tracer.gave_up_counts, server)
    finally:
        await client.close()
        await server.stop()
    events = read_events([tmp_path / "delay" / "trace"])
    assert sorted((e["event"], e["msg_id"], e["reason"]) for e in events
                  if e["event"] in ("dispatched", "gave_up")) == [
        ("dispatched", "kept", None), ("gave_up", "doomed", "dispatch_refused")]
    assert server.scheduler.tracer.gave_up_counts == {"dispatch_refused": 1}


async def test_a_compact_send_is_answered_with_a_count_only_when_every_message_was_stored(
    server, client, clock, realtime
):
    due = clock() + 1_000
    sent = [message("s", b"a", clock, deliver_at_ms=due), message("s", b"b", clock,
                                                                  deliver_at_ms=due + 1)]
    answer = await client.request({"op": "send", "messages": [encode_message(m) for m in sent],
                                   "compact": True})
    assert answer == {"rid": answer["rid"], "stored": 2}
    too_far = message("s", b"c", clock, deliver_at_ms=clock() + server.config.max_delay_ms + 1)
    mixed = await client.request({"op": "send", "compact": True, "messages": [
        encode_message(message("s", b"d", clock, deliver_at_ms=due)), encode_message(too_far)]})
    assert [r.get("status") or r["error"]["code"] for r in mixed["results"]] == [
        "stored", "delay_out_of_range"]
    assert server.metrics.registry.get_sample_value("qmq_delay_messages_scheduled_total") == 3
    clock.advance(1_001)
    await realtime.wait_for(3, server)
    assert sorted(realtime.bodies()) == [b"a", b"b", b"d"]


async def test_a_commit_wakes_the_sleeping_timer_only_for_a_message_due_before_it_would_wake(
    tmp_path, clock, realtime
):
    # 60 s buckets: the idle timer sleeps to the next bucket (up to 60 s of real time), so a
    # message due now is delivered promptly only if its commit woke the timer.
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=60_000)
    server = DelayServer(config, clock=clock, dispatch=realtime.dispatch)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        await settle(server)
        scheduler = server.scheduler
        wake_at_ms = scheduler._timer_wake_at_ms
        assert wake_at_ms is not None and wake_at_ms > clock()
        later = await client.send(message("s", b"later", clock, deliver_at_ms=wake_at_ms + 5))
        assert later["results"][0]["status"] == "stored"
        assert not scheduler._wakeup.is_set()  # nothing due before the timer's own wake-up
        await client.send(message("s", b"now", clock, deliver_at_ms=clock()))
        async with asyncio.timeout(20):
            await realtime.arrived.wait()  # no poke: the commit woke it
        assert realtime.bodies() == [b"now"]
        clock.advance(wake_at_ms + 5 - clock())
        await realtime.wait_for(2, server)
        assert realtime.bodies() == [b"now", b"later"]
    finally:
        await client.close()
        await server.stop()
