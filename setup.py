"""Build hook for the optional C extensions; every other setting is in pyproject.toml.

``logstore._framing`` frames log records in C (see logstore/_framing.c); ``serverkit._send_check``
is the servers' quick check of sent payloads over a batch (see serverkit/_send_check.c);
``realtime.storage._codecs`` encodes a commit's message records and consumer-log entries, and
the visible-message records of held messages falling due (see realtime/storage/_codecs.c);
``delayserver._due_records`` checks and parses the delay-log records of due messages (see
delayserver/_due_records.c); ``delayserver._commit_codecs`` encodes the delay store's commit
(delay-log records and schedule entries, see delayserver/_commit_codecs.c). The four that
compute CRC-32 call
zlib's, so they link zlib (``-lz``; the header is Debian's zlib1g-dev).

All are optional: when no C compiler (or zlib header) is present the build goes on without them
and the pure-Python twins (logstore.record, serverkit.send_check,
realtime.storage.message_record, consumer_log and control_record,
delayserver.storage.due_records, delay_record and schedule_entry) do the work;
``logstore.twins`` chooses, and ``QMQ_NO_EXTENSIONS=1`` forces the Python twins. ``.ci/run``
fails when one of these did not build (README, "C extensions").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("logstore._framing", sources=["logstore/_framing.c"], libraries=["z"],
                  depends=["logstore/_framing.h"],
                  optional=True),
        Extension("serverkit._send_check", sources=["serverkit/_send_check.c"], optional=True),
        Extension("serverkit._call_queue", sources=["serverkit/_call_queue.c"], optional=True),
        Extension("realtime.storage._codecs", sources=["realtime/storage/_codecs.c"],
                  libraries=["z"],
                  depends=["logstore/_framing.h", "realtime/storage/_run_codec.h"], optional=True),
        Extension("delayserver._due_records", sources=["delayserver/_due_records.c"],
                  libraries=["z"], optional=True),
        Extension("delayserver._commit_codecs", sources=["delayserver/_commit_codecs.c"],
                  libraries=["z"], depends=["logstore/_framing.h"], optional=True),
    ],
)
