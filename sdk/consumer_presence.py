"""A consumer's presence at its brokers: heartbeats to the brokers it pulls from (only for pairs
not pulled lately), and the leave at close; the ``BrokerPresenceMixin`` part of
``sdk.consumer.Consumer`` (split from it). The MetaServer's side of presence is ``sdk.presence``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from sdk.connection import ConnectionPool
from sdk.presence import Presence
from sdk.received import Subscription
from wire.errors import Forbidden, QmqError

log = logging.getLogger("sdk.consumer")  # the consumer's logger: these lines are its own

# Longest wait for an ack, nack or heartbeat answer, in milliseconds.
CONTROL_TIMEOUT_MS = 5_000


class BrokerPresenceMixin:
    """Heartbeats and the leave of ``Consumer``, which sets these fields (event loop)."""

    group: str
    app: str
    consumer_id: str
    heartbeat_interval_ms: int
    _pool: ConnectionPool
    _presence: Presence | None
    _subscriptions: dict[str, Subscription]

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._broker_heartbeat()
            await asyncio.sleep(self.heartbeat_interval_ms / 1000)

    def _pairs_by_address(self, unpulled_for_s: float | None = None,
                          ) -> dict[str, list[list[str]]]:
        """The [subject, group] pairs this consumer pulls from each broker address; with
        ``unpulled_for_s``, only those whose last pull was sent longer ago than that."""
        by_address: dict[str, list[list[str]]] = {}
        now = asyncio.get_running_loop().time()
        for sub in self._subscriptions.values():
            for (source, group), address in sub.addresses.items():
                if unpulled_for_s is not None and ((source, group) in sub.pulls_out
                                                   or now - sub.pull_sent_at.get(
                                                       (source, group), float("-inf"))
                                                   < unpulled_for_s):
                    continue  # its pull told the broker we are alive (or is out now)
                pair = [source, self.group]
                pairs = by_address.setdefault(address, [])
                if pair not in pairs:
                    pairs.append(pair)
        return by_address

    async def _to_brokers(self, op: str, by_address: dict[str, list[list[str]]]) -> None:
        """Send a heartbeat or leave to each broker; a failure is logged as a warning (the
        next heartbeat or pull tries again; without a leave the broker hands the consumer's
        messages on when it expires)."""
        async def to_broker(address: str, subscriptions: list[list[str]]) -> None:
            request = {"op": op, "consumer_id": self.consumer_id, "subscriptions": subscriptions}
            try:
                await self._pool.request(address, request, CONTROL_TIMEOUT_MS)
            except Forbidden as exc:  # the pulls were refused too (and said so): nothing held
                log.debug("%s to broker %s refused: %s", op, address, exc)
            except QmqError as exc:
                log.warning("%s to broker %s failed: %s", op, address, exc)

        await asyncio.gather(*(to_broker(a, s) for a, s in by_address.items()))

    async def _leave(self) -> None:
        """Tell every broker we pulled from that this consumer is gone, so what it still holds
        (prefetched, never handed out, or not acked) goes to the group's others at once, and
        the MetaServer (in the process's shared heartbeat, sdk.presence), so it no longer
        counts as online. A failure is a warning."""
        presence, self._presence = self._presence, None
        await asyncio.gather(presence.leave(self.consumer_id) if presence is not None
                             else asyncio.sleep(0),
                             self._to_brokers("leave", self._pairs_by_address()))

    def _heartbeat_fields(self) -> dict[str, Any]:
        """What this consumer's heartbeat tells the MetaServer."""
        return {"client_id": self.consumer_id, "app": self.app, "group": self.group,
                "subjects": sorted(self._subscriptions), "role": "consumer"}

    async def heartbeat(self) -> None:
        """Tell each broker we pull from, and the MetaServer, that this consumer is alive.
        Failures are logged as warnings: the next heartbeat (or pull) tries again. The
        MetaServer hears it in the shared heartbeat of the process's consumers
        (sdk.presence), which runs on its own every ``heartbeat_interval_ms``."""
        await asyncio.gather(
            self._presence.beat_now() if self._presence is not None else asyncio.sleep(0),
            self._broker_heartbeat())

    async def _broker_heartbeat(self) -> None:
        """The brokers' part of ``heartbeat`` (the MetaServer's runs in sdk.presence). A broker
        notes a consumer as seen whenever one of its pulls begins: pairs pulled within the
        interval need no heartbeat (an idle consumer parked in long polls sends its brokers
        none; issue 19)."""
        recent_s = self.heartbeat_interval_ms / 1000
        await self._to_brokers("heartbeat", self._pairs_by_address(unpulled_for_s=recent_s))
