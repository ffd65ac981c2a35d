"""The event loop's CPU for one woken long poll at a low rate (issue 18, 2,000 msg/s): a pull
parks, a send of a few messages wakes it, it answers them, and they are acked.

    python -m bench.pull_wake                       # 3,000 cycles of 3 messages, 5 runs
    python -m bench.pull_wake --per-send 1 --ack-every 8
    python -m bench.pull_wake --direct both         # the pull parked with no task, and in one,
                                                    # runs alternated

An in-process realtime broker (flush sync, data dir in /tmp, tracing on, as ``qmq up`` runs
it). A cycle: one pull (``wait_ms`` 20 s) parks, one send of ``--per-send`` messages commits
and wakes it, the pull answers; every ``--ack-every`` cycles one ack of the pulls' range. Each
cycle is followed by a send alike to another subject, which nobody pulls. Printed: the event loop thread's CPU
(``time.thread_time``: the store thread's commit is not in it) per cycle for both phases, and
their difference, about what the pull, its wake and its ack cost the loop; the median of
``--runs`` runs, each run's figures after it. No frames are encoded or sent: the request path
(FrameServer) is not in it. ``--direct on`` makes the pull as the realtime server does
(``direct``: tried at once, parked with no task, its end handed to ``Pulls.parked_answered``;
here that resolves a future the cycle awaits); ``both`` alternates runs without and with it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from realtime.broker import Broker
from realtime.config import RealtimeConfig
from realtime.pulls import Pulled
from realtime.tracing import BrokerTracer
from tracelog.writer import TraceWriter
from wire.message import Message, encode_message
from wire.protocol import Ack, Pull

SUBJECT, GROUP = "bench.wake", "g"
ALONE_SUBJECT = "bench.wake.alone"  # sent to, never pulled
BODY_BYTES = 256
WARM_UP_CYCLES = 200


async def _park_direct(broker: Broker, request: Pull) -> asyncio.Future[Pulled]:
    """A pull as the realtime server makes it, parked with no task: the future of its answer."""
    answer: asyncio.Future[Pulled] = asyncio.get_running_loop().create_future()
    # Where the parked pull's end goes (the server sets its own once: here one per cycle, as
    # only this pull is parked).
    broker.pulls.parked_answered = lambda poll, out: answer.set_result(out)  # type: ignore
    out = await broker.pull(request, None, direct=True)
    if isinstance(out, Pulled):
        answer.set_result(out)
    return answer


async def _cycles(broker: Broker, cycles: int, per_send: int, ack_every: int,
                  direct: bool = False) -> tuple[float, float]:
    """Loop-thread CPU seconds of ``cycles`` cycles with a pull and of as many sends alone,
    taken in turns so that both see the same machine (see the module docstring)."""
    request = Pull(1, SUBJECT, GROUP, "c1", 256, 20_000, [], "earliest", False)
    pending: list[int] = []
    payloads = [[encode_message(Message.create(subject, os.urandom(BODY_BYTES),
                                               now_ms=broker.clock()))
                 for _ in range(per_send)]
                for _ in range(cycles) for subject in (SUBJECT, ALONE_SUBJECT)]
    spent = [0.0, 0.0]  # with the pull, send alone
    for n in range(cycles):
        start_s = time.thread_time()
        if direct:  # parked in this step, no task: the reply resolves the future
            task = await _park_direct(broker, request)
        else:
            task = asyncio.ensure_future(broker.pull(request))
        while broker.waiting_pulls == 0:
            await asyncio.sleep(0)
        await broker.send(payloads[2 * n])
        pulled = await task
        pending.extend(pulled.pull_seqs)
        if len(pending) >= ack_every * per_send:
            await broker.ack(Ack(2, SUBJECT, GROUP, "c1", [(pending[0], pending[-1])]))
            pending.clear()
        middle_s = time.thread_time()
        await broker.send(payloads[2 * n + 1])
        end_s = time.thread_time()
        spent[0] += middle_s - start_s
        spent[1] += end_s - middle_s
    return spent[0], spent[1]


async def run_once(cycles: int, per_send: int, ack_every: int,
                   direct: bool = False) -> tuple[float, float]:
    """Loop CPU seconds per cycle: with the pull, and of a send alone."""
    with tempfile.TemporaryDirectory(prefix="qmq-bench-wake-") as directory:
        config = RealtimeConfig(data_dir=directory, port=0, flush="sync")
        writer = TraceWriter(config.trace_directory, "realtime:bench")
        broker = await Broker.open(config, tracer=BrokerTracer(writer))
        try:
            await _cycles(broker, WARM_UP_CYCLES, per_send, ack_every, direct)
            with_pull, alone = await _cycles(broker, cycles, per_send, ack_every, direct)
        finally:
            await broker.stop()
            writer.close()
    return with_pull / cycles, alone / cycles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=3_000)
    parser.add_argument("--per-send", type=int, default=3, help="messages per send")
    parser.add_argument("--ack-every", type=int, default=1, help="cycles per ack")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--direct", choices=("off", "on", "both"), default="off",
                        help="the pull made as the realtime server makes it (no task)")
    args = parser.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.direct]
    runs: dict[bool, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for _ in range(args.runs):
        for mode in modes:
            runs[mode].append(asyncio.run(run_once(args.cycles, args.per_send, args.ack_every,
                                                   mode)))
    for mode, results in runs.items():
        diffs = [(w - a) * 1e6 for w, a in results]
        print(f"{args.cycles:,} cycles of {args.per_send} message(s), an ack every "
              f"{args.ack_every} cycle(s), direct {'on' if mode else 'off'}; load "
              f"{os.getloadavg()[0]:.2f}: loop CPU-us per cycle, median: with the pull "
              f"{statistics.median(w for w, _ in results) * 1e6:.1f}, send alone "
              f"{statistics.median(a for _, a in results) * 1e6:.1f}, the pull's part "
              f"{statistics.median(diffs):.1f} (runs {', '.join(f'{d:.1f}' for d in diffs)})")


if __name__ == "__main__":
    main()
