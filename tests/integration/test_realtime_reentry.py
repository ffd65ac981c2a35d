"""A realtime server's request that must wait before it is served (its token's grant not cached,
or its master's lease lapsed) goes on in ``_granted`` or ``_role_renewed``, which enter
``handle_now`` again with the grant: the request is still counted once
(``qmq_realtime_requests_total``) and served once (review rv20-L4)."""

from __future__ import annotations

from typing import Any

import pytest

from realtime.server import RealtimeServer
from tests.rawclient import FakeClock, RawClient, message
from tests.integration.realtime_fixtures import client, server  # noqa: F401 (fixtures)


@pytest.fixture
def served(server, monkeypatch) -> dict[str, int]:
    """How many times each op reached the broker's part that serves it."""
    counts = {"send": 0, "pull": 0, "ack": 0}
    broker = server.broker
    send_soon, pull_now = broker.sends.send_soon, broker.pulls.pull_now
    record_ack = broker.pulllog.record_ack

    def counted_send(*args: Any, **kwargs: Any) -> Any:
        counts["send"] += 1
        return send_soon(*args, **kwargs)

    def counted_pull(*args: Any, **kwargs: Any) -> Any:
        counts["pull"] += 1
        return pull_now(*args, **kwargs)

    def counted_ack(*args: Any, **kwargs: Any) -> Any:
        counts["ack"] += 1
        return record_ack(*args, **kwargs)

    monkeypatch.setattr(broker.sends, "send_soon", counted_send)
    monkeypatch.setattr(broker.pulls, "pull_now", counted_pull)
    monkeypatch.setattr(broker.pulllog, "record_ack", counted_ack)
    return counts


async def _one_of_each(server: RealtimeServer, client: RawClient, hold_up: list[str]
                       ) -> dict[str, dict[str, Any]]:
    """A send, a pull and an ack, each held up once on its way (``hold_up`` is filled with
    the op about to go, and emptied by the hold-up that took it). Their answers."""
    answers = {}
    hold_up[:] = ["send"]
    answers["send"] = await client.send(message("orders", b"one", FakeClock()))
    assert not hold_up, "the send was not held up"
    hold_up[:] = ["pull"]
    answers["pull"] = await client.pull("orders", "g", "c1", start="earliest")
    assert not hold_up, "the pull was not held up"
    hold_up[:] = ["ack"]
    seq = answers["pull"]["pull_seqs"][0]
    answers["ack"] = await client.ack("orders", "g", "c1", [[seq, seq]])
    assert not hold_up, "the ack was not held up"
    return answers


def _check_counted_and_served_once(server: RealtimeServer, before: dict[str, int],
                                   served: dict[str, int],
                                   answers: dict[str, dict[str, Any]]) -> None:
    counts = server.metrics.request_counts
    assert {op: counts[op] - before[op] for op in ("send", "pull", "ack")} == \
        {"send": 1, "pull": 1, "ack": 1}
    assert served == {"send": 1, "pull": 1, "ack": 1}
    assert [r["status"] for r in answers["send"]["results"]] == ["stored"]
    assert len(answers["pull"]["payloads"]) == 1
    assert answers["ack"] == {"acked": 1, "rid": answers["ack"]["rid"]}


async def test_a_request_whose_grant_was_not_cached_is_counted_and_served_once(
        server, client, served, monkeypatch):
    hold_up: list[str] = []
    asked: list[str] = []
    grant_now, grant = server.gate.grant_now, server.gate.grant

    def not_cached(token: str | None) -> Any:
        if hold_up:  # this request's grant must be asked for
            return None
        return grant_now(token)

    async def asked_for(token: str | None, app: str | None) -> Any:
        asked.append(hold_up.pop())
        return await grant(token, app)

    monkeypatch.setattr(server.gate, "grant_now", not_cached)
    monkeypatch.setattr(server.gate, "grant", asked_for)
    before = dict(server.metrics.request_counts)
    answers = await _one_of_each(server, client, hold_up)
    assert asked == ["send", "pull", "ack"]  # each went on in _granted
    _check_counted_and_served_once(server, before, served, answers)


async def test_a_request_that_found_the_lease_lapsed_is_counted_and_served_once(
        server, client, served, monkeypatch):
    hold_up: list[str] = []
    renewed: list[str] = []
    writable_now = server.role.writable_now

    def lapsed() -> bool:
        # Refusing until the renewal: the request's first check finds the lease lapsed.
        return not hold_up and writable_now()

    async def renew() -> None:
        renewed.append(hold_up.pop())

    monkeypatch.setattr(server.role, "writable_now", lapsed)
    monkeypatch.setattr(server, "_check_role_renewed", renew)
    before = dict(server.metrics.request_counts)
    answers = await _one_of_each(server, client, hold_up)
    assert renewed == ["send", "pull", "ack"]  # each went on in _role_renewed
    _check_counted_and_served_once(server, before, served, answers)
