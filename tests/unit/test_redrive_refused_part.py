"""The dead-letter redrive (``metaserver.dead_letters.redrive``) over a plain send split over
two broker groups, one of which refuses its part for good (``forbidden``): the other group's
part stands re-driven, and each message of the refused part is reported once in ``errors``
with the refusal, as the refusal of its part's request (e417392), never counted re-driven; the
entry names the group that refused (before: the dead letter's own broker, as if it had)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from metaserver import dead_letters
from metaserver.dead_letters import BrokerRef, dead_subject, redrive, redrive_message
from serverkit.payload_sender import home_group
from tests.rawclient import FakeClock, message
from tests.unit.test_payload_sender_hold import _G0, _G1, _Routes, _sender_over
from tests.unit.test_payload_sender_split import _SendFails
from wire.errors import Forbidden
from wire.message import encode_message

NOW_MS = 1_700_000_000_000
SOURCE = BrokerRef(group="g0", address="a:1")


def _dead_letters(monkeypatch: Any, count: int) -> list[bytes]:
    """``count`` dead letters of s/g on SOURCE, browsed from the fake broker; returns them."""
    clock = FakeClock()
    name = dead_subject("s", "g")
    payloads = [encode_message(message(name, b"d%d" % n, clock)) for n in range(count)]

    async def each_broker(brokers, work, errors):
        return [(b, await work(b, None)) for b in brokers]

    async def subjects(conn, prefix):
        return [{"subject": name}]

    async def browse(conn, subject, count_max=None) -> AsyncIterator[tuple[int, bytes]]:
        for sequence, payload in enumerate(payloads):
            yield sequence, payload

    monkeypatch.setattr(dead_letters, "_each_broker", each_broker)
    monkeypatch.setattr(dead_letters, "_dead_subjects", subjects)
    monkeypatch.setattr(dead_letters, "_browse", browse)
    return payloads


async def test_a_redrive_a_part_of_which_a_group_refused_for_good_redrives_the_rest_and_reports_the_refused(
        monkeypatch):
    from wire.message import decode_message
    dead = _dead_letters(monkeypatch, 40)
    redriven = [redrive_message(decode_message(p), "s", NOW_MS) for p in dead]
    homes = [home_group(encode_message(m), 2) for m in redriven]
    assert {0, 1} <= set(homes), "the re-driven messages go to both groups"
    brokers = _SendFails({"b:1": 9}, Forbidden("app t may not send to s"), after_write=False)
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)

    answer = await redrive([SOURCE], sender, "s", "g", None, NOW_MS)

    refused = [(n, m.id) for n, (m, home) in enumerate(zip(redriven, homes)) if home == 1]
    assert answer["redriven"] == homes.count(0)
    assert answer["duplicates"] == 0
    assert len(answer["errors"]) == len(refused)
    for (sequence, new_id), error in zip(refused, answer["errors"]):
        assert error["code"] == Forbidden.code, error
        assert error["broker_group"] == "g1", "the group that refused it, not the dead letter's"
        assert f"sequence {sequence} on g0 (a:1) as {new_id}:" in error["message"], error
        assert "app t may not send to s" in error["message"], error
    assert sorted(address for address, _ids in brokers.sends) == ["a:1", "b:1"], \
        "the refused part is not tried again, in no group"
    assert brokers.stored["a:1"] == {m.id for m, home in zip(redriven, homes) if home == 0}
