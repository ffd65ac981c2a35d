"""How many function calls one message costs ``qmq up``'s event loop, by function (issue 18's
"CPU per message": the loop's CPU is Python spread thin, so the count of calls is the figure a
change to the path moves, whatever the machine's load).

    python -m bench.call_count                    # 500 then 2,500 messages, data dir in /dev/shm
    python -m bench.call_count --top 40           # the 40 most called functions
    python -m bench.call_count --disk             # data dir in /tmp

``qmq up`` runs under ``cProfile`` (which sees the event loop's thread only: the store thread's
calls are not counted). The client is bench.path_cpu's: one message at a time (send, wait for
the confirmation, wait until the consumer has it, ack), so no message shares a batch, a commit
or a pull with another, and the count is per commit cycle. Two runs on two fresh servers, with
``--few`` and ``--many`` messages; their difference over ``--many - --few`` messages takes out
the start-up and the warm-up. The idle work of the seconds the extra messages took stays in
(an idle ``qmq up`` makes ~13,000 calls a second: ~40 a message at cProfile's ~300 messages a
second), and the rate moves with the machine's load, so compare trees function by function
(the rows of the request path are exact); the totals move by tens of calls between runs. Printed: the calls per message in all, those of
Python functions, then per function its calls per message and cProfile's time per message
(cProfile slows every call several times over: its times rank functions, they are not CPU
figures; bench.path_cpu gives those).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import sys
import sysconfig
import tempfile
from typing import Any

from bench.path_cpu import _one_run, qmq_up
from bench.peers.servers import wait_in_sync

# A function as cProfile names it: (file, line, name).
FunctionKey = tuple[str, int, str]


def count_calls(messages: int, tmpfs: bool = True, replicas: int = 1,
                event_loop: str | None = None) -> dict[FunctionKey, tuple[int, float]]:
    """A fresh ``qmq up`` under cProfile, ``messages`` one at a time (after path_cpu's warm-up),
    stopped: per function, its calls and cProfile's own time in it (callees not included), in seconds.
    ``replicas`` 2: with a sync slave of each group (in the same process), once it is in sync.
    ``event_loop``: ``qmq up --event-loop`` (uvloop's own work is C, which cProfile sees only
    as the Python calls it makes back)."""
    extra = ["--replicas", str(replicas)] if replicas > 1 else []
    if event_loop is not None:
        extra += ["--event-loop", event_loop]
    with tempfile.TemporaryDirectory(prefix="qmq-call-count-") as directory:
        profile = os.path.join(directory, "qmq-up.prof")
        with qmq_up("qmq-call-count-", "sync", extra, tmpfs=tmpfs,
                    interpreter_args=["-m", "cProfile", "-o", profile]) as server:
            if replicas > 1:
                wait_in_sync(f"http://{server.address}")
            asyncio.run(_one_run(f"http://{server.address}", server.pid, messages, 0.2, False))
        # qmq up exits on SIGTERM through its graceful stop, and cProfile writes as it ends.
        stats: dict[FunctionKey, Any] = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        return {key: (row[1], row[2]) for key, row in stats.items()}  # calls, own time


def per_message(few: dict[FunctionKey, tuple[int, float]],
                many: dict[FunctionKey, tuple[int, float]], messages: int
                ) -> list[tuple[FunctionKey, float, float]]:
    """Per function, (key, calls per message, cProfile us per message) over the ``messages``
    that the larger run had more, most called first."""
    rows = []
    for key in set(few) | set(many):
        calls = many.get(key, (0, 0.0))[0] - few.get(key, (0, 0.0))[0]
        seconds = many.get(key, (0, 0.0))[1] - few.get(key, (0, 0.0))[1]
        rows.append((key, calls / messages, seconds / messages * 1e6))
    rows.sort(key=lambda row: (-row[1], row[0]))
    return rows


def describe(key: FunctionKey) -> str:
    """``name file:line``, with the path cut to what follows site-packages, the standard
    library's directory or the repository."""
    filename, line, name = key
    if filename == "~":
        return name  # a builtin: cProfile names it in full
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    stdlib = sysconfig.get_paths()["stdlib"]
    for prefix in (root + os.sep, "site-packages" + os.sep, stdlib + os.sep):
        if prefix in filename:
            filename = filename.split(prefix, 1)[1]
    return f"{name} {filename}:{line}"


def is_python(key: FunctionKey) -> bool:
    """A Python function (cProfile names builtins and C methods with the file ``~``)."""
    return key[0] != "~"


def main(argv: list[str] | None = None) -> int:
    """Count, print the totals and the ``--top`` functions."""
    parser = argparse.ArgumentParser(prog="python -m bench.call_count", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--few", type=int, default=500, help="messages of the smaller run")
    parser.add_argument("--many", type=int, default=2_500, help="messages of the larger run")
    parser.add_argument("--top", type=int, default=60, help="functions listed")
    parser.add_argument("--disk", action="store_true", help="data dir in /tmp, not /dev/shm")
    parser.add_argument("--replicas", type=int, default=1,
                        help="qmq up --replicas: 2 adds a sync slave to each group")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default=None,
                        help="qmq up --event-loop")
    args = parser.parse_args(argv)
    if not 0 < args.few < args.many:
        parser.error(f"--few {args.few} must be above 0 and below --many {args.many}")
    print(f"qmq up under cProfile, {args.few} then {args.many} messages one at a time "
          f"({'disk' if args.disk else 'tmpfs'} data dir, replicas {args.replicas}, event loop "
          f"{args.event_loop or 'default'}); load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    few = count_calls(args.few, tmpfs=not args.disk, replicas=args.replicas,
                      event_loop=args.event_loop)
    many = count_calls(args.many, tmpfs=not args.disk, replicas=args.replicas,
                       event_loop=args.event_loop)
    rows = per_message(few, many, args.many - args.few)
    total = sum(calls for _, calls, _ in rows)
    python = sum(calls for key, calls, _ in rows if is_python(key))
    print(f"event loop calls per message: {total:.0f}, of Python functions {python:.0f}")
    print("  calls/msg  cProfile own us/msg  function")
    for key, calls, us in rows[:args.top]:
        print(f"  {calls:9.2f}  {us:19.1f}  {describe(key)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
