"""``qmq.sync``: the blocking Producer and Consumer for Django, Flask and scripts (``sdk.sync``;
docs/SDK.md, "Blocking code")."""

from sdk.sync import BlockingMessage, Consumer, Producer, Subscription

__all__ = ["BlockingMessage", "Consumer", "Producer", "Subscription"]
