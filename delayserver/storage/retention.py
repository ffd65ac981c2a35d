"""Retention below the done watermark: bucket files and delay-log segments.

Called by ``DelayStore.mark_done_before`` only after a checkpoint holding the new watermark is
durable, so a crash halfway leaves files that recovery deletes (every file of a bucket below the
persisted watermark), never a watermark that is behind what was deleted.
"""

from __future__ import annotations

import logging
import os

from delayserver.storage.layout import DAY_MS, Layout, parse_bucket_file_name
from logstore import SegmentedLog, fsync_directory

log = logging.getLogger(__name__)


def retire_bucket_files(layout: Layout, done_before_ms: int) -> set[int]:
    """Delete the ``.sched``, ``.dispatched`` and ``.cancelled`` files of every bucket below
    ``done_before_ms`` and the day directories left empty; returns the buckets retired."""
    last_day = (done_before_ms - 1) // DAY_MS
    retired: set[int] = set()
    for day in layout.list_days():
        if day > last_day:
            break
        directory = layout.day_dir(day)
        names = os.listdir(directory)
        removed = 0
        for name in names:
            parsed = parse_bucket_file_name(name)
            if parsed is not None and parsed[0] < done_before_ms:
                os.unlink(os.path.join(directory, name))
                retired.add(parsed[0])
                removed += 1
        if removed == len(names):
            os.rmdir(directory)
        elif removed:
            fsync_directory(directory)
    if retired:
        fsync_directory(layout.schedule_dir)
        log.info("delay store: retired %d bucket(s) below %d", len(retired), done_before_ms)
    return retired


def delete_done_segments(delay_log: SegmentedLog, chunk_max_bucket: dict[int, int],
                         chunk_size_bytes: int, done_before_ms: int) -> int:
    """Delete the leading delay-log segments (never the active one) whose records were all filed
    in buckets below ``done_before_ms``; returns how many.

    ``chunk_max_bucket`` holds, per chunk of ``chunk_size_bytes`` bytes, the highest bucket of any
    record starting in it. A segment goes when every chunk it overlaps is below the watermark:
    conservative, since a chunk shared with a younger segment keeps the older one. Every bucket
    below the watermark is fully dispatched or cancelled, so so is every record deleted."""
    size = chunk_size_bytes
    cut = None
    for segment in delay_log.segments()[:-1]:
        if segment.end_offset > segment.base_offset:
            chunks = range(segment.base_offset // size, (segment.end_offset - 1) // size + 1)
            if max(chunk_max_bucket.get(c, -1) for c in chunks) >= done_before_ms:
                break
        cut = segment.end_offset
    if cut is None:
        return 0
    deleted = delay_log.delete_segments_before(cut)
    first = delay_log.first_offset
    for chunk in [c for c in chunk_max_bucket if (c + 1) * size <= first]:
        del chunk_max_bucket[chunk]
    return len(deleted)
