"""The delay server: holds delayed messages until their time, then hands them to realtime brokers.

- ``delayserver.storage``: the delay log, the schedule log split into time buckets, each
  bucket's dispatch and cancel logs, pending counts and checkpoints behind the ``DelayStore``
  facade (synchronous, no clock; docs/FORMATS.md), called on one I/O thread.
- ``window``: ``PreloadWindow``, the in-memory level (what is loaded, due, in flight, awaiting
  retry; the cap and the done limit), a pure state machine told the time; ``wheel``: the timing
  wheel it keeps due times in.
- ``scheduler``: ``Scheduler``, the async orchestration around them: the group commit of
  delayed sends, the loader that fills the window, the timer, cancel, the done watermark.
- ``dispatch``: ``Dispatcher``, the dispatch workers (with retry) and the recorder of confirmed
  dispatches; ``stats``: their lateness histogram and rate.
- ``server``: ``DelayServer``, the process (``qmq delay``); ``config``, ``metrics`` and
  ``tracing`` are its settings, Prometheus metrics and trace events.

docs/ARCHITECTURE.md has the delay path.
"""
