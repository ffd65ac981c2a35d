"""bench.peers' clients of one measurement (``Clients.results``): a client that fails ends the
measurement at once, naming it, rather than after the others' timeouts (session 17: a producer
that gave up left its consumer waiting ~1,000 s for messages that never came)."""

from __future__ import annotations

import os
import stat
import sys

import pytest

from bench.peers.measure import Clients
from bench.peers.servers import Running, Setting

# A stand-in for ``python -m bench.peers.worker SYSTEM URL ROLE PARAMS OUT``: a consumer that
# waits until it is killed, a producer that fails without writing its figures, another that
# writes them.
FAKE_WORKER = f"""#!{sys.executable}
import json, sys, time
role, out = sys.argv[5], sys.argv[7]
if role == "consume":
    time.sleep(3600)
elif role == "produce_fails":
    print("send failed: not_master, resending the same ids, attempt 4 of 4")
    sys.exit(1)
else:
    with open(out, "w") as f:
        json.dump({{"sent": 1}}, f)
"""


@pytest.fixture
def clients(tmp_path):
    worker = tmp_path / "fake-python"
    worker.write_text(FAKE_WORKER)
    worker.chmod(worker.stat().st_mode | stat.S_IXUSR)
    setting = Setting("pyqmq-slave", "pyqmq", "pyqmq, one sync slave", "sync", True)
    made = Clients(setting, Running("http://127.0.0.1:1", [], str(tmp_path)), str(worker))
    yield made
    made.kill()


def test_a_producer_that_fails_ends_the_measurement_while_its_consumer_still_waits(clients):
    clients.start("consume", {})
    clients.start("produce_fails", {})
    with pytest.raises(RuntimeError, match="pyqmq-slave produce_fails failed") as failed:
        clients.results(timeout_s=30)
    assert "attempt 4 of 4" in str(failed.value)  # what it printed comes with it
    consumer = clients._started[0][1]
    assert consumer.poll() is None  # not waited for: kill() stops it


def test_the_figures_of_clients_that_end_are_returned_in_start_order(clients):
    clients.start("produce", {})
    clients.start("produce_again", {})
    assert list(clients.results(timeout_s=3600)) == ["produce", "produce_again"]
    assert all(os.path.exists(path) for _role, _child, path in clients._started)
