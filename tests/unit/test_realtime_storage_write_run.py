"""The usual commit through real files in ONE call (``commit_run.write_run``: the run encoded,
written, fsynced and its consumer-log entries written, then ``SegmentedLog.framed_written``):
every fault leaves what the general path leaves, for the C twin (real descriptors that fail:
a read-only one, /dev/null's fsync, /dev/full) and for the Python twin (``os.pwrite`` and
``os.fsync``/``os.fdatasync`` failing as a full disk, EIO, a short write, a failed fsync); and the two twins
write the same bytes and answer the same."""

from __future__ import annotations

import errno
import os

import pytest

from logstore import fileio
from realtime.storage import MessageStore, commit_run
from tests.twins import built_twin
from tests.unit.test_realtime_storage_commit_run import CONFIG, LIFE, commit, files_of
from tests.unit.test_realtime_storage_store import T0

STYLES = ["general path", "one call"]


class Taken:
    """``commit_run.write_run`` (the twin given), counting the runs it wrote."""

    def __init__(self, write_run) -> None:
        self.write_run = write_run
        self.written = 0

    def __call__(self, *args):
        answer = self.write_run(*args)
        self.written += answer is not None
        return answer


def _swap_fd(handle, path: str, flags: int) -> int:
    """Point ``handle`` (an OsFile) at ``path`` opened with ``flags``; returns its own fd."""
    own = handle._fd
    handle._fd = os.open(path, flags)
    return own


def _records_file(messages: MessageStore):
    return messages._message_log.log._segments[-1].handle


def _entries_file(messages: MessageStore):
    return messages._consumer_logs["s"].handle_for(1)


# Real descriptors that fail (the C twin's faults): which file, what it is pointed at.
FD_FAULTS = {
    "records' write fails (EBADF)": (_records_file, "records", os.O_RDONLY),
    "fsync fails (EINVAL)": (_records_file, os.devnull, os.O_WRONLY),
    "records' write finds the disk full": (_records_file, "/dev/full", os.O_WRONLY),
    "entries' write fails (EBADF)": (_entries_file, "entries", os.O_RDONLY),
    "entries' write finds the disk full": (_entries_file, "/dev/full", os.O_WRONLY),
}


def _fd_outcome(tmp_path, style, fault, taken):
    """What a store shows through a commit whose descriptor fails, a next one (the
    descriptor given back), and a reopen."""
    data_dir = str(tmp_path / style)
    messages = MessageStore(data_dir, CONFIG, now_ms=T0)
    seen = [commit(messages, style, ["s"], ["a0"], [b"a0"]),
            commit(messages, style, ["s", "s"], ["b0", "b1"], [b"b0", b"b1"])]
    file_of, path, flags = fault
    handle = file_of(messages)
    if path in ("records", "entries"):
        path = handle.path  # the file itself, read-only: pwrite fails with EBADF
    own = _swap_fd(handle, path, flags)
    written_before = taken.written
    try:
        seen.append(commit(messages, style, ["s"] * 3, ["c0", "c1", "c2"], [b"c" * 100] * 3))
    except Exception as exc:  # noqa: BLE001 - the outcome compared is the error's type
        seen.append(type(exc).__name__)
    finally:
        os.close(handle._fd)
        handle._fd = own
    faulted_in_one_call = taken.written == written_before + 1
    try:
        seen.append(commit(messages, style, ["s", "s"], ["c0", "d1"], [b"d"] * 2))
    except Exception as exc:  # noqa: BLE001
        seen.append(type(exc).__name__)
    seen.append((messages.end_sequence("s"), messages.copy_bounds(), files_of(data_dir)))
    messages.close()
    reopened = MessageStore(data_dir, CONFIG, now_ms=T0 + 1)
    try:
        seen.append([(m.sequence, m.message_id, m.payload)
                     for m in reopened.scan("s", 0, 100)[0]])
    finally:
        reopened.close()
    return seen, faulted_in_one_call


@pytest.mark.parametrize("fault", list(FD_FAULTS))
def test_a_failing_descriptor_in_the_c_call_leaves_what_it_leaves_on_the_general_path(
        tmp_path, monkeypatch, fault):
    write_run_c = built_twin("realtime.storage._codecs", "write_run")
    write_sync_c = built_twin("logstore._framing", "write_sync")
    if write_run_c is None or write_sync_c is None:
        pytest.skip("the C twins are not built")
    # The general path's write through the built C write_sync too, under QMQ_NO_EXTENSIONS as
    # without it: both calls then meet the failing descriptor in C.
    monkeypatch.setattr(fileio, "_write_sync_c", write_sync_c)
    taken = Taken(write_run_c)
    monkeypatch.setattr(commit_run, "write_run", taken)
    general, _ = _fd_outcome(tmp_path, "general path", FD_FAULTS[fault], taken)
    assert taken.written == 0
    one_call, faulted_in_one_call = _fd_outcome(tmp_path, "one call", FD_FAULTS[fault], taken)
    assert faulted_in_one_call, "the faulted commit did not take the one call"
    assert isinstance(one_call[2], str), f"no error: {one_call[2]}"
    assert one_call == general


class OsFaults:
    """``os.pwrite`` and ``os.fsync``/``os.fdatasync`` of the store's files failing as a disk does: the Nth
    pwrite failing (``errno``), or writing half its bytes and the next one failing with EIO
    (a short write), a disk with ``capacity`` bytes left (ENOSPC past it), the Nth fsync
    failing with EIO."""

    def __init__(self) -> None:
        self.pwrites = self.fsyncs = 0
        self.fail_pwrite_at: int | None = None
        self.errno = errno.EIO
        self.short_pwrite_at: int | None = None
        self.capacity: int | None = None
        self.fail_fsync_at: int | None = None

    def clear(self) -> None:
        self.fail_pwrite_at = self.short_pwrite_at = self.capacity = None
        self.fail_fsync_at = None

    def pwrite(self, fd, data, offset):
        self.pwrites += 1
        if self.pwrites == self.fail_pwrite_at:
            raise OSError(self.errno, os.strerror(self.errno))
        data = bytes(data)
        if self.pwrites == self.short_pwrite_at:
            self.fail_pwrite_at, self.errno = self.pwrites + 1, errno.EIO
            data = data[:len(data) // 2]
        if self.capacity is not None:
            if self.capacity <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data = data[:self.capacity]
            self.capacity -= len(data)
        return REAL_PWRITE(fd, data, offset)

    def fsync(self, fd, real=None):
        self.fsyncs += 1
        if self.fsyncs == self.fail_fsync_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        (real or REAL_FSYNC)(fd)

    def fdatasync(self, fd):
        self.fsync(fd, REAL_FDATASYNC)  # a file's sync (logstore.fileio), counted as one


REAL_PWRITE, REAL_FSYNC, REAL_FDATASYNC = os.pwrite, os.fsync, os.fdatasync

OS_FAULTS = {
    "full disk in the records' write": lambda f: setattr(f, "capacity", 100),
    "full disk in the entries' write": lambda f: setattr(f, "capacity", 3 * 143 + 10),
    "EIO writing the records": lambda f: setattr(f, "fail_pwrite_at", f.pwrites + 1),
    "EIO writing the entries": lambda f: setattr(f, "fail_pwrite_at", f.pwrites + 2),
    "short write of the records": lambda f: setattr(f, "short_pwrite_at", f.pwrites + 1),
    "short write of the entries": lambda f: setattr(f, "short_pwrite_at", f.pwrites + 2),
    "failed fsync": lambda f: setattr(f, "fail_fsync_at", f.fsyncs + 1),
}


def _os_outcome(tmp_path, style, fault, taken, monkeypatch):
    data_dir = str(tmp_path / style)
    faults = OsFaults()
    monkeypatch.setattr(os, "pwrite", faults.pwrite)
    monkeypatch.setattr(os, "fsync", faults.fsync)
    monkeypatch.setattr(os, "fdatasync", faults.fdatasync)
    messages = MessageStore(data_dir, CONFIG, now_ms=T0)
    seen = [commit(messages, style, ["s"], ["a0"], [b"a0"]),
            commit(messages, style, ["s", "s"], ["b0", "b1"], [b"b0", b"b1"])]
    fault(faults)
    written_before = taken.written
    for ids in (["c0", "c1", "c2"], ["c0", "d1"]):  # the faulted commit, then the next one
        try:
            seen.append(commit(messages, style, ["s"] * len(ids), ids, [b"c" * 100] * len(ids)))
        except Exception as exc:  # noqa: BLE001 - the outcome compared is the error's type
            seen.append(type(exc).__name__)
        seen.append((messages.end_sequence("s"), messages.copy_bounds(), faults.pwrites,
                     faults.fsyncs, files_of(data_dir)))
        if ids[-1] == "c2":
            faulted_in_one_call = taken.written == written_before + 1
        faults.clear()
    messages.close()
    monkeypatch.setattr(os, "pwrite", REAL_PWRITE)
    monkeypatch.setattr(os, "fsync", REAL_FSYNC)
    monkeypatch.setattr(os, "fdatasync", REAL_FDATASYNC)
    reopened = MessageStore(data_dir, CONFIG, now_ms=T0 + 1)
    try:
        seen.append([(m.sequence, m.message_id, m.payload)
                     for m in reopened.scan("s", 0, 100)[0]])
    finally:
        reopened.close()
    return seen, faulted_in_one_call


@pytest.mark.parametrize("fault", list(OS_FAULTS))
def test_a_fault_in_the_python_twin_of_the_one_call_leaves_what_the_general_path_leaves(
        tmp_path, monkeypatch, fault):
    taken = Taken(commit_run.write_run_python)
    monkeypatch.setattr(commit_run, "write_run", taken)
    monkeypatch.setattr(fileio, "_write_sync_c", None)  # the general path's write: os calls
    general, _ = _os_outcome(tmp_path, "general path", OS_FAULTS[fault], taken, monkeypatch)
    assert taken.written == 0
    one_call, faulted_in_one_call = _os_outcome(tmp_path, "one call", OS_FAULTS[fault], taken,
                                                monkeypatch)
    assert faulted_in_one_call, "the faulted commit did not take the one call"
    assert isinstance(one_call[2], str), f"no error: {one_call[2]}"
    assert one_call == general


def _twin_answer(write_run, tmp_path, name, args, fault=None):
    """What ``write_run`` answers (its clock fields zeroed) and leaves in two files."""
    paths = [str(tmp_path / f"{name}.records"), str(tmp_path / f"{name}.entries")]
    fds = [os.open(path, os.O_RDWR | os.O_CREAT) for path in paths]
    for fd in fds:
        os.pwrite(fd, b"h" * 7, 0)
    if fault is not None:
        which, path, flags = fault
        os.close(fds[which])
        fds[which] = os.open(paths[which] if path is None else path, flags)
    try:
        answer = write_run(fds[0], 7, fds[1], 7, *args)
    finally:
        for fd in fds:
            os.close(fd)
    if answer is not None:
        answer = answer[:4] + (0, 0) + answer[6:]  # fsync_ns, synced_at_ns: clock readings
    contents = []
    for path in paths:
        with open(path, "rb") as f:
            contents.append(f.read())
    return answer, contents


TWIN_RUNS = {
    "a usual run": (T0, "s\u00e9", 5, ["a", "b\u00e9"], [b"xy", b""], 1000, 1 << 20, 512, 1 << 20),
    "refused: no room": (T0, "s", 5, ["a"], [b"xy"], 1000, 10, 512, 1 << 20),
    "refused: an id too long": (T0, "s", 5, ["abc"], [b"xy"], 1000, 1 << 20, 2, 1 << 20),
    "refused: a payload not bytes": (T0, "s", 5, ["a"], [bytearray(b"x")], 0, 1 << 20, 8, 999),
}
TWIN_FAULTS = {
    "none": None,
    "records' write fails": (0, None, os.O_RDONLY),
    "fsync fails": (0, os.devnull, os.O_WRONLY),
    "records' write finds the disk full": (0, "/dev/full", os.O_WRONLY),
    "entries' write fails": (1, None, os.O_RDONLY),
}


@pytest.mark.parametrize("fault", list(TWIN_FAULTS))
@pytest.mark.parametrize("run", list(TWIN_RUNS))
def test_both_twins_of_write_run_write_the_same_bytes_and_answer_the_same(tmp_path, run,
                                                                           fault):
    write_run_c = built_twin("realtime.storage._codecs", "write_run")
    if write_run_c is None:
        pytest.skip("realtime.storage._codecs is not built")
    args = TWIN_RUNS[run]
    c_answer = _twin_answer(write_run_c, tmp_path, "c", args, TWIN_FAULTS[fault])
    python_answer = _twin_answer(commit_run.write_run_python, tmp_path, "python", args,
                                 TWIN_FAULTS[fault])
    assert c_answer == python_answer
    answer, (records, entries) = c_answer
    if run != "a usual run":
        assert answer is None and records == entries == b"h" * 7  # nothing written
    elif fault == "none":
        framed, encoded_entries = commit_run.encode_run_python(*args)
        assert answer == (len(framed), len(framed), 0, 0, 0, 0, len(encoded_entries), 0)
        assert (records, entries) == (b"h" * 7 + framed, b"h" * 7 + encoded_entries)


def test_a_negative_file_offset_is_an_error_in_both_twins(tmp_path):
    write_run_c = built_twin("realtime.storage._codecs", "write_run")
    args = TWIN_RUNS["a usual run"]
    for write_run in (write_run_c, commit_run.write_run_python):
        if write_run is None:
            continue
        with pytest.raises(ValueError, match="offsets -1, 0: one is negative"):
            write_run(1, -1, 2, 0, *args)


def test_the_one_call_checkpoints_after_the_commits_the_general_path_checkpoints_after(
        tmp_path, monkeypatch):
    taken = Taken(commit_run.write_run)
    monkeypatch.setattr(commit_run, "write_run", taken)
    checkpoints = {}
    for style in STYLES:
        data_dir = str(tmp_path / style)
        messages = MessageStore(data_dir, CONFIG, now_ms=T0)
        checkpoints[style] = []
        for run in LIFE:
            commit(messages, style, *run)
            checkpoints[style].append(files_of(os.path.join(data_dir, "checkpoint")))
        messages.close()
    assert checkpoints["one call"] == checkpoints["general path"]
    assert taken.written >= 30, "the usual commits did not take the one call"
    assert len({str(files) for files in checkpoints["one call"]}) >= 4, "few checkpoints"
