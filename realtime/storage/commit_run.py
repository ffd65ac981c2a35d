"""``encode_run``: the broker's usual commit encoded in one call (``MessageStore.append_commit``).

The usual group commit is one subject, every message new, no tags. For it the store needs, from
the run of ids and payloads, the message records framed as logstore records back to back (one
buffer the message log writes as it is) and the consumer-log entries of those records (written
right after the fsync, in the same call: ``SegmentedLog.append_framed_durably``).
``encode_run`` makes both at once, and checks the run as ``WriteBatch`` does, answering None
(naming nothing) when the general path must take the run: that path words what is wrong.

The C twin (``realtime.storage._codecs.encode_run``) writes every record straight into the one
framed buffer: no bytes object per record, no second copy to frame them. The Python twin here is
the composition of the twins the general path runs: ``check_run``, ``encode_subject_records``,
``frame_records`` and ``encode_entries``; tests/unit/test_realtime_storage_commit_run.py holds
the two to the same answers.
"""

from __future__ import annotations

from itertools import accumulate, repeat
from operator import add
from typing import Sequence

from logstore.record import HEADER_SIZE_BYTES, frame_records
from logstore.twins import c_twin
from realtime.storage.config import U64_MAX
from realtime.storage.consumer_log import encode_entries
from realtime.storage.message_record import encode_subject_records, record_size_bytes
from realtime.storage.write_batch import check_run

U16_MAX = 0xFFFF


def encode_run_python(timestamp_ms: int, subject: str, first_sequence: int,
                      message_ids: Sequence[str], payloads: Sequence[bytes], log_offset: int,
                      room_bytes: int, id_bytes_max: int, record_bytes_max: int,
                      ) -> tuple[bytes, bytes] | None:
    """(the framed records, their consumer-log entries) of one subject's run of new messages
    with no tags, numbered from ``first_sequence`` and written at message-log offset
    ``log_offset``; None when the general path must take the run: what ``check_run`` refuses,
    a timestamp not an int in [0, 2**64), a record of the run's longest id and longest payload
    over ``record_bytes_max`` (``WriteBatch``'s bound), or framed bytes over ``room_bytes``."""
    if (type(message_ids) is not list or type(payloads) is not list
            or type(timestamp_ms) is not int or not 0 <= timestamp_ms <= U64_MAX
            or first_sequence < 0 or log_offset < 0):
        return None
    checked = check_run(message_ids, payloads, id_bytes_max)
    if checked is None:
        return None
    ids_utf8, id_longest, payload_longest = checked
    try:
        subject_utf8 = subject.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if len(subject_utf8) > U16_MAX or record_size_bytes(
            len(subject_utf8), id_longest, payload_longest) > record_bytes_max:
        return None
    count = len(ids_utf8)
    blooms = [0] * count
    bodies = encode_subject_records(timestamp_ms, subject,
                                    list(range(first_sequence, first_sequence + count)),
                                    blooms, ids_utf8, payloads)
    sizes = list(map(len, bodies))
    if sum(sizes) + HEADER_SIZE_BYTES * count > room_bytes:
        return None
    offsets = list(accumulate(map(add, sizes, repeat(HEADER_SIZE_BYTES)), initial=log_offset))
    offsets.pop()
    return frame_records(bodies), encode_entries([timestamp_ms] * count, offsets, sizes, blooms)


# The C twin (realtime/storage/_codecs.c); optional, chosen by logstore.twins. One call either
# way: the store's commit calls ``encode_run`` with no wrapper in between.
encode_run = c_twin("realtime.storage._codecs", "encode_run") or encode_run_python

__all__ = ["encode_run", "encode_run_python"]
