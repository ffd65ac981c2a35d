"""The trace work of W2's hot slot on the realtime broker, in-process: CPU ms in the window
(the calls the broker makes while the burst is served) and of the writes after it.

Run: ``.venv/bin/python -m bench.trace_hot_slot`` (20,000 messages; ``--messages N``).

It drives ``realtime.tracing.BrokerTracer`` as a broker does in a hot slot with the hand-off
on: the members of every held message are built ahead (``visible_members``, at the hand-off,
not timed), then the visibility rounds (``made_visible_members``: 1,024 then 4,096 at a time,
``stored`` and ``dispatched`` lines), each round's messages pulled by one consumer in pulls of
1,024 (``pulled_columns``, with their consumer-log sequences) and each pull acked as one range
(``acked``): "window" is the CPU of those calls. Then ``flush`` writes every line to a
temporary directory ("write": what the writer thread does, after the burst). Messages have
100-byte bodies and one due instant. The median of ``--runs`` (default 5) is printed;
``process_time`` counts this process's CPU only. A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from realtime.handoffs import VISIBLE_BATCH_MAX, VISIBLE_FIRST_BATCH_MAX
from realtime.tracing import BrokerTracer
from serverkit.send_check import Checked, QuickCheck
from tracelog.writer import TraceWriter
from wire.message import Message, encode_message

SUBJECT = "dl.w2"
DUE_MS = 1_795_000_000_000
PULL_MAX = 1_024  # messages per pull, as bench.hot_slot's consumer asks


def held(count: int) -> list[tuple[Checked, bytes]]:
    """``count`` delayed messages due at DUE_MS, with what the broker's check reads."""
    check = QuickCheck()
    out = []
    for i in range(count):
        payload = encode_message(Message(id=f"w2-{i:08d}", subject=SUBJECT, body=bytes(100),
                                         created_at_ms=DUE_MS - 12_000, deliver_at_ms=DUE_MS))
        checked = check.check_many([payload], 1 << 62)[0]
        assert checked is not None
        out.append((checked, payload))
    return out


def run_once(messages: list[tuple[Checked, bytes]]) -> tuple[float, float]:
    """(window CPU ms, write CPU ms) of one hot slot's trace work."""
    directory = tempfile.mkdtemp(prefix="qmq-bench-trace-hot-")
    try:
        writer = TraceWriter(directory, "realtime:bench", background=False,
                             pending_events_max=10_000_000)
        tracer = BrokerTracer(writer)
        members = [tracer.visible_members(checked) for checked, _payload in messages]
        window_s = 0.0
        done = pull_seq = 0
        size = VISIBLE_FIRST_BATCH_MAX
        while done < len(messages):
            batch = messages[done:done + size]
            sequences = list(range(done, done + len(batch)))
            started = time.process_time()
            tracer.made_visible_members(SUBJECT, members[done:done + len(batch)], sequences,
                                        [checked.deliver_at_ms for checked, _ in batch],
                                        DUE_MS + 5)
            window_s += time.process_time() - started
            for first in range(0, len(batch), PULL_MAX):
                pulled = batch[first:first + PULL_MAX]
                pull_seqs = list(range(pull_seq, pull_seq + len(pulled)))
                payloads = [payload for _checked, payload in pulled]
                log_seqs = sequences[first:first + len(pulled)]
                started = time.process_time()
                tracer.pulled_columns(SUBJECT, "g1", "c1", pull_seqs, payloads, None,
                                      DUE_MS + 10, log_seqs)
                tracer.acked(SUBJECT, "g1", "c1", [(pull_seqs[0], pull_seqs[-1])], DUE_MS + 15)
                window_s += time.process_time() - started
                pull_seq += len(pulled)
            done += len(batch)
            size = VISIBLE_BATCH_MAX
        started = time.process_time()
        writer.close()
        return window_s * 1000, (time.process_time() - started) * 1000
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.trace_hot_slot",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    messages = held(args.messages)
    runs = [run_once(messages) for _ in range(args.runs)]
    window = statistics.median(r[0] for r in runs)
    write = statistics.median(r[1] for r in runs)
    print(f"bench.trace_hot_slot: {args.messages:,} messages, median of {args.runs}: "
          f"window {window:.1f} CPU-ms, write {write:.1f} CPU-ms, "
          f"{1000 * (window + write) / args.messages:.2f} us per message in all", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
