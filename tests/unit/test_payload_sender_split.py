"""``PayloadSender.send`` without ``visible_at_ms`` (a plain send: the delay server's dispatch,
a realtime broker's retry copies) over a route of two home groups, fake connections: a part
that fails keeps the other parts' results, and only its own messages are answered with the
error (the caller retries or reports just those); a batch no part of which was stored raises,
as before."""

from __future__ import annotations

from collections import Counter

import pytest

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from serverkit.payload_sender import home_group
from tests.rawclient import FakeClock
from tests.unit.delay_handoff_support import schedule
from tests.unit.test_delay_scheduler_races import settle
from tests.unit.test_payload_sender_hold import (
    _G0, _G1, _Brokers, _payloads, _Routes, _sender_over,
)
from wire.errors import Forbidden, Internal, Overloaded
from wire.message import encode_message, peek_message_id


class _SendFails(_Brokers):
    """Sends stored at every address; those to an address in ``fails`` (address -> how many
    times) raise ``error`` instead (a RuntimeError stands for any error outside the
    protocol's a part may raise: an answer the sender cannot read, a bug), after storing when
    ``after_write``."""

    def __init__(self, fails: dict[str, int], error: BaseException,
                 after_write: bool = True) -> None:
        super().__init__()
        self.fails, self.error, self.after_write = dict(fails), error, after_write
        self.sends: list[tuple[str, list[str]]] = []  # (address, ids) of each send request
        self.stored: dict[str, set[str]] = {"a:1": set(), "b:1": set()}

    async def request(self, address, request, timeout_ms):
        if request["op"] != "send":
            return await super().request(address, request, timeout_ms)
        ids = [peek_message_id(p) for p in request["messages"]]
        self.sends.append((address, ids))
        if self.fails.get(address, 0) > 0:
            self.fails[address] -= 1
            if self.after_write:
                self.stored[address].update(ids)
            raise self.error
        self.stored[address].update(ids)
        return {"results": [{"id": i, "status": "stored"} for i in ids]}


def _split(count: int = 40) -> tuple[list[bytes], list[int]]:
    payloads = _payloads(count)
    homes = [home_group(p, 2) for p in payloads]
    assert {0, 1} <= set(homes), "the payloads go to both groups"
    return payloads, homes


async def test_a_plain_send_one_part_of_which_raised_a_non_qmq_error_keeps_the_other_part_s_results():
    # Before: the RuntimeError was raised for the whole batch, so the delay server retried all
    # 40 messages, g0's stored part too (its de-duplication absorbed them).
    payloads, homes = _split()
    brokers = _SendFails({"b:1": 2}, RuntimeError("an answer without results"))
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    _group, results = await sender.send("s", payloads)
    for home, payload, result in zip(homes, payloads, results):
        assert result["id"] == peek_message_id(payload)
        if home == 0:
            assert result.get("status") == "stored", result
        else:
            assert result["error"]["code"] == Internal.code, result
            assert "RuntimeError: an answer without results" in result["error"]["message"]
    assert sorted(address for address, _ids in brokers.sends) == ["a:1", "b:1", "b:1"], \
        "g0's part went once; g1's is tried again after a route refresh, in its home group"


async def test_a_plain_send_whose_failed_part_is_stored_on_the_second_try_answers_every_message_stored():
    payloads, _homes = _split()
    brokers = _SendFails({"b:1": 1}, RuntimeError("an answer without results"))
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    _group, results = await sender.send("s", payloads)
    assert [r.get("status") for r in results] == ["stored"] * len(payloads)
    assert [address for address, _ids in brokers.sends].count("a:1") == 1


async def test_a_plain_send_one_part_of_which_no_group_took_answers_that_part_with_the_refusal():
    # Every broker refuses g1's part (overloaded, retriable) on both tries, g0 stores its own:
    # the refusal is that part's answer, not raised for the batch.
    payloads, homes = _split()
    g1_ids = {peek_message_id(p) for p, h in zip(payloads, homes) if h == 1}
    brokers = _SendFails({}, RuntimeError("unused"))
    real = brokers.request

    async def g1_part_refused(address, request, timeout_ms):
        if request["op"] == "send" and {peek_message_id(p) for p in request["messages"]} \
                == g1_ids:
            raise Overloaded(f"{address} is busy")
        return await real(address, request, timeout_ms)

    brokers.request = g1_part_refused  # type: ignore[method-assign]
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    _group, results = await sender.send("s", payloads)
    for home, result in zip(homes, results):
        if home == 0:
            assert result.get("status") == "stored", result
        else:
            assert result["error"]["code"] == Overloaded.code, result
    assert brokers.stored["a:1"] == {peek_message_id(p) for p, h in zip(payloads, homes)
                                     if h == 0}


@pytest.mark.parametrize("error,raised", [(RuntimeError("garbage"), Internal),
                                          (Overloaded("busy"), Overloaded)],
                         ids=["non_qmq_error", "retriable"])
async def test_a_plain_send_no_part_of_which_was_stored_raises(error, raised):
    brokers = _SendFails({"a:1": 9, "b:1": 9}, error, after_write=False)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(raised):  # the caller retries the batch
        await sender.send("s", _payloads(40))


async def test_a_refused_part_fails_only_its_own_messages():
    # g1 refuses its part at the request level (forbidden: not retriable, so no other group is
    # tried): before, the refusal was raised for the batch and g0's stored part was answered
    # with it too. Now g0's messages stand stored and only g1's carry the refusal, marked as
    # their part's (``part_refused``), so a caller tells it from a refusal of the message.
    payloads, homes = _split()
    brokers = _SendFails({"b:1": 9}, Forbidden("app t may not send to s"), after_write=False)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    _group, results = await sender.send("s", payloads)
    for home, payload, result in zip(homes, payloads, results):
        assert result["id"] == peek_message_id(payload)
        if home == 0:
            assert result.get("status") == "stored", result
            assert "part_refused" not in result
        else:
            assert result["error"]["code"] == Forbidden.code, result
            assert "app t may not send to s" in result["error"]["message"]
            assert result["part_refused"] is True
    assert sorted(address for address, _ids in brokers.sends) == ["a:1", "b:1"], \
        "a refusal for good is not tried again, in no group"


@pytest.mark.parametrize("other", [Overloaded("busy"), Forbidden("no")],
                         ids=["other_part_retriable", "other_part_refused_too"])
async def test_a_plain_send_a_part_of_which_was_refused_and_none_stored_raises_the_refusal(other):
    payloads, _homes = _split()
    brokers = _SendFails({}, RuntimeError("unused"))

    async def refused(address, request, timeout_ms):
        if request["op"] != "send":
            return await _Brokers.request(brokers, address, request, timeout_ms)
        raise Forbidden("no") if address == "b:1" else other

    brokers.request = refused  # type: ignore[method-assign]
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(Forbidden):  # as before: nothing stored, the caller has the refusal
        await sender.send("s", payloads)


async def test_a_pinned_send_a_part_of_which_was_refused_keeps_the_other_part_s_results():
    payloads, homes = _split()
    brokers = _SendFails({"b:1": 9}, Forbidden("no"), after_write=False)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    pins = ["g1" if home == 1 else None for home in homes]
    _group, results = await sender.send("s", payloads, None, pins)
    for home, result in zip(homes, results):
        if home == 0:
            assert result.get("status") == "stored", result
        else:
            assert result["error"]["code"] == Forbidden.code, result
            assert result["part_refused"] is True


async def test_a_pinned_send_one_part_of_which_raised_a_non_qmq_error_keeps_the_other_part_s_results():
    # A due-time send after a lost hold answer goes to the group the hold went to: a part
    # pinned to g1 failing outside the protocol leaves g0's part stored and answered.
    payloads, homes = _split()
    brokers = _SendFails({"b:1": 9}, RuntimeError("an answer without results"))
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    pins = ["g1" if home == 1 else None for home in homes]
    _group, results = await sender.send("s", payloads, None, pins)
    for home, result in zip(homes, results):
        if home == 0:
            assert result.get("status") == "stored", result
        else:
            assert result["error"]["code"] == Internal.code, result
    assert [address for address, _ids in brokers.sends].count("a:1") == 1


async def test_a_pinned_send_every_part_of_which_failed_raises():
    payloads, homes = _split()
    brokers = _SendFails({"a:1": 9, "b:1": 9}, RuntimeError("garbage"), after_write=False)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(Internal):
        await sender.send("s", payloads, None, ["g1" if h == 1 else None for h in homes])



@pytest.mark.parametrize("error, after_write", [
    # g1's send stores its part and then raises outside the protocol once.
    (RuntimeError("an answer without results"), True),
    # g1 refuses its part once at the request level (forbidden), then takes it. Before, the
    # batch was retried whole (g0's part sent twice), and none may be dropped as refused for
    # good: a part's refusal is no message's.
    (Forbidden("app t may not send to s"), False),
], ids=["raised", "refused"])
async def test_a_due_dispatch_one_part_of_which_failed_sends_only_that_part_again(
        tmp_path, error, after_write):
    # The delay server over a real PayloadSender (the Scheduler alone, a fake clock, no
    # hand-off): only g1's messages are dispatched again; g0's part went once.
    clock = FakeClock()
    brokers = _SendFails({"b:1": 1}, error, after_write=after_write)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=1_000,
                         trace=False, handoff_lead_ms=0)
    scheduler = await Scheduler.open(config, clock, sender.send)
    await scheduler.start()
    try:
        messages = await schedule(scheduler, clock, clock() + 5_000,
                                  *[b"m%d" % n for n in range(20)])
        homes = {m.id: home_group(encode_message(m), 2) for m in messages}
        assert set(homes.values()) == {0, 1}, "the messages go to both groups"
        clock.advance(5_000)
        await settle(scheduler)
        clock.advance(10_000)  # past the dispatch retry's backoff
        await settle(scheduler)
        sent = Counter(i for _address, ids in brokers.sends for i in ids)
        assert {i: sent[i] for i in homes} == {i: 1 + home for i, home in homes.items()}
        assert brokers.stored["a:1"] | brokers.stored["b:1"] == set(homes)
    finally:
        await scheduler.stop()
