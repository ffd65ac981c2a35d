"""parse_due_run: the C twin and the pure-Python twin give the same answers on normal and
malformed runs of delay-log records, and the Python twin's answers are the right ones."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.storage.delay_record import FIXED, SUBJECT_LENGTH, encode_delay_record
from delayserver.storage.due_records import parse_due_run_python
from logstore.record import encode_record
from tests.twins import built_twin

LIMIT = 16 << 20
BUCKET_MS = 1_700_000_040_000

parse_due_run_c = built_twin("delayserver._due_records", "parse_due_run")


def body(message_id: bytes, subject: bytes, payload: bytes, due: int,
         bucket: int = BUCKET_MS) -> bytes:
    """A delay-record body, built field by field so a test can make any field wrong."""
    return (FIXED.pack(due, bucket, len(message_id)) + message_id
            + SUBJECT_LENGTH.pack(len(subject)) + subject + payload)


def run_of(bodies: list[bytes]) -> tuple[bytes, list[int], list[int]]:
    """The bytes of the framed records back to back, their header positions and body sizes."""
    data, ats = b"", []
    for one in bodies:
        ats.append(len(data))
        data += encode_record(one)
    return data, ats, [len(one) for one in bodies]


def both(data, ats, sizes, due, buckets, hashes, limit=LIMIT):
    """Both twins' answers; they must be equal."""
    python = parse_due_run_python(data, ats, sizes, due, buckets, hashes, limit)
    if parse_due_run_c is not None:
        assert parse_due_run_c(data, list(ats), list(sizes), list(due), list(buckets),
                               list(hashes), limit) == python
    return python


def test_a_run_of_good_records_gives_each_subject_and_payload():
    ids = [b"m-%d" % i for i in range(20)]
    bodies = [encode_delay_record(BUCKET_MS + i, BUCKET_MS, ids[i], b"orders.%d" % (i % 3),
                                  b"payload %d" % i) for i in range(20)]
    data, ats, sizes = run_of(bodies)
    got = both(data, ats, sizes, [BUCKET_MS + i for i in range(20)], [BUCKET_MS] * 20,
               [zlib.crc32(i) for i in ids])
    assert got == [("orders.%d" % (i % 3), b"payload %d" % i) for i in range(20)]
    assert both(memoryview(data), ats[::3], sizes[::3], [BUCKET_MS + i for i in range(0, 20, 3)],
                [BUCKET_MS] * 7, [zlib.crc32(i) for i in ids[::3]]) == got[::3]


def test_records_that_break_a_rule_give_none_and_their_neighbours_still_parse():
    good = body(b"id", b"s", b"p", 5)
    cases = {
        "wrong due": (good, 6, BUCKET_MS, zlib.crc32(b"id")),
        "wrong bucket": (good, 5, BUCKET_MS + 1, zlib.crc32(b"id")),
        "wrong id hash": (good, 5, BUCKET_MS, zlib.crc32(b"id") ^ 1),
        "empty id": (body(b"", b"s", b"p", 5), 5, BUCKET_MS, zlib.crc32(b"")),
        "empty subject": (body(b"id", b"", b"p", 5), 5, BUCKET_MS, zlib.crc32(b"id")),
        "subject not UTF-8": (body(b"id", b"\xff\xfe", b"p", 5), 5, BUCKET_MS,
                              zlib.crc32(b"id")),
        "id runs past the body": (FIXED.pack(5, BUCKET_MS, 900) + b"id" + b"\0\1s", 5,
                                  BUCKET_MS, zlib.crc32(b"id")),
        "subject runs past the body": (FIXED.pack(5, BUCKET_MS, 2) + b"id" + b"\0\x09s", 5,
                                       BUCKET_MS, zlib.crc32(b"id")),
        "shorter than a record header": (b"short", 5, BUCKET_MS, 0),
        "empty payload is fine": (body(b"id", b"s", b"", 5), 5, BUCKET_MS, zlib.crc32(b"id")),
    }
    for name, (bad, due, bucket, hashed) in cases.items():
        data, ats, sizes = run_of([good, bad, good])
        got = both(data, ats, sizes, [5, due, 5], [BUCKET_MS, bucket, BUCKET_MS],
                   [zlib.crc32(b"id"), hashed, zlib.crc32(b"id")])
        assert got[0] == got[2] == ("s", b"p"), name
        assert got[1] == (("s", b"") if name == "empty payload is fine" else None), name


def test_a_bad_position_size_or_crc_gives_none():
    good = body(b"id", b"s", b"payload", 5)
    data, ats, sizes = run_of([good, good])
    fields = ([5, 5], [BUCKET_MS] * 2, [zlib.crc32(b"id")] * 2)
    assert both(data, [ats[0], -1], sizes, *fields)[1] is None
    assert both(data, [ats[0], ats[1] + 1], sizes, *fields)[1] is None
    assert both(data, ats, [sizes[0], sizes[1] + 1], *fields)[1] is None
    assert both(data, ats, [sizes[0], sizes[1] - 1], *fields)[1] is None
    assert both(data, ats, [sizes[0], len(data) * 4], *fields)[1] is None
    assert both(data, ats, sizes, *fields, limit=sizes[0] - 1) == [None, None]
    assert both(data[:-1], ats, sizes, *fields)[1] is None  # the run was cut short
    flipped = bytearray(data)
    flipped[ats[1] + 12 + 19] ^= 0x01  # a byte of the second body
    assert both(bytes(flipped), ats, sizes, *fields) == [("s", b"payload"), None]


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_both_twins_agree_on_any_corruption_of_a_run(data):
    ids = [b"i%d" % i for i in range(4)]
    bodies = [body(ids[i], data.draw(st.binary(min_size=1, max_size=8)),
                   data.draw(st.binary(max_size=40)), 7 + i) for i in range(4)]
    raw, ats, sizes = run_of(bodies)
    corrupted = bytearray(raw)
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(corrupted) - 1))
        corrupted[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(corrupted)))
    ats = [a + data.draw(st.sampled_from([0, 0, 0, -1, 1, 13])) for a in ats]
    both(bytes(corrupted[:cut]), ats, sizes, [7, 8, 9, 10], [BUCKET_MS] * 4,
         [zlib.crc32(i) for i in ids])


@pytest.mark.skipif(parse_due_run_c is None, reason="delayserver._due_records not built")
def test_the_c_twin_survives_a_finalizer_that_empties_a_list_while_it_parses():
    # Tuples the C twin allocates can run the garbage collector, and with it any finalizer;
    # one that empties a list must not leave the C loop indexing past it. In a child process:
    # the bug this guards against is a segfault.
    script = textwrap.dedent("""
        import gc, zlib
        from delayserver._due_records import parse_due_run
        from delayserver.storage.delay_record import encode_delay_record
        from logstore.record import encode_record
        body = encode_delay_record(5, 5, b"m", b"o", b"p")
        framed = encode_record(body)
        ats = [k * len(framed) for k in range(4)]
        args = (framed * 4, ats, [len(body)] * 4, [5] * 4, [5] * 4, [zlib.crc32(b"m")] * 4,
                1 << 20)
        class EmptiesTheRun:
            def __del__(self):
                ats.clear()
        keep = [(k, -k) for k in range(5000)]  # empties the 2-tuple free list
        gc.set_threshold(1)
        cycle = EmptiesTheRun(); cycle.me = cycle; del cycle
        try:
            parse_due_run(*args)
        except RuntimeError as exc:
            print(exc)
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout == "a list changed size during parse_due_run\n"
