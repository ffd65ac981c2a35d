"""``PayloadSender.send`` with ``visible_at_ms`` (the hand-off) over a route of several home
groups, fake connections: an older group's part is answered not_supported per message and the
parts newer groups held keep their results; a route of older groups only raises
NotSupported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serverkit.payload_sender import PayloadSender, home_group
from tests.rawclient import FakeClock, message
from wire.errors import (ConnectionLost, Internal, NoRoute, NotMaster, NotSupported, Overloaded,
                         ReadOnly)
from wire.message import encode_message, peek_message_id


class FakeRoutes:
    def __init__(self, groups):
        self.route = SimpleNamespace(groups=groups)

    async def get(self, subject, kind):
        return self.route

    async def refresh(self, subject, kind):
        return self.route


class FakePool:
    """Brokers by address: ``holds`` says whether each takes hold."""

    def __init__(self, holds: dict[str, bool]) -> None:
        self.holds = holds
        self.requests: list[tuple[str, str]] = []

    async def get(self, address):
        return SimpleNamespace(server={"holds": True} if self.holds[address] else {})

    async def request(self, address, request, timeout_ms):
        self.requests.append((address, request["op"]))
        return {"results": [{"id": peek_message_id(p), "status": "stored"}
                            for p in request["messages"]]}


def _sender(holds: dict[str, bool]) -> tuple[PayloadSender, FakePool]:
    sender = PayloadSender("http://127.0.0.1:1", kind="realtime", client_id="t")
    groups = [SimpleNamespace(group=f"g{i}", addresses=[address])
              for i, address in enumerate(sorted(holds))]
    sender.routes = FakeRoutes(groups)  # type: ignore[assignment]
    pool = FakePool(holds)
    sender.pool = pool  # type: ignore[assignment]
    return sender, pool


def _payloads(count: int) -> list[bytes]:
    clock = FakeClock()
    return [encode_message(message("s", b"m%d" % n, clock)) for n in range(count)]


async def test_a_hold_over_an_older_and_a_newer_group_keeps_what_the_newer_one_held():
    sender, pool = _sender({"a:1": True, "b:1": False})
    payloads = _payloads(40)
    _group, results = await sender.send("s", payloads, [1] * len(payloads))
    homes = [home_group(p, 2) for p in payloads]
    assert {0, 1} <= set(homes), "the payloads go to both groups"
    for home, result in zip(homes, results):
        if home == 0:
            assert result.get("status") == "stored"
        else:
            assert result["error"]["code"] == NotSupported.code
    assert pool.requests == [("a:1", "hold")]


async def test_a_hold_where_every_group_is_older_raises_not_supported():
    sender, _pool = _sender({"a:1": False, "b:1": False})
    with pytest.raises(NotSupported):
        await sender.send("s", _payloads(40), [1] * 40)


async def test_each_held_message_s_result_names_the_group_that_holds_it():
    """The delay server traces ``handed`` with it: the audit's holder of a handed message."""
    sender, _pool = _sender({"a:1": True, "b:1": True})
    payloads = _payloads(40)
    _group, results = await sender.send("s", payloads, [1] * len(payloads))
    assert [r["group"] for r in results] == [f"g{home_group(p, 2)}" for p in payloads]
    _group, sent = await sender.send("s", payloads)
    assert not [r for r in sent if "group" in r], "a plain send's results are as they were"


class _Routes:
    """The MetaServer's answers: producers get the usable groups, consumers every live one."""

    def __init__(self, producer, consumer) -> None:
        self.producer, self.consumer = producer, consumer

    async def get(self, subject, role):
        return SimpleNamespace(groups=self.producer if role == "producer" else self.consumer)

    refresh = get


class _Brokers:
    """Holding brokers by address; ``dies_after_write``: stores a hold, then the connection
    drops before the answer (a kill -9 of that master after its fsync)."""

    def __init__(self, dies_after_write=frozenset()) -> None:
        self.held: dict[str, set[str]] = {"a:1": set(), "b:1": set()}
        self.dies_after_write = set(dies_after_write)

    async def get(self, address):
        return SimpleNamespace(server={"holds": True})

    async def request(self, address, request, timeout_ms):
        if request["op"] == "send":
            return {"results": [{"id": peek_message_id(p), "status": "stored"}
                                for p in request["messages"]]}
        if request["op"] == "hold":
            ids = [peek_message_id(p) for p in request["messages"]]
            self.held[address].update(ids)
            if address in self.dies_after_write:
                raise ConnectionLost(f"{address} closed the connection")
            return {"results": [{"id": i, "status": "stored"} for i in ids]}
        dropped = [i in self.held[address] for i in request["ids"]]
        self.held[address] -= set(request["ids"])
        return {"cancelled": dropped}

    async def discard(self, address):
        pass


_G0 = SimpleNamespace(group="g0", addresses=["a:1"])
_G1 = SimpleNamespace(group="g1", addresses=["b:1"])


def _at_home(home: int) -> bytes:
    return next(p for p in _payloads(100) if home_group(p, 2) == home)


def _sender_over(routes, brokers) -> PayloadSender:
    sender = PayloadSender("http://127.0.0.1:1", kind="realtime", client_id="t")
    sender.routes = routes  # type: ignore[assignment]
    sender.pool = brokers  # type: ignore[assignment]
    return sender


async def test_a_hold_whose_answer_was_lost_is_not_handed_to_a_second_group():
    """Its home group's master stored it and died before answering (its promoted slave
    holds it): a second group holding it too delivers it whatever a cancel drops in one
    (found in review, reviewho R2). The hold fails; the delay server retries it or sends it
    when due (the broker's de-duplication absorbs that)."""
    brokers = _Brokers(dies_after_write={"a:1"})
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(ConnectionLost):
        await sender.send("s", [_at_home(0)], [10_000])
    assert brokers.held["b:1"] == set()
    brokers.dies_after_write = set()
    _group, results = await sender.send("s", [_at_home(0)])
    assert results[0]["status"] == "stored"


async def test_a_cancel_of_a_held_message_asks_a_group_producers_may_not_use_now():
    """The group holding it left the producer route (failing over, short of in-sync slaves,
    read-only) but is live and makes it visible at its due time (reviewho R2)."""
    payload = _at_home(0)
    brokers = _Brokers()
    routes = _Routes([_G0, _G1], [_G0, _G1])
    sender = _sender_over(routes, brokers)
    await sender.send("s", [payload], [10_000])
    routes.producer = [_G1]
    assert await sender.cancel_held_answers("s", [peek_message_id(payload)]) == ["dropped"]
    assert brokers.held["a:1"] == set()



class _RefreshDropsHome:
    """The cached producer route lists g0 and g1; a refresh (after the failed attempt) no
    longer lists g0, whose master is gone and its slave not yet promoted."""

    async def get(self, subject, role):
        return SimpleNamespace(groups=[_G0, _G1])

    async def refresh(self, subject, role):
        return SimpleNamespace(groups=[_G1])


async def test_a_hold_whose_answer_was_lost_is_not_held_by_a_second_group_after_the_route_changed():
    # reviewho2 N1: the retry recomputed the ids' homes over the refreshed route (g0 gone).
    payload = _at_home(0)
    brokers = _Brokers(dies_after_write={"a:1"})
    sender = _sender_over(_RefreshDropsHome(), brokers)
    with pytest.raises(ConnectionLost):  # the dispatcher sends it at its due time instead
        await sender.send("s", [payload], [10_000])
    holders = sorted(a for a, ids in brokers.held.items() if peek_message_id(payload) in ids)
    assert holders == ["a:1"], f"held by {holders}: each would deliver it at its due time"


async def test_a_cancel_of_a_message_a_group_dropped_before_says_so_and_an_older_broker_never_does():
    payload = _at_home(0)
    message_id = peek_message_id(payload)
    brokers = _Brokers()
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    await sender.send("s", [payload], [10_000])
    assert await sender.cancel_held_answers("s", [message_id]) == ["dropped"]
    assert await sender.cancel_held_answers("s", [message_id]) == [""]  # no field: older
    real = brokers.request

    async def with_before(address, request, timeout_ms):
        answer = await real(address, request, timeout_ms)
        if request["op"] == "cancel_held":
            answer["dropped_before"] = [address == "a:1" for _ in request["ids"]]
        return answer

    brokers.request = with_before
    assert await sender.cancel_held_answers("s", [message_id]) == ["dropped_before"]


async def test_each_result_of_a_hold_carries_the_clock_of_the_broker_that_took_it():
    payload = _at_home(0)
    brokers = _Brokers()
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    _group, results = await sender.send("s", [payload], [10_000])
    assert "broker_now_ms" not in results[0]  # a broker that does not say it
    real = brokers.request

    async def with_clock(address, request, timeout_ms):
        answer = await real(address, request, timeout_ms)
        if request["op"] == "hold":
            answer["now_ms"] = 1_234
        return answer

    brokers.request = with_clock
    _group, results = await sender.send("s", [payload], [10_000])
    assert results[0]["broker_now_ms"] == 1_234 and results[0]["group"] == "g0"


class _DemotedAfterWrite(_Brokers):
    """Stores a hold, then answers NotMaster: its lease lapsed during the store call, or it
    was demoted while waiting for its slaves (a promoted slave may hold the copy)."""

    def __init__(self, demoted: set[str]) -> None:
        super().__init__()
        self.demoted = demoted

    async def request(self, address, request, timeout_ms):
        answer = await super().request(address, request, timeout_ms)
        if request["op"] == "hold" and address in self.demoted:
            raise NotMaster(f"{address} is not the leased master of group g0")
        return answer


async def test_a_hold_refused_not_master_after_its_write_is_not_held_by_a_second_group():
    # review s11 rvho-3: NotMaster was retried over the refreshed route (home g0 gone).
    payload = _at_home(0)
    brokers = _DemotedAfterWrite(demoted={"a:1"})
    sender = _sender_over(_RefreshDropsHome(), brokers)
    with pytest.raises(NotMaster):  # the dispatcher sends it at its due time instead
        await sender.send("s", [payload], [10_000])
    holders = sorted(a for a, ids in brokers.held.items() if peek_message_id(payload) in ids)
    assert holders == ["a:1"], f"held by {holders}: each would deliver it at its due time"


class _SendsRecorded(_Brokers):
    """``_Brokers`` noting every plain send's address."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sent_to: list[str] = []

    async def request(self, address, request, timeout_ms):
        if request["op"] == "send":
            self.sent_to.append(address)
        return await super().request(address, request, timeout_ms)


async def test_a_send_after_a_lost_hold_answer_goes_to_the_group_the_hold_went_to_after_the_route_changed():
    # REPLICATION.md 16 "Still open": the due-time send went to the id's home over the route
    # then; a group added (or the holder gone from the producer route while failing over)
    # sent it to a second group, which delivered it too.
    payload = _at_home(0)
    brokers = _SendsRecorded(dies_after_write={"a:1"})
    routes = _Routes([_G0, _G1], [_G0, _G1])
    sender = _sender_over(routes, brokers)
    with pytest.raises(ConnectionLost) as lost:
        await sender.send("s", [payload], [10_000])
    assert lost.value.holders == ["g0"]
    routes.producer = [_G1]  # g0 failing over: producers may not use it, consumers still do
    group, results = await sender.send("s", [payload], None, lost.value.holders)
    assert (group, results[0]["status"], brokers.sent_to) == ("g0", "stored", ["a:1"])


async def test_a_send_pinned_to_a_group_not_in_the_route_fails_retriably_and_goes_nowhere_else():
    payload = _at_home(0)
    brokers = _SendsRecorded()
    sender = _sender_over(_Routes([_G1], [_G1]), brokers)
    with pytest.raises(NoRoute, match="g0"):
        await sender.send("s", [payload], None, ["g0"])
    assert brokers.sent_to == []
    _group, results = await sender.send("s", [payload, _at_home(1)], None, [None, None])
    assert [r["status"] for r in results] == ["stored", "stored"], "no pin: as before"


class _SecondGroupRefuses(_Brokers):
    """g0 (a:1) holds its part; g1 (b:1) refuses every hold with ``refusal``: raised as a
    whole request, or (``per_message``) in every message's answer, as a read-only broker
    answers a hold."""

    def __init__(self, refusal, per_message: bool = False) -> None:
        super().__init__()
        self.refusal, self.per_message = refusal, per_message
        self.holds_to: list[str] = []
        self.hold_ids: list[tuple[str, str]] = []  # (address, id) of each message held there

    async def request(self, address, request, timeout_ms):
        if request["op"] == "hold":
            self.holds_to.append(address)
            self.hold_ids += [(address, peek_message_id(p)) for p in request["messages"]]
            if address == "b:1":
                if not self.per_message:
                    raise self.refusal
                return {"results": [{"id": peek_message_id(p), "error": {
                    "code": self.refusal.code, "message": str(self.refusal)}}
                    for p in request["messages"]]}
        return await super().request(address, request, timeout_ms)


_REFUSALS = [(ReadOnly("g1 is read-only"), False), (ReadOnly("g1 is read-only"), True),
             (Overloaded("g1 is busy"), False), (NoRoute("no broker of g1 answers"), False)]


@pytest.mark.parametrize("refusal,per_message", _REFUSALS,
                         ids=["read_only", "read_only_per_message", "overloaded", "no_route"])
async def test_a_hold_whose_second_group_refuses_twice_keeps_what_the_first_group_held(
        refusal, per_message):
    # review s13 rvmends-4: the refusal was raised for the whole batch, so the delay server
    # took g0's held part as held by none and a cancel of it never asked g0.
    payloads = _payloads(40)
    homes = [home_group(p, 2) for p in payloads]
    brokers = _SecondGroupRefuses(refusal, per_message)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    _group, results = await sender.send("s", payloads, [10_000] * len(payloads))
    assert brokers.holds_to.count("b:1") == 2, "g1's part is tried again after a refresh"
    for home, payload, result in zip(homes, payloads, results):
        assert result["id"] == peek_message_id(payload)
        if home == 0:
            assert (result.get("status"), result.get("group")) == ("stored", "g0")
        else:
            assert result["error"]["code"] == refusal.code, result
    assert brokers.held["a:1"] == {peek_message_id(p) for p, h in zip(payloads, homes) if h == 0}


class _RefreshSaysNoRoute:
    """Routes whose ``get`` lists g0 and g1 and whose ``refresh`` (a hold's second try) the
    MetaServer answers ``no_route`` the first ``failures`` times."""

    def __init__(self, failures: int = 1) -> None:
        self.refreshes, self.failures = 0, failures

    async def get(self, subject, role):
        return SimpleNamespace(groups=[_G0, _G1])

    async def refresh(self, subject, role):
        self.refreshes += 1
        if self.refreshes <= self.failures:
            raise NoRoute(f"no route for {subject!r}")
        return SimpleNamespace(groups=[_G0, _G1])


async def test_a_hold_whose_route_refresh_fails_keeps_what_the_first_group_held():
    # review s14 rva-1: the refresh's error was raised for the whole hold, so the delay server
    # took g0's held part as held by none and a cancel of it never asked g0.
    payloads = _payloads(40)
    homes = [home_group(p, 2) for p in payloads]
    brokers = _SecondGroupRefuses(ReadOnly("g1 is read-only"))
    sender = _sender_over(_RefreshSaysNoRoute(), brokers)
    _group, results = await sender.send("s", payloads, [10_000] * len(payloads))
    for home, result in zip(homes, results):
        if home == 0:
            assert (result.get("status"), result.get("group")) == ("stored", "g0"), result
        else:
            assert result["error"]["code"] == NoRoute.code, result


async def test_a_hold_every_group_of_which_refuses_raises_the_refusal():
    brokers = _SecondGroupRefuses(ReadOnly("read-only"))
    real = brokers.request

    async def both_refuse(address, request, timeout_ms):
        if request["op"] == "hold" and address == "a:1":
            raise ReadOnly("g0 is read-only")
        return await real(address, request, timeout_ms)

    brokers.request = both_refuse
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(ReadOnly):  # held by none: the delay server retries the batch
        await sender.send("s", _payloads(40), [10_000] * 40)


class _LostThenOlder(_Brokers):
    """Group g0 lists two brokers: a:1 stores a hold and its answer is lost, a:2 is an older
    broker without ``holds`` (a rolling upgrade, or a dead broker's address not yet expired)."""

    async def get(self, address):
        return SimpleNamespace(server={} if address == "a:2" else {"holds": True})


async def test_a_hold_whose_answer_one_broker_lost_is_not_taken_as_refused_by_the_next_one():
    # review s13 rvmends-1 (its "Also"): a:2's NotSupported replaced a:1's lost answer, so the
    # delay server took the hold as refused, though a:1 may hold it.
    payload = _at_home(0)
    brokers = _LostThenOlder(dies_after_write={"a:1"})
    brokers.held["a:2"] = set()
    g0 = SimpleNamespace(group="g0", addresses=["a:1", "a:2"])
    sender = _sender_over(_Routes([g0, _G1], [g0, _G1]), brokers)
    with pytest.raises(ConnectionLost) as lost:
        await sender.send("s", [payload], [10_000])
    assert lost.value.holders == ["g0"]


class _SecondGroupAnswersGarbage(_SecondGroupRefuses):
    """g0 (a:1) holds its part; g1 (b:1) stores its part and then answers something the sender
    cannot read (a RuntimeError stands for any non-QmqError a part may raise after its write)."""

    def __init__(self) -> None:
        super().__init__(ReadOnly("unused"))

    async def request(self, address, request, timeout_ms):
        if request["op"] == "hold" and address == "b:1":
            self.holds_to.append(address)
            self.held[address].update(peek_message_id(p) for p in request["messages"])
            raise RuntimeError("an answer without results")
        return await super().request(address, request, timeout_ms)


async def test_a_hold_one_part_of_which_raised_a_non_qmq_error_names_every_part_s_holder():
    # review s14 rva: the other error was raised alone, so the delay server took g0's held
    # part as held by none. It is now a lost answer (Internal: g1 may hold its part) whose
    # ``holders`` name g0 for g0's part and g1 for g1's, each message sent when due to there.
    payloads = _payloads(40)
    homes = [home_group(p, 2) for p in payloads]
    brokers = _SecondGroupAnswersGarbage()
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(Internal) as unknown:
        await sender.send("s", payloads, [10_000] * len(payloads))
    assert "RuntimeError: an answer without results" in str(unknown.value)
    assert unknown.value.holders == [f"g{home}" for home in homes]
    assert brokers.holds_to.count("b:1") == 1, "a part that may be held is not held again"
    assert brokers.held["a:1"] == {peek_message_id(p) for p, h in zip(payloads, homes) if h == 0}


async def test_a_hold_whose_second_try_raised_a_non_qmq_error_names_what_the_first_try_held():
    payloads = _payloads(40)
    homes = [home_group(p, 2) for p in payloads]
    brokers = _SecondGroupAnswersGarbage()
    real = brokers.request

    async def refuses_then_garbage(address, request, timeout_ms):
        if request["op"] == "hold" and address == "b:1" and "b:1" not in brokers.holds_to:
            brokers.holds_to.append(address)
            raise ReadOnly("g1 is read-only")
        return await real(address, request, timeout_ms)

    brokers.request = refuses_then_garbage
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    with pytest.raises(Internal) as unknown:
        await sender.send("s", payloads, [10_000] * len(payloads))
    assert unknown.value.holders == [f"g{home}" for home in homes]
    assert brokers.holds_to.count("a:1") == 1
