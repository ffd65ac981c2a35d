"""TLS on the MetaServer (https) and the data plane, with a self-signed certificate made by
``openssl`` in the test: a round trip through realtime and delay servers, and refusals."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

import qmq
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from qmq import commands
from sdk.connection import Connection
from sdk.routes import RouteCache
from wire.errors import ConnectionLost, NoRoute
from tests.rawclient import RawClient

ADMIN = "tls-admin-secret-0123456789"
RECEIVE_TIMEOUT_S = 30
OPENSSL_TIMEOUT_S = 60

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """(cert, key) PEM files, made in ``directory`` by openssl, of a self-signed certificate
    for 127.0.0.1 and localhost (also tests/e2e/test_event_loop.py's)."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=OPENSSL_TIMEOUT_S,
    )
    return cert, key


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(cert, key) PEM paths of a self-signed certificate for 127.0.0.1 and localhost."""
    cert, key = self_signed_certificate(tmp_path_factory.mktemp("tls"))
    return str(cert), str(key)


async def test_messages_round_trip_over_tls_with_an_https_metaserver_and_auth_on(
        tmp_path: Path, certificate: tuple[str, str]) -> None:
    cert, key = certificate
    tls = {"tls_cert": cert, "tls_key": key, "tls_ca": cert}
    meta_config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0, admin_token=ADMIN,
                             **tls)
    async with start_metaserver(meta_config) as meta:
        assert meta.url.startswith("https://127.0.0.1:")
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt-1", port=0,
            heartbeat_interval_ms=200, token=ADMIN, **tls))
        await realtime.start()
        delay = DelayServer(DelayConfig(
            data_dir=str(tmp_path / "delay"), meta_url=meta.url, group="delay-1", port=0,
            bucket_ms=1000, heartbeat_interval_ms=200, token=ADMIN, **tls))
        await delay.start()
        try:
            assert realtime.registration is not None and realtime.registration.registered
            async with qmq.Producer(meta.url, token=ADMIN, tls=cert) as producer, \
                    qmq.Consumer(meta.url, group="g", token=ADMIN, tls=cert, start="earliest",
                                 wait_ms=200) as consumer:
                now = await producer.send("secure.now", b"now")
                later = await producer.send("secure.now", b"later", delay=50)
                subscription = consumer.subscribe("secure.now")
                bodies = set()
                for _ in range(2):
                    async with asyncio.timeout(RECEIVE_TIMEOUT_S):
                        got = await subscription.__anext__()
                    bodies.add(got.body)
                    await got.ack()
                assert bodies == {b"now", b"later"}
                assert now.status == "stored" and later.delayed
            # The CLI's admin calls (sdk.http1, no aiohttp) over https with the token ...
            commands.CLIENT.set(commands.ClientSettings(token=ADMIN, tls_ca=cert))
            brokers = await commands.admin_request(meta.url, "GET", "/api/admin/brokers")
            assert {b["group"] for b in brokers["brokers"]} == {"rt-1", "delay-1"}
            # ... and without it: refused, exit 1 (qmq.exits), the MetaServer's code named.
            commands.CLIENT.set(commands.ClientSettings(token=None, tls_ca=cert))
            with pytest.raises(commands.CommandError, match="401 unauthorized") as refused:
                await commands.admin_request(meta.url, "GET", "/api/admin/brokers")
            assert refused.value.exit_code == 1
        finally:
            await delay.stop()
            await realtime.stop()


async def test_a_client_that_does_not_trust_the_certificate_cannot_connect(
        tmp_path: Path, certificate: tuple[str, str]) -> None:
    cert, key = certificate
    meta_config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0, tls_cert=cert,
                             tls_key=key, tls_ca=cert)
    async with start_metaserver(meta_config) as meta:
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt-1", port=0,
            tls_cert=cert, tls_key=key, tls_ca=cert))
        await realtime.start()
        try:
            # Default verification (system CAs) refuses the self-signed MetaServer ...
            async with aiohttp.ClientSession() as session:
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await session.get(meta.url + "/health")
            # ... as the client's own path does (a route lookup: nothing cached, so NoRoute) ...
            with pytest.raises(NoRoute, match="CERTIFICATE_VERIFY_FAILED"):
                await RouteCache(meta.url).get("secure.now", "producer")
            # ... a plain-TCP client gets no answer from a TLS broker ...
            assert realtime.port is not None
            with pytest.raises(ConnectionError):
                await RawClient.connect(realtime.port)
            # ... and a TLS client that trusts only the system CAs is refused by it.
            with pytest.raises(ConnectionLost, match="CERTIFICATE_VERIFY_FAILED"):
                await Connection.open(realtime.address, client_id="c", app="a", token=None,
                                      ssl_context=ssl.create_default_context())
        finally:
            await realtime.stop()


def test_a_certificate_without_its_key_fails_at_start_naming_both_options(
        certificate: tuple[str, str], tmp_path: Any) -> None:
    cert, _key = certificate
    with pytest.raises(ValueError, match="tls_cert .* and tls_key None go together"):
        MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), tls_cert=cert)
    with pytest.raises(ValueError, match="tls_cert .* and tls_key None go together"):
        RealtimeServer(RealtimeConfig(data_dir=str(tmp_path / "rt"), tls_cert=cert))
