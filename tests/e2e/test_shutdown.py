"""SIGTERM stops every server gracefully: it deregisters at once, stops taking requests, answers
the ones in flight (a long poll answers at once instead of at its deadline), commits and
checkpoints, says so in its output, exits 0, and comes back fast on the same state.

Every send is either answered (and then durable: a restart serves it) or cut off by a clean
connection close; timing bounds are generous because the machine is shared.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all
from tests.harness import (
    broker_states, start_metaserver, wait_for, wait_registered,
)
from tests.rawclient import RawClient

EXIT_BOUND_S = 20  # SIGTERM to exit, on a loaded machine
RESTART_BOUND_S = 20  # process start to serving, on a loaded machine
SEND_WINDOW = 100  # sends in flight at once
SENDS_MAX = 100_000  # bound on the producing loop
LONG_POLL_MS = 30_000  # far longer than the shutdown may take
BROKER_FLAGS = ("--ack-timeout-ms", "5000", "--consumer-expiry-ms", "5000")
PRODUCER_OPTIONS = {"retries_max": 0, "retry_budget_ms": 0, "send_timeout_ms": 30_000}


class SendsInFlight:
    """``SEND_WINDOW`` sends in flight all the time, until sends start failing (the server
    went away); each one ends as a receipt or an error."""

    def __init__(self, producer: qmq.Producer, subject: str, prefix: str, **kwargs) -> None:
        self.started = 0
        self.receipts: list[qmq.Receipt] = []
        self.errors: list[BaseException] = []
        self.task = asyncio.create_task(self._run(producer, subject, prefix, kwargs))

    async def _run(self, producer: qmq.Producer, subject: str, prefix: str, kwargs) -> None:
        for first in range(0, SENDS_MAX, SEND_WINDOW):
            if self.errors:
                return
            ids = [f"{prefix}-{n:06d}" for n in range(first, first + SEND_WINDOW)]
            self.started += len(ids)
            await asyncio.gather(*(self._send(producer, subject, i, **kwargs) for i in ids))

    async def _send(self, producer: qmq.Producer, subject: str, message_id: str, **kwargs) -> None:
        try:
            self.receipts.append(await producer.send(subject, message_id.encode(),
                                                     message_id=message_id, **kwargs))
        except qmq.QmqError as exc:
            self.errors.append(exc)

    @property
    def acknowledged(self) -> set[str]:
        return {r.message_id for r in self.receipts}

    async def wait_done(self) -> None:
        async with asyncio.timeout(60):
            await self.task
        assert len(self.receipts) + len(self.errors) == self.started
        unexpected = [e for e in self.errors
                      if not isinstance(e, (qmq.ConnectionLost, qmq.NoRoute))]
        assert unexpected == [], f"sends cut by a shutdown must fail retriably: {unexpected[:3]}"


def sigterm_and_time(server) -> tuple[int, float]:
    """SIGTERM ``server``; (exit code, seconds to exit)."""
    started = time.monotonic()
    code = server.terminate(timeout_s=60)
    return code, time.monotonic() - started


async def read_all(meta_url: str, subject: str, expected: set[str], group: str) -> Ledger:
    """A new group reads ``subject`` from the start until it has every id in ``expected``."""
    ledger = Ledger()
    reader = await RunningConsumer(meta_url, group, subject, ledger, name=f"{group}-reader",
                                   start="earliest").start()
    try:
        await wait_for(lambda: ledger.ids >= expected, 60, f"{group} to read every receipt",
                       interval_s=0.2)
    finally:
        await close_all([reader])
    return ledger


@pytest.mark.timeout(180)
async def test_sigterm_on_a_realtime_server_answers_in_flight_requests_and_deregisters_at_once(
        cluster):
    cluster.start_meta()
    broker = cluster.start_broker("rt1", *BROKER_FLAGS)
    await asyncio.to_thread(wait_registered, cluster.meta_url, {("realtime", "rt1"): "rw"})
    subject = "orders.paid"
    poller = await RawClient.connect(broker.port)
    try:
        long_poll = asyncio.create_task(poller.pull("orders.idle", "watchers", "w1",
                                                    wait_ms=LONG_POLL_MS))
        # Requests on one connection are read in order: once this is answered the long poll is
        # being served.
        assert (await poller.request({"op": "heartbeat", "consumer_id": "w1",
                                      "subscriptions": []}))["ok"]
        async with qmq.Producer(cluster.meta_url, **PRODUCER_OPTIONS) as producer:
            sends = SendsInFlight(producer, subject, "paid")
            await wait_for(lambda: len(sends.receipts) >= 2_000 or sends.task.done(), 60,
                           "the first receipts")
            code, exit_s = await asyncio.to_thread(sigterm_and_time, broker)
            states_at_exit = await asyncio.to_thread(broker_states, cluster.meta_url)
            await sends.wait_done()
        async with asyncio.timeout(10):
            answer = await long_poll
    finally:
        await poller.close()

    assert code == 0, broker.text()[-3000:]
    assert exit_s < EXIT_BOUND_S
    assert answer.get("payloads") == [], f"the long poll must be answered, got {answer}"
    assert states_at_exit.get(("realtime", "rt1")) == "offline", \
        "deregistered at once, not after heartbeat expiry"
    output = broker.text()
    assert "message log fsynced and checkpointed" in output
    assert "deregistered from the MetaServer" in output
    assert sends.errors, "the shutdown must have cut some sends"

    started = time.monotonic()
    await asyncio.to_thread(cluster.start_broker, "rt1", *BROKER_FLAGS)
    restart_s = time.monotonic() - started
    assert restart_s < RESTART_BOUND_S
    ledger = await read_all(cluster.meta_url, subject, sends.acknowledged, "audit")
    assert ledger.duplicates() == {}
    assert all(d.body == d.id.encode() for d in ledger.deliveries)
    print(f"realtime: exit {exit_s:.2f} s after SIGTERM, restart {restart_s:.2f} s, "
          f"{len(sends.receipts)} receipts all served after the restart, "
          f"{len(sends.errors)} sends cut; {output.strip().splitlines()[-1]}")


@pytest.mark.timeout(180)
async def test_sigterm_on_a_delay_server_keeps_every_acknowledged_delayed_send_and_restarts_fast(
        cluster):
    cluster.start_meta()
    cluster.start_broker("rt1", *BROKER_FLAGS)
    delay = cluster.start_delay("d1")
    await asyncio.to_thread(wait_registered, cluster.meta_url,
                            {("realtime", "rt1"): "rw", ("delay", "d1"): "rw"})
    subject = "orders.expire"
    async with qmq.Producer(cluster.meta_url, **PRODUCER_OPTIONS) as producer:
        sends = SendsInFlight(producer, subject, "expire", delay=1_000)
        await wait_for(lambda: len(sends.receipts) >= 2_000 or sends.task.done(), 60,
                       "the first delayed receipts")
        code, exit_s = await asyncio.to_thread(sigterm_and_time, delay)
        states_at_exit = await asyncio.to_thread(broker_states, cluster.meta_url)
        await sends.wait_done()

    assert code == 0, delay.text()[-3000:]
    assert exit_s < EXIT_BOUND_S
    assert states_at_exit.get(("delay", "d1")) == "offline"
    output = delay.text()
    assert "delay store fsynced and checkpointed" in output
    assert "deregistered from the MetaServer" in output
    assert sends.errors, "the shutdown must have cut some sends"

    started = time.monotonic()
    await asyncio.to_thread(cluster.start_delay, "d1")
    restart_s = time.monotonic() - started
    assert restart_s < RESTART_BOUND_S
    ledger = await read_all(cluster.meta_url, subject, sends.acknowledged, "expiry")
    assert ledger.duplicates() == {}
    print(f"delay: exit {exit_s:.2f} s after SIGTERM, restart {restart_s:.2f} s, "
          f"{len(sends.receipts)} delayed receipts all delivered after the restart")


def hammer(url: str, stop: threading.Event, outcomes: list[str]) -> None:
    """GET ``url`` until ``stop``; record "ok" for a complete JSON answer, "refused" for a
    connection that failed or closed, anything else verbatim."""
    for _ in range(100_000):
        if stop.is_set():
            return
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                json.loads(response.read())
                outcomes.append("ok")
        except urllib.error.HTTPError as exc:
            outcomes.append(f"HTTP {exc.code}")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            outcomes.append("refused")
            time.sleep(0.05)


@pytest.mark.timeout(120)
def test_sigterm_on_the_metaserver_finishes_requests_in_flight_and_restarts_fast(tmp_path):
    db = str(tmp_path / "meta.db")
    meta = start_metaserver(db)
    stop = threading.Event()
    outcomes: list[str] = []
    threads = [threading.Thread(target=hammer, args=(f"{meta.url}/api/admin/brokers", stop,
                                                     outcomes)) for _ in range(4)]
    try:
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while outcomes.count("ok") < 50 and time.monotonic() < deadline:
            time.sleep(0.05)
        code, exit_s = sigterm_and_time(meta)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
        meta.terminate()
    assert code == 0, meta.text()[-3000:]
    assert exit_s < EXIT_BOUND_S
    assert outcomes.count("ok") >= 50
    assert set(outcomes) <= {"ok", "refused"}, "every request answered whole or refused"
    assert "metaserver stopped" in meta.text()
    started = time.monotonic()
    again = start_metaserver(db)
    restart_s = time.monotonic() - started
    try:
        assert restart_s < RESTART_BOUND_S
    finally:
        again.terminate()
    print(f"metaserver: exit {exit_s:.2f} s after SIGTERM, restart {restart_s:.2f} s, "
          f"{outcomes.count('ok')} answers, {outcomes.count('refused')} refused connections")


@pytest.mark.timeout(180)
async def test_sigterm_on_qmq_up_stops_all_three_servers_cleanly_and_it_restarts_on_its_data(
        cluster):
    up = await asyncio.to_thread(cluster.start_up)
    subject = "demo.events"
    async with qmq.Producer(up.meta_url, **PRODUCER_OPTIONS) as producer:
        sends = SendsInFlight(producer, subject, "demo")
        await wait_for(lambda: len(sends.receipts) >= 2_000 or sends.task.done(), 60,
                       "the first receipts")
        code, exit_s = await asyncio.to_thread(sigterm_and_time, up)
        await sends.wait_done()
    assert code == 0, up.text()[-3000:]
    assert exit_s < EXIT_BOUND_S
    output = up.text()
    for line in ("realtime group realtime-1 stopped", "delay group delay-1 stopped",
                 "deregistered from the MetaServer", "metaserver stopped"):
        assert line in output, f"{line!r} missing from: {output[-2000:]}"

    started = time.monotonic()
    again = await asyncio.to_thread(cluster.start_up)
    restart_s = time.monotonic() - started
    assert restart_s < RESTART_BOUND_S
    ledger = await read_all(again.meta_url, subject, sends.acknowledged, "replay")
    assert ledger.duplicates() == {}
    print(f"qmq up: exit {exit_s:.2f} s after SIGTERM, restart {restart_s:.2f} s, "
          f"{len(sends.receipts)} receipts served after the restart")
