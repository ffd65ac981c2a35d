"""Forwarding already-encoded message payloads to the brokers of a subject, with failover.

The servers use this among themselves: the delay server dispatches due messages to the
subject's realtime brokers, and a realtime broker hands nacked messages to a delay server. The
payload bytes are sent verbatim (never re-encoded), so a resend after a failure carries the same
message id and the receiving broker's de-duplication makes it harmless.
"""

from __future__ import annotations

import logging
import ssl
from typing import Any

from sdk.connection import ConnectionPool
from wire.errors import ConnectionLost, NoRoute, QmqError, error_from_wire
from wire.limits import MAX_SEND_BATCH_MESSAGES
from sdk.routes import RouteCache

log = logging.getLogger(__name__)

SEND_TIMEOUT_MS_DEFAULT = 5_000


class PayloadSender:
    """Sends payload batches for a subject to the live brokers of ``kind`` the MetaServer names."""

    def __init__(
        self,
        meta_url: str,
        *,
        kind: str,
        client_id: str,
        app: str = "qmq-internal",
        token: str | None = None,
        send_timeout_ms: int = SEND_TIMEOUT_MS_DEFAULT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.kind = kind
        self.send_timeout_ms = send_timeout_ms
        # ``token`` (an admin token when auth is on) opens both the MetaServer and the brokers.
        self.routes = RouteCache(meta_url, kind=kind, token=token, ssl_context=ssl_context)
        self.pool = ConnectionPool(client_id=client_id, app=app, token=token,
                                   ssl_context=ssl_context)
        self._next = 0

    async def send(self, subject: str, payloads: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
        """Send ``payloads`` (all of ``subject``) and return (broker group, per-payload results).

        Tries each group of the route in turn on a retriable failure, refreshing the route once;
        raises the last error when none accepted the batch. A per-payload error is returned in its
        result, not raised.
        """
        if not payloads:
            return "", []
        last_error: QmqError = NoRoute(f"no {self.kind} broker for subject {subject!r}")
        for attempt in range(2):
            route = await (self.routes.refresh(subject, "producer") if attempt
                           else self.routes.get(subject, "producer"))
            groups = [g for g in route.groups if g.addresses]
            if not groups:
                continue
            self._next += 1
            # Every address of every group: a group's list can still hold a broker that died
            # (kill -9) beside its restarted replacement until the MetaServer expires it.
            first = self._next % len(groups)
            rotated = groups[first:] + groups[:first]
            targets = [(group, address) for group in rotated for address in group.addresses]
            for group, address in targets:
                try:
                    results: list[dict[str, Any]] = []
                    for start in range(0, len(payloads), MAX_SEND_BATCH_MESSAGES):
                        chunk = payloads[start:start + MAX_SEND_BATCH_MESSAGES]
                        answer = await self.pool.request(
                            address, {"op": "send", "messages": chunk}, self.send_timeout_ms
                        )
                        results.extend(answer.get("results", []))
                    if _all_retriable_failures(results):
                        error = results[0]["error"]
                        raise error_from_wire(error["code"], error["message"])
                    return group.group, results
                except QmqError as exc:
                    if not exc.retriable:
                        raise
                    log.info("%s broker %s (%s) refused a batch of %s, trying another: %s",
                             self.kind, group.group, address, subject, exc)
                    last_error = exc
                    if isinstance(exc, ConnectionLost):
                        await self.pool.discard(address)
        raise last_error

    async def close(self) -> None:
        """Close connections and the route cache's HTTP session."""
        await self.pool.close()
        await self.routes.close()


def _all_retriable_failures(results: list[dict[str, Any]]) -> bool:
    """True when every result is an error with a retriable code (try another broker)."""
    if not results:
        return False
    for result in results:
        error = result.get("error")
        if not error or not error_from_wire(error.get("code", ""), "").retriable:
            return False
    return True
