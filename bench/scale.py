"""How a broker's and a MetaServer's costs grow with consumers and groups (issue 19).

Three measurements, each over a fresh loopback cluster (``bench._cluster.Cluster``):

- ``idle``: N connected consumers (one ``qmq.Consumer`` each, on 10 subjects, one group, all
  in one client process run from the tree) with no traffic. After they settle, the broker's,
  the MetaServer's and the client process's CPU per second over a window, and the MetaServer's
  database write transactions per second (``qmq_meta_write_transactions_total``).
- ``groups``: G consumer groups set up by a first pull each (a raw client, one subject per
  group, as ``qmq`` consumers do on their first pull); the broker's CPU per group setup, in
  batches, so a creep as groups accumulate shows as a rising figure.
- ``admin``: the wall time of ``qmq admin groups`` against the MetaServer.
- ``burst``: ``--messages`` (10k) sent at once to one subject that ``--consumers`` idle
  consumers of one group pull (each with ``--prefetch``, 0: the SDK's default): how many
  consumers the burst reached, and the time from its first send until the last message came
  (docs/SDK.md, "How a burst spreads over a group").
- ``grid``: the issue's table: subjects with a group each at ``--sizes`` (100, 1k, 10k) and
  idle consumers at ``--consumer-sizes`` (100, 1,000); for each, the broker's and the
  MetaServer's CPU while idle, their RSS, the bytes of one broker heartbeat and of one backlog
  report (``qmq_meta_http_request_bytes_total`` over the window), and the broker's open files.

``--tree DIR`` runs the servers (and the CLI, and the idle consumers' process) from another
checkout, e.g. an export of main before a change (``git archive main | tar -x -C DIR``, with
the built C twins ``*.so`` copied in, else the servers run their Python twins), so before and
after can alternate in one sitting: ``--tree`` may be given twice and the runs alternate between the trees. Every run
prints the 1-minute load average beside it: the machine may be shared, and the figures are
only comparable between runs of one sitting.

    python -m bench.scale idle --consumers 300 --runs 3
    python -m bench.scale groups --groups 3000
    python -m bench.scale admin --runs 5
    python -m bench.scale burst --consumers 300 --prefetch 32 --runs 3
    python -m bench.scale grid --runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import asynccontextmanager, contextmanager
from typing import Any, AsyncIterator, Iterator

from bench._cluster import Cluster, process_cpu_s
from tests.rawclient import FakeClock, RawClient, message
from wire.limits import MAX_SEND_BATCH_MESSAGES

SUBJECTS = 10
CONNECT_WAIT_S = 300.0  # longest wait for every consumer to connect to the broker
SETTLE_S = 20.0  # after they connected: first heartbeats and routes are written; then the window
# Longer than one SDK heartbeat interval (5 s) and than two route refreshes (30 s each): a
# shorter window caught the idle consumers' refreshes, most of a MetaServer's idle work, or not,
# by chance (29-49% of a core for the same 300 consumers).
WINDOW_S = 60.0
CONSUMER_EXPIRY_S = 30.0  # the broker's default consumer expiry (RealtimeConfig)
BURST_SETTLE_S = 10.0  # after the consumers connected, before the burst
CLOSE_WAIT_S = 120.0  # longest wait for the client process to close its consumers and exit


def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


@contextmanager
def tree(directory: str | None) -> Iterator[None]:
    """Run the servers (python -m qmq, started from the cwd) from ``directory`` if given."""
    if directory is None:
        yield
        return
    before_cwd, before_path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(directory)
    os.environ["PYTHONPATH"] = directory
    try:
        yield
    finally:
        os.chdir(before_cwd)
        if before_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before_path


def connections(port: str) -> int:
    """Established TCP connections to the local ``port`` (the broker's clients)."""
    out = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
                         capture_output=True, text=True, check=True).stdout
    return len(out.splitlines())


def meta_writes(meta_url: str) -> float:
    """The MetaServer's ``qmq_meta_write_transactions_total``; from a MetaServer without it
    (before issue 19), its answered heartbeats, one write transaction each."""
    with urllib.request.urlopen(f"{meta_url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    heartbeats = 0.0
    for line in lines:
        if line.startswith("qmq_meta_write_transactions_total "):
            return float(line.split()[1])
        if line.startswith("qmq_meta_http_requests_total{") and "heartbeat" in line \
                and 'status="200"' in line:
            heartbeats += float(line.rsplit(" ", 1)[1])
    return heartbeats


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MB (VmRSS), 0.0 if unknown."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def open_files(pid: int) -> int:
    """Descriptors ``pid`` holds open now."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def request_bytes(meta_url: str) -> dict[str, tuple[float, float]]:
    """Per broker route (heartbeat, backlog): (requests answered 200, request body bytes)."""
    with urllib.request.urlopen(f"{meta_url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    out: dict[str, list[float]] = {"heartbeat": [0.0, 0.0], "backlog": [0.0, 0.0]}
    for line in lines:
        for name in out:
            if f'route="/api/brokers/{name}"' not in line:
                continue
            if line.startswith("qmq_meta_http_requests_total{") and 'status="200"' in line:
                out[name][0] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("qmq_meta_http_request_bytes_total{"):
                out[name][1] += float(line.rsplit(" ", 1)[1])
    return {name: (count, size) for name, (count, size) in out.items()}


class Window:
    """CPU, writes and request bytes of a cluster over one measuring window."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    async def __aenter__(self) -> Window:
        c = self.cluster
        self.cpu0 = process_cpu_s(c.broker.pid), process_cpu_s(c.meta.pid)
        self.writes0 = await asyncio.to_thread(meta_writes, c.meta_url)
        self.bytes0 = await asyncio.to_thread(request_bytes, c.meta_url)
        self.began = time.monotonic()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        c = self.cluster
        self.elapsed = time.monotonic() - self.began
        self.cpu1 = process_cpu_s(c.broker.pid), process_cpu_s(c.meta.pid)
        self.writes1 = await asyncio.to_thread(meta_writes, c.meta_url)
        self.bytes1 = await asyncio.to_thread(request_bytes, c.meta_url)
        self.result = self._figures()

    def _figures(self) -> dict[str, Any]:
        """What the window measured, with the servers' RSS and the broker's open files at its
        end (read while they run: ``result`` keeps it)."""
        c, elapsed = self.cluster, self.elapsed
        out: dict[str, Any] = {
            "broker_cpu_pct": round(100 * (self.cpu1[0] - self.cpu0[0]) / elapsed, 1),
            "meta_cpu_pct": round(100 * (self.cpu1[1] - self.cpu0[1]) / elapsed, 1),
            # the window's scrapes are writes of none: only heartbeats and flushes count
            "meta_writes_per_s": round((self.writes1 - self.writes0) / elapsed, 1),
            "broker_rss_mb": rss_mb(c.broker.pid), "meta_rss_mb": rss_mb(c.meta.pid),
            "broker_open_files": open_files(c.broker.pid)}
        for name in ("heartbeat", "backlog"):
            count = self.bytes1[name][0] - self.bytes0[name][0]
            size = self.bytes1[name][1] - self.bytes0[name][1]
            out[f"{name}_bytes"] = round(size / count) if count else None
        return out


# The idle consumers' process: run with the tree's code on the path (``--tree``), so the
# client side of a change (the SDK's heartbeats and route refreshes) is measured with it.
# argv: MetaServer URL, consumers, subjects; prints "ready" once every consumer subscribed, and
# closes them all gracefully when its stdin closes.
CLIENT_SCRIPT = """
import asyncio, sys
import qmq

async def main(meta_url, count, subjects):
    pool = [qmq.Consumer(meta_url, group="idle", consumer_id=f"c{i}") for i in range(count)]
    for i, consumer in enumerate(pool):
        await consumer.__aenter__()
        consumer.subscribe(f"idle.s{i % subjects}")
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await asyncio.gather(*(c.close() for c in pool), return_exceptions=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


@asynccontextmanager
async def client_process(cluster: Cluster, script: str, consumers: int,
                         args: list[str]) -> AsyncIterator[subprocess.Popen[str]]:
    """A client process running ``script`` (the MetaServer's URL, then ``args``), once it said
    "ready" and the broker has ``consumers`` connections (or CONNECT_WAIT_S passed); on exit its
    stdin is closed (its cue to stop) and it is killed if it has not ended in CLOSE_WAIT_S."""
    client = subprocess.Popen([sys.executable, "-c", script, cluster.meta_url, *args],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdin is not None
        ready = await asyncio.to_thread(client.stdout.readline)
        assert ready.strip() == "ready", ready
        port = cluster.broker.address.rsplit(":", 1)[1]
        deadline = time.monotonic() + CONNECT_WAIT_S
        while connections(port) < consumers and time.monotonic() < deadline:
            await asyncio.sleep(1)
        yield client
    finally:
        if client.stdin is not None:
            client.stdin.close()
        try:
            await asyncio.to_thread(client.wait, CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()


async def idle_run(consumers: int) -> dict[str, Any]:
    """One run of ``idle``: CPU of the broker and MetaServer per second, writes per second,
    with the consumers in a client process of their own (its CPU reported beside)."""
    with Cluster() as cluster:
        async with client_process(cluster, CLIENT_SCRIPT, consumers,
                                  [str(consumers), str(SUBJECTS)]) as client:
            connected = connections(cluster.broker.address.rsplit(":", 1)[1])
            await asyncio.sleep(SETTLE_S)
            client_cpu0 = process_cpu_s(client.pid)
            async with Window(cluster) as window:
                await asyncio.sleep(WINDOW_S)
            client_cpu_pct = round(100 * (process_cpu_s(client.pid) - client_cpu0)
                                   / window.elapsed, 1)
    figures = window.result
    return {"consumers": consumers, "connected": connected, **figures,
            "client_cpu_pct": client_cpu_pct,
            "broker_cpu_ms_per_consumer_s": round(
                10 * figures["broker_cpu_pct"] / max(consumers, 1), 3),
            "meta_cpu_ms_per_consumer_s": round(
                10 * figures["meta_cpu_pct"] / max(consumers, 1), 3),
            "load_1m": round(load_average(), 1)}


# The burst's consumers' process: argv MetaServer URL, consumers, messages, prefetch (0: the
# SDK's default). Prints "ready" once subscribed, then one JSON line when every message has
# come (or BURST_WAIT_S passed): how many came, to how many consumers, and the monotonic
# times of the first and last; then waits for its stdin to close.
BURST_SCRIPT = """
import asyncio, json, sys, time
import qmq

async def main(meta_url, count, messages, prefetch):
    got, first, last = {}, [], []
    done = asyncio.Event()
    options = {"prefetch": prefetch} if prefetch else {}
    pool = [qmq.Consumer(meta_url, group="burst", consumer_id=f"b{i}", **options)
            for i in range(count)]

    async def take(name, sub):
        async for msg in sub:
            now = time.monotonic()
            first[:] = first or [now]
            last[:] = [now]
            got[name] = got.get(name, 0) + 1
            await msg.ack()
            if sum(got.values()) >= messages:
                done.set()

    tasks = []
    for i, consumer in enumerate(pool):
        await consumer.__aenter__()
        tasks.append(asyncio.create_task(take(f"b{i}", consumer.subscribe("burst.s"))))
    print("ready", flush=True)
    try:
        await asyncio.wait_for(done.wait(), %(wait)s)
    except TimeoutError:
        pass
    print(json.dumps({"received": sum(got.values()), "consumers_with_messages": len(got),
                      "first_s": first[0] if first else None,
                      "last_s": last[0] if last else None}), flush=True)
    await asyncio.to_thread(sys.stdin.read)
    await asyncio.gather(*(c.close() for c in pool), return_exceptions=True)

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
"""
BURST_WAIT_S = 120.0  # longest wait for a burst to be consumed


async def burst_run(consumers: int, messages: int, prefetch: int) -> dict[str, Any]:
    """One run of ``burst``: ``messages`` sent at once to a subject that ``consumers`` idle
    consumers of one group pull (``prefetch`` each, 0: the default): how many consumers the
    burst reached, and how long from its first send until the last message came."""
    with Cluster() as cluster:
        script = BURST_SCRIPT % {"wait": BURST_WAIT_S}
        async with client_process(cluster, script, consumers,
                                  [str(consumers), str(messages), str(prefetch)]) as client:
            assert client.stdout is not None
            await asyncio.sleep(BURST_SETTLE_S)  # every consumer's first pull parked
            host, broker_port = cluster.broker.address.rsplit(":", 1)
            sender = await RawClient.connect(int(broker_port))
            clock = FakeClock()
            began = time.monotonic()
            try:
                step = MAX_SEND_BATCH_MESSAGES
                for first in range(0, messages, step):
                    sent = await sender.send(*(message("burst.s", b"x" * 100, clock)
                                               for _ in range(first, min(messages,
                                                                          first + step))))
                    assert all(r["status"] == "stored" for r in sent.get("results", [None])), \
                        sent
            finally:
                await sender.close()
            sent_s = time.monotonic() - began
            result = json.loads(await asyncio.to_thread(client.stdout.readline))
    drained_s = result["last_s"] - began if result["last_s"] is not None else None
    return {"consumers": consumers, "messages": messages, "prefetch": prefetch or "default",
            "received": result["received"],
            "consumers_with_messages": result["consumers_with_messages"],
            "sent_s": round(sent_s, 2),
            "drained_s": round(drained_s, 2) if drained_s is not None else None,
            "msgs_per_s": round(messages / drained_s) if drained_s else None,
            "load_1m": round(load_average(), 1)}


async def subjects_run(subjects: int) -> dict[str, Any]:
    """``subjects`` subjects with a message and a group each (set up by a raw client's pull),
    then idle: what they cost while nothing happens."""
    with Cluster() as cluster:
        host, port = cluster.broker.address.rsplit(":", 1)
        client = await RawClient.connect(int(port))
        clock = FakeClock()
        try:
            for first in range(0, subjects, 200):
                sent = await client.send(*(message(f"grid.s{i}", b"x", clock)
                                           for i in range(first, min(subjects, first + 200))))
                assert all(r["status"] == "stored" for r in sent["results"]), sent
            for first in range(0, subjects, 500):
                answers = await asyncio.gather(*(
                    client.pull(f"grid.s{i}", f"g{i}", "c1", start="earliest")
                    for i in range(first, min(subjects, first + 500))))
                assert all(len(a.get("pull_seqs", ())) == 1 for a in answers), answers[:3]
            # The backlog reaches the MetaServer in reports of at most 1,000 rows every 3 s, and
            # the raw client's consumer expires after the broker's consumer expiry (30 s): its
            # groups' rows change once then, which must fall before the window.
            await asyncio.sleep(max(SETTLE_S, CONSUMER_EXPIRY_S + 5) + 3 * subjects / 1000)
            async with Window(cluster) as window:
                await asyncio.sleep(WINDOW_S)
        finally:
            await client.close()
    return {"subjects_and_groups": subjects, **window.result,
            "load_1m": round(load_average(), 1)}


async def groups_run(groups: int, batch: int) -> dict[str, Any]:
    """One run of ``groups``: broker CPU ms per group setup, per batch of ``batch`` groups."""
    with Cluster() as cluster:
        host, port = cluster.broker.address.rsplit(":", 1)
        client = await RawClient.connect(int(port))
        per_batch = []
        clock = FakeClock()
        try:
            for first in range(0, groups, 200):  # one message per subject: a pull creates a group
                sent = await client.send(*(message(f"grp.s{i}", b"x", clock)
                                           for i in range(first, min(groups, first + 200))))
                assert all(r["status"] == "stored" for r in sent["results"]), sent
            for first in range(0, groups, batch):
                cpu0 = process_cpu_s(cluster.broker.pid)
                count = min(batch, groups - first)
                answers = await asyncio.gather(*(
                    client.pull(f"grp.s{i}", f"g{i}", "c1", start="earliest")
                    for i in range(first, first + count)))
                assert all(len(a.get("pull_seqs", ())) == 1 for a in answers), answers[:3]
                per_batch.append(round(1000 * (process_cpu_s(cluster.broker.pid) - cpu0) / count,
                                       2))
            # What the groups cost once set up, with no traffic: the broker's background rounds
            # (expiry, heartbeat backlog, flush) over every group.
            cpu0, began = process_cpu_s(cluster.broker.pid), time.monotonic()
            await asyncio.sleep(WINDOW_S)
            idle_pct = round(100 * (process_cpu_s(cluster.broker.pid) - cpu0)
                             / (time.monotonic() - began), 1)
        finally:
            await client.close()
    return {"groups": groups, "broker_cpu_ms_per_group_by_batch": per_batch,
            "first_batch": per_batch[0], "last_batch": per_batch[-1],
            "idle_broker_cpu_pct": idle_pct,
            "load_1m": round(load_average(), 1)}


def admin_run(groups: int) -> dict[str, Any]:
    """One run of ``admin``: wall seconds of ``qmq admin groups``."""
    with Cluster() as cluster:
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "qmq", "admin", "groups", "--meta",
                               cluster.meta_url], capture_output=True, text=True, timeout=120)
        wall_s = time.monotonic() - began
        assert done.returncode == 0, done.stderr
    return {"admin_groups_wall_s": round(wall_s, 2), "load_1m": round(load_average(), 1)}


def summarize(label: str, runs: list[dict[str, Any]], keys: list[str]) -> dict[str, Any]:
    """Medians of ``keys`` over ``runs``."""
    return {"tree": label, "runs": len(runs),
            **{f"median_{key}": statistics.median(r[key] for r in runs) for key in keys},
            "load_1m": [r["load_1m"] for r in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["idle", "groups", "admin", "grid", "burst"])
    parser.add_argument("--messages", type=int, default=10_000, help="burst: messages sent")
    parser.add_argument("--prefetch", type=int, default=0,
                        help="burst: each consumer's prefetch (0: the SDK's default)")
    parser.add_argument("--sizes", default="100,1000,10000",
                        help="grid: subjects (a group each) per run")
    parser.add_argument("--consumer-sizes", default="100,1000",
                        help="grid: idle consumers per run")
    parser.add_argument("--consumers", type=int, default=300)
    parser.add_argument("--groups", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[],
                        help="run the servers from this checkout (give twice to alternate)")
    args = parser.parse_args()
    if args.what == "grid":
        grid(args)
        return
    trees: list[str | None] = [os.path.abspath(t) for t in args.tree] or [None]
    results: dict[str, list[dict[str, Any]]] = {str(t): [] for t in trees}
    for run in range(args.runs):
        for directory in trees:
            with tree(directory):
                if args.what == "idle":
                    result = asyncio.run(idle_run(args.consumers))
                elif args.what == "burst":
                    result = asyncio.run(burst_run(args.consumers, args.messages,
                                                   args.prefetch))
                elif args.what == "groups":
                    result = asyncio.run(groups_run(args.groups, args.batch))
                else:
                    result = admin_run(args.groups)
            result["tree"] = str(directory)
            results[str(directory)].append(result)
            print(json.dumps(result), flush=True)
    keys = {"idle": ["broker_cpu_pct", "meta_cpu_pct", "meta_writes_per_s", "client_cpu_pct",
                     "broker_rss_mb"],
            "groups": ["first_batch", "last_batch", "idle_broker_cpu_pct"],
            "admin": ["admin_groups_wall_s"],
            "burst": ["consumers_with_messages", "drained_s", "msgs_per_s"]}[args.what]
    for label, runs in results.items():
        print(json.dumps(summarize(label, runs, keys)), flush=True)


def grid(args: argparse.Namespace) -> None:
    """The issue's table: one line per size and run, then the medians per size."""
    keys = ["broker_cpu_pct", "meta_cpu_pct", "meta_writes_per_s", "broker_rss_mb",
            "meta_rss_mb", "broker_open_files"]
    for label, run, sizes in (
            ("subjects", subjects_run, args.sizes),
            ("consumers", idle_run, args.consumer_sizes)):
        for size in (int(n) for n in sizes.split(",") if n):
            runs = []
            for _ in range(args.runs):
                result = asyncio.run(run(size))
                runs.append(result)
                print(json.dumps(result), flush=True)
            print(json.dumps(summarize(f"{label}={size}", runs, keys)), flush=True)


if __name__ == "__main__":
    main()
