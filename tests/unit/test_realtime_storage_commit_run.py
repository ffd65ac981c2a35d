"""The usual commit in one call (``MessageStore.append_commit``: ``commit_run.encode_run``, then
``SegmentedLog.append_framed_durably``): the same bytes on disk, the same answers and the same
failures (full disk, EIO, a short write, a failed fsync) as the general path (``append_many``
then ``commit_sequences``); and the two twins of ``encode_run`` give the same answers."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore import record
from logstore.faults import FaultPlan
from realtime.storage import MessageStore, commit_run, consumer_log, message_record
from realtime.storage import write_batch
from tests.twins import built_twin
from tests.unit.test_realtime_storage_store import T0, TINY
from tests.unit.test_realtime_storage_write_error_copy import _one_call_opener

# Tiny segments and write buffer (a big batch, a segment roll take the general path), room for
# a few commits per consumer-log file.
CONFIG = dataclasses.replace(TINY, consumer_log_entries_per_file=16)
STYLES = ["general path", "one call"]


class Spy:
    """``commit_run.encode_run`` and ``commit_run.write_run``, counting the runs they took
    (the usual commit taken): ``written`` through real files in the one C call, ``encoded``
    either way."""

    def __init__(self, encode_run, write_run) -> None:
        self.encode_run = encode_run
        self.write_run = write_run
        self.encoded = 0
        self.written = 0

    def encode(self, *args):
        answer = self.encode_run(*args)
        self.encoded += answer is not None
        return answer

    def write(self, *args):
        answer = self.write_run(*args)
        self.encoded += answer is not None
        self.written += answer is not None
        return answer


@pytest.fixture
def spy(monkeypatch) -> Spy:
    spy = Spy(commit_run.encode_run, commit_run.write_run)
    monkeypatch.setattr(commit_run, "encode_run", spy.encode)
    monkeypatch.setattr(commit_run, "write_run", spy.write)
    return spy


def commit(messages: MessageStore, style: str, subjects, ids, payloads, tags=None):
    """One group commit as the broker makes it (``Sends._append_and_commit_io``)."""
    tags = tags if tags is not None else [()] * len(ids)
    try:
        if style == "one call":
            return messages.append_commit(subjects, ids, tags, T0, payloads)
        messages.append_many(subjects, ids, tags, T0, payloads)
        return messages.commit_sequences()
    except BaseException:
        messages.discard()
        raise


def files_of(data_dir: str) -> dict[str, bytes]:
    found = {}
    for root, _dirs, names in os.walk(data_dir):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                found[os.path.relpath(path, data_dir)] = f.read()
    return found


# Commits of a broker's life: a new subject, the usual ones, a duplicate, an id twice, tags,
# two subjects, a batch over the write buffer, enough to roll segments and consumer-log files.
LIFE = ([(["s"], ["a"], [b"a"], None)]
        + [(["s"] * 3, [f"u{n}.{i}" for i in range(3)], [b"p" * (40 + n)] * 3, None)
           for n in range(12)]
        + [(["s", "s"], ["u0.0", "new"], [b"d", b"n"], None),
           (["s", "s"], ["twice", "twice"], [b"t", b"t"], None),
           (["s"], ["tagged"], [b"t"], [(7,)]),
           (["s", "t"], ["s1", "t1"], [b"s", b"t"], None),
           (["s"] * 12, [f"big{i}" for i in range(12)], [b"b" * 200] * 12, None)]
        + [(["t"] * 2, [f"v{n}.{i}" for i in range(2)], [b"q" * 90] * 2, None)
           for n in range(30)])


@pytest.mark.parametrize("extensions", [True, False], ids=["C twins", "Python twins"])
def test_the_one_call_writes_the_bytes_and_gives_the_answers_of_the_general_path(
        tmp_path, spy, monkeypatch, extensions):
    if not extensions:
        spy.encode_run = commit_run.encode_run_python
        spy.write_run = commit_run.write_run_python
    answers, files = {}, {}
    for style in STYLES:
        data_dir = str(tmp_path / style)
        messages = MessageStore(data_dir, CONFIG, now_ms=T0)
        answers[style] = [commit(messages, style, *run) for run in LIFE]
        messages.close()
        files[style] = files_of(data_dir)
    assert answers["one call"] == answers["general path"]
    assert files["one call"] == files["general path"]
    assert answers["one call"][1] == [1, 2, 3]
    assert spy.encoded >= 30, "the usual commits did not take the one call"
    assert spy.written == spy.encoded, "real files: the records written in the encoder's call"


def _full_records(plan):
    plan.disk_capacity_bytes = plan.bytes_written + 100


def _full_entries(plan):
    plan.disk_capacity_bytes = plan.bytes_written + 3 * (12 + 28 + 1 + 2 + 100) + 10


FAULTS = {
    "full disk in the records' write": _full_records,
    "full disk in the entries' write": _full_entries,
    "EIO writing the records": lambda plan: setattr(plan, "fail_write_at", plan.writes + 1),
    "EIO writing the entries": lambda plan: setattr(plan, "fail_write_at", plan.writes + 2),
    "short write of the records": lambda plan: setattr(plan, "short_write_at",
                                                       plan.writes + 1),
    "failed fsync": lambda plan: setattr(plan, "fail_sync_at", plan.syncs + 1),
}


def _outcome(tmp_path, style, one_call_file, fault, spy):
    """What a store shows through a faulted commit, a next one, and a reopen; and whether the
    faulted commit took the one call."""
    data_dir = str(tmp_path / f"{style}-{one_call_file}")
    plan = FaultPlan()
    opener = _one_call_opener(plan) if one_call_file else plan.opener
    messages = MessageStore(data_dir, CONFIG, opener=opener, now_ms=T0)
    seen = [commit(messages, style, ["s"], ["a0"], [b"a0"]),
            commit(messages, style, ["s", "s"], ["b0", "b1"], [b"b0", b"b1"])]
    fault(plan)
    encoded_before = spy.encoded
    for ids in (["c0", "c1", "c2"], ["c0", "d1"]):  # the faulted commit, then the next one
        try:
            seen.append(commit(messages, style, ["s"] * len(ids), ids, [b"c" * 100] * len(ids)))
        except Exception as exc:  # noqa: BLE001 - the outcome compared is the error's type
            seen.append(type(exc).__name__)
        seen.append((messages.end_sequence("s"), messages.copy_bounds(), plan.writes,
                     plan.syncs, files_of(data_dir)))
        if ids[-1] == "c2":
            faulted_in_one_call = spy.encoded == encoded_before + 1
        plan.disk_capacity_bytes = plan.fail_write_at = plan.short_write_at = None
        plan.fail_sync_at = None
    messages.close()
    reopened = MessageStore(data_dir, CONFIG, now_ms=T0 + 1)
    try:
        seen.append([(m.sequence, m.message_id, m.payload)
                     for m in reopened.scan("s", 0, 100)[0]])
    finally:
        reopened.close()
    return seen, faulted_in_one_call


@pytest.mark.parametrize("one_call_file", [False, True],
                         ids=["write then fsync", "write and fsync in one call"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_in_the_one_call_leaves_what_it_leaves_on_the_general_path(
        tmp_path, spy, fault, one_call_file):
    general, _ = _outcome(tmp_path, "general path", one_call_file, FAULTS[fault], spy)
    assert spy.encoded == 0
    one_call, faulted_in_one_call = _outcome(tmp_path, "one call", one_call_file,
                                             FAULTS[fault], spy)
    assert faulted_in_one_call, "the faulted commit did not take the one call"
    assert isinstance(one_call[2], str), f"no error: {one_call[2]}"
    assert one_call == general


def python_encode_run(args, monkeypatch):
    """What the Python twin of encode_run answers, made of the general path's Python twins."""
    with monkeypatch.context() as patch:
        patch.setattr(write_batch, "_check_run_c", None)
        patch.setattr(message_record, "_encode_subject_records_c", None)
        patch.setattr(consumer_log, "_encode_entries_c", None)
        patch.setattr(commit_run, "frame_records", record.frame_records_python)
        return commit_run.encode_run_python(*args)


run_ids = st.lists(st.one_of(st.text(max_size=12), st.just("\ud800"), st.just(7)),
                   max_size=5)
run_payloads = st.lists(st.one_of(st.binary(max_size=40), st.just(bytearray(b"ba"))),
                        max_size=5)


@settings(max_examples=300, deadline=None)
@given(timestamp_ms=st.one_of(st.integers(-1, (1 << 64)), st.just(True)),
       subject=st.text(min_size=1, max_size=6), first=st.integers(0, 1 << 40),
       ids=run_ids, payloads=run_payloads, log_offset=st.integers(0, 1 << 40),
       room_bytes=st.integers(-1, 600), id_bytes_max=st.integers(1, 8),
       record_bytes_max=st.integers(28, 120))
def test_both_twins_of_encode_run_give_the_same_answer(timestamp_ms, subject, first, ids,
                                                       payloads, log_offset, room_bytes,
                                                       id_bytes_max, record_bytes_max):
    encode_run_c = built_twin("realtime.storage._codecs", "encode_run")
    if encode_run_c is None:
        pytest.skip("realtime.storage._codecs is not built")
    args = (timestamp_ms, subject, first, ids, payloads, log_offset, room_bytes, id_bytes_max,
            record_bytes_max)
    with pytest.MonkeyPatch.context() as monkeypatch:
        expected = python_encode_run(args, monkeypatch)
    assert encode_run_c(*args) == expected


def test_a_run_is_its_framed_records_and_their_entries_as_the_general_path_makes_them(
        monkeypatch):
    args = (T0, "s\u00e9", 5, ["a", "b\u00e9"], [b"xy", b""], 1000, 1 << 20, 512, 1 << 20)
    bodies = message_record.encode_subject_records(T0, "s\u00e9", [5, 6], [0, 0],
                                                   [b"a", b"b\xc3\xa9"], [b"xy", b""])
    sizes = [len(body) for body in bodies]
    expected = (record.frame_records_python(bodies),
                consumer_log.encode_entries([T0, T0], [1000, 1000 + 12 + sizes[0]], sizes,
                                            [0, 0]))
    assert commit_run.encode_run(*args) == expected
    assert python_encode_run(args, monkeypatch) == expected
    # One byte short of room: the general path takes the run.
    short = args[:6] + (len(expected[0]) - 1,) + args[7:]
    assert commit_run.encode_run(*short) is None
    assert python_encode_run(short, monkeypatch) is None


@pytest.mark.parametrize("ids, tags, payloads", [
    (["a", "b"], None, [b"a", b"b"]),
    (["a", "b", "c", "d"], None, [b"a", b"b", b"c", b"d"]),
    (["a", "b", "c"], [()] * 2, [b"a", b"b", b"c"]),
    (["a", "b", "c"], None, [b"a", b"b"]),
], ids=["fewer ids", "more ids", "fewer tag lists", "fewer payloads"])
def test_columns_of_different_lengths_are_refused_as_the_general_path_refuses_them(
        tmp_path, ids, tags, payloads):
    refused = {}
    for style in STYLES:
        messages = MessageStore(str(tmp_path / style), CONFIG, now_ms=T0)
        commit(messages, style, ["s"], ["first"], [b"f"])
        with pytest.raises(ValueError) as caught:
            commit(messages, style, ["s"] * 3, ids, payloads, tags)
        refused[style] = (str(caught.value), messages.end_sequence("s"))
        assert commit(messages, style, ["s"], ["next"], [b"n"]) == [1]
        messages.close()
    assert refused["one call"] == refused["general path"]
