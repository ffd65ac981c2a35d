"""The outbox and the idempotent consumer with real processes and kill -9, the application's
database on PostgreSQL, the service a ``qmq up``:

* the application is killed between its commit and the relay's send, then a relay is killed
  after sending and before marking: after the restart every message arrives exactly once;
* two ``qmq outbox relay`` processes started at once send no message twice;
* a consumer killed in the middle of a handler (before its commit, and after its commit but
  before its ack) leaves the handler's writes in the database exactly once after redelivery.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

import qmq
from tests.harness import REPO_ROOT, Cluster, ServerProcess, UpProcess, _spawn, start_server, wait_for
from tests.pg import PgCluster, create_database

pytestmark = [pytest.mark.postgres]

UP_FLAGS = ("--ack-timeout-ms", "1000", "--consumer-expiry-ms", "2000", "--no-trace")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    cluster = Cluster(tmp_path_factory.mktemp("outbox-up"))
    try:
        yield cluster.start_up(*UP_FLAGS)
    finally:
        cluster.stop_all()


@pytest.fixture
async def db_url(pg_cluster: PgCluster) -> str:
    name = f"o_{uuid.uuid4().hex[:16]}"
    await create_database(pg_cluster.url_of("postgres"), name)
    return pg_cluster.url_of(name)


def app(db_url: str, meta_url: str, *args: str, ready: str) -> ServerProcess:
    """``tests/e2e/outbox_app.py`` in its own process, once it printed ``ready``."""
    cmd = [sys.executable, "-m", "tests.e2e.outbox_app", "--db", db_url, "--meta", meta_url,
           *args]
    process, output, _ = _spawn(f"app {args[0]}", cmd, re.compile(f"({ready})"))
    return ServerProcess(f"app {args[0]}", list(args), process, "", output)


def run_app(db_url: str, meta_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tests.e2e.outbox_app", "--db", db_url,
                           "--meta", meta_url, *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT)


async def received(meta_url: str, subject: str, group: str, expected: int) -> Counter[str]:
    """Message bodies of ``subject`` from the start, until ``expected`` arrived and nothing more
    came for a second. A redelivery (an ack slower than the 1 s ack timeout, on a busy machine)
    is the same stored message handed out again, not a second copy: it is not counted."""
    counts: Counter[str] = Counter()
    async with qmq.Consumer(meta_url, group=group, start="earliest") as consumer:
        stream = consumer.subscribe(subject).__aiter__()
        while True:
            try:
                async with asyncio.timeout(30 if sum(counts.values()) < expected else 1):
                    msg = await stream.__anext__()
            except asyncio.TimeoutError:
                return counts
            if not msg.redelivered:
                counts[msg.body.decode()] += 1
            await msg.ack()


async def test_messages_of_a_killed_app_and_a_killed_relay_arrive_once_after_restart(
        up: UpProcess, db_url: str) -> None:
    subject = f"orders-{uuid.uuid4().hex[:6]}"  # the qmq up is shared by the module's tests
    writer = app(db_url, up.meta_url, "write", "20", "--hang", "--subject", subject,
                 ready="committed 20")
    writer.kill9()  # committed, never relayed
    died = run_app(db_url, up.meta_url, "relay-die")
    assert died.returncode == -9 and "sent 20, dying" in died.stdout, died.stdout + died.stderr
    done = run_app(db_url, up.meta_url, "relay")  # sends the same 20 ids again
    assert done.returncode == 0 and "drained" in done.stdout, done.stdout + done.stderr
    counts = await received(up.meta_url, subject, "g", 20)
    assert counts == Counter({str(order): 1 for order in range(1, 21)})


async def test_two_relays_started_at_once_send_no_duplicates(up: UpProcess, db_url: str) -> None:
    subject = f"orders-{uuid.uuid4().hex[:6]}"
    written = run_app(db_url, up.meta_url, "write", "2000", "--subject", subject)
    assert "committed 2000" in written.stdout, written.stdout + written.stderr
    args = ["outbox", "relay", "--db", db_url, "--meta", up.meta_url, "--batch", "100"]
    ready = re.compile(r'(outbox relay of|"event": "starting")')
    with ThreadPoolExecutor(2) as pool:  # the second says each status as JSON (--json)
        relays = list(pool.map(lambda json_: start_server(
            "relay", args + ["--json"] * json_, ready=ready), (False, True)))
    try:
        counts = await received(up.meta_url, subject, "g", 2000)
        assert len(counts) == 2000 and set(counts.values()) == {1}
        holders = [r for r in relays
                   if "holds the lock" in r.text() or '"event": "relaying"' in r.text()]
        assert len(holders) == 1, [r.text() for r in relays]
    finally:
        for relay in relays:
            relay.terminate()
    plain, as_json = (relay.text() for relay in relays)
    sent = [int(m.group(1)) for m in re.finditer(r"stopped: (\d+) message", plain)]
    sent += [json.loads(line)["sent"] for line in as_json.splitlines()
             if line.startswith("{") and '"stopped"' in line]
    assert sorted(sent) == [0, 2000], (plain, as_json)  # the lock holder sent them all


async def test_a_consumer_killed_mid_handler_leaves_its_writes_exactly_once(
        up: UpProcess, db_url: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    async with qmq.Producer(up.meta_url) as producer:
        await producer.send("payments", b"pay-1")
        first = app(db_url, up.meta_url, "consume", "--hang-after-commit", ready="holding pay-1")
        first.kill9()  # committed its ledger row, never acked
        # pay-1 comes again once the dead consumer's hold expires: recorded, so not booked.
        second = app(db_url, up.meta_url, "consume", "--hang-before-commit",
                     ready="already booked pay-1")
        await producer.send("payments", b"pay-2")
        await wait_for(lambda: "holding pay-2 before commit" in second.text(), 30,
                       "the second consumer inside pay-2's transaction")
        second.kill9()  # inside its transaction: rolled back
    third = app(db_url, up.meta_url, "consume", ready="booked pay-2")
    try:
        engine = create_async_engine(db_url)
        async with engine.connect() as connection:
            rows = (await connection.execute(
                text("SELECT payment, count(*) FROM ledger GROUP BY payment"))).all()
        await engine.dispose()
        assert sorted(rows) == [("pay-1", 1), ("pay-2", 1)]
    finally:
        third.terminate()
