"""Broker.send and its group commit, in-process: requests that share one commit each get their
own answers, and every stored message reaches the tail, the pulls and the trace once."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest

from realtime.broker import Broker
from realtime.config import RealtimeConfig
from realtime.metrics import RealtimeMetrics
from realtime.tracing import BrokerTracer
from wire.message import Message, decode_message, encode_message
from wire.protocol import Pull
from tracelog.reading import read_events
from tracelog.writer import TraceWriter
from tests.rawclient import FakeClock


@pytest.fixture
async def broker(tmp_path):
    clock = FakeClock()
    tracer = BrokerTracer(TraceWriter(tmp_path / "trace", "realtime:rt", clock_ms=clock,
                                      background=False))
    broker = await Broker.open(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0), clock,
                               tracer=tracer)
    yield broker
    await broker.stop()


def payload(subject: str, message_id: str, body: bytes, **fields) -> bytes:
    return encode_message(Message.create(subject, body, now_ms=FakeClock()(), id=message_id,
                                         **fields))


async def send_in_one_commit(broker: Broker, requests: list[list[bytes]]) -> list[list]:
    """Send every request while the committer counts as busy, so they all queue and the
    committer task takes them together (a send to an idle committer is committed at once, in
    its own task, alone)."""
    commits = []
    broker.on_commit = commits.append
    committer = broker.sends.commits
    committer._running = True  # what a commit in flight looks like to a send
    sends = [asyncio.ensure_future(broker.send(request)) for request in requests]
    for _ in range(100):
        if len(committer.pending) == len(requests):
            break
        await asyncio.sleep(0)
    committer._running = False
    committer.wake()
    answers = await asyncio.gather(*sends)
    assert len(commits) == 1, f"the requests took {len(commits)} commits"
    return answers


async def bodies(broker: Broker, subject: str) -> list[bytes]:
    pulled = await broker.pull(Pull(1, subject, "g", "c1", 100, 0, [], "earliest", False))
    return [decode_message(p).body for p in pulled.payloads]


async def test_requests_of_one_subject_in_one_commit_each_get_their_own_answers(broker):
    requests = [[payload("a", f"a{n}", b"%d" % n) for n in range(first, first + 3)]
                for first in (0, 3, 6)]
    answers = await send_in_one_commit(broker, requests)
    assert [[r["id"] for r in answer] for answer in answers] == [
        ["a0", "a1", "a2"], ["a3", "a4", "a5"], ["a6", "a7", "a8"]]
    assert all(r["status"] == "stored" for answer in answers for r in answer)
    assert await bodies(broker, "a") == [b"%d" % n for n in range(9)]


async def test_a_commit_of_mixed_subjects_bad_messages_and_a_repeated_id_answers_each(broker):
    requests = [
        [payload("a", "a0", b"a0"), payload("b", "b0", b"b0"), b"\xc1not a message"],
        [payload("a", "a0", b"again"), payload("a", "a1", b"a1")],
        [payload("b", "b1", b"b1", tags=("vip",))],
    ]
    answers = await send_in_one_commit(broker, requests)
    assert [[(r["id"], r.get("status") or r["error"]["code"]) for r in answer]
            for answer in answers] == [
        [("a0", "stored"), ("b0", "stored"), ("", "bad_request")],
        [("a0", "duplicate"), ("a1", "stored")],
        [("b1", "stored")]]
    assert await bodies(broker, "a") == [b"a0", b"a1"]
    assert await bodies(broker, "b") == [b"b0", b"b1"]
    broker.tracer.writer.flush()
    stored = [e["msg_id"] for e in read_events([broker.tracer.writer.directory])
              if e["event"] == "stored"]
    assert sorted(stored) == ["a0", "a1", "b0", "b1"]


async def test_a_bug_publishing_a_commit_answers_its_sends_internal_and_later_sends_are_stored(
        broker, monkeypatch):
    publish = broker.sends._publish
    calls = []

    def publish_raising_once(batch, sequences):
        calls.append(len(sequences))
        if len(calls) == 1:
            raise KeyError("injected publish bug")
        publish(batch, sequences)

    monkeypatch.setattr(broker.sends, "_publish", publish_raising_once)
    async with asyncio.timeout(30):  # generous: before the fix it was never answered
        first = await broker.send([payload("a", "a0", b"a0"), payload("a", "a1", b"a1")])
    assert [(r["id"], r["error"]["code"]) for r in first] == [("a0", "internal"),
                                                              ("a1", "internal")]
    assert "KeyError" in first[0]["error"]["message"]
    assert broker.sends.commits.publish_failures == 1
    # The committer is still running: a later send is stored and answered, and the resend of
    # the failed one (it was stored) is a duplicate.
    async with asyncio.timeout(30):
        second = await broker.send([payload("a", "a2", b"a2")])
    assert [r["status"] for r in second] == ["stored"]
    again = await broker.send([payload("a", "a0", b"a0"), payload("a", "a1", b"a1")])
    assert [r["status"] for r in again] == ["duplicate", "duplicate"]
    assert broker.message_errors.get("internal") == 2
    metrics = RealtimeMetrics("rt")
    metrics.watch(broker, SimpleNamespace(stats=defaultdict(int)))  # type: ignore[arg-type]
    assert metrics.registry.get_sample_value(
        "qmq_realtime_commit_publish_failures_total") == 1


def gate_store(broker: Broker) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Hold the store thread inside each commit made once ``armed`` is set, until
    ``release`` is set; ``entered`` tells that a commit is being held."""
    commit_io = broker.sends._append_and_commit_io
    armed, entered, release = threading.Event(), threading.Event(), threading.Event()

    def held(batch, now_ms):
        if armed.is_set():
            entered.set()
            assert release.wait(30)
        return commit_io(batch, now_ms)

    broker.sends._append_and_commit_io = held
    return armed, entered, release


async def wait_until(predicate) -> None:
    async with asyncio.timeout(30):  # generous: each step is a loop turn or a thread hop
        while not predicate():
            await asyncio.sleep(0.005)


async def test_a_send_riding_in_the_commit_of_a_sender_cancelled_meanwhile_is_answered(broker):
    armed, entered, release = gate_store(broker)
    committer = broker.sends.commits
    armed.set()
    first = asyncio.create_task(broker.send([payload("s", "m1", b"1")]))
    await wait_until(entered.is_set)
    second = asyncio.create_task(broker.send([payload("s", "m2", b"2")]))  # queues
    await wait_until(lambda: len(committer.pending) == 1)
    # A send read as the first commit publishes commits in its own task and takes the
    # queued second along; then that task is cancelled (a stop past its grace).
    third: list[asyncio.Future] = []
    broker.on_commit = lambda count: third or third.append(
        asyncio.ensure_future(broker.send([payload("s", "m3", b"3")])))
    entered.clear()
    release.set()
    await wait_until(lambda: third)
    release.clear()
    await wait_until(entered.is_set)
    assert committer.pending == []
    third[0].cancel()
    release.set()
    await asyncio.gather(first, third[0], return_exceptions=True)
    async with asyncio.timeout(30):
        assert [r["status"] for r in await second] == ["stored"]
    assert broker.committed.ends["s"] == 3, "the cancelled commit's run is not in the tail"
    assert await bodies(broker, "s") == [b"1", b"2", b"3"]


async def test_a_demote_cancelling_the_committer_mid_commit_still_answers_its_senders(broker):
    armed, entered, release = gate_store(broker)
    committer = broker.sends.commits
    armed.set()
    first = asyncio.create_task(broker.send([payload("s", "m1", b"1")]))
    await wait_until(entered.is_set)
    second = asyncio.create_task(broker.send([payload("s", "m2", b"2")]))
    await wait_until(lambda: len(committer.pending) == 1)
    entered.clear()
    release.set()
    await first
    release.clear()
    await wait_until(entered.is_set)  # the committer task's commit of the second
    stopping = asyncio.create_task(broker._stop_rounds())  # Broker.demote's first step
    await asyncio.sleep(0)
    release.set()
    await stopping
    await committer.commit_pending()
    async with asyncio.timeout(30):
        assert [r["status"] for r in await second] == ["stored"]
    assert broker.committed.ends["s"] == 2


async def test_the_usual_commit_of_a_known_subject_takes_the_stores_one_call(broker,
                                                                              monkeypatch):
    from realtime.storage import commit_run

    encoded = []

    def spy_on(name, twin):
        def spy(*args):
            answer = twin(*args)
            encoded.append((name, answer is not None))
            return answer
        return spy

    # Real files: the run is encoded and written in one call (write_run); encode_run alone
    # is for files that are not (a test's FaultyFile).
    monkeypatch.setattr(commit_run, "encode_run", spy_on("encode_run", commit_run.encode_run))
    monkeypatch.setattr(commit_run, "write_run", spy_on("write_run", commit_run.write_run))
    await broker.send([payload("rt.one", "a", b"first")])  # a new subject: the general path
    await broker.send([payload("rt.one", f"b{i}", b"next") for i in range(3)])
    assert encoded == [("write_run", True)]
    assert await bodies(broker, "rt.one") == [b"first", b"next", b"next", b"next"]


def test_a_send_request_starts_as_a_fresh_later_does():
    # SendRequest sets the Later's own fields itself (no second __init__ per send): they must
    # stay those Later() starts with, whatever fields Later gains.
    from realtime.sends import SendRequest
    from serverkit.frame_server import Later

    fresh, request = Later(), SendRequest([], [], None, [], False)
    for field in Later.__slots__:
        assert getattr(request, field) == getattr(fresh, field), field
