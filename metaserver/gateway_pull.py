"""The gateway's consuming side: pull with long polling, ack and nack, for one token.

A pull reads the subject and the group's ``%retry%`` subject (as the SDK's Consumer does) from
every broker group of their consumer routes, in two steps:

1. **Now:** each broker in turn, on the pooled connection, asked with ``wait_ms`` 0 for what
   is still missing, until ``max_count`` are taken. Asking one at a time never takes more than
   was asked for, so nothing is left held for the consumer that it was not handed.
2. **Long poll**, only when step 1 found nothing and ``wait_ms`` > 0. With one broker: the
   pooled connection waits. With several: each waits on a connection of its own, and once one
   answers with messages the others' connections are closed, and a broker whose long poll's
   connection closed takes nothing for it (docs/PROTOCOL.md, ``pull``). Brokers answering in
   the same instant are all returned, so such an answer may hold up to ``max_count`` from each.

Acks and nacks go to the broker named in each receipt, one request per (broker, subject,
consumer) with the receipts' pull sequences as ranges. A receipt naming a broker that is not in
the subject's consumer route (gone, or never a broker) is refused, so the gateway connects only
to registered brokers. Messages a consumer pulled and never acked come back to the group after
its ack timeout, or once the consumer has not pulled for the broker's consumer expiry (30 s).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from metaserver import gateway_codec as codec
from metaserver.registry import Registry
from sdk.acks import seqs_to_ranges
from sdk.connection import Connection, ConnectionPool
from sdk.routes import RouteCache
from wire.errors import NoRoute, NotFound, QmqError
from wire.message import decode_message, retry_subject, validate_tags
from wire.protocol import pull_columns

log = logging.getLogger(__name__)

# Longest wait for an ack, nack or a pull beyond its wait_ms, in milliseconds.
CONTROL_TIMEOUT_MS = 5_000
# Consumers whose MetaServer heartbeat the gateway remembers having written (it writes one per
# (consumer, group, subject) at most every third of the client expiry).
HEARTBEATS_REMEMBERED_MAX = 10_000

Target = tuple[str, str, str]  # (subject pulled, broker group, address)


class Puller:
    """Pulls, acks and nacks for one token over ``pool``; routes from ``routes``."""

    def __init__(self, registry: Registry, routes: RouteCache, pool: ConnectionPool,
                 ssl_context: ssl.SSLContext | None) -> None:
        self.registry = registry
        self.routes = routes
        self.pool = pool
        self.ssl_context = ssl_context
        self._turn = 0
        # (consumer id, group, subject) -> time.monotonic() of the last MetaServer heartbeat.
        self._heartbeats: dict[tuple[str, str, str], float] = {}

    async def close(self) -> None:
        """Close the pooled connections."""
        await self.pool.close()

    async def pull(self, subject: str, group: str, consumer_id: str, max_count: int,
                   wait_ms: int, tags: list[str], start: str) -> list[dict[str, Any]]:
        """Up to ``max_count`` messages of ``subject`` (and its retries) for ``consumer_id`` of
        ``group``, waiting up to ``wait_ms`` for the first."""
        validate_tags(tags, "pull")
        targets = await self._targets(subject, group)
        await self._heartbeat(consumer_id, group, subject)

        def op(source: str, count: int, wait: int) -> dict[str, Any]:
            return {"op": "pull", "subject": source, "group": group, "consumer_id": consumer_id,
                    "max_count": count, "wait_ms": wait, "tags": tags,
                    "start": start if source == subject else "earliest"}

        self._turn += 1
        first = self._turn % len(targets)
        targets = targets[first:] + targets[:first]
        out: list[dict[str, Any]] = []
        failures: list[QmqError] = []
        for source, broker_group, address in targets:
            room = max_count - len(out)
            if room <= 0:
                break
            try:
                answer = await self.pool.request(address, op(source, room, 0), CONTROL_TIMEOUT_MS)
            except QmqError as exc:
                if not exc.retriable:
                    raise
                log.warning("gateway pull of %s from %s (%s) failed: %s", source, broker_group,
                            address, exc)
                failures.append(exc)
                continue
            out += self._messages(answer, address, source, group, consumer_id)
        if len(failures) == len(targets):
            raise failures[-1]
        if out or wait_ms == 0:
            return out
        return await self._long_poll(targets, op, max_count, wait_ms, group, consumer_id)

    async def _targets(self, subject: str, group: str) -> list[Target]:
        targets: list[Target] = []
        for source in (subject, retry_subject(subject, group)):
            try:
                route = await self.routes.get(source, "consumer")
            except NoRoute:
                if source == subject:
                    raise
                continue  # no retries routed yet
            targets += [(source, g.group, g.addresses[0]) for g in route.groups]
        if not targets:
            raise NoRoute(f"no live realtime broker group serves subject {subject!r}")
        return targets

    async def _long_poll(self, targets: list[Target], op: Any, max_count: int, wait_ms: int,
                         group: str, consumer_id: str) -> list[dict[str, Any]]:
        timeout_ms = wait_ms + CONTROL_TIMEOUT_MS
        if len(targets) == 1:
            source, _, address = targets[0]
            answer = await self.pool.request(address, op(source, max_count, wait_ms),
                                             timeout_ms)
            return self._messages(answer, address, source, group, consumer_id)
        pool = self.pool
        connections: list[Connection] = []

        async def wait_on(target: Target) -> tuple[Target, dict[str, Any]]:
            source, _, address = target
            conn = await Connection.open(address, client_id=pool.client_id, app=pool.app,
                                         token=pool.token, ssl_context=self.ssl_context)
            connections.append(conn)
            return target, await conn.request(op(source, max_count, wait_ms), timeout_ms)

        tasks = [asyncio.create_task(wait_on(t)) for t in targets]
        out: list[dict[str, Any]] = []
        errors: list[BaseException] = []
        try:
            pending: set[asyncio.Task[Any]] = set(tasks)
            while pending and not out:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        errors.append(task.exception())  # type: ignore[arg-type]
                        continue
                    (source, _, address), answer = task.result()
                    out += self._messages(answer, address, source, group, consumer_id)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # A long poll whose connection closes takes nothing for it (docs/PROTOCOL.md).
            await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)
        if not out and len(errors) == len(targets) and isinstance(errors[-1], QmqError):
            raise errors[-1]
        return out

    def _messages(self, answer: dict[str, Any], address: str, source: str, group: str,
                  consumer_id: str) -> list[dict[str, Any]]:
        """The JSON of a pull answer's messages. One that cannot be read is logged and left
        unacked (the broker hands it out again), as the SDK does."""
        pull_seqs, payloads, redelivered = pull_columns(answer)
        out = []
        for pull_seq, payload, times in zip(pull_seqs, payloads, redelivered):
            try:
                message = decode_message(payload)
            except QmqError as exc:
                log.error("broker %s sent an unreadable message of %s (pull seq %d): %s",
                          address, source, pull_seq, exc.message)
                continue
            receipt = codec.make_receipt(address, source, group, consumer_id, pull_seq)
            out.append(codec.pulled_json(message, receipt, times))
        return out

    async def _heartbeat(self, consumer_id: str, group: str, subject: str) -> None:
        """Tell the registry an HTTP consumer is online (the console counts it), at most every
        third of the client expiry per (consumer, group, subject)."""
        key = (consumer_id, group, subject)
        now = time.monotonic()
        last = self._heartbeats.get(key)
        if last is not None and now - last < self.registry.config.client_expiry_ms / 3000:
            return
        if len(self._heartbeats) >= HEARTBEATS_REMEMBERED_MAX:
            self._heartbeats.clear()
        self._heartbeats[key] = now
        await self.registry.client_heartbeat(consumer_id, self.pool.app, group,
                                             [subject, retry_subject(subject, group)],
                                             "consumer")

    async def ack(self, receipts: list[codec.Receipt]) -> int:
        """Ack the receipts' messages; how many became acked."""
        answers = await self._per_broker(receipts, "ack", lambda seqs: {
            "ranges": seqs_to_ranges(seqs)})
        return sum(int(a.get("acked", 0)) for a in answers)

    async def nack(self, receipts: list[codec.Receipt], retry_after_ms: int | None) -> int:
        """Nack the receipts' messages (a retry after ``retry_after_ms`` or the group's
        backoff); how many were handed back."""
        answers = await self._per_broker(receipts, "nack", lambda seqs: {
            "pull_seqs": sorted(set(seqs)), "retry_after_ms": retry_after_ms})
        return sum(int(a.get("nacked", 0)) for a in answers)

    async def _per_broker(self, receipts: list[codec.Receipt], name: str,
                          fields: Any) -> list[dict[str, Any]]:
        by_key: dict[tuple[str, str, str, str], list[int]] = {}
        for r in receipts:
            by_key.setdefault((r.address, r.source, r.group, r.consumer_id), []).append(
                r.pull_seq)
        for address, source, _, _ in by_key:
            await self._check_broker(address, source)
        return list(await asyncio.gather(*(
            self.pool.request(address, {"op": name, "subject": source, "group": group,
                                        "consumer_id": consumer, **fields(seqs)},
                              CONTROL_TIMEOUT_MS)
            for (address, source, group, consumer), seqs in by_key.items())))

    async def _check_broker(self, address: str, source: str) -> None:
        """NotFound unless ``address`` serves ``source`` now (refreshing the route once)."""
        for refresh in (False, True):
            try:
                route = await (self.routes.refresh if refresh else self.routes.get)(
                    source, "consumer")
            except NoRoute:
                route = None
            if route is not None and any(address in g.addresses for g in route.groups):
                return
        raise NotFound(f"broker {address} does not serve subject {source!r} now; messages "
                       "pulled from it come back to the group after its ack timeout")

