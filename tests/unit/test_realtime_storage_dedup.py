"""realtime.storage.dedup.DedupIndex against a plain model of its contract: an insertion-ordered
map from (subject, id) to (sequence, timestamp) where adding an id again moves it to the end,
ids_max forgets the oldest-inserted first and prune stops at the first young one."""

from __future__ import annotations

import gc
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.storage import dedup
from realtime.storage.dedup import DedupIndex

WINDOW_MS = 100


class Model:
    """What DedupIndex must behave like, written the obvious way."""

    def __init__(self, ids_max: int) -> None:
        self.ids_max = ids_max
        self.ids: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()

    def lookup(self, subject: str, message_id: str, timestamp_ms: int) -> int | None:
        found = self.ids.get((subject, message_id))
        if found is None or timestamp_ms - found[1] >= WINDOW_MS:
            return None
        return found[0]

    def add(self, subject: str, message_id: str, sequence: int, timestamp_ms: int) -> None:
        self.ids.pop((subject, message_id), None)
        self.ids[(subject, message_id)] = (sequence, timestamp_ms)
        while len(self.ids) > self.ids_max:
            self.ids.popitem(last=False)

    def forget(self, subject: str, message_id: str, sequence: int) -> None:
        if self.ids.get((subject, message_id), (None,))[0] == sequence:
            del self.ids[(subject, message_id)]

    def prune(self, now_ms: int) -> int:
        dropped = 0
        while self.ids:
            key, (_, stored_ms) = next(iter(self.ids.items()))
            if now_ms - stored_ms < WINDOW_MS:
                break
            del self.ids[key]
            dropped += 1
        return dropped


names = st.tuples(st.sampled_from(["s", "t", "1:s", "s1"]), st.sampled_from(["a", "b", ":s", "1"]))
operations = st.lists(st.one_of(
    st.tuples(st.just("add_many"), st.lists(names, max_size=5), st.integers(0, 300)),
    st.tuples(st.just("add"), names, st.integers(0, 300)),
    st.tuples(st.just("forget"), names, st.integers(0, 3)),
    st.tuples(st.just("prune"), st.integers(0, 400)),
    st.tuples(st.just("add_fresh"), st.sampled_from(["s", "t", "1:s", "s1"]),
              st.lists(st.sampled_from(["a", "b", ":s", "1"]), max_size=4), st.integers(0, 300)),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 6), operations, st.sampled_from([1, 2, 3, dedup.ORDER_CHUNK_KEYS]))
def test_the_index_answers_as_the_ordered_model_does(ids_max, ops, chunk_keys):
    # chunk_keys: the eviction order's lists as short as 1 key, so they fill and are evicted
    # whole and in part within a few operations.
    default, dedup.ORDER_CHUNK_KEYS = dedup.ORDER_CHUNK_KEYS, chunk_keys
    try:
        _answer_as_the_model_does(ids_max, ops)
    finally:
        dedup.ORDER_CHUNK_KEYS = default


def _answer_as_the_model_does(ids_max, ops):
    index, model = DedupIndex(WINDOW_MS, ids_max), Model(ids_max)
    sequence = 0
    for op in ops:
        if op[0] == "add_many":
            _, pairs, timestamp_ms = op
            sequences = list(range(sequence, sequence + len(pairs)))
            for (subject, message_id), pair_sequence in zip(pairs, sequences):
                model.add(subject, message_id, pair_sequence, timestamp_ms)
            keys = [key for subject, message_id in pairs
                    for key in DedupIndex.keys(subject, [message_id])]
            index.add_many(keys, sequences, [timestamp_ms] * len(pairs))
            sequence += len(pairs)
        elif op[0] == "add":
            _, (subject, message_id), timestamp_ms = op
            model.add(subject, message_id, sequence, timestamp_ms)
            index.add(subject, message_id, sequence, timestamp_ms)
            sequence += 1
        elif op[0] == "add_fresh":  # the usual commit: fresh_keys, then add_fresh
            _, subject, message_ids, timestamp_ms = op
            fresh = (len(set(message_ids)) == len(message_ids)
                     and not any((subject, m) in model.ids for m in message_ids))
            keys = index.fresh_keys(subject, message_ids, len(message_ids))
            assert (keys is not None) == fresh
            assert index.fresh_keys(subject, message_ids, len(message_ids) + 1) is None
            if keys is not None:
                for offset, message_id in enumerate(message_ids):
                    model.add(subject, message_id, sequence + offset, timestamp_ms)
                index.add_fresh(keys, sequence, timestamp_ms)
                sequence += len(message_ids)
        elif op[0] == "forget":
            _, (subject, message_id), back = op
            model.forget(subject, message_id, sequence - 1 - back)
            index.forget(subject, message_id, sequence - 1 - back)
        else:
            assert index.prune(op[1]) == model.prune(op[1])
        assert len(index) == len(model.ids)
        for subject, message_id in [(s, m) for s in ["s", "t", "1:s", "s1"]
                                    for m in ["a", "b", ":s", "1"]]:
            for now_ms in (0, 150, 400):
                assert index.lookup(subject, message_id, now_ms) == model.lookup(
                    subject, message_id, now_ms)


def test_lookup_many_is_none_when_no_key_is_known_and_a_list_otherwise():
    index = DedupIndex(WINDOW_MS, 10)
    index.add("s", "a", 7, 0)
    assert index.lookup_many(DedupIndex.keys("s", ["x", "y"]), 0) is None
    assert index.lookup_many(DedupIndex.keys("s", ["x", "a"]), 0) == [None, 7]
    assert index.lookup_many(DedupIndex.keys("s", ["a"]), WINDOW_MS) == [None]  # window passed


def test_keys_of_different_subject_and_id_pairs_never_collide():
    pairs = [("ab", "c"), ("a", "bc"), ("1:a", "b"), ("1", ":ab")]
    keys = [DedupIndex.keys(subject, [message_id])[0] for subject, message_id in pairs]
    assert len(set(keys)) == len(pairs)


def test_settled_ids_get_their_sequences_in_place_and_are_evicted_at_their_old_position():
    index = DedupIndex(WINDOW_MS, 3)
    index.add_many(DedupIndex.keys("s", ["a", "b"]), [-1, -1], [0, 0])  # held: no sequence
    index.add("s", "c", 5, 10)
    index.settle_many(DedupIndex.keys("s", ["a", "b"]), [6, 7], [20, 20])  # made visible
    assert [index.lookup("s", i, 20) for i in "abc"] == [6, 7, 5]
    index.add("s", "d", 8, 30)  # past ids_max: "a" goes first, as when it was held
    assert [index.lookup("s", i, 30) for i in "abcd"] == [None, 7, 5, 8]
    assert len(index) == 3


def test_settling_an_id_the_index_forgot_adds_them_all_at_the_end():
    index = DedupIndex(WINDOW_MS, 3)
    index.add("s", "a", -1, 0)
    index.add("s", "b", 1, 0)
    assert index.prune(WINDOW_MS) == 2  # "a" is forgotten while it is held
    index.add("s", "c", 2, WINDOW_MS)
    index.settle_many(DedupIndex.keys("s", ["a"]), [3], [WINDOW_MS + 1])
    index.add("s", "d", 4, WINDOW_MS + 2)
    index.add("s", "e", 5, WINDOW_MS + 2)  # past ids_max: "c" goes, then "a" stays
    assert [index.lookup("s", i, WINDOW_MS + 2) for i in "acde"] == [3, None, 4, 5]


def test_a_settled_id_keeps_later_ids_longer_never_shorter():
    index = DedupIndex(WINDOW_MS, 10)
    index.add("s", "a", -1, 0)
    index.add("s", "b", 1, 5)
    index.settle_many(DedupIndex.keys("s", ["a"]), [2], [50])
    # "b" is past its window at 105 but "a" (settled at 50) is not: prune stops at "a"
    assert index.prune(WINDOW_MS + 5) == 0
    assert index.lookup("s", "a", WINDOW_MS + 5) == 2
    assert index.prune(WINDOW_MS + 50) == 2
    assert len(index) == 0


def test_the_index_keeps_no_object_the_garbage_collector_tracks_per_commit():
    # Every gen-0 pass promotes and every older one scans again what the collector tracks; a
    # tuple of ints or of str is untracked by the first pass that sees it, a list is not.
    index = DedupIndex(window_ms=WINDOW_MS, ids_max=10**6)
    index.add_many(index.keys("s", ["m0"]), [0], [0])
    gc.collect()
    before = len(gc.get_objects())
    for commit in range(1, 1001):
        index.add_many(index.keys("s", [f"m{commit}"]), [commit], [commit])
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # a few: not one per commit
    assert index.lookup("s", "m1000", 1000) == 1000
    index.prune(now_ms=10**6)
    assert len(index) == 0


def test_the_index_holds_no_object_the_garbage_collector_tracks_per_id():
    # A tracked object held counts towards the next young pass, which then scans it: a value
    # is one int, not a (sequence, timestamp_ms) tuple.
    index = DedupIndex(window_ms=WINDOW_MS, ids_max=10**6)
    keys = index.keys("s", [f"m{n}" for n in range(5000)])
    gc.disable()
    try:
        before = len(gc.get_objects())
        for commit in range(1000):
            at = commit * 5
            index.add_many(keys[at:at + 5], range(at, at + 5), [10**12 + at] * 5)
        assert len(gc.get_objects()) - before < 100  # a few: not one per id or per commit
    finally:
        gc.enable()
    assert index.lookup("s", "m4999", 10**12 + 4995) == 4999


def test_sequences_and_timestamps_of_either_sign_come_back_as_they_were_added():
    index = DedupIndex(window_ms=10**15, ids_max=100)
    for n, (sequence, timestamp_ms) in enumerate([(-1, 0), (-2, -5), (0, 2**62), (2**40, -1),
                                                  (7, 1_700_000_000_000), (3, 2**63),
                                                  (4, 2**64 - 1)]):  # the store's u64 max
        index.add("s", f"m{n}", sequence, timestamp_ms)
        assert index.lookup("s", f"m{n}", timestamp_ms) == sequence
        assert index.lookup("s", f"m{n}", timestamp_ms + 10**15) is None  # its window passed
        assert index.lookup("s", f"m{n}", timestamp_ms + 10**15 - 1) == sequence


def test_add_fresh_leaves_the_index_add_many_leaves():
    # The usual commit's add_fresh packs from one range: the same values and eviction order
    # as add_many's, for sequences and timestamps across the store's domain.
    for first, timestamp_ms in [(0, 0), (5, -5), (2**40, 2**63), (3, 2**64 - 1), (-4, 7)]:
        fresh, many = DedupIndex(10**15, 100), DedupIndex(10**15, 100)
        for index in (fresh, many):
            index.add("s", "old", 1, 0)
        keys = fresh.fresh_keys("s", ["a", "b", "c"], 3)
        assert keys == DedupIndex.keys("s", ["a", "b", "c"])
        fresh.add_fresh(keys, first, timestamp_ms)
        many.add_many(keys, range(first, first + 3), [timestamp_ms] * 3)
        assert fresh._ids == many._ids and list(fresh._order) == list(many._order)
        assert fresh._stale == many._stale == {}
        assert [fresh.lookup("s", i, timestamp_ms) for i in "abc"] == [first, first + 1,
                                                                       first + 2]


def test_fresh_keys_is_none_for_a_known_id_a_repeated_one_or_another_count():
    index = DedupIndex(WINDOW_MS, 10)
    index.add("s", "a", 7, 0)
    assert index.fresh_keys("s", ["x", "a"], 2) is None  # known, even past its window
    assert index.fresh_keys("s", ["x", "x"], 2) is None
    assert index.fresh_keys("s", ["x", "y"], 3) is None
    assert index.fresh_keys("t", ["a"], 1) == DedupIndex.keys("t", ["a"])
