"""A model-based test of DelayStore: random sends (some late), dispatches, cancels, watermark
moves, checkpoints, clean reopens and crashes (the data directory copied while open), checked
against a plain-dict model after every step: what load_bucket returns, cancel outcomes and the
pending counts."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.storage import DelayStore, DelayStoreConfig
from delayserver.storage.layout import HOUR_MS

NOW_MS = 1_700_000_000_000
BUCKET_MS = 1_000
BASE = NOW_MS - NOW_MS % HOUR_MS
BUCKETS = 12  # every message is due within BASE + 12 buckets (one hour)
SUBJECTS = ("orders", "refunds", "%retry%orders%billing")


@dataclass
class Message:
    subject: str
    deliver_at_ms: int
    filed_bucket_ms: int
    state: str = "pending"  # "pending" | "dispatched" | "cancelled"


class Model:
    def __init__(self) -> None:
        self.messages: dict[str, Message] = {}
        self.done_before = 0

    def pending(self) -> dict[str, Message]:
        return {k: m for k, m in self.messages.items() if m.state == "pending"}

    def cancel_outcome(self, message_id: str, deliver_at_ms: int) -> str:
        message = self.messages.get(message_id)
        if message is None:
            natural = deliver_at_ms - deliver_at_ms % BUCKET_MS
            return "already_past" if natural < self.done_before else "unknown"
        if message.filed_bucket_ms < self.done_before:
            return "already_past"  # its bucket is finished and its files retired
        return {"pending": "cancelled", "dispatched": "already_dispatched",
                "cancelled": "already_cancelled"}[message.state]


def check(store: DelayStore, model: Model) -> None:
    pending = model.pending()
    seen = {}
    buckets = store.buckets_with_pending(0, BASE + 2 * HOUR_MS)
    assert buckets == sorted(buckets)
    for bucket in buckets:
        for entry in store.load_bucket(bucket):
            record = store.read(entry)
            assert record.message_id not in seen, "loaded twice"
            seen[record.message_id] = entry
            assert record.payload == record.message_id.encode() * 2
            assert entry.bucket_ms == bucket
    assert set(seen) == set(pending)
    for message_id, entry in seen.items():
        assert entry.bucket_ms == pending[message_id].filed_bucket_ms
        assert entry.deliver_at_ms == pending[message_id].deliver_at_ms
    stats = store.pending_stats()
    assert stats.total == len(pending)
    per_subject: dict[str, int] = {}
    per_hour: dict[int, int] = {}
    for message in pending.values():
        per_subject[message.subject] = per_subject.get(message.subject, 0) + 1
        hour = message.filed_bucket_ms - message.filed_bucket_ms % HOUR_MS
        per_hour[hour] = per_hour.get(hour, 0) + 1
    assert stats.per_subject == per_subject
    assert stats.per_hour == per_hour
    assert store.done_before() == model.done_before


step = st.one_of(
    st.tuples(st.just("send"), st.lists(st.tuples(st.integers(-3, BUCKETS - 1),
                                                  st.integers(0, BUCKET_MS - 1),
                                                  st.sampled_from(SUBJECTS)),
                                        min_size=1, max_size=12)),
    st.tuples(st.just("dispatch"), st.integers(0, 50)),
    st.tuples(st.just("cancel"), st.integers(0, 80)),
    st.tuples(st.just("mark_done"), st.integers(1, 4)),
    st.tuples(st.just("checkpoint"), st.none()),
    st.tuples(st.just("reopen"), st.none()),
    st.tuples(st.just("crash"), st.none()),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(step, min_size=1, max_size=25), st.sampled_from(["sync", "async"]))
def test_the_store_matches_a_model_through_sends_dispatches_cancels_reopens_and_crashes(
    steps, flush_mode
):
    config = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096,
                              checkpoint_every_bytes=1_500, flush_mode=flush_mode)
    root = tempfile.mkdtemp(prefix="delay-model-")
    try:
        directory = f"{root}/0"
        store = DelayStore(directory, config, now_ms=NOW_MS)
        model = Model()
        next_id = 0
        generation = 0
        for op, arg in steps:
            if op == "send":
                for bucket_offset, ms, subject in arg:
                    message_id = f"m{next_id}"
                    next_id += 1
                    deliver_at = BASE + bucket_offset * BUCKET_MS + ms
                    store.append(message_id, subject, deliver_at, message_id.encode() * 2)
                    natural = deliver_at - deliver_at % BUCKET_MS
                    model.messages[message_id] = Message(subject, deliver_at,
                                                         max(natural, model.done_before))
                entries = store.commit()
                assert len(entries) == len(arg)
            elif op == "dispatch":
                pending = sorted(model.pending().items(), key=lambda kv: kv[1].filed_bucket_ms)
                if pending:
                    bucket = pending[arg % len(pending)][1].filed_bucket_ms
                    loaded = store.load_bucket(bucket)
                    chosen = loaded[: 1 + arg % len(loaded)]
                    store.record_dispatched(chosen)
                    for entry in chosen:
                        model.messages[store.read(entry).message_id].state = "dispatched"
            elif op == "cancel":
                message_id = f"m{arg}"
                known = model.messages.get(message_id)
                deliver_at = known.deliver_at_ms if known else BASE + 5
                expected = model.cancel_outcome(message_id, deliver_at)
                assert store.cancel(message_id, deliver_at) == expected
                if expected == "cancelled":
                    known.state = "cancelled"
            elif op == "mark_done":
                pending_buckets = [m.filed_bucket_ms for m in model.pending().values()]
                limit = min(pending_buckets, default=BASE + BUCKETS * BUCKET_MS)
                target = min(limit, BASE + arg * BUCKET_MS * 3)
                if target > model.done_before:
                    store.mark_done_before(target)
                    model.done_before = target
            elif op == "checkpoint":
                store.checkpoint()
            else:
                generation += 1
                if op == "crash":
                    image = f"{root}/{generation}"
                    shutil.copytree(directory, image)
                    store.close()
                    directory = image
                else:
                    store.close()
                store = DelayStore(directory, config, now_ms=NOW_MS)
            check(store, model)
        store.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
