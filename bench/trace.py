"""Trace cost on the realtime broker, in-process: CPU microseconds per message and per event.

Run: ``.venv/bin/python -m bench.trace`` (100,000 messages; ``--messages N``).

It drives ``realtime.tracing.BrokerTracer`` as the broker does on the end-to-end path: each
message is stored (one ``stored`` line flagged ``produced``, which readers expand into both
events), pulled by one consumer of a group and acked, in batches of ``--batch`` (4 events in 3
lines per message), through a ``TraceWriter`` with no background
thread that writes real files to a temporary directory. Every step runs on one thread, so the
figure is the whole CPU cost tracing adds to a broker per message (event building, JSON
encoding and the write), the same whether it lands on the event loop, a storage thread or the
writer thread (all share the GIL). Messages have 256-byte bodies; the store step gets them
with what the broker's send check read of them (``Checked``), as the broker passes them; the pull step gets the same payload objects,
as the broker's tail hands them out.

Each run is repeated ``--runs`` times (default 5) and the median printed; ``process_time``
measures this process's CPU only, so the figure hardly depends on how busy the machine is.
This is a benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

from serverkit.send_check import Checked, QuickCheck
from realtime.tracing import BrokerTracer
from wire.message import Message, encode_message
from tracelog.writer import TraceWriter

BODY_BYTES = 256
EVENTS_PER_MESSAGE = 4  # produced, stored, pulled, acked
LINES_PER_MESSAGE = 3  # stored (flagged produced), pulled, acked
FLUSH_EVERY_MESSAGES = 3_333  # about 10,000 lines: the writer's default batch


def payloads(count: int) -> list[tuple[Checked, bytes]]:
    """``count`` payloads as producers send them, with what the broker's send check reads."""
    now_ms = 1_767_225_600_000
    check = QuickCheck()
    out = []
    for i in range(count):
        payload = encode_message(Message.create("orders.created", bytes(BODY_BYTES),
                                                now_ms=now_ms, id=f"{i:016x}{i:016x}"))
        checked = check.check(payload, now_ms)
        assert checked is not None
        out.append((checked, payload))
    return out


def run_once(all_payloads: list[tuple[Checked, bytes]], batch: int,
             decode_pulls: bool = False) -> float:
    """CPU seconds to trace every payload through store, pull and ack; ``decode_pulls``
    gives the pulls no consumer-log sequences, so each decodes its payload (as when a message
    was stored too long ago)."""
    directory = tempfile.mkdtemp(prefix="qmq-bench-trace-")
    try:
        writer = TraceWriter(directory, "realtime:bench", background=False,
                             batch_max=10_000, pending_events_max=10_000_000)
        tracer = BrokerTracer(writer)
        now_ms = 1_767_225_600_000
        started = time.process_time()
        pull_seq = 0
        for first in range(0, len(all_payloads), batch):
            chunk = all_payloads[first:first + batch]
            seqs = range(pull_seq, pull_seq + len(chunk))  # consumer-log = pull sequences here
            tracer.stored([checked for checked, _p in chunk], seqs, now_ms)
            out = [{"payload": p, "pull_seq": pull_seq + i, "redelivered": 0}
                   for i, (_m, p) in enumerate(chunk)]
            tracer.pulled("orders.created", "billing", "c1", out, now_ms + 1,
                          () if decode_pulls else list(seqs))
            tracer.acked("orders.created", "billing", "c1",
                         [(pull_seq, pull_seq + len(chunk) - 1)], now_ms + 2)
            pull_seq += len(chunk)
            if pull_seq % FLUSH_EVERY_MESSAGES < batch:  # as the writer thread would, in batches
                writer.flush()
        writer.close()
        elapsed = time.process_time() - started
        assert writer.written_events == LINES_PER_MESSAGE * len(all_payloads), (
            writer.written_events, writer.dropped_events)
        return elapsed
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64, help="messages per store/pull/ack")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-pulls", action="store_true",
                        help="pulls decode every payload (no recently-stored members)")
    args = parser.parse_args()
    all_payloads = payloads(args.messages)
    per_message_us = []
    for _ in range(args.runs):
        seconds = run_once(all_payloads, args.batch, args.decode_pulls)
        per_message_us.append(seconds * 1e6 / args.messages)
    median = statistics.median(per_message_us)
    print(f"{args.messages:,} messages x {EVENTS_PER_MESSAGE} events in {LINES_PER_MESSAGE} lines, "
          f"batches of {args.batch}, "
          f"{'pulls decode payloads, ' if args.decode_pulls else ''}"
          f"{args.runs} runs: tracing costs {median:.1f} CPU-us per message "
          f"({median / EVENTS_PER_MESSAGE:.2f} per event), median; runs "
          f"{', '.join(f'{us:.1f}' for us in per_message_us)}")


if __name__ == "__main__":
    main()
