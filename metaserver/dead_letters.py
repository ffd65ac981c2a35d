"""The dead-letter admin API: list, show, re-drive and purge dead letters across realtime brokers,
and the delay servers' latest stats.

Dead letters live on the realtime brokers, in ``%dead%<subject>%<group>`` subjects. The MetaServer
keeps no copy: every call asks the online realtime brokers (from the registry) over the binary
protocol, with the admin ops ``subjects``, ``browse`` and ``purge`` (docs/PROTOCOL.md), one short
connection per broker, all brokers at once. A broker that cannot be reached or fails is reported
in the answer's ``errors`` list; the others still answer.

Re-driving publishes a new message to the original subject through its realtime route (a
``PayloadSender``, as a producer would), so it lands wherever producers' messages land. It does
not purge: the admin purges once the re-driven messages are handled.

This module may import ``sdk`` but no server package (``realtime.retries`` names the properties
mirrored below; a test checks they agree).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from metaserver.errors import BadRequest, BrokerUnreachable, NotFound
from metaserver.validation import Field, check_name
from sdk.connection import Connection
from wire.errors import NotFound as WireNotFound
from wire.errors import QmqError
from wire.limits import MAX_MESSAGE_ID_CHARS, MAX_PULL_BATCH_MESSAGES
from wire.message import (
    DEAD_PREFIX,
    Message,
    dead_subject,
    decode_message,
    encode_message,
    new_message_id,
    parse_internal_subject,
    validate_message,
)
from serverkit.payload_sender import PayloadSender

log = logging.getLogger(__name__)
T = TypeVar("T")

# Rows one ``GET /api/admin/dead`` returns at most (then ``truncated`` is true).
DEAD_ROWS_MAX = 1000
# Characters of the body shown in a listing.
BODY_PREVIEW_CHARS = 200
# Ids one redrive request may name.
REDRIVE_IDS_MAX = 1000
# Longest wait for a broker: connecting plus hello, and each request, in ms.
BROKER_REQUEST_TIMEOUT_MS = 10_000
# Who the MetaServer says it is to brokers.
ADMIN_CLIENT_ID = "metaserver-admin"
ADMIN_APP = "qmq-admin"

# Message properties set by realtime.retries on every retry and dead copy.
ORIGIN_ID_PROPERTY = "qmq-origin-id"
ORIGIN_SUBJECT_PROPERTY = "qmq-origin-subject"
# Set on a re-driven message: the dead copy's id, and how many re-drives the chain has had.
REDRIVEN_FROM_PROPERTY = "qmq-redriven-from"
REDRIVES_PROPERTY = "qmq-redrives"


@dataclass(frozen=True)
class BrokerRef:
    """An online realtime broker as the registry lists it."""

    group: str
    address: str
    token: str | None = field(default=None, repr=False)  # said in hello (the admin's token)
    ssl_context: ssl.SSLContext | None = field(default=None, repr=False)  # None: plain TCP


def realtime_brokers(brokers: list[dict[str, Any]], group: str | None = None, *,
                     token: str | None = None,
                     ssl_context: ssl.SSLContext | None = None) -> list[BrokerRef]:
    """The online realtime masters of ``Registry.list_brokers()`` (of one group if given), to be
    reached with ``token`` (over TLS with ``ssl_context``). Slaves serve no client, the admin
    included (docs/REPLICATION.md 3)."""
    return [BrokerRef(b["group"], b["address"], token, ssl_context) for b in brokers
            if b["kind"] == "realtime" and b["state"] != "offline"
            and b.get("role", "master") == "master"
            and (group is None or b["group"] == group)]


def delay_stats(brokers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per online delay master with the stats of its latest heartbeat (a slave holds
    a copy of the same messages; counting it would count them twice).

    A delay server reports its stats object as the heartbeat's ``backlog``; an explicit
    ``stats`` object is used when there is no such backlog.
    """
    out = []
    for b in brokers:
        if b["kind"] != "delay" or b["state"] == "offline" or b.get("role", "master") != "master":
            continue
        raw = b["stats"] or {}
        stats = raw.get("backlog") if isinstance(raw.get("backlog"), dict) else raw.get("stats")
        out.append({"group": b["group"], "address": b["address"], "broker_id": b["broker_id"],
                    "state": b["state"], "last_heartbeat_ms": b["last_heartbeat_ms"],
                    "heartbeat_age_ms": b["heartbeat_age_ms"], "stats": stats or {}})
    return out


# --- talking to brokers -------------------------------------------------------------------------


async def _on_broker(broker: BrokerRef, work: Callable[[Connection], Awaitable[T]]) -> T:
    """Run ``work`` on a fresh connection to ``broker``; QmqError (ConnectionLost, ...) on failure."""
    conn = await Connection.open(broker.address, client_id=ADMIN_CLIENT_ID, app=ADMIN_APP,
                                 token=broker.token, ssl_context=broker.ssl_context, connect_timeout_ms=BROKER_REQUEST_TIMEOUT_MS)
    try:
        return await work(conn)
    finally:
        await conn.close()


async def _each_broker(brokers: list[BrokerRef], work: Callable[[BrokerRef, Connection],
                                                               Awaitable[T]],
                       errors: list[dict[str, Any]]) -> list[tuple[BrokerRef, T]]:
    """Run ``work`` on every broker at once; failures go to ``errors``, results come back in
    broker order."""

    async def one(broker: BrokerRef) -> tuple[BrokerRef, T] | None:
        try:
            return broker, await _on_broker(broker, lambda conn: work(broker, conn))
        except QmqError as exc:
            log.warning("admin request to broker %s (%s) failed: %s", broker.group,
                        broker.address, exc)
            errors.append(broker_error(broker, exc))
            return None

    results = await asyncio.gather(*(one(b) for b in brokers))
    return [r for r in results if r is not None]


def broker_error(broker: BrokerRef, exc: QmqError) -> dict[str, Any]:
    """One entry of an answer's ``errors``."""
    return {"broker_group": broker.group, "address": broker.address, "code": exc.code,
            "message": exc.message}


async def _request(conn: Connection, op: dict[str, Any]) -> dict[str, Any]:
    return await conn.request(op, BROKER_REQUEST_TIMEOUT_MS)


async def _dead_subjects(conn: Connection, prefix: str) -> list[dict[str, Any]]:
    """The broker's dead subjects starting with ``prefix`` (each {subject, first_sequence,
    end_sequence, purged_before})."""
    answer = await _request(conn, {"op": "subjects", "prefix": prefix})
    return [s for s in answer.get("subjects", []) if s["subject"].startswith(DEAD_PREFIX)]


async def _browse(conn: Connection, subject: str, count_max: int | None = None
                  ) -> AsyncIterator[tuple[int, bytes]]:
    """Every unpurged ``(sequence, payload)`` of ``subject`` (at most ``count_max``), a page at
    a time; nothing is consumed."""
    from_sequence: int | None = None
    given = 0
    while count_max is None or given < count_max:
        page = MAX_PULL_BATCH_MESSAGES if count_max is None else min(
            MAX_PULL_BATCH_MESSAGES, count_max - given)
        answer = await _request(conn, {"op": "browse", "subject": subject,
                                       "from_sequence": from_sequence, "max_count": page})
        for item in answer["messages"]:
            yield item["sequence"], item["payload"]
            given += 1
        next_sequence = answer["next_sequence"]
        if next_sequence >= answer["end_sequence"] or (
                from_sequence is not None and next_sequence <= from_sequence):
            return
        from_sequence = next_sequence


# --- listing and showing ------------------------------------------------------------------------


def _preview(body: bytes) -> str:
    # 4 bytes per character at most, so this slice holds the first BODY_PREVIEW_CHARS characters.
    return body[:4 * BODY_PREVIEW_CHARS].decode("utf-8", "replace")[:BODY_PREVIEW_CHARS]


def dead_row(broker: BrokerRef, subject: str, sequence: int, message: Message) -> dict[str, Any]:
    """One row of the dead-letter listing."""
    internal = parse_internal_subject(subject)
    assert internal is not None, subject
    return {
        "broker_group": broker.group,
        "address": broker.address,
        "dead_subject": subject,
        "subject": internal.subject,
        "group": internal.group,
        "sequence": sequence,
        "id": message.id,
        "retries": message.retries,
        "created_at_ms": message.created_at_ms,
        "origin_id": message.properties.get(ORIGIN_ID_PROPERTY, message.id),
        "body_preview": _preview(message.body),
        "size_bytes": len(message.body),
    }


def dead_prefix(subject: str | None, group: str | None) -> str:
    """The narrowest subject prefix that finds the dead subjects of these filters."""
    if subject is not None and group is not None:
        return dead_subject(subject, group)
    if subject is not None:
        return f"{DEAD_PREFIX}{subject}%"
    return DEAD_PREFIX


def _wanted(name: str, subject: str | None, group: str | None) -> bool:
    internal = parse_internal_subject(name)
    return (internal is not None and internal.kind == "dead"
            and (subject is None or internal.subject == subject)
            and (group is None or internal.group == group))


async def list_dead(brokers: list[BrokerRef], subject: str | None,
                    group: str | None) -> dict[str, Any]:
    """``{dead: [...], truncated, errors}``: unpurged dead letters, at most DEAD_ROWS_MAX rows,
    sorted by broker group, dead subject and sequence."""
    errors: list[dict[str, Any]] = []

    async def collect(broker: BrokerRef, conn: Connection) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        listing = await _dead_subjects(conn, dead_prefix(subject, group))
        for item in listing:
            name = item["subject"]
            if not _wanted(name, subject, group) or item["purged_before"] >= item["end_sequence"]:
                continue
            async for sequence, payload in _browse(conn, name, DEAD_ROWS_MAX + 1 - len(rows)):
                try:
                    rows.append(dead_row(broker, name, sequence, decode_message(payload)))
                except QmqError as exc:
                    errors.append({**broker_error(broker, exc),
                                   "message": f"{name} sequence {sequence}: {exc.message}"})
            if len(rows) > DEAD_ROWS_MAX:
                break
        return rows

    rows = [row for _, found in await _each_broker(brokers, collect, errors) for row in found]
    rows.sort(key=lambda r: (r["broker_group"], r["address"], r["dead_subject"], r["sequence"]))
    truncated = len(rows) > DEAD_ROWS_MAX
    return {"dead": rows[:DEAD_ROWS_MAX], "truncated": truncated, "errors": errors}


def message_view(message: Message) -> dict[str, Any]:
    """A whole message as JSON: the body as UTF-8 text when it decodes, else base64."""
    try:
        body, encoding = message.body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        body, encoding = base64.b64encode(message.body).decode("ascii"), "base64"
    return {
        "id": message.id,
        "origin_id": message.properties.get(ORIGIN_ID_PROPERTY, message.id),
        "origin_subject": message.properties.get(ORIGIN_SUBJECT_PROPERTY),
        "retries": message.retries,
        "created_at_ms": message.created_at_ms,
        "deliver_at_ms": message.deliver_at_ms,
        "expire_at_ms": message.expire_at_ms,
        "tags": list(message.tags),
        "properties": message.properties,
        "size_bytes": len(message.body),
        "encoding": encoding,
        "body": body,
    }


async def show_dead(brokers: list[BrokerRef], broker_group: str, subject: str,
                    sequence: int) -> dict[str, Any]:
    """The dead letter ``sequence`` of ``subject`` on ``broker_group``; NotFound when the group
    has no online broker or none holds it unpurged, BrokerUnreachable when none answered."""
    if not brokers:
        raise NotFound(f"broker group {broker_group!r} has no online realtime broker")
    failures: list[str] = []
    for broker in brokers:
        async def read(conn: Connection) -> dict[str, Any]:
            return await _request(conn, {"op": "browse", "subject": subject,
                                         "from_sequence": sequence, "max_count": 1})
        try:
            answer = await _on_broker(broker, read)
        except WireNotFound:
            continue
        except QmqError as exc:
            failures.append(f"{broker.address}: {exc.code}: {exc.message}")
            continue
        found = [m for m in answer["messages"] if m["sequence"] == sequence]
        if not found:
            continue
        internal = parse_internal_subject(subject)
        assert internal is not None
        return {"broker_group": broker.group, "address": broker.address,
                "dead_subject": subject, "subject": internal.subject, "group": internal.group,
                "sequence": sequence, **message_view(decode_message(found[0]["payload"]))}
    if failures:
        raise BrokerUnreachable(f"no broker of group {broker_group!r} answered: "
                                + "; ".join(failures))
    raise NotFound(f"{subject} sequence {sequence} is not an unpurged dead letter on broker "
                   f"group {broker_group!r}")


# --- re-driving and purging ---------------------------------------------------------------------


def redrive_message(dead: Message, subject: str, now_ms: int) -> Message:
    """The new message that re-drives ``dead`` to ``subject``.

    Retries start again at 0 and the copy is a new retry chain: its id is
    ``<origin id>.redrive<N>`` (N counts the chain's re-drives; a fresh id when that is too
    long), the old chain's origin properties are dropped so its retries get fresh ids, and
    ``qmq-redriven-from`` names the dead copy. Delivered at once and never expiring: re-driving is
    the admin's explicit wish to have it handled.
    """
    origin_id = dead.properties.get(ORIGIN_ID_PROPERTY, dead.id)
    previous = dead.properties.get(REDRIVES_PROPERTY, "0")
    redrives = int(previous) + 1 if previous.isascii() and previous.isdigit() else 1
    new_id = f"{origin_id}.redrive{redrives}"
    if len(new_id) > MAX_MESSAGE_ID_CHARS:
        new_id = new_message_id()
    properties = {k: v for k, v in dead.properties.items()
                  if k not in (ORIGIN_ID_PROPERTY, ORIGIN_SUBJECT_PROPERTY)}
    properties[REDRIVEN_FROM_PROPERTY] = dead.id
    properties[REDRIVES_PROPERTY] = str(redrives)
    return Message(id=new_id, subject=subject, body=dead.body, tags=dead.tags,
                   properties=properties, created_at_ms=now_ms)


async def redrive(brokers: list[BrokerRef], sender: PayloadSender, subject: str, group: str,
                  ids: list[str] | None, now_ms: int) -> dict[str, Any]:
    """Re-publish ``subject``/``group``'s unpurged dead letters (only those whose id or origin id
    is in ``ids``, if given) to ``subject``; ``{redriven, duplicates, errors}``."""
    name = dead_subject(subject, group)
    wanted = set(ids) if ids is not None else None
    errors: list[dict[str, Any]] = []
    counts = {"redriven": 0, "duplicates": 0}

    async def send(broker: BrokerRef, batch: list[tuple[int, Message]]) -> None:
        payloads = [encode_message(m) for _, m in batch]
        try:
            _, results = await sender.send(subject, payloads)
        except QmqError as exc:
            errors.append({"code": exc.code, "message": f"re-driving {len(batch)} message(s) "
                           f"to {subject}: {exc.message}"})
            return
        for (sequence, message), result in zip(batch, results):
            if "error" in result:
                # The group that refused it ("": none took it), not the dead letter's own
                # broker: that one is named in the message.
                errors.append({"broker_group": result.get("group", ""), "address": "",
                               "code": result["error"]["code"],
                               "message": f"{name} sequence {sequence} on {broker.group} "
                                          f"({broker.address}) as {message.id}: "
                                          f"{result['error']['message']}"})
            elif result.get("status") == "duplicate":
                counts["duplicates"] += 1
            else:
                counts["redriven"] += 1

    async def work(broker: BrokerRef, conn: Connection) -> None:
        if not any(s["subject"] == name for s in await _dead_subjects(conn, name)):
            return
        batch: list[tuple[int, Message]] = []
        async for sequence, payload in _browse(conn, name):
            try:
                dead = decode_message(payload)
                if wanted is not None and not (
                        dead.id in wanted or dead.properties.get(ORIGIN_ID_PROPERTY) in wanted):
                    continue
                message = redrive_message(dead, subject, now_ms)
                validate_message(message)
            except QmqError as exc:
                errors.append({**broker_error(broker, exc),
                               "message": f"{name} sequence {sequence}: {exc.message}"})
                continue
            batch.append((sequence, message))
            if len(batch) == MAX_PULL_BATCH_MESSAGES:
                await send(broker, batch)
                batch = []
        if batch:
            await send(broker, batch)

    await _each_broker(brokers, work, errors)
    return {**counts, "errors": errors}


async def purge(brokers: list[BrokerRef], subject: str, group: str,
                through_sequence: int | None) -> dict[str, Any]:
    """Purge ``subject``/``group``'s dead letters on every broker holding them (through
    ``through_sequence`` of each broker, or all that are there now); ``{purged, brokers,
    errors}``."""
    name = dead_subject(subject, group)
    errors: list[dict[str, Any]] = []

    async def work(broker: BrokerRef, conn: Connection) -> dict[str, Any] | None:
        found = [s for s in await _dead_subjects(conn, name) if s["subject"] == name]
        if not found:
            return None
        through = found[0]["end_sequence"] - 1 if through_sequence is None else through_sequence
        if through < 0:
            return None
        answer = await _request(conn, {"op": "purge", "subject": name,
                                       "through_sequence": through})
        return {"broker_group": broker.group, "address": broker.address,
                "purged_before": answer["purged_before"], "purged": answer.get("purged", 0)}

    done = [r for _, r in await _each_broker(brokers, work, errors) if r is not None]
    return {"purged": sum(r["purged"] for r in done), "brokers": done, "errors": errors}


# --- request checks -----------------------------------------------------------------------------


def check_dead_subject(key: str, value: str) -> str:
    """A ``%dead%<subject>%<group>`` name."""
    try:
        internal = parse_internal_subject(value)
    except QmqError as exc:
        raise BadRequest(f"{key} {value!r} is not a dead-letter subject: {exc.message}") from None
    if internal is None or internal.kind != "dead":
        raise BadRequest(f"{key} {value!r} is not a dead-letter subject "
                         f"({DEAD_PREFIX}<subject>%<group>)")
    return value


def check_sequence_text(key: str, value: str) -> int:
    """A non-negative decimal integer given as text (a query parameter)."""
    if not (value.isascii() and value.isdigit()) or int(value) > 2**64 - 1:
        raise BadRequest(f"{key} {value!r} must be a non-negative integer")
    return int(value)


def check_sequence(key: str, value: int) -> int:
    """A non-negative integer below 2^64."""
    if not 0 <= value <= 2**64 - 1:
        raise BadRequest(f"{key} {value} must be between 0 and {2**64 - 1}")
    return value


def check_ids(key: str, value: list[Any]) -> list[str]:
    """1..REDRIVE_IDS_MAX message ids."""
    if not 1 <= len(value) <= REDRIVE_IDS_MAX:
        raise BadRequest(f"{key} has {len(value)} ids; give 1 to {REDRIVE_IDS_MAX} "
                         "(or leave it out for all)")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not 1 <= len(item) <= MAX_MESSAGE_ID_CHARS:
            raise BadRequest(f"{key}[{i}] {item!r} must be a message id of 1 to "
                             f"{MAX_MESSAGE_ID_CHARS} characters")
    return value


DEAD_LIST_QUERY = {
    "subject": Field(str, required=False, check=check_name),
    "group": Field(str, required=False, check=check_name),
}

DEAD_MESSAGE_QUERY = {
    "broker_group": Field(str, check=check_name),
    "dead_subject": Field(str, check=check_dead_subject),
    "sequence": Field(str, check=check_sequence_text),
}

REDRIVE = {
    "subject": Field(str, check=check_name),
    "group": Field(str, check=check_name),
    "ids": Field(list, required=False, check=check_ids),
}

PURGE = {
    "subject": Field(str, check=check_name),
    "group": Field(str, check=check_name),
    "through_sequence": Field(int, required=False, check=check_sequence),
    "broker_group": Field(str, required=False, check=check_name),
}
