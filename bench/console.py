"""Console benchmark: response time of each console page with 1,000 subjects and 100 brokers.

Run: ``.venv/bin/python -m bench.console`` (``--subjects``, ``--brokers``, ``--requests`` per
page, 200 by default). Goal: p99 < 200 ms for every page.

A ``qmq metaserver`` subprocess on SQLite (127.0.0.1, port 0) is seeded over its own HTTP API,
as brokers and clients would fill it: ``--brokers`` brokers register and heartbeat (nine in ten
realtime, in groups of two; the rest delay servers, whose stats carry 72 hours of pending
counts), each realtime broker reporting the backlog of its subjects for two consumer groups
as real brokers do (``serverkit.backlog.BacklogSync``: whole once, then only the changes);
then ``--subjects`` subjects get routes (one consumer route request each) and two consumer
groups each (client heartbeats). Then every page is fetched ``--requests`` times, one request
at a time, from this process (aiohttp), and p50/p99/max are printed per page with the goal
beside them, the MetaServer's CPU seconds and the load average: the machine may be shared, so
figures measured while it is busy say so.

``seeded`` is shared with tests/e2e/test_console_browser.py, which checks the pages stay right at
this size. A benchmark, not a test: it asserts nothing, and every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from sqlalchemy import update
from sqlalchemy.exc import OperationalError

from bench._cluster import percentile, process_cpu_s, start_server
from serverkit.backlog import BacklogSync
from metaserver.db import make_engine
from metaserver.models import Client, ConsumerGroup, Subject, SubjectRoute

GOAL_P99_MS = 200.0
HOUR_MS = 3_600_000
CONSUMER_GROUPS = ("billing", "audit")
PAGES = ["/", "/subjects", "/subjects?page=5", "/subjects?q=subject-09", "/delay", "/schedules",
         "/tokens", "/messages"]
# Seconds between two heartbeats of every fake broker: a third of the MetaServer's default
# broker expiry (15 s), as real brokers do.
HEARTBEAT_INTERVAL_S = 5.0


def subject_name(i: int) -> str:
    return f"subject-{i:04d}"


class Fleet:
    """Fake brokers: ``brokers`` registrations and the heartbeats that keep them online."""

    def __init__(self, subjects: int, brokers: int, now_ms: int) -> None:
        delay_count = max(1, brokers // 10)
        self.realtime = [(f"rt-{i // 2:02d}", f"127.0.0.1:{21000 + i}")
                         for i in range(brokers - delay_count)]
        self.delay = [(f"delay-{i // 2:02d}", f"127.0.0.1:{22000 + i}")
                      for i in range(delay_count)]
        self.subjects = subjects
        self.held: dict[str, list[str]] = {}  # broker group -> its subjects, once routed
        # address -> what the MetaServer holds of that realtime broker's backlog
        self.syncs: dict[str, BacklogSync] = {address: BacklogSync()
                                              for _, address in self.realtime}
        hour = now_ms - now_ms % HOUR_MS
        self.delay_stats = {
            "pending_total": sum(100 + (h * 37 % 121) - 60 for h in range(72)), "in_memory": 200, "dispatched": 10_000,
            "dispatch_rate_per_s": 25.0, "early": 0, "lateness_ms_max": 40,
            "lateness_ms_p50_le": 5, "lateness_ms_p99_le": 50, "done_before_ms": hour,
            # A day's rhythm, so the chart has a shape: 40..160 per hour.
            "pending_per_hour": {str(hour + h * HOUR_MS): 100 + (h * 37 % 121) - 60
                                 for h in range(72)},
            "pending_per_subject": {subject_name(h): 100 for h in range(72)}}

    def heartbeats(self) -> list[dict[str, Any]]:
        """One heartbeat per broker: realtime ones with the backlog of their subjects, as the
        changes since what the MetaServer acknowledged (``acknowledged`` takes its answer)."""
        out: list[dict[str, Any]] = [{
            "group": group, "kind": "realtime", "address": address,
            **self.syncs[address].fields([
                {"subject": s, "group": cg, "lag": (i * 7 + n) % 500, "consumers": 1,
                 "redelivered": n % 3, "retried": n % 2, "dead": 0}
                for n, s in enumerate(self.held.get(group, [])) for cg in CONSUMER_GROUPS])}
            for i, (group, address) in enumerate(self.realtime)]
        out += [{"group": group, "kind": "delay", "address": address,
                 "backlog": self.delay_stats} for group, address in self.delay]
        return out


async def _insert_routes(db_url: str, fleet: Fleet, now_ms: int) -> None:
    """Write the subjects, their routes (two realtime groups each, round robin), consumer groups
    and online consumers straight into the database: a thousand route requests through the API
    take a minute on a busy 2-core machine, and this benchmark measures the pages, not that."""
    groups = sorted({g for g, _ in fleet.realtime})
    subjects, routes, consumer_groups, clients = [], [], [], []
    for i in range(fleet.subjects):
        name = subject_name(i)
        subjects.append({"name": name, "version": 1, "created_at_ms": now_ms,
                         "updated_at_ms": now_ms})
        for k in range(min(2, len(groups))):
            group = groups[(2 * i + k) % len(groups)]
            routes.append({"subject": name, "group_name": group, "active": True,
                           "added_at_ms": now_ms, "removed_at_ms": None})
            fleet.held.setdefault(group, []).append(name)
        for group in CONSUMER_GROUPS:
            consumer_groups.append({"name": group, "subject": name, "created_at_ms": now_ms})
            clients.append({"client_id": f"consumer-{i}-{group}", "app": "bench",
                            "group_name": group, "role": "consumer", "subjects": [name],
                            "online": True, "first_seen_ms": now_ms, "last_seen_ms": now_ms})
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            for table, rows in ((Subject, subjects), (SubjectRoute, routes),
                                (ConsumerGroup, consumer_groups), (Client, clients)):
                await conn.execute(table.__table__.insert(), rows)
    finally:
        await engine.dispose()


async def _touch_clients(db_url: str) -> None:
    """The seeded consumers heartbeat: their last-seen time is now (one UPDATE for all)."""
    engine = make_engine(db_url)
    try:
        async with engine.begin() as conn:
            await conn.execute(update(Client).where(Client.app == "bench")
                               .values(last_seen_ms=int(time.time() * 1000), online=True))
    except OperationalError as exc:  # the MetaServer held the write lock too long: next round
        print(f"refreshing the consumers' last-seen time failed ({exc.orig}); next round")
    finally:
        await engine.dispose()


@contextlib.asynccontextmanager
async def seeded(meta_url: str, db_url: str, subjects: int = 1000, brokers: int = 100,
                 now_ms: int | None = None) -> AsyncIterator[Fleet]:
    """Fill the MetaServer at ``meta_url`` (auth off, its database at ``db_url``) with
    ``brokers`` brokers (registered and heartbeating over the API) and ``subjects`` routed
    subjects with two consumer groups each (written to the database), and keep brokers and
    consumers online (every HEARTBEAT_INTERVAL_S, as real ones) until the block ends."""
    now_ms = now_ms if now_ms is not None else int(time.time() * 1000)
    fleet = Fleet(subjects, brokers, now_ms)
    registered: set[str] = set()
    async with aiohttp.ClientSession(base_url=meta_url) as http:

        async def call(method: str, path: str, **kwargs: Any) -> Any:
            async with http.request(method, path, **kwargs) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{path}: HTTP {resp.status} {await resp.text()}")
                return await resp.json()

        async def heartbeat(body: dict[str, Any]) -> None:
            sync = fleet.syncs.get(body["address"])
            async with http.post("/api/brokers/heartbeat", json=body) as resp:
                answer = await resp.json() if resp.status == 200 else {}
            if sync is not None:  # as serverkit.registration: an unknown answer sends it whole
                sync.acknowledged(answer.get("backlog_version"))
            if resp.status != 404:
                return
            # Expired while the MetaServer was busy: register again, as a real broker does.
            await call("POST", "/api/brokers/register", json={
                k: body[k] for k in ("group", "kind", "address")})

        async def heartbeat_all() -> None:
            await asyncio.gather(*(heartbeat(body) for body in fleet.heartbeats()
                                   if body["address"] in registered))
            await _touch_clients(db_url)

        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(HEARTBEAT_INTERVAL_S)
                await heartbeat_all()

        alive = asyncio.create_task(keep_alive())
        try:
            # Brokers first, while there is no subject: each registration re-plans every route.
            for kind, members in (("realtime", fleet.realtime), ("delay", fleet.delay)):
                for group, address in members:
                    await call("POST", "/api/brokers/register",
                               json={"group": group, "kind": kind, "address": address})
                    registered.add(address)
            await _insert_routes(db_url, fleet, now_ms)
            await heartbeat_all()
            yield fleet
        finally:
            alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await alive


async def measure(meta_url: str, requests: int) -> dict[str, list[float]]:
    """Fetch every page ``requests`` times, one at a time; response times in ms per page."""
    times: dict[str, list[float]] = {}
    async with aiohttp.ClientSession(base_url=meta_url) as http:
        for page in PAGES:
            taken = times[page] = []
            for _ in range(requests):
                start = time.perf_counter()
                async with http.get(page) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{page}: HTTP {resp.status}")
                taken.append((time.perf_counter() - start) * 1000)
    return times


async def run(args: argparse.Namespace) -> None:
    directory = tempfile.mkdtemp(prefix="qmq-bench-console-")
    db_url = f"sqlite+aiosqlite:///{os.path.join(directory, 'meta.db')}"
    meta = start_server("metaserver", ["metaserver", "--db", db_url, "--host", "127.0.0.1",
                                       "--port", "0"])
    try:
        url = f"http://{meta.address}"
        started = time.perf_counter()
        async with seeded(url, db_url, args.subjects, args.brokers) as fleet:
            print(f"seeded {fleet.subjects} subjects x {len(CONSUMER_GROUPS)} groups, "
                  f"{len(fleet.realtime)} realtime brokers and {len(fleet.delay)} delay servers "
                  f"in {time.perf_counter() - started:.1f} s")
            cpu_before = process_cpu_s(meta.pid)
            load_before = os.getloadavg()
            times = await measure(url, args.requests)
            cpu = process_cpu_s(meta.pid) - cpu_before
            load_after = os.getloadavg()
        print(f"{'page':28} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}  goal p99 < "
              f"{GOAL_P99_MS:.0f} ms")
        for page, taken in times.items():
            taken.sort()
            p99 = percentile(taken, 0.99)
            verdict = "ok" if p99 < GOAL_P99_MS else "OVER"
            print(f"{page:28} {percentile(taken, 0.5):8.1f} {p99:8.1f} {taken[-1]:8.1f}  "
                  f"{verdict}")
        print(f"{args.requests} requests per page, one at a time; MetaServer CPU {cpu:.1f} s; "
              f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
              f"({os.cpu_count()} cores)")
    finally:
        meta.stop()
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--subjects", type=int, default=1000)
    parser.add_argument("--brokers", type=int, default=100)
    parser.add_argument("--requests", type=int, default=200, help="requests per page")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
