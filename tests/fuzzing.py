"""Throwing bad bytes at live servers: a cluster on its own thread, a blocking raw client, and the
Hypothesis strategies of tests/integration/test_fuzz_*.py.

The cluster (MetaServer on SQLite, one realtime broker, one delay server, all on 127.0.0.1 port
0) runs on an event loop in a background thread, so the Hypothesis tests stay plain synchronous
functions that talk to it over sockets, the way a foreign client would. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Coroutine
from concurrent.futures import Future
from contextlib import AsyncExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qmq
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.message import Message, encode_message
from wire.protocol import FrameDecoder, encode_frame

T = TypeVar("T")

# Examples per strategy and server (CI runs 200; QMQ_FUZZ_EXAMPLES=2000 for a deeper local run).
FUZZ_EXAMPLES = int(os.environ.get("QMQ_FUZZ_EXAMPLES", "200"))
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)
# Longest wait for the server to answer and close one fuzzed connection after we stop writing.
EXCHANGE_TIMEOUT_S = 30
# Longest wait for the cluster to start or stop, and for one call run on its loop.
CLUSTER_TIMEOUT_S = 90
# Error codes a server may answer (docs/PROTOCOL.md); "internal" means a server bug and fails.
EXPECTED_CODES = frozenset({"bad_request", "unauthorized", "forbidden", "too_large",
                            "delay_out_of_range", "readonly", "overloaded", "not_found",
                            "not_supported"})
# Auth is on in the fuzzed cluster: the servers check every request's token with the MetaServer,
# and every connection below says hello with this admin token (fuzzed hellos may carry others).
FUZZ_ADMIN_TOKEN = "fuzz-admin-0123456789abcdef"
# The epoch ms the strategies build times around (the cluster runs on the wall clock).
BASE_MS = int(time.time() * 1000)


class ClusterThread:
    """A MetaServer, a realtime broker and a delay server (or the MetaServer alone) served by an
    event loop on a thread."""

    def __init__(self, data_dir: Path, brokers: bool = True,
                 admin_token: str | None = FUZZ_ADMIN_TOKEN) -> None:
        self.data_dir = data_dir
        self.brokers = brokers  # False: the MetaServer alone
        self.admin_token = admin_token  # set: auth is on; the brokers carry this token too
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzz-cluster",
                                       daemon=True)
        self._stack = AsyncExitStack()
        self.meta_url = ""
        self.realtime: RealtimeServer | None = None
        self.delay: DelayServer | None = None

    def start(self) -> "ClusterThread":
        """Start the loop and the three servers; returns self once all listen."""
        self.thread.start()
        self.call(self._start())
        return self

    def stop(self) -> None:
        """Stop the servers, then the loop and its thread."""
        try:
            self.call(self._stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(CLUSTER_TIMEOUT_S)
            self.loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = CLUSTER_TIMEOUT_S) -> T:
        """Run ``coro`` on the cluster's loop and return its result (bounded wait)."""
        future: Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(timeout_s)

    async def _start(self) -> None:
        meta = await self._stack.enter_async_context(start_metaserver(MetaConfig(
            db_url=sqlite_url(self.data_dir / "meta.db"), port=0, admin_token=self.admin_token)))
        self.meta_url = meta.url
        if not self.brokers:
            return
        # Async flush: fuzzing stores thousands of tiny messages and fsyncs prove nothing here.
        self.realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(self.data_dir / "rt"), meta_url=meta.url, group="rt-fuzz", port=0,
            flush="async", heartbeat_interval_ms=500, shutdown_grace_ms=1000,
            token=self.admin_token))
        await self.realtime.start()
        self._stack.push_async_callback(self.realtime.stop)
        self.delay = DelayServer(DelayConfig(
            data_dir=str(self.data_dir / "delay"), meta_url=meta.url, group="delay-fuzz", port=0,
            flush="async", bucket_ms=1000, heartbeat_interval_ms=500, shutdown_grace_ms=1000,
            token=self.admin_token))
        await self.delay.start()
        self._stack.push_async_callback(self.delay.stop)

    # --- what the fuzz tests check afterwards ---------------------------------------------------

    def delay_pending_payloads(self, deliver_at_ms: int) -> list[bytes]:
        """The payloads the delay store holds for the bucket of ``deliver_at_ms``, read (and
        CRC-verified) on the store's own I/O thread."""
        scheduler = self.delay.scheduler  # type: ignore[union-attr]

        def read() -> list[bytes]:
            store = scheduler.store
            bucket_ms = store.bucket_of(deliver_at_ms)
            return [store.read(entry).payload for entry in store.load_bucket(bucket_ms)]

        return self.call(scheduler._io(read))

    def sdk_round_trip(self, subject: str, delay_ms: int | None = None) -> None:
        """A normal SDK producer sends one message (delayed by ``delay_ms`` if given) and a
        normal SDK consumer receives it intact; raises AssertionError otherwise."""
        asyncio.run(self._round_trip(subject, delay_ms))

    async def _round_trip(self, subject: str, delay_ms: int | None) -> None:
        body = f"after fuzzing {subject}".encode()
        async with asyncio.timeout(CLUSTER_TIMEOUT_S), \
                qmq.Consumer(self.meta_url, group="fuzz-check", start="earliest",
                             wait_ms=500, token=self.admin_token) as consumer, \
                qmq.Producer(self.meta_url, token=self.admin_token) as producer:
            delay = timedelta(milliseconds=delay_ms) if delay_ms is not None else None
            receipt = await producer.send(subject, body, delay=delay)
            assert receipt.status == "stored", receipt
            async for msg in consumer.subscribe(subject):
                assert msg.id == receipt.message_id and msg.body == body, msg
                await msg.ack()
                break


class SyncClient:
    """A blocking protocol client: one request at a time, for setting up and checking."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=EXCHANGE_TIMEOUT_S)
        self.decoder = FrameDecoder()
        self.rid = 0
        self.ready: list[dict[str, Any]] = []
        answer = self.request({"op": "hello", "client_id": "fuzz-check", "app": "tests",
                               "token": FUZZ_ADMIN_TOKEN,
                               "protocol": 1})
        assert answer.get("ok"), answer

    def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send one request and return its answer."""
        self.rid += 1
        self.sock.sendall(encode_frame({**frame, "rid": self.rid}))
        while True:
            for answer in self.ready:
                if answer.get("rid") == self.rid:
                    self.ready.remove(answer)
                    return answer
            data = self.sock.recv(1 << 16)
            if not data:
                raise ConnectionError("server closed the connection")
            self.ready += self.decoder.feed(data)

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()


def store_messages(port: int, subject: str, count: int, deliver_at_ms: int | None = None
                   ) -> list[bytes]:
    """Send ``count`` messages to the server on ``port``; returns their payloads (all stored)."""
    payloads = [encode_message(Message.create(
        subject, b"kept %d " % i + bytes(range(256)), now_ms=BASE_MS, tags=["keep"],
        properties={"n": str(i)}, deliver_at_ms=deliver_at_ms, id=f"{subject}-kept-{i}"))
        for i in range(count)]
    client = SyncClient(port)
    try:
        answer = client.request({"op": "send", "messages": payloads})
    finally:
        client.close()
    assert [r.get("status") for r in answer["results"]] == ["stored"] * count, answer
    return payloads


def drain_and_nack(port: int, group: str, rounds_max: int = 20) -> int:
    """Pull everything stored on the fuzzed subjects as a new group and nack all of it (the
    broker must be able to make and hand off a retry copy of whatever a producer stored);
    returns how many messages were nacked. Fails on any error answer."""
    client = SyncClient(port)
    nacked = 0
    try:
        for subject in FUZZ_SUBJECTS:
            for _ in range(rounds_max):
                pulled = client.request({"op": "pull", "subject": subject, "group": group,
                                         "consumer_id": "drain", "max_count": 256,
                                         "start": "earliest"})
                assert "pull_seqs" in pulled, pulled
                seqs = pulled["pull_seqs"]
                if not seqs:
                    break
                answer = client.request({"op": "nack", "subject": subject, "group": group,
                                         "consumer_id": "drain", "pull_seqs": seqs,
                                         "retry_after_ms": 3_600_000})
                assert answer.get("nacked") == len(seqs), (subject, answer)
                nacked += len(seqs)
    finally:
        client.close()
    return nacked


def browse_payloads(port: int, subject: str, count: int) -> list[bytes]:
    """The first ``count`` stored payloads of ``subject`` on a realtime broker (not consumed)."""
    client = SyncClient(port)
    try:
        answer = client.request({"op": "browse", "subject": subject, "from_sequence": 0,
                                 "max_count": count})
    finally:
        client.close()
    assert "messages" in answer, answer
    return [m["payload"] for m in answer["messages"]]


# The rid of the probe ``exchange`` sends behind well-framed data; fuzzed rids stay below it.
PROBE_RID = 2**64 - 1


def whole_frames(data: bytes) -> bool:
    """True if ``data`` is a sequence of complete, decodable frames (as the server's own codec
    sees it): then the server must keep the connection open and answer what follows."""
    decoder = FrameDecoder()
    try:
        decoder.feed(data)
    except Exception:
        return False
    return decoder.buffered_bytes == 0


def exchange(port: int, data: bytes, hello: bool) -> list[dict[str, Any]]:
    """Connect, say hello (if asked), write ``data``, stop writing, and read every answer until
    the server closes.

    When ``data`` is whole frames (request-level faults at worst), a ``hello`` probe follows it
    and must be answered before we stop writing: the connection survived. Fails if the server
    does not close within EXCHANGE_TIMEOUT_S after that (a stuck connection) or writes anything
    that is not a well-formed response."""
    hello_frame = encode_frame({"op": "hello", "rid": 0, "client_id": "fuzz", "app": "tests",
                                "token": FUZZ_ADMIN_TOKEN,
                                "protocol": 1}) if hello else b""
    probe = whole_frames(data)
    probe_frame = encode_frame({"op": "hello", "rid": PROBE_RID, "client_id": "probe",
                                "token": FUZZ_ADMIN_TOKEN,
                                "app": "tests", "protocol": 1}) if probe else b""
    sock = socket.create_connection(("127.0.0.1", port), timeout=EXCHANGE_TIMEOUT_S)
    decoder = FrameDecoder(max_frame_bytes=0xFFFFFFFF)
    answers: list[dict[str, Any]] = []
    try:
        try:
            sock.sendall(hello_frame + data + probe_frame)
            if probe:
                answers += _read_until(sock, decoder, probed=True)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            assert not probe, "the server closed a connection that sent only whole frames"
        answers += _read_until(sock, decoder, probed=False)
    finally:
        sock.close()
    assert decoder.buffered_bytes == 0, "the server wrote a partial frame"
    for answer in answers:
        check_answer(answer)
    if probe:
        assert any(a.get("rid") == PROBE_RID and a.get("ok") for a in answers), answers
    return answers


def _read_until(sock: socket.socket, decoder: FrameDecoder, probed: bool) -> list[dict[str, Any]]:
    """Read answers until the probe's answer arrives (``probed``) or the server closes."""
    answers: list[dict[str, Any]] = []
    deadline = time.monotonic() + EXCHANGE_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 16)
        except ConnectionResetError:
            chunk = b""
        except socket.timeout:
            break
        if not chunk:
            assert not probed, "the server closed a connection that sent only whole frames"
            return answers
        answers += decoder.feed(chunk)
        if probed and any(a.get("rid") == PROBE_RID for a in answers):
            return answers
    what = "answered the probe" if probed else "closed the connection"
    raise AssertionError(f"the server neither {what} within {EXCHANGE_TIMEOUT_S} s")


def check_answer(answer: dict[str, Any]) -> None:
    """A response has a rid (int or nil) and, if an error, an expected code and a message."""
    assert "rid" in answer, answer
    error = answer.get("error")
    if error is not None:
        assert error.get("code") in EXPECTED_CODES, answer
        assert isinstance(error.get("message"), str) and error["message"], answer
    else:
        assert type(answer["rid"]) is int, answer


def tracebacks(records: list[logging.LogRecord]) -> list[str]:
    """The log records that carry a traceback or are errors: each one is a bug to fix."""
    return [f"{r.name}: {r.getMessage()}" for r in records
            if r.exc_info or r.levelno >= logging.ERROR]


def throw_frames(port: int, frames: st.SearchStrategy[bytes], caplog: Any) -> None:
    """Throw byte streams Hypothesis draws from ``frames`` at the server on ``port``
    (``exchange``, mostly after a hello: ``greets``), FUZZ_SETTINGS' examples of them; fails
    on an exchange's check or on a traceback or error logged meanwhile (``caplog``, pytest's)."""
    caplog.set_level(logging.WARNING)

    @FUZZ_SETTINGS
    @given(data=frames, hello=greets)
    def throw(data: bytes, hello: bool) -> None:
        exchange(port, data, hello)

    throw()
    assert tracebacks(caplog.records) == []


# --- strategies --------------------------------------------------------------------------------

_U64_MAX = 2**64 - 1
_fresh_ids = itertools.count()
_I64_MIN = -(2**63)

# Scalars msgpack can carry, leaning on the edges servers get wrong.
scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(_I64_MIN, _U64_MAX),
    st.sampled_from([0, -1, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, _U64_MAX, _I64_MIN]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=24), st.binary(max_size=48),
    # Extension types, which the protocol never uses, and msgpack's own timestamp (ext -1).
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999)),
)
# Anything msgpack can carry: nested lists and maps (keys not always str) of scalars.
junk = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), children, max_size=5),
    max_leaves=12,
)

# The subjects fuzzed requests name (drain_and_nack consumes them all afterwards).
FUZZ_SUBJECTS = ("fuzz", "fuzz.kept", "%retry%fuzz%g", "%dead%fuzz%g", "z" * 200)
subjects = st.sampled_from(FUZZ_SUBJECTS)
groups = st.sampled_from(["g", "h", "g" * 200])
consumers = st.sampled_from(["c1", "c2"])
seqs = st.integers(0, 40) | st.sampled_from([_U64_MAX, 2**63])
# Due times: in the past, due now-ish, a few seconds to hours ahead, at the 2-year horizon.
due_ms = st.one_of(st.integers(BASE_MS - 10**7, BASE_MS + 10**7),
                   st.sampled_from([0, BASE_MS + 63_072_000_000, _U64_MAX]))


@st.composite
def message_maps(draw: st.DrawFn) -> dict[str, Any]:
    """A valid message payload map (before any mutation)."""
    payload: dict[str, Any] = {
        # Mostly fresh ids (a counter: drawn uuids repeat) so most sends store something; a few
        # short drawn ones repeat on purpose.
        "i": draw(st.builds(lambda n: f"fz{next(_fresh_ids)}.{n}", st.integers(0, 9)) | st.text(
            st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8)),
        "s": draw(subjects),
        "b": draw(st.binary(max_size=64)),
        "c": BASE_MS,
    }
    if draw(st.booleans()):
        payload["t"] = draw(st.lists(st.sampled_from(["a", "b", "é" * 32]), max_size=3))
    if draw(st.booleans()):
        payload["p"] = draw(st.dictionaries(
            st.sampled_from(["k", "qmq-origin-id"]),
            st.text(max_size=8) | st.sampled_from(["has space", "o" * 128]), max_size=2))
    # Hypothesis leans to small draws, so a rare branch is the one taken on the largest value.
    if draw(st.integers(0, 3)) == 3:  # mostly absent: a realtime broker refuses a future one
        payload["d"] = draw(due_ms)
    if draw(st.booleans()):
        payload["x"] = draw(due_ms)
    if draw(st.booleans()):
        payload["r"] = draw(st.integers(0, 20) | st.sampled_from([2**63, _U64_MAX]))
    return payload


def _consumer_fields(draw: st.DrawFn) -> dict[str, Any]:
    return {"subject": draw(subjects), "group": draw(groups), "consumer_id": draw(consumers)}


@st.composite
def request_maps(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed request of any op (its message payloads may later be mutated)."""
    # send three times as often as the others: stored messages are what later ops work on.
    op = draw(st.sampled_from(["hello", "send", "send", "send", "pull", "ack", "nack", "cancel",
                               "heartbeat", "subjects", "browse", "purge"]))
    rid = draw(st.integers(0, 1000))
    if op == "hello":
        # A later hello may swap the connection's token for a wrong or an over-long one.
        token = draw(st.sampled_from([FUZZ_ADMIN_TOKEN, None, "wrong-token", "t" * 513]))
        return {"op": op, "rid": rid, "client_id": "fuzz", "app": "tests", "protocol": 1,
                "token": token}
    if op == "send":
        return {"op": op, "rid": rid, "messages": draw(st.lists(message_maps(), min_size=1,
                                                                max_size=4))}
    if op == "pull":
        return {"op": op, "rid": rid, **_consumer_fields(draw),
                "max_count": draw(st.integers(1, 20)), "wait_ms": draw(st.integers(0, 20)),
                "tags": draw(st.lists(st.sampled_from(["a", "keep"]), max_size=2)),
                "start": draw(st.sampled_from(["latest", "earliest"])),
                "broadcast": draw(st.booleans())}
    if op == "ack":
        ranges = draw(st.lists(st.tuples(seqs, st.integers(0, 3)), min_size=1, max_size=4))
        return {"op": op, "rid": rid, **_consumer_fields(draw),
                "ranges": [[first, min(first + extra, _U64_MAX)] for first, extra in ranges]}
    if op == "nack":
        return {"op": op, "rid": rid, **_consumer_fields(draw),
                "pull_seqs": draw(st.lists(seqs, min_size=1, max_size=4)),
                "retry_after_ms": draw(st.none() | st.integers(0, 10_000))}
    if op == "cancel":
        ids = draw(st.lists(st.sampled_from(["fuzz-kept-0", "x", "a" * 128]), min_size=1,
                            max_size=3))
        return {"op": op, "rid": rid, "ids": ids,
                "deliver_at_ms": [draw(due_ms) for _ in ids]}
    if op == "heartbeat":
        return {"op": op, "rid": rid, "consumer_id": draw(consumers),
                "subscriptions": [[draw(subjects), draw(groups)]]}
    if op == "subjects":
        return {"op": op, "rid": rid, "prefix": draw(st.sampled_from(["", "fuzz", "%"]))}
    if op == "browse":
        return {"op": op, "rid": rid, "subject": draw(subjects),
                "from_sequence": draw(st.none() | seqs), "max_count": draw(st.integers(1, 20))}
    return {"op": op, "rid": rid, "subject": "%dead%fuzz%g", "through_sequence": draw(seqs)}


@st.composite
def mutated(draw: st.DrawFn, value: dict[Any, Any]) -> dict[Any, Any]:
    """``value`` with 0-3 of: a field replaced by junk, a field removed, an extra field."""
    out = dict(value)
    for _ in range(draw(st.integers(0, 3))):
        action = draw(st.sampled_from(["replace", "remove", "extra"]))
        keys = sorted(out, key=repr)
        if action == "replace" and keys:
            out[draw(st.sampled_from(keys))] = draw(junk)
        elif action == "remove" and keys:
            del out[draw(st.sampled_from(keys))]
        else:
            out[draw(st.one_of(st.text(max_size=6), st.integers(-3, 3)))] = draw(junk)
    return out


def pack(value: Any) -> bytes:
    """msgpack of ``value`` as our clients encode it."""
    return msgpack.packb(value, use_bin_type=True)


def frame(payload: bytes) -> bytes:
    """``u32 length | payload``."""
    return struct.pack(">I", len(payload)) + payload


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    """(b) 1-4 correctly framed requests whose fields (and message payloads) are mutated:
    wrong types, missing and extra fields, huge and negative ints, nested junk, unknown ops."""
    frames = []
    for _ in range(draw(st.integers(1, 4))):
        request = draw(request_maps())
        if request["op"] == "send":
            request["messages"] = [
                pack(draw(mutated(m))) if draw(st.integers(0, 2)) == 2 else pack(m)
                for m in request["messages"]
            ]
            if draw(st.booleans()):
                request["messages"].append(draw(st.binary(max_size=32)))
        if draw(st.integers(0, 2)) == 2:
            request = draw(mutated(request))
        if draw(st.integers(0, 9)) == 9:
            request["op"] = draw(st.text(max_size=10))
        frames.append(frame(pack(request)))
    return b"".join(frames)


@st.composite
def damaged_requests(draw: st.DrawFn) -> bytes:
    """(c) a valid framed request, truncated and/or with bits flipped (header included)."""
    request = draw(request_maps())
    if request["op"] == "send":
        request["messages"] = [pack(m) for m in request["messages"]]
    data = bytearray(frame(pack(request)))
    for _ in range(draw(st.integers(0, 4))):
        index = draw(st.integers(0, len(data) - 1))
        data[index] ^= 1 << draw(st.integers(0, 7))
    if draw(st.booleans()):
        data = data[:draw(st.integers(0, len(data)))]
    return bytes(data)


@st.composite
def lying_lengths(draw: st.DrawFn) -> bytes:
    """(d) a request payload behind a length prefix that lies about its size."""
    request = draw(request_maps())
    if request["op"] == "send":
        request["messages"] = [pack(m) for m in request["messages"]]
    payload = pack(request)
    declared = draw(st.one_of(
        st.integers(0, len(payload) + 8),
        st.integers(0, 2**32 - 1),
        st.sampled_from([0, 2**23, 2**23 + 1, 2**32 - 1]),
    ))
    tail = draw(st.binary(max_size=16))
    return struct.pack(">I", declared) + payload + tail


# Whether a fuzzed stream follows a hello (mostly: most ops are refused before one).
greets = st.sampled_from([True, True, True, False])

random_streams = st.binary(max_size=512)
"""(a) arbitrary bytes."""

__all__ = [
    "FUZZ_SETTINGS", "ClusterThread", "SyncClient", "store_messages", "browse_payloads",
    "drain_and_nack",
    "exchange", "throw_frames", "tracebacks", "random_streams", "mutated_requests",
    "damaged_requests",
    "lying_lengths", "greets",
]


def frame_strategies() -> list[Any]:
    """The four kinds of bad input, as pytest params both server fuzz modules run: random byte
    streams, valid frames with mutated fields, truncated or bit-flipped frames, lying length
    prefixes."""
    import pytest

    return [
        pytest.param(random_streams, id="random-bytes"),
        pytest.param(mutated_requests(), id="mutated-fields"),
        pytest.param(damaged_requests(), id="truncated-or-bit-flipped"),
        pytest.param(lying_lengths(), id="lying-length-prefix"),
    ]
