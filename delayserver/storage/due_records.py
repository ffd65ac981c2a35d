"""Checking and parsing the delay-log records of due messages in one pass: what dispatching
needs of each (its subject and stored payload), from the raw bytes of a run of records that
``SegmentedLog.read_runs`` read with one ``pread``.

``parse_due_run`` is the C twin (``delayserver/_due_records.c``, optional, built by setup.py);
``parse_due_run_python`` is the pure-Python one, always there and always tested against it
(tests/unit/test_due_records.py, normal and malformed input). Both answer, per record, the
(subject, payload) pair or None, with exactly the same rules:

- the logstore framing (``logstore.record``): the record lies inside ``data``, its size is at
  most ``record_size_bytes_max``, its header has the length given by the schedule entry, magic
  0x514D and version 1, and its CRC-32 over header bytes 0..3, 8..11 and the body matches;
- the delay record (``delay_record``): at least 20 bytes; ``deliver_at_ms`` and ``bucket_ms``
  equal the schedule entry's; an id of at least 1 byte whose CRC-32 is the entry's id hash; a
  subject of at least 1 byte of UTF-8; the payload is the rest of the body.

None means "not decided here": the caller reads that record alone with ``DelayStore.read``,
which raises the exact error. So a twin may only differ from ``read`` by deferring.
"""

from __future__ import annotations

import zlib
from typing import Sequence

from delayserver.storage.delay_record import FIXED, SUBJECT_LENGTH
from logstore.record import HEADER, MAGIC, VERSION, record_crc
from logstore.twins import c_twin

_ID_AT = FIXED.size  # 18
_MIN_BODY_BYTES = FIXED.size + SUBJECT_LENGTH.size  # 20


def parse_due_run_python(data: bytes | memoryview, ats: Sequence[int], sizes: Sequence[int],
                         deliver_at_ms: Sequence[int], bucket_ms: Sequence[int],
                         id_hashes: Sequence[int], record_size_bytes_max: int,
                         ) -> list[tuple[str, bytes] | None]:
    """(subject, payload) of the record at each ``ats[k]`` of ``data`` with body size
    ``sizes[k]``, checked against its schedule entry's fields; None where a check fails."""
    view = memoryview(data)
    crc32 = zlib.crc32
    header_size = HEADER.size
    out: list[tuple[str, bytes] | None] = []
    for at, size, due, bucket, hashed in zip(ats, sizes, deliver_at_ms, bucket_ms, id_hashes):
        out.append(None)
        if at < 0 or size > record_size_bytes_max or at + header_size + size > len(view):
            continue
        length, crc, magic, version, _attributes = HEADER.unpack_from(view, at)
        if length != size or magic != MAGIC or version != VERSION:
            continue
        body = view[at + header_size : at + header_size + size]
        if record_crc(view, at, body) != crc:
            continue
        if size < _MIN_BODY_BYTES:
            continue
        record_due, record_bucket, id_length = FIXED.unpack_from(body, 0)
        subject_length_at = _ID_AT + id_length
        if (record_due != due or record_bucket != bucket or id_length == 0
                or subject_length_at + SUBJECT_LENGTH.size > size):
            continue
        (subject_length,) = SUBJECT_LENGTH.unpack_from(body, subject_length_at)
        payload_at = subject_length_at + SUBJECT_LENGTH.size + subject_length
        if (subject_length == 0 or payload_at > size
                or crc32(body[_ID_AT:subject_length_at]) != hashed):
            continue
        try:
            subject = str(body[subject_length_at + SUBJECT_LENGTH.size : payload_at], "utf-8")
        except UnicodeDecodeError:
            continue
        out[-1] = (subject, body[payload_at:].tobytes())
    return out


parse_due_run = c_twin("delayserver._due_records", "parse_due_run") or parse_due_run_python
