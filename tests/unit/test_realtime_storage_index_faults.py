"""MessageStore: a batch whose message-log write succeeded but whose consumer-log entries could
not be written (a full disk, an I/O error) leaves nothing behind, on a master's commit and on a
slave's copy (review s14 rvc-1, rvc-2)."""

from __future__ import annotations

import errno
import glob
import os

import pytest

from logstore import DiskFull, LogWriteFailed
from logstore import fileio
from logstore.fileio import OsFile
from realtime.storage import MessageStore, StoreConfig
from realtime.storage.message_record import encode_message_record
from tests.twins import built_twin
from tests.unit.test_realtime_storage_store import T0, TINY, payload_of


class ClogFull:
    """An opener whose consumer-log files find the disk full while ``full`` is set."""

    def __init__(self) -> None:
        self.full = False

    def opener(self, path: str):
        outer = self
        inner = OsFile(path)

        class Handle:
            def append(self, data):
                if outer.full and "/consumerlog/" in path:
                    raise OSError(errno.ENOSPC, "injected: no space left on device", path)
                inner.append(data)

            def __getattr__(self, name):
                return getattr(inner, name)

        return Handle()


class ClogEio:
    def __init__(self) -> None:
        self.fail = False

    def opener(self, path: str):
        outer, inner = self, OsFile(path)

        class Handle:
            def append(self, data):
                if outer.fail and "/consumerlog/" in path:
                    raise OSError(errno.EIO, "injected EIO", path)
                inner.append(data)

            def __getattr__(self, name):
                return getattr(inner, name)

        return Handle()


def _refused_commit(tmp_path):
    disk = ClogFull()
    master = MessageStore(str(tmp_path / "m"), TINY, opener=disk.opener, now_ms=T0)
    for i in range(3):
        master.append("s", f"old{i}", [1], T0, payload_of("s", i))
    master.commit()
    start = master.copy_bounds()[1]
    disk.full = True
    for i in range(3):
        master.append("s", f"new{i}", [1], T0, b"refused")
    with pytest.raises(DiskFull):
        master.commit()
    disk.full = False
    return master, start


def test_a_commit_refused_for_a_full_disk_on_its_consumer_log_leaves_nothing_in_the_message_log(
        tmp_path):
    master, start = _refused_commit(tmp_path)
    try:
        assert master.copy_bounds()[1] == start, "the refused batch stays in the message log"
    finally:
        master.close()


def test_a_slave_copies_past_a_commit_refused_on_its_consumer_log(tmp_path):
    master, _ = _refused_commit(tmp_path)
    slave = MessageStore(str(tmp_path / "s"), TINY, now_ms=T0)
    master.append("s", "new0", [1], T0, b"retry")  # the producer's resend: sequence 3
    master.commit()
    offset, end = slave.copy_bounds()[1], master.copy_bounds()[1]
    while offset < end:  # as a slave's fetches copy it
        offset = slave.append_copy(offset, master.read_copy(offset, 1 << 20))
    assert slave.read("s", 3).payload == b"retry"
    assert slave.end_sequence("s") == master.end_sequence("s") == 4
    master.close()
    slave.close()


def test_a_restart_after_a_commit_refused_on_its_consumer_log_does_not_deliver_it(tmp_path):
    master, _ = _refused_commit(tmp_path)
    master.close()
    reopened = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    try:
        assert reopened.end_sequence("s") == 3, "the refused messages reappear after a restart"
    finally:
        reopened.close()


def test_a_consumer_log_write_failure_makes_the_store_refuse_writes_until_reopened(tmp_path):
    disk = ClogEio()
    store = MessageStore(str(tmp_path / "m"), TINY, opener=disk.opener, now_ms=T0)
    store.append("s", "a", [1], T0, b"a")
    store.commit()
    disk.fail = True
    store.append("s", "b", [1], T0, b"b")
    with pytest.raises(LogWriteFailed):
        store.commit()
    disk.fail = False
    try:
        with pytest.raises(LogWriteFailed):
            store.append("s", "c", [1], T0, b"c")
            store.commit()
    finally:
        store.close()


def _copy_all(master, slave, disk):
    offset, end = slave.copy_bounds()[1], master.copy_bounds()[1]
    while offset < end:
        data = master.read_copy(offset, 1 << 20)
        try:
            offset = slave.append_copy(offset, data)
        except DiskFull:
            disk.full = False  # space returns; the follower fetches again from its log's end
            offset = slave.copy_bounds()[1]


def test_a_slave_whose_consumer_log_finds_the_disk_full_keeps_every_copied_message_readable(
        tmp_path):
    master = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    disk = ClogFull()
    slave = MessageStore(str(tmp_path / "s"), TINY, opener=disk.opener, now_ms=T0)
    for i in range(3):
        master.append("s", f"a{i}", [1], T0, b"a%d" % i)
    master.commit()
    _copy_all(master, slave, disk)
    for i in range(3):
        master.append("s", f"b{i}", [1], T0, b"b%d" % i)
    master.commit()
    disk.full = True
    _copy_all(master, slave, disk)  # the first try of the chunk fails on the consumer log
    for i in range(3):
        master.append("s", f"c{i}", [1], T0, b"c%d" % i)
    master.commit()
    _copy_all(master, slave, disk)
    assert slave.end_sequence("s") == master.end_sequence("s") == 9
    try:
        assert [slave.read("s", n).payload for n in range(9)] == \
            [master.read("s", n).payload for n in range(9)]
    finally:
        master.close()
        slave.close()


def test_the_masters_recovery_lets_a_later_batch_win_over_a_dropped_batchs_leftover_records(
        tmp_path):
    # Recovery step 4 (docs/FORMATS.md): records of a dropped batch left in the message log
    # (a failed write's, or a crash between a full disk and the cut back) whose sequences a
    # later batch reused: the later record wins. Planted by hand, as nothing else leaves them.
    store = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    for i in range(3):
        store.append("s", f"old{i}", [1], T0, payload_of("s", i))
    store.commit()
    store._message_log.append_durably([encode_message_record(T0, 3 + i, 0, "s", f"lost{i}",
                                                             b"dropped") for i in range(3)])
    store.append("s", "new0", [1], T0, b"retry")  # sequence 3 again
    store.commit()
    store.close()
    for path in glob.glob(os.path.join(str(tmp_path / "m"), "checkpoint", "*.ckpt")):
        os.unlink(path)
    reopened = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    try:
        assert reopened.end_sequence("s") == 4
        assert reopened.read("s", 3).payload == b"retry"
        assert not reopened.append("s", "lost1", [1], T0, b"").duplicate
    finally:
        reopened.close()


class ClogFullCutFails(ClogFull):
    """``ClogFull`` under which the message log's cut back fails too (EIO on truncate)."""

    def opener(self, path: str):
        handle, outer = super().opener(path), self

        class Handle:
            def truncate(self, size):
                if outer.full and "/consumerlog/" not in path:
                    raise OSError(errno.EIO, "injected EIO on truncate", path)
                handle.truncate(size)

            def __getattr__(self, name):
                return getattr(handle, name)

        return Handle()


def test_a_cut_back_that_fails_makes_the_store_refuse_writes_naming_the_log_and_why(tmp_path):
    # review s14 rvc: the cut of a refused batch failing leaves its records in the message log;
    # the store must refuse every later commit until reopened (docs/FORMATS.md), and say where.
    disk = ClogFullCutFails()
    store = MessageStore(str(tmp_path / "m"), TINY, opener=disk.opener, now_ms=T0)
    try:
        store.append("s", "a", [1], T0, b"a")
        store.commit()
        disk.full = True
        store.append("s", "b", [1], T0, b"b")
        with pytest.raises(DiskFull):
            store.commit()
        disk.full = False
        with pytest.raises(LogWriteFailed) as refused:
            store.append("s", "c", [1], T0, b"c")
            store.commit()
        message = str(refused.value)
        assert "cut back to offset 43 of segment 00000000000000000000.log after a failed " \
            "write failed on" in message and "injected EIO on truncate" in message
        assert refused.value.path == str(tmp_path / "m" / "messagelog"), message
    finally:
        store.close()


class WriteSyncSpy:
    """Around the C ``write_sync``: the extra arguments of each call (3 when the call also wrote
    consumer-log entries), and ``then_errno`` returned for that write, instead of doing it."""

    def __init__(self, real) -> None:
        self.real = real
        self.then_counts: list[int] = []
        self.then_errno = 0

    def __call__(self, fd, data, offset, *then):
        self.then_counts.append(len(then))
        if then and self.then_errno:
            return (*self.real(fd, data, offset), 0, self.then_errno)
        return self.real(fd, data, offset, *then)


@pytest.fixture
def write_sync(monkeypatch):
    """The C write_sync, spied on, as the store's: even under QMQ_NO_EXTENSIONS (CI's second
    pass), so these tests run in both passes; ``tests.twins --check-built`` keeps it built."""
    built = built_twin("logstore._framing", "write_sync")
    if built is None:
        pytest.skip("the C twin write_sync was not built")
    spy = WriteSyncSpy(built)
    monkeypatch.setattr(fileio, "_write_sync_c", spy)
    return spy


def _commit_three(store, prefix):
    for i in range(3):
        store.append("s", f"{prefix}{i}", [1], T0, b"%s%d" % (prefix.encode(), i))
    return store.commit()


def test_a_usual_commit_writes_its_entries_in_the_call_that_writes_and_fsyncs_its_records(
        tmp_path, write_sync):
    store = MessageStore(str(tmp_path / "m"), StoreConfig(), now_ms=T0)
    _commit_three(store, "a")  # a new subject: its consumer log's first file opens after
    _commit_three(store, "b")
    assert write_sync.then_counts == [0, 3]
    store.close()
    reopened = MessageStore(str(tmp_path / "m"), StoreConfig(), now_ms=T0)
    try:
        assert [reopened.read("s", n).payload for n in range(6)] == [
            b"a0", b"a1", b"a2", b"b0", b"b1", b"b2"]
        assert not reopened.recovery.subjects, "recovery had to mend the consumer log"
    finally:
        reopened.close()


@pytest.mark.parametrize("then_errno, refused", [(errno.ENOSPC, DiskFull),
                                                 (errno.EIO, LogWriteFailed)])
def test_entries_the_one_call_fails_to_write_after_the_fsync_leave_nothing_of_their_batch(
        tmp_path, write_sync, then_errno, refused):
    store = MessageStore(str(tmp_path / "m"), StoreConfig(), now_ms=T0)
    _commit_three(store, "a")
    start = store.copy_bounds()[1]
    write_sync.then_errno = then_errno
    with pytest.raises(refused):
        _commit_three(store, "b")
    assert write_sync.then_counts == [0, 3]
    assert store.copy_bounds()[1] == start, "the refused batch stays in the message log"
    assert store.end_sequence("s") == 3
    write_sync.then_errno = 0
    if refused is DiskFull:  # not sticky: the resend gets the sequences again
        _commit_three(store, "c")
        assert store.read("s", 3).payload == b"c0"
    else:
        with pytest.raises(LogWriteFailed):
            _commit_three(store, "c")
    store.close()
    reopened = MessageStore(str(tmp_path / "m"), StoreConfig(), now_ms=T0)
    try:
        assert reopened.end_sequence("s") == (6 if refused is DiskFull else 3)
        assert reopened.read("s", 2).payload == b"a2"
    finally:
        reopened.close()


class ClogEioCutFails(ClogEio):
    """``ClogEio`` under which the consumer log's own cut back fails too (EIO on truncate)."""

    def opener(self, path: str):
        handle, outer = super().opener(path), self

        class Handle:
            def truncate(self, size):
                if outer.fail and "/consumerlog/" in path:
                    raise OSError(errno.EIO, "injected EIO on truncate", path)
                handle.truncate(size)

            def __getattr__(self, name):
                return getattr(handle, name)

        return Handle()


@pytest.mark.parametrize("subjects", [("s",), ("s", "t")],
                         ids=["entries written by the sync", "entries written after it"])
def test_a_consumer_log_whose_cut_back_fails_makes_the_store_refuse_writes(tmp_path, subjects):
    from realtime.storage import StoreFailed

    disk = ClogEioCutFails()
    store = MessageStore(str(tmp_path / "m"), TINY, opener=disk.opener, now_ms=T0)
    try:
        for subject in subjects:
            store.append(subject, f"{subject}-a", [1], T0, b"a")
        store.commit()
        disk.fail = True
        for subject in subjects:
            store.append(subject, f"{subject}-b", [1], T0, b"b")
        with pytest.raises(StoreFailed, match="injected EIO on truncate"):
            store.commit()
        disk.fail = False
        with pytest.raises(StoreFailed):
            store.append("s", "c", [1], T0, b"c")
    finally:
        store.close()
