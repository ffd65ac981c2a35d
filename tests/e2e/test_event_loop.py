"""``--event-loop uvloop`` and ``--event-loop asyncio``: every server command serves send, pull and
ack on either loop, over TLS too, and stops gracefully on SIGTERM; the SDK runs on uvloop as a
user's application may; an unknown loop is a usage error before anything starts."""

from __future__ import annotations

import asyncio
import re
import shutil
from pathlib import Path

import pytest

import qmq
from tests.harness import Cluster, run_qmq, start_server
from tests.integration.test_tls import self_signed_certificate

uvloop = pytest.importorskip("uvloop")

LOOPS = ("uvloop", "asyncio")
RECEIVE_TIMEOUT_S = 30
_HTTPS_LISTEN = re.compile(r"listening on https://(\S+?)[ /]")


def round_trip(meta_url: str, subject: str, tls: str | None = None) -> set[bytes]:
    """Send one message now and one delayed 50 ms, then pull and ack both, from an SDK client
    running on uvloop (a user's choice of loop); returns the bodies received."""

    async def run() -> set[bytes]:
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        async with qmq.Producer(meta_url, tls=tls) as producer, \
                qmq.Consumer(meta_url, group="g", tls=tls, start="earliest",
                             wait_ms=200) as consumer:
            await producer.send(subject, b"now")
            await producer.send(subject, b"later", delay=50)
            subscription = consumer.subscribe(subject)
            bodies = set()
            async with asyncio.timeout(RECEIVE_TIMEOUT_S):
                while len(bodies) < 2:
                    got = await subscription.__anext__()
                    bodies.add(got.body)
                    await got.ack()
            return bodies

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run())


@pytest.mark.parametrize("loop", LOOPS)
def test_qmq_up_serves_send_pull_and_ack_on_either_loop(cluster: Cluster, loop: str) -> None:
    up = cluster.start_up("--event-loop", loop)
    assert any(line.split() == ["event", "loop", loop] for line in up.output), up.text()
    assert round_trip(up.meta_url, f"loop.{loop}") == {b"now", b"later"}
    assert up.terminate() == 0, up.text()  # the signal handlers work on this loop too
    assert "metaserver stopped" in up.text()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A PEM file holding a self-signed certificate for 127.0.0.1 and its key."""
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = self_signed_certificate(directory)
    both = directory / "both.pem"
    both.write_text(cert.read_text() + key.read_text())
    return str(both)


@pytest.mark.parametrize("loop", LOOPS)
def test_tls_servers_serve_send_pull_and_ack_on_either_loop(
        cluster: Cluster, tmp_path: Path, certificate: str, loop: str) -> None:
    tls = ["--tls-cert", certificate, "--tls-key", certificate, "--tls-ca", certificate,
           "--event-loop", loop]
    meta = cluster.keep(start_server("metaserver", [
        "metaserver", "--db", f"sqlite+aiosqlite:///{tmp_path / 'meta.db'}", "--port", "0",
        *tls], ready=_HTTPS_LISTEN))
    cluster.meta = meta
    meta_url = f"https://{meta.address}"
    realtime = cluster.keep(start_server("realtime", [
        "realtime", "--meta", meta_url, "--data-dir", str(tmp_path / "rt"), "--group", "rt-1",
        "--port", "0", "--metrics-port", "0", *tls]))
    delay = cluster.keep(start_server("delay", [
        "delay", "--meta", meta_url, "--data-dir", str(tmp_path / "delay"), "--group", "dl-1",
        "--port", "0", "--metrics-port", "0", "--bucket-ms", "1000", *tls]))
    for server in (meta, realtime, delay):
        assert f"event loop {loop})" in server.text(), server.text()
    assert round_trip(meta_url, f"tls.{loop}", tls=certificate) == {b"now", b"later"}
    for server in (delay, realtime, meta):
        assert server.terminate() == 0, server.text()


def test_an_unknown_event_loop_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    done = run_qmq("up", "--data-dir", str(tmp_path / "up"), "--event-loop", "trio")
    assert done.returncode == 2 and "invalid choice: 'trio'" in done.stderr, done.stderr
    done = run_qmq("realtime", "--data-dir", str(tmp_path / "rt"), env={"QMQ_EVENT_LOOP": "trio"})
    assert done.returncode == 2 and "event loop 'trio' is unknown" in done.stderr, done.stderr
    config = tmp_path / "qmq.toml"
    config.write_text('event_loop = "trio"\n')
    done = run_qmq("delay", "--data-dir", str(tmp_path / "dl"), "--config", str(config))
    assert done.returncode == 2 and "event_loop = 'trio'" in done.stderr, done.stderr
    assert not (tmp_path / "up").exists() and not (tmp_path / "rt").exists()
