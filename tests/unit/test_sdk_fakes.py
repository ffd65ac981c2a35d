"""A fake broker and a fake MetaServer for the SDK tests, and tests that the fakes behave.

FakeBroker speaks the real frame protocol with the real codec on 127.0.0.1 port 0, handles every
request in its own task (so a long-poll pull does not block an ack, as on a real broker) and
records what it got. A test scripts faults with ``fail_next(op, ...)``. FakeMeta is an aiohttp app
on port 0 serving /api/route and /api/clients/heartbeat(s); ``stop()`` makes it really unreachable.
Tests wait for things with ``wait_until`` (an asyncio.Condition), never by sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web

from wire.errors import QmqError, error_from_wire
from wire.message import Message, decode_message, encode_message
from wire.protocol import (
    FrameDecoder,
    encode_frame,
    error_response,
    hello_response,
    parse_request,
    pull_response,
    send_result_error,
    send_result_ok,
)


class FakeBroker:
    """An in-process broker of one group. Sends are stored (and de-duplicated by id); pulls hand
    out what ``publish`` queued, numbering pull sequences from 1 per subject."""

    def __init__(self, group: str) -> None:
        self.group = group
        self.address = ""
        self.requests: list[dict[str, Any]] = []  # every request map, in arrival order
        self.stored: dict[str, Message] = {}
        self.cancelled: set[str] = set()  # ids a cancel op named (as a delay group)
        self.ack_ranges: list[list[list[int]]] = []  # the ranges of each ack op
        self.heartbeats: list[dict[str, Any]] = []
        self.leaves: list[dict[str, Any]] = []
        self._ready: dict[str, list[Message]] = {}
        self._next_pull_seq: dict[str, int] = {}
        self._faults: dict[str, list[tuple[str, Any]]] = {}
        self._changed = asyncio.Condition()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        # When set to an unset Event, send requests are held (unanswered) until it is set.
        self.send_gate: asyncio.Event | None = None
        # The same for ack requests.
        self.ack_gate: asyncio.Event | None = None

    async def start(self) -> FakeBroker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = f"127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- what a test controls -------------------------------------------------------------------

    def fail_next(self, op: str, how: str, arg: Any = None) -> None:
        """Script the next ``op`` request: "drop" (abort the connection without answering),
        "store_then_drop" (a send is stored or a cancel done, then the connection is aborted), "error" (answer
        error ``arg`` = (code, message)), "result_error" (each send result is error ``arg``)."""
        self._faults.setdefault(op, []).append((how, arg))

    def publish(self, subject: str, *bodies: bytes) -> list[Message]:
        """Make messages available to pulls of ``subject``."""
        messages = [
            Message.create(subject, body, now_ms=1_000, id=f"m-{subject}-{len(self.stored) + i}")
            for i, body in enumerate(bodies)
        ]
        self._ready.setdefault(subject, []).extend(messages)
        for message in messages:
            self.stored[message.id] = message
        asyncio.get_running_loop().create_task(self._notify())
        return messages

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [r for r in self.requests if r.get("op") == op]

    def sent_ids(self) -> list[list[str]]:
        """The message ids of each send op, in order."""
        return [[decode_message(p).id for p in r["messages"]] for r in self.ops("send")]

    def acked_seqs(self) -> list[int]:
        return sorted(s for ranges in self.ack_ranges for a, b in ranges for s in range(a, b + 1))

    def drop_connections(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)

    # -- serving --------------------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        decoder = FrameDecoder()
        try:
            while data := await reader.read(65536):
                for frame in decoder.feed(data):
                    task = asyncio.get_running_loop().create_task(self._handle(frame, writer))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except (ConnectionError, QmqError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _handle(self, frame: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        self.requests.append(frame)
        await self._notify()
        try:
            answer = await self._answer(frame, writer)
        except QmqError as exc:
            answer = error_response(frame.get("rid"), exc)
        if answer is not None and not writer.is_closing():
            writer.write(encode_frame(answer))
        await self._notify()

    async def _answer(self, frame: dict[str, Any], writer: asyncio.StreamWriter) -> dict | None:
        req = parse_request(frame)
        faults = self._faults.get(req.op)
        how, arg = faults.pop(0) if faults else ("", None)
        if how == "drop":
            writer.transport.abort()
            return None
        if how == "error":
            raise error_from_wire(*arg)
        rid = req.rid
        if req.op == "hello":
            return {"rid": rid, **hello_response("realtime", self.group, f"{self.group}-n1")}
        if req.op == "send":
            if self.send_gate is not None:
                await self.send_gate.wait()
            results = []
            for payload in req.messages:
                message = decode_message(payload)
                if how == "result_error":
                    results.append(send_result_error(message.id, error_from_wire(*arg)))
                    continue
                duplicate = message.id in self.stored
                self.stored.setdefault(message.id, message)
                results.append(send_result_ok(message.id, duplicate))
            if how == "store_then_drop":
                writer.transport.abort()
                return None
            return {"rid": rid, "results": results}
        if req.op == "pull":
            return await self._pull(req)
        if req.op == "ack":
            if self.ack_gate is not None:
                await self.ack_gate.wait()
            self.ack_ranges.append([list(r) for r in req.ranges])
            return {"rid": rid, "acked": sum(b - a + 1 for a, b in req.ranges)}
        if req.op == "heartbeat":
            self.heartbeats.append(frame)
            return {"rid": rid, "ok": True}
        if req.op == "leave":
            self.leaves.append(frame)
            return {"rid": rid, "released": 0}
        if req.op == "nack":
            raise error_from_wire("not_supported", "nack needs the delay server")
        if req.op == "cancel":  # as a delay group: a stored id is cancelled once
            results = []
            for message_id in frame["ids"]:
                status = "already_cancelled" if message_id in self.cancelled else (
                    "cancelled" if message_id in self.stored else "unknown")
                self.cancelled.add(message_id)
                results.append({"id": message_id, "status": status})
            if how == "store_then_drop":  # cancelled, and the answer is lost
                writer.transport.abort()
                return None
            return {"rid": rid, "results": results}
        raise error_from_wire("bad_request", f"fake broker does not do {req.op}")

    async def _pull(self, req: Any) -> dict[str, Any]:
        ready = self._ready.setdefault(req.subject, [])
        try:
            async with asyncio.timeout(req.wait_ms / 1000):
                async with self._changed:
                    await self._changed.wait_for(lambda: bool(ready))
        except TimeoutError:
            pass
        taken, ready[:] = ready[:req.max_count], ready[req.max_count:]
        first = self._next_pull_seq.get(req.subject, 1)
        self._next_pull_seq[req.subject] = first + len(taken)
        return {"rid": req.rid, **pull_response(list(range(first, first + len(taken))),
                                                [encode_message(m) for m in taken],
                                                [0] * len(taken))}


class FakeMeta:
    """A MetaServer answering routes from ``routes`` (subject -> brokers, same for both roles)."""

    def __init__(self) -> None:
        self.routes: dict[str, list[FakeBroker]] = {}
        self.version = 1
        self.route_requests: list[dict[str, str]] = []
        self.heartbeats: list[dict[str, Any]] = []
        self.leaves: list[dict[str, Any]] = []
        # Bodies of the batched heartbeats (each client is also appended to heartbeats or
        # leaves); False answers the path 404, as a MetaServer from before it did.
        self.batches: list[dict[str, Any]] = []
        self.batched = True
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._changed = asyncio.Condition()

    def set_route(self, subject: str, brokers: list[FakeBroker]) -> None:
        self.routes[subject] = brokers
        self.version += 1

    async def start(self) -> FakeMeta:
        app = web.Application()
        app.router.add_get("/api/route", self._route)
        app.router.add_post("/api/clients/heartbeat", self._heartbeat)
        app.router.add_post("/api/clients/leave", self._leave)
        app.router.add_post("/api/clients/heartbeats", self._heartbeats)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        """Close the listening socket: later requests get connection refused."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        async with self._changed:
            await self._changed.wait_for(predicate)

    async def _route(self, request: web.Request) -> web.Response:
        self.route_requests.append(dict(request.query))
        subject = request.query["subject"]
        if " " in subject:
            return web.json_response(
                {"error": {"code": "bad_request", "message": f"bad subject {subject!r}"}}, status=400
            )
        brokers = self.routes.get(subject, [])
        if not brokers:
            return web.json_response(
                {"error": {"code": "no_route", "message": f"no broker for {subject!r}"}}, status=503
            )
        groups = [
            {"group": b.group, "kind": "realtime", "state": "rw", "addresses": [b.address]}
            for b in brokers
        ]
        return web.json_response({"subject": subject, "version": self.version, "groups": groups})

    async def _leave(self, request: web.Request) -> web.Response:
        self.leaves.append(await request.json())
        return web.json_response({"ok": True, "known": True})

    async def _heartbeats(self, request: web.Request) -> web.Response:
        if not self.batched:
            return web.json_response(
                {"error": {"code": "not_found", "message": "no such path"}}, status=404)
        body = await request.json()
        self.batches.append(body)
        self.heartbeats.extend(body["clients"])
        self.leaves.extend({"client_id": client_id} for client_id in body["left"])
        async with self._changed:
            self._changed.notify_all()
        return web.json_response({"ok": True, "written": 0, "noted": 0})

    async def _heartbeat(self, request: web.Request) -> web.Response:
        self.heartbeats.append(await request.json())
        async with self._changed:
            self._changed.notify_all()
        return web.json_response({"ok": True})


@pytest.fixture
async def meta():
    server = await FakeMeta().start()
    yield server
    await server.stop()


@pytest.fixture
async def broker_a():
    broker = await FakeBroker("group-a").start()
    yield broker
    await broker.stop()


@pytest.fixture
async def broker_b():
    broker = await FakeBroker("group-b").start()
    yield broker
    await broker.stop()


# -- the fakes themselves ----------------------------------------------------------------------


async def test_the_fake_metaserver_answers_no_route_for_an_unknown_subject(meta):
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.get(f"{meta.url}/api/route", params={"subject": "x"}) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_route"


async def test_the_fake_broker_marks_a_resent_id_as_duplicate(broker_a):
    from sdk.connection import Connection

    conn = await Connection.open(broker_a.address, client_id="c", app="a", token=None)
    payload = encode_message(Message.create("s", b"x", now_ms=1, id="same"))
    first = await conn.request({"op": "send", "messages": [payload]}, 1000)
    second = await conn.request({"op": "send", "messages": [payload]}, 1000)
    await conn.close()
    assert first["results"] == [{"id": "same", "status": "stored"}]
    assert second["results"] == [{"id": "same", "status": "duplicate"}]
