"""Where the delay store's files live, and the in-memory index of schedule buckets.

Directory layout (``<data_dir>/``)::

    delaylog/<20-digit base offset>.log             the delay log (logstore.SegmentedLog)
    schedule/<8-digit day index>/<20-digit bucket start ms>.sched        schedule entries
    schedule/<8-digit day index>/<20-digit bucket start ms>.dispatched   dispatch records
    schedule/<8-digit day index>/<20-digit bucket start ms>.cancelled    cancel records
    touched/<20-digit epoch>.touched                 buckets with dispatch/cancel records per epoch
    checkpoint/delaystore.<20-digit sequence>.ckpt   checkpoints (logstore.CheckpointStore)

The day index is ``bucket_ms // 86_400_000`` (UTC days since the epoch), so a day directory holds
``86_400_000 / bucket_ms`` buckets at most (1440 with 1-minute buckets) and 2 years ahead is ~730
directories.

``BucketIndex`` keeps, per day, a sorted ``array('q')`` of the bucket starts that have a schedule
file or buffered entries and a parallel array of their entry counts: 16 bytes per bucket, so one
million buckets (two years of one-minute buckets) cost 16 MB and nothing per message.
"""

from __future__ import annotations

import os
from array import array
from bisect import bisect_left, bisect_right, insort
from typing import Iterator

from delayserver.storage import done_record, schedule_entry, touched_record

DAY_MS = 86_400_000
HOUR_MS = 3_600_000
DAY_DIRECTORY_DIGITS = 8


class Layout:
    """Paths of one data directory."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        self.delaylog_dir = os.path.join(data_dir, "delaylog")
        self.schedule_dir = os.path.join(data_dir, "schedule")
        self.touched_dir = os.path.join(data_dir, "touched")
        self.checkpoint_dir = os.path.join(data_dir, "checkpoint")
        self._day_dirs: dict[int, str] = {}

    def day_dir(self, day: int) -> str:
        """The directory of day index ``day``."""
        path = self._day_dirs.get(day)
        if path is None:
            if len(self._day_dirs) > 4096:
                self._day_dirs.clear()
            path = os.path.join(self.schedule_dir, f"{day:0{DAY_DIRECTORY_DIGITS}d}")
            self._day_dirs[day] = path
        return path

    def schedule_path(self, bucket_ms: int) -> str:
        """The schedule file of a bucket."""
        return f"{self.day_dir(bucket_ms // DAY_MS)}/{bucket_ms:020d}{schedule_entry.FILE_SUFFIX}"

    def done_path(self, bucket_ms: int, kind: int) -> str:
        """The dispatch (``kind`` 1) or cancel (``kind`` 2) file of a bucket."""
        return os.path.join(self.day_dir(bucket_ms // DAY_MS),
                            f"{bucket_ms:020d}{done_record.SUFFIXES[kind]}")

    def touched_path(self, epoch: int) -> str:
        """The touched log of ``epoch``."""
        return os.path.join(self.touched_dir, touched_record.file_name(epoch))

    def list_days(self) -> list[int]:
        """Day indexes that have a directory, ascending."""
        try:
            names = os.listdir(self.schedule_dir)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in names if n.isdigit())


def parse_bucket_file_name(name: str) -> tuple[int, str] | None:
    """(bucket start, suffix) of a bucket file name, or None for anything else."""
    stem, dot, suffix = name.partition(".")
    if len(stem) != 20 or not stem.isdigit() or not dot:
        return None
    suffix = "." + suffix
    if suffix != schedule_entry.FILE_SUFFIX and suffix not in done_record.SUFFIXES.values():
        return None
    return int(stem), suffix


class BucketIndex:
    """Sorted bucket starts with their entry counts (file plus write-behind buffer), per day."""

    def __init__(self) -> None:
        self._days: list[int] = []
        self._starts: dict[int, array] = {}
        self._counts: dict[int, array] = {}
        self._last: tuple[int, array, array] | None = None  # the last day looked up

    def __len__(self) -> int:
        return sum(len(starts) for starts in self._starts.values())

    def _day_arrays(self, day: int, create: bool) -> tuple[array, array] | None:
        last = self._last
        if last is not None and last[0] == day:
            return last[1], last[2]
        starts = self._starts.get(day)
        if starts is None:
            if not create:
                return None
            starts, counts = array("q"), array("q")
            self._starts[day] = starts
            self._counts[day] = counts
            insort(self._days, day)
        counts = self._counts[day]
        self._last = (day, starts, counts)
        return starts, counts

    def count(self, bucket_ms: int) -> int:
        """Entries of the bucket (0 when it is not indexed)."""
        arrays = self._day_arrays(bucket_ms // DAY_MS, create=False)
        if arrays is None:
            return 0
        starts, counts = arrays
        i = bisect_left(starts, bucket_ms)
        if i < len(starts) and starts[i] == bucket_ms:
            return counts[i]
        return 0

    def __contains__(self, bucket_ms: int) -> bool:
        arrays = self._day_arrays(bucket_ms // DAY_MS, create=False)
        if arrays is None:
            return False
        starts = arrays[0]
        i = bisect_left(starts, bucket_ms)
        return i < len(starts) and starts[i] == bucket_ms

    def reserve(self, bucket_ms: int, entries: int = 1) -> int:
        """Add ``entries`` to the bucket (indexing it if new); returns its count before."""
        starts, counts = self._day_arrays(bucket_ms // DAY_MS, create=True)
        i = bisect_left(starts, bucket_ms)
        if i < len(starts) and starts[i] == bucket_ms:
            before = counts[i]
            counts[i] = before + entries
            return before
        starts.insert(i, bucket_ms)
        counts.insert(i, entries)
        return 0

    def set_count(self, bucket_ms: int, entries: int) -> None:
        """Set the bucket's count (indexing it if new)."""
        starts, counts = self._day_arrays(bucket_ms // DAY_MS, create=True)
        i = bisect_left(starts, bucket_ms)
        if i < len(starts) and starts[i] == bucket_ms:
            counts[i] = entries
        else:
            starts.insert(i, bucket_ms)
            counts.insert(i, entries)

    def remove(self, bucket_ms: int) -> None:
        """Forget the bucket (no-op when absent)."""
        day = bucket_ms // DAY_MS
        arrays = self._day_arrays(day, create=False)
        if arrays is None:
            return
        starts, counts = arrays
        i = bisect_left(starts, bucket_ms)
        if i < len(starts) and starts[i] == bucket_ms:
            del starts[i]
            del counts[i]
        if not starts:
            del self._starts[day]
            del self._counts[day]
            self._days.remove(day)
            self._last = None

    def buckets(self, from_bucket_ms: int, to_bucket_ms: int) -> Iterator[int]:
        """Indexed buckets in [from_bucket_ms, to_bucket_ms], ascending."""
        if to_bucket_ms < from_bucket_ms:
            return
        first_day = bisect_left(self._days, from_bucket_ms // DAY_MS)
        last_day = bisect_right(self._days, to_bucket_ms // DAY_MS)
        for day in self._days[first_day:last_day]:
            starts = self._starts[day]
            lo = bisect_left(starts, from_bucket_ms)
            hi = bisect_right(starts, to_bucket_ms)
            yield from starts[lo:hi]

    def days(self) -> list[int]:
        """Days with at least one indexed bucket, ascending."""
        return list(self._days)

    def buckets_of_day(self, day: int) -> list[int]:
        """The indexed buckets of ``day``, ascending."""
        starts = self._starts.get(day)
        return list(starts) if starts is not None else []

    def entries_per_day(self, min_bucket_ms: int = 0) -> dict[int, int]:
        """Entry totals per day, counting buckets at or after ``min_bucket_ms`` only."""
        totals = {}
        for day in self._days:
            starts, counts = self._starts[day], self._counts[day]
            lo = bisect_left(starts, min_bucket_ms)
            total = sum(counts[lo:])
            if lo < len(starts):
                totals[day] = total
        return totals
