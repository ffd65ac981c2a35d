"""``PayloadSender.send`` with ``visible_at_ms`` (the hand-off) over a route of several home
groups, fake connections: an older group's part is answered not_supported per message and the
parts newer groups held keep their results; a route of older groups only raises
NotSupported."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from serverkit.payload_sender import PayloadSender, home_group
from tests.rawclient import FakeClock, message
from wire.errors import NotSupported
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
