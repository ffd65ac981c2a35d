"""A Producer's ``cancel`` of a delayed message by its receipt, at the delay group that holds
it, resent on a retriable failure by the producer's ``RetryPolicy`` as a send is.
A mixin of ``Producer``, which owns every field used here (event loop only)."""

from __future__ import annotations

import asyncio
import logging
from time import monotonic
from typing import Any

from wire.errors import BadRequest, NoRoute, QmqError
from sdk.connection import ConnectionPool
from sdk.retry_policy import RetryPolicy
from sdk.routes import RouteCache
from sdk.send_batch import Receipt

# The producer's logger: cancel is the producer's method, so its warnings stay under one name.
log = logging.getLogger("sdk.producer")


class CancellingMixin:
    """``cancel`` and its one try at a group (``_cancel_at_group``)."""

    send_timeout_ms: int
    _retry: RetryPolicy
    _delay_routes: RouteCache
    _pool: ConnectionPool

    async def cancel(self, receipt: Receipt) -> str:
        """Cancel a delayed message by its receipt, at the delay group that holds it.

        Returns "cancelled" (it will never be delivered), "already_dispatched" (too late: it was
        or is being delivered), "already_cancelled", "already_past" (too late: the delay group
        has finished with that due time, so the message was delivered, or cancelled earlier),
        or "unknown" (that delay group does not know it). BadRequest for the receipt of a
        message that was not delayed. A retriable failure (``not_master`` while the delay group
        fails over, a lost connection, no answer) is tried again with the route asked afresh,
        as a send is (3 times, then while ``retry_budget_ms`` lasts, or ``retries_max`` times);
        a cancel whose answer was lost then says "already_cancelled".
        """
        if receipt.deliver_at_ms is None:
            raise BadRequest(f"message {receipt.message_id} was not delayed; only delayed "
                             "messages can be cancelled")
        op = {"op": "cancel", "ids": [receipt.message_id],
              "deliver_at_ms": [receipt.deliver_at_ms]}
        attempt = 0
        failed_at: float | None = None
        while True:
            try:
                return await self._cancel_at_group(receipt, op, refresh=attempt > 0)
            except QmqError as exc:
                # A failover of the delay group (not_master), a lost connection or no answer:
                # the route is asked again and the cancel resent, as a send is. A cancel whose
                # answer was lost then answers already_cancelled.
                if not exc.retriable:
                    raise
                attempt += 1
                failed_at = monotonic() if failed_at is None else failed_at
                pause_ms = self._retry.pause_ms(attempt, (monotonic() - failed_at) * 1000)
                if pause_ms is None:
                    raise
                log.warning("cancel of %s at %s failed (%s: %s); asking the route again, "
                            "attempt %d%s", receipt.message_id, receipt.broker_group,
                            exc.code, exc.message, attempt + 1, self._retry.attempts_said())
            if pause_ms:
                await asyncio.sleep(pause_ms / 1000)

    async def _cancel_at_group(self, receipt: Receipt, op: dict[str, Any], *,
                               refresh: bool) -> str:
        """One try of ``cancel``: the delay group's address from the route, then the op."""
        routes = self._delay_routes
        route = await (routes.refresh if refresh else routes.get)(receipt.subject, "producer")
        group = route.group(receipt.broker_group)
        if (group is None or not group.addresses) and not refresh:
            route = await routes.refresh(receipt.subject, "producer")
            group = route.group(receipt.broker_group)
        if group is None or not group.addresses:
            raise NoRoute(f"delay group {receipt.broker_group} holding message "
                          f"{receipt.message_id} is not reachable now; try again")
        answer = await self._pool.request(group.addresses[0], op, self.send_timeout_ms)
        return str(answer["results"][0]["status"])
