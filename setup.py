"""Build hook for the optional C extensions; every other setting is in pyproject.toml.

``logstore._framing`` frames log records in C (see logstore/_framing.c); ``serverkit._send_check``
is the servers' quick check of sent payloads over a batch (see serverkit/_send_check.c);
``realtime.storage._codecs`` encodes a commit's message records and consumer-log entries (see
realtime/storage/_codecs.c); ``delayserver._due_records`` checks and parses the delay-log
records of due messages (see delayserver/_due_records.c; links zlib for CRC-32). All are
optional: when no C compiler (or zlib header) is present the build goes on without them and the
pure-Python twins (logstore.record, serverkit.send_check, realtime.storage.message_record and
consumer_log, delayserver.storage.due_records) do the work.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("logstore._framing", sources=["logstore/_framing.c"], optional=True),
        Extension("serverkit._send_check", sources=["serverkit/_send_check.c"], optional=True),
        Extension("realtime.storage._codecs", sources=["realtime/storage/_codecs.c"],
                  optional=True),
        Extension("delayserver._due_records", sources=["delayserver/_due_records.c"],
                  libraries=["z"], optional=True),
    ],
)
