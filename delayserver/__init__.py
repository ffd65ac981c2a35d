"""The delay server: holds delayed messages until their time, then hands them to realtime brokers.

- ``delayserver.storage``: the delay log, the schedule log split into time buckets, each
  bucket's dispatch and cancel logs, pending counts and checkpoints behind the ``DelayStore``
  facade (synchronous, no clock; docs/FORMATS.md).
- ``wheel``: the timing wheel of the preload window, told the time.
- ``scheduler``: ``Scheduler``, the group commit of delayed sends, the preload window, dispatch
  with retry, cancel and the done watermark; ``stats``: pending counts for the MetaServer.
- ``server``: ``DelayServer``, the process (``qmq delay``); ``config``, ``metrics`` and
  ``tracing`` are its settings, Prometheus metrics and trace events.

docs/ARCHITECTURE.md has the delay path.
"""
