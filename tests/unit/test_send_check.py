"""serverkit.send_check: the servers' quick check accepts only what the full check accepts, with the
same fields, and defers everything else to it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.sends import DELIVER_AT_SKEW_MS_MAX
from wire.errors import QmqError
from wire.limits import (
    MAX_BODY_BYTES,
    MAX_MESSAGE_ID_CHARS,
    MAX_PROPERTIES,
    MAX_PROPERTY_KEY_BYTES,
    MAX_PROPERTY_VALUE_BYTES,
    MAX_TAG_BYTES,
    MAX_TAGS,
)
from wire.message import (
    ORIGIN_ID_PROPERTY,
    Message,
    decode_message,
    encode_message,
    validate_message,
)
from serverkit.send_check import VALID_SUBJECTS_MAX, Checked, QuickCheck
from tests.twins import built_twin

NOW_MS = 1_700_000_000_000
DELIVER_AT_MAX_MS = NOW_MS + DELIVER_AT_SKEW_MS_MAX


def full_check(payload: bytes) -> Checked | None:
    """What the broker's full path makes of a payload (None: refused)."""
    try:
        message = decode_message(payload)
        validate_message(message, allow_internal=True, now_ms=NOW_MS)
    except QmqError:
        return None
    if message.deliver_at_ms is not None and message.deliver_at_ms > DELIVER_AT_MAX_MS:
        return None
    return Checked(message.id, message.subject, message.tags, message.expire_at_ms,
                   message.deliver_at_ms, message.created_at_ms, message.retries,
                   message.properties.get(ORIGIN_ID_PROPERTY))


def payload(**fields) -> bytes:
    base = {"i": "m-1", "s": "orders", "b": b"body", "c": NOW_MS}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...}, use_bin_type=True)


# Valid fields near every limit, then at most one field changed to an edge or a wrong type: the
# quick check must never accept what the full check refuses.
valid_fields = st.fixed_dictionaries({
    "i": st.from_regex(r"\A[\x21-\x7e]{1,4}\Z") | st.just("x" * MAX_MESSAGE_ID_CHARS),
    "s": st.sampled_from(["orders", "a.b-c_d", "%retry%orders%billing", "%dead%orders%billing"]),
    "b": st.binary(max_size=8),
    "c": st.integers(min_value=0, max_value=2**63 - 1),
}, optional={
    "t": st.lists(st.text(min_size=1, max_size=3) | st.just("t" * MAX_TAG_BYTES),
                  max_size=MAX_TAGS),
    "p": st.dictionaries(st.text(min_size=1, max_size=3) | st.just("k" * MAX_PROPERTY_KEY_BYTES),
                         st.text(max_size=3) | st.just("v" * MAX_PROPERTY_VALUE_BYTES),
                         max_size=4),
    "d": st.integers(min_value=0, max_value=DELIVER_AT_MAX_MS),
    "x": st.integers(min_value=0, max_value=2**63 - 1),
    "r": st.integers(min_value=0, max_value=1000),
})
anything = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2, max_value=2**64 - 1),
                     st.text(max_size=5), st.binary(max_size=5), st.lists(st.text(max_size=3),
                                                                          max_size=3),
                     st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2))
edges = {
    "i": st.sampled_from(["x" * (MAX_MESSAGE_ID_CHARS + 1), "a b", "", "é", "a\x7f", "\x1fa",
                          "a\tb", "a\u00a0b", "\U0001f600"]),
    "s": st.sampled_from(["%bogus", "%retry%x", "-bad", "", "x" * 201, "a/b"]),
    "b": st.just(b"x" * (MAX_BODY_BYTES + 1)),
    "c": st.just(-1),
    "t": st.sampled_from([["t"] * (MAX_TAGS + 1), [""], ["t" * (MAX_TAG_BYTES + 1)],
                          ["é" * (MAX_TAG_BYTES // 2 + 1)], [1]]),
    "p": st.sampled_from([{"": "v"}, {"k" * (MAX_PROPERTY_KEY_BYTES + 1): "v"},
                          {"é" * (MAX_PROPERTY_KEY_BYTES // 2 + 1): "v"},
                          {"k": "é" * (MAX_PROPERTY_VALUE_BYTES // 2 + 1)}, {"k": 1},
                          {f"k{i}": "v" for i in range(MAX_PROPERTIES + 1)}]),
    "d": st.sampled_from([DELIVER_AT_MAX_MS + 1, -1]),
    "x": st.just(-1),
    "r": st.just(-1),
    "zz": st.just(1),
}
mutations = st.none() | st.sampled_from(sorted(edges)).flatmap(
    lambda key: st.tuples(st.just(key), edges[key] | anything | st.just(...)))


@settings(max_examples=500, deadline=None)
@given(valid_fields, mutations)
def test_the_quick_check_accepts_only_what_the_full_check_accepts_with_the_same_fields(
        fields, mutation):
    if mutation is not None:
        fields[mutation[0]] = mutation[1]
    data = payload(**fields)
    quick = QuickCheck().check(data, DELIVER_AT_MAX_MS)
    full = full_check(data)
    if quick is not None:
        assert quick == full
    elif mutation is None:
        # A valid message without surprises takes the quick path.
        assert full is not None


@given(st.binary(max_size=64))
def test_bytes_that_are_not_a_message_are_left_to_the_full_check(data):
    assert QuickCheck().check(data, DELIVER_AT_MAX_MS) is None or full_check(data) is not None


def test_a_producers_plain_message_passes_the_quick_check():
    message = Message.create("orders", b"x" * 256, now_ms=NOW_MS, tags=("vip",),
                             properties={"order": "42"}, expire_at_ms=NOW_MS + 1000, id="m-42")
    data = encode_message(message)
    assert QuickCheck().check(data, DELIVER_AT_MAX_MS) == Checked(
        "m-42", "orders", ("vip",), NOW_MS + 1000, None, NOW_MS, 0, None)


@pytest.mark.parametrize("fields", [
    {"b": b"x" * (MAX_BODY_BYTES + 1)},
    {"t": ["t"] * (MAX_TAGS + 1)},
    {"p": {f"k{i}": "v" for i in range(MAX_PROPERTIES + 1)}},
    {"d": DELIVER_AT_MAX_MS + 1},
    {"x": None},
    {"extra": 1},
], ids=["body", "tags", "properties", "deliver_at", "nil expire_at", "unknown key"])
def test_a_message_at_or_past_a_limit_is_left_to_the_full_check(fields):
    assert QuickCheck().check(payload(**fields), DELIVER_AT_MAX_MS) is None


def test_the_cache_of_valid_subjects_stays_bounded():
    check = QuickCheck()
    for n in range(VALID_SUBJECTS_MAX + 5):
        assert check.check(payload(s=f"s{n}"), DELIVER_AT_MAX_MS) is not None
    assert len(check._valid_subjects) <= VALID_SUBJECTS_MAX


check_many_c = built_twin("serverkit._send_check", "check_many")
needs_c = pytest.mark.skipif(check_many_c is None, reason="serverkit._send_check not built")


def c_check(data: object, subjects: set[str]) -> Checked | None:
    (out,) = check_many_c([data], DELIVER_AT_MAX_MS, subjects, Checked, MAX_BODY_BYTES,
                          MAX_MESSAGE_ID_CHARS, MAX_TAGS, MAX_TAG_BYTES)
    return out


@needs_c
@settings(max_examples=500, deadline=None)
@given(valid_fields, mutations)
def test_the_c_twin_decides_only_as_the_python_check_does(fields, mutation):
    if mutation is not None:
        fields[mutation[0]] = mutation[1]
    data = payload(**fields)
    python = QuickCheck()
    # Cache the subject (when valid) as a first message of it would, whatever the other fields.
    python.check(payload(s=fields.get("s", ...)), DELIVER_AT_MAX_MS)
    expected = python.check(data, DELIVER_AT_MAX_MS)
    decided = c_check(data, python._valid_subjects)
    assert decided is None or (decided == expected and type(decided) is Checked)
    if mutation is None and "p" not in fields:
        assert decided == expected  # the shapes it is for are decided in C


@needs_c
@given(st.binary(max_size=64))
def test_the_c_twin_leaves_bytes_that_are_not_a_message_to_the_python_check(data):
    decided = c_check(data, {"orders"})
    assert decided is None or decided == QuickCheck().check(data, DELIVER_AT_MAX_MS)


@needs_c
def test_the_c_twin_defers_every_cut_of_a_valid_payload_and_anything_not_bytes():
    data = payload(d=NOW_MS, x=NOW_MS + 1, r=2, t=["vip", "é"])
    assert c_check(data, {"orders"}) == Checked("m-1", "orders", ("vip", "é"), NOW_MS + 1,
                                                NOW_MS, NOW_MS, 2, None)
    for cut in range(len(data)):
        assert c_check(data[:cut], {"orders"}) is None
    assert c_check(data + b"\x00", {"orders"}) is None
    assert c_check(bytearray(data), {"orders"}) is None
    assert c_check(data, set()) is None  # a subject the Python check has not validated yet
    bad_utf8 = payload(t=["v"]).replace(b"\xa1v", b"\xa1\xff")  # a tag that is not UTF-8
    assert c_check(bad_utf8, {"orders"}) is None
    assert QuickCheck().check(bad_utf8, DELIVER_AT_MAX_MS) is None


@pytest.mark.parametrize("fields", [{}, {"t": ["vip"]}, {"s": "new.subject"}, {"c": -1},
                                    {"d": DELIVER_AT_MAX_MS + 1}, {"p": {"k": "v"}}])
def test_check_many_gives_what_check_gives_payload_by_payload(fields):
    payloads = [payload(i=f"m-{n}", **fields) for n in range(3)] + [b"\xc1", payload()]
    assert QuickCheck().check_many(payloads, DELIVER_AT_MAX_MS) == [
        QuickCheck().check(p, DELIVER_AT_MAX_MS) for p in payloads]


@needs_c
def test_the_c_twin_survives_a_finalizer_that_empties_the_batch_while_it_reads():
    # Tuples the C twin allocates can run the garbage collector, and with it any finalizer;
    # one that empties the list must not leave the C loop reading freed memory. In a child
    # process: the bug this guards against is a segfault.
    script = textwrap.dedent("""
        import gc, msgpack
        from serverkit._send_check import check_many
        from serverkit.send_check import Checked
        payloads = [msgpack.packb({"i": "m", "s": "o", "b": b"", "c": 1, "t": ["a"]},
                                  use_bin_type=True) for _ in range(4)]
        args = (payloads, 10**13, {"o"}, Checked, 1 << 22, 128, 10, 64)
        class EmptiesTheBatch:
            def __del__(self):
                payloads.clear()
        gc.set_threshold(1)
        cycle = EmptiesTheBatch(); cycle.me = cycle; del cycle
        try:
            check_many(*args)
        except RuntimeError as exc:
            print(exc)
    """)
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=60)
    assert child.returncode == 0, child.stderr
    assert child.stdout == "payloads changed size during check_many\n"


EDGE_CASES = [
    ("i", "x" * (MAX_MESSAGE_ID_CHARS + 1)), ("i", "x" * MAX_MESSAGE_ID_CHARS), ("i", "a b"),
    ("i", ""), ("i", "é"), ("i", "a\x7f"), ("i", "\x1fa"), ("i", "!~"), ("i", 5), ("i", b"m"),
    ("s", "%bogus"), ("s", "é"), ("s", b"orders"), ("b", "text"),
    ("b", b"x" * (MAX_BODY_BYTES + 1)), ("b", b"x" * MAX_BODY_BYTES), ("c", -1), ("c", 0),
    ("c", 2**64 - 1), ("c", 1.5), ("c", True), ("c", None), ("d", DELIVER_AT_MAX_MS),
    ("d", DELIVER_AT_MAX_MS + 1), ("d", -1), ("d", None), ("x", -(2**63)), ("x", None),
    ("x", 2**63), ("r", None), ("r", -1), ("r", 0), ("r", 2**64 - 1), ("zz", 1), ("i", ...),
    ("t", []), ("t", ["vip"]), ("t", ["t"] * MAX_TAGS), ("t", ["t"] * (MAX_TAGS + 1)),
    ("t", [""]), ("t", ["t" * MAX_TAG_BYTES]), ("t", ["t" * (MAX_TAG_BYTES + 1)]),
    ("t", ["é" * (MAX_TAG_BYTES // 2)]), ("t", ["é" * (MAX_TAG_BYTES // 2 + 1)]),
    ("t", ["\U0001f600", "a"]), ("t", [1]), ("t", "vip"), ("t", None), ("t", [b"vip"]),
    ("t", [["a"]]),
]


@needs_c
@pytest.mark.parametrize("key, value", EDGE_CASES)
def test_the_c_twin_decides_each_field_at_its_edges_as_the_python_check_does(key, value):
    data = payload(**{key: value})
    python = QuickCheck()
    python.check(payload(s="orders"), DELIVER_AT_MAX_MS)
    expected = python.check(data, DELIVER_AT_MAX_MS)
    decided = c_check(data, python._valid_subjects)
    assert decided is None or decided == expected
    if key != "s" and key != "zz":
        assert decided == expected  # every other field's edge is decided in C, not deferred
