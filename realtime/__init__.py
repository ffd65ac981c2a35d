"""The realtime broker: stores messages per subject and serves them to consumer groups.

- ``realtime.storage``: the message log (all subjects), a consumer log per subject, the dedup
  index and the ``MessageStore`` facade over them (synchronous, no clock; docs/FORMATS.md).
- ``broker``: ``Broker``, the group commit of sends, long-polled pulls from the in-memory tail
  (``tail``) or the store, acks, ack timeout, consumer expiry and retention.
- ``nacks`` and ``retries``: a nacked message's retry copy, handed to a delay server, and its
  dead letter after ``retries_max``; ``admin``: the dead-letter admin ops.
- ``server``: ``RealtimeServer``, the process (``qmq realtime``) around the broker; ``config``,
  ``metrics`` and ``tracing`` are its settings, Prometheus metrics and trace events.

docs/ARCHITECTURE.md has the send and pull paths.
"""
