"""A pull answered without a task (issue 18): tried at once, and a long poll parked with no task
is answered from the loop callback after the commit that wakes it (``Pulls.pull`` with
``direct``, ``ParkedPull``); what cannot be done at once goes the async way as before."""

from __future__ import annotations

import asyncio
import threading

import pytest

from realtime.broker import Broker
from realtime.config import RealtimeConfig
from realtime.pulls import NOTHING_PULLED, ParkedPull, Pulled
from realtime.sends import SendRequest
from serverkit.frame_server import Session
from tests.harness import wait_for
from tests.rawclient import FakeClock
from wire.message import Message, encode_message
from wire.protocol import Pull
from wire.responses import pull_response

S, G = "orders", "billing"


@pytest.fixture
async def broker(tmp_path):
    broker = await Broker.open(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0), FakeClock())
    yield broker
    await broker.stop()


async def send(broker: Broker, *message_ids: str) -> None:
    await broker.send([encode_message(Message.create(S, b"body", now_ms=FakeClock()(), id=i))
                       for i in message_ids])


def pull_request(consumer: str = "c1", wait_ms: int = 30_000) -> Pull:
    return Pull(1, S, G, consumer, 100, wait_ms, [], "earliest", False)


class Replies:
    """Where parked pulls' answers go (``Pulls.parked_answered``), with what the pull log had
    recorded when each came."""

    def __init__(self, broker: Broker) -> None:
        self._broker = broker
        self.answers: list[Pulled | BaseException] = []
        self.pulled_before: list[int] = []  # broker.stats["pulled"] as each answer came

    def __call__(self, poll: ParkedPull, answer: Pulled | BaseException) -> None:
        self.answers.append(answer)
        self.pulled_before.append(self._broker.stats["pulled"])


async def parked(broker: Broker, request: Pull, connection=None) -> Replies:
    """A long poll of ``request`` parked with no task, its answers recorded."""
    replies = Replies(broker)
    broker.pulls.parked_answered = replies
    out = await broker.pull(request, connection, direct=True)
    assert isinstance(out, ParkedPull), out
    return replies


async def answered(replies: Replies) -> None:
    await wait_for(lambda: replies.answers, 10, "the parked pull's answer")


async def quiet(broker: Broker) -> None:
    """No background round (the pull log's flush) can make the pull-log thread busy: a pull
    then records on the loop whenever the test expects it to."""
    await broker._stop_rounds()


async def caught_up(broker: Broker) -> None:
    """The group exists and its cursor is known at the end (a planned pull, then a tail one)."""
    await send(broker, "m0")
    await broker.pull(pull_request(wait_ms=0))
    await send(broker, "m1")
    assert len((await broker.pull(pull_request(wait_ms=0))).payloads) == 1


async def test_a_pull_the_tail_answers_is_answered_without_suspending(broker):
    await quiet(broker)
    await caught_up(broker)
    await send(broker, "m2", "m3")
    coro = broker.pull(pull_request(), direct=True)
    with pytest.raises(StopIteration) as done:
        coro.send(None)  # one step, as the frame server steps an inline op
    assert len(done.value.value.payloads) == 2


async def test_a_parked_pull_is_answered_by_the_commit_that_wakes_it_with_no_task(broker):
    await caught_up(broker)
    tasks_before = len(asyncio.all_tasks())
    replies = await parked(broker, pull_request())
    assert broker.pulls.waiting_pulls == 1
    assert len(asyncio.all_tasks()) == tasks_before, "nothing waits in a task"
    await send(broker, "m2")
    await answered(replies)
    [answer] = replies.answers
    assert isinstance(answer, Pulled) and len(answer.payloads) == 1
    assert replies.pulled_before == [3], "recorded in the pull log before it was answered"
    assert broker.pulls.waiting_pulls == 0
    assert not broker.pulls._pulls_in_progress
    assert not any(broker.committed._deadline_slots.values())


async def test_the_senders_are_woken_before_the_parked_pulls_of_their_commit(broker):
    await caught_up(broker)
    order: list[str] = []
    broker.pulls.parked_answered = lambda poll, answer: order.append("pull")
    out = await broker.pull(pull_request(), direct=True)
    assert isinstance(out, ParkedPull)

    async def send_noting(subject: str) -> None:
        message = Message.create(subject, b"body", now_ms=FakeClock()(), id=subject)
        await broker.send([encode_message(message)])
        order.append(subject)  # in the step its answer would be written in

    # The store thread is busy: the first send commits in its own task once it is free, the
    # second (the pull's subject) is queued behind it and committed by the committer task,
    # whose publishing step wakes its sender and the pull.
    release = threading.Event()
    busy = asyncio.ensure_future(broker.on_store_thread(release.wait, 30))
    await asyncio.sleep(0)
    sends = [asyncio.ensure_future(send_noting(subject)) for subject in ("other", S)]
    await asyncio.sleep(0)
    release.set()
    await busy
    await asyncio.gather(*sends)
    await wait_for(lambda: "pull" in order, 10, "the pull's answer")
    assert order == ["other", S, "pull"], "the producer first, then the woken pull"


async def test_a_parked_pull_whose_connection_closed_records_nothing(broker):
    await caught_up(broker)
    connection = Session("consumer:1")
    replies = await parked(broker, pull_request(), connection)
    connection.closed = True
    await send(broker, "m2")
    await answered(replies)
    assert replies.answers == [NOTHING_PULLED]
    assert broker.stats["pulled"] == 2, "nothing recorded for a consumer nobody answers for"
    other = await broker.pull(pull_request("c2", wait_ms=0))
    assert len(other.payloads) == 1, "the message goes to a live consumer at once"


async def test_a_parked_pull_ends_empty_after_its_wait(broker):
    await caught_up(broker)
    replies = await parked(broker, pull_request(wait_ms=20))
    await answered(replies)
    assert replies.answers == [NOTHING_PULLED]
    assert broker.pulls.waiting_pulls == 0
    assert all(not wake.waiters and not wake.direct
               for wake in broker.committed._wakes.values())


async def test_ending_the_long_polls_answers_a_parked_pull_empty(broker):
    await caught_up(broker)
    replies = await parked(broker, pull_request())
    broker.end_long_polls()
    await answered(replies)
    assert replies.answers == [NOTHING_PULLED]
    after = await broker.pull(pull_request(), direct=True)
    assert after == NOTHING_PULLED, "a later poll answers at once"


async def test_a_woken_pull_goes_to_the_pull_log_thread_when_it_is_busy_and_still_answers(broker):
    await caught_up(broker)
    replies = await parked(broker, pull_request())
    release = threading.Event()
    busy = asyncio.ensure_future(broker.on_pulllog_thread(release.wait, 30))
    await send(broker, "m2")
    await asyncio.sleep(0.01)
    assert not replies.answers, "it waits for the thread in a task, as before"
    release.set()
    await busy
    await answered(replies)
    assert len(replies.answers[0].payloads) == 1  # type: ignore[union-attr]


async def test_a_direct_pull_never_runs_beside_a_pull_of_its_group_holding_the_lock(broker):
    await caught_up(broker)
    await send(broker, "m2", "m3")
    pulls = broker.pulls
    entered, release = asyncio.Event(), asyncio.Event()
    from_tail = pulls._pull_from_tail

    async def slow_from_tail(*args):
        entered.set()
        await release.wait()  # holds the group's lock meanwhile
        return await from_tail(*args)

    pulls._pull_from_tail = slow_from_tail  # type: ignore[method-assign]
    first = asyncio.ensure_future(broker.pull(pull_request("c1", wait_ms=0)))
    await entered.wait()
    second = broker.pull(pull_request("c2", wait_ms=0), direct=True)
    waits_on = second.send(None)  # it does not finish at once: it queues on the lock
    assert waits_on is not None and broker.stats["pulled"] == 2
    release.set()
    task = asyncio.ensure_future(_resume(second, waits_on))
    taken = [len((await first).payloads), len((await task).payloads)]
    assert taken == [2, 0], "each entry once, in the lock's order"
    assert broker.stats["pulled"] == 4


async def _resume(coro, waits_on):
    """Go on with a coroutine stepped once by hand (as serverkit.resumed.Resumed does for the frame server)."""
    await asyncio.wait([waits_on])
    try:
        while True:
            waits_on = coro.send(None)
            await asyncio.wait([waits_on])
    except StopIteration as done:
        return done.value


async def test_a_commit_whose_senders_are_answered_by_callback_answers_its_parked_pulls_in_the_same_step(
        broker):
    await quiet(broker)
    await caught_up(broker)
    order: list[str] = []
    broker.pulls.parked_answered = lambda poll, answer: order.append("pull")
    out = await broker.pull(pull_request(), direct=True)
    assert isinstance(out, ParkedPull)
    publish = broker.sends._publish_committed

    def publish_noting(*args):
        publish(*args)
        order.append("step ended")

    broker.sends._publish_committed = publish_noting  # type: ignore[method-assign]
    # The committer was built with the bound method: it calls the attribute's value it holds.
    broker.sends.commits._committed = publish_noting
    message = Message.create(S, b"body", now_ms=FakeClock()(), id="m2")
    assert type(broker.send_soon([encode_message(message)], False,
                                 lambda request: order.append("send"))) is SendRequest
    await wait_for(lambda: "step ended" in order, 10, "the commit's publishing step")
    assert order == ["send", "pull", "step ended"], "the producer, then the pull, in one step"


async def test_a_commit_that_answers_its_parked_pulls_in_its_step_schedules_no_loop_callback_for_them(
        broker, monkeypatch):
    # Each such commit used to leave a _run_due callback that found nothing: an empty loop
    # turn per commit (issue 18).
    await quiet(broker)
    await caught_up(broker)
    replies = await parked(broker, pull_request())
    loop = asyncio.get_running_loop()
    scheduled: list[object] = []
    call_soon = loop.call_soon

    def noting_call_soon(callback, *args, **kwargs):
        scheduled.append(callback)
        return call_soon(callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_soon", noting_call_soon)
    message = Message.create(S, b"body", now_ms=FakeClock()(), id="m2")
    sent: list[object] = []
    assert type(broker.send_soon([encode_message(message)], False, sent.append)) is SendRequest
    await answered(replies)
    assert sent and len(replies.answers[0].payloads) == 1
    assert broker.pulls._run_due not in scheduled, scheduled


async def test_a_publishing_step_that_fails_before_its_pulls_are_answered_still_answers_them(
        broker):
    await quiet(broker)
    await caught_up(broker)
    replies = await parked(broker, pull_request())

    def failing_on_commit(count: int) -> None:
        raise RuntimeError("a bug after the commit was published")

    broker.on_commit = failing_on_commit
    message = Message.create(S, b"body", now_ms=FakeClock()(), id="m2")
    assert type(broker.send_soon([encode_message(message)], False,
                                 lambda request: None)) is SendRequest
    await answered(replies)
    assert len(replies.answers[0].payloads) == 1


async def test_a_parked_pull_with_no_server_keeps_its_answer_as_its_later_does(broker):
    # Without a server's parked_answered, the poll (the request's Later) keeps its answer for
    # the frame server that takes it over: the response map, as any Later keeps it.
    await caught_up(broker)
    out = await broker.pull(pull_request(wait_ms=20), direct=True)
    assert isinstance(out, ParkedPull)
    await wait_for(lambda: out.ended, 10, "the parked pull's end")
    assert out._outcome == pull_response(*NOTHING_PULLED)


class _Connection:
    """What a bound ``Later`` writes its answer to (``_FrameConnection.send``)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, response: dict, request: Pull) -> None:
        self.sent.append(response)


class _Server:
    """The frame server's fields a bound ``Later`` touches as it answers."""

    def __init__(self) -> None:
        self._laters: set = set()
        self._laters_ended = None


async def test_a_parked_pull_answered_before_a_frame_server_takes_it_over_is_answered_then(
        broker):
    # Review rvd-L2: the unbound poll kept its Pulled (a tuple) as its outcome, and the frame
    # server binding it then failed to answer with it (TypeError: not a map).
    await caught_up(broker)
    request = pull_request(wait_ms=30_000)
    out = await broker.pull(request, direct=True)
    assert isinstance(out, ParkedPull)
    await send(broker, "m2")
    await wait_for(lambda: out.ended, 10, "the parked pull's end")
    server, connection = _Server(), _Connection()
    # As FrameServer._answer binds a Later given its outcome before the handler returned.
    out._server, out._connection, out._request = server, connection, request
    outcome, out._outcome, out._given_once = out._outcome, None, False
    out.answer(outcome)
    [response] = connection.sent
    assert response["rid"] == request.rid
    assert len(response["payloads"]) == 1 and len(response["pull_seqs"]) == 1
    assert list(response["redelivered"]) == [0]
