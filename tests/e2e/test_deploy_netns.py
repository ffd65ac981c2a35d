"""docs/DEPLOY.md's three hosts, built as network namespaces with an address each (veth pairs on a
bridge in a fourth namespace; the test creates and removes all of them, and nothing of the
machine's own network is touched). Each host runs the servers of its config file in the guide,
with the guide's addresses 10.0.0.x moved to 10.213.0.x and its data directories to a
temporary one; the MetaServer's database is the session's PostgreSQL, reached on its socket.
Auth is on as the guide's env files set it. The guide's "Checking it" block runs as written from
the meta host; then more traffic goes through it, and nothing is lost."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT, ServerProcess, start_server, wait_until
from tests.pg import PgCluster

SUBNET = "10.213.0"
META_URL = f"http://{SUBNET}.1:8090"
HOSTS = ("meta", "broker-a", "broker-b")  # in the guide's order: 10.0.0.1, .2, .3
HOST_FILES = (REPO_ROOT / "docs" / "DEPLOY.md").read_text().split("```toml\n")[1:]
TAG = f"q{os.getpid() % 100000}"  # namespace names of this run
# The guide's /etc/qmq/env files: the MetaServer's QMQ_ADMIN_TOKEN turns auth on, and every
# server and `qmq admin` passes it as QMQ_TOKEN.
ADMIN_TOKEN = "deploy-test-admin-token-0123456789abcdef"
CHECKING = (REPO_ROOT / "docs" / "DEPLOY.md").read_text().split("## Checking it", 1)[1]
CHECK_BLOCK = CHECKING.split("```sh\n", 1)[1].split("```", 1)[0]

pytestmark = pytest.mark.skipif(shutil.which("ip") is None or os.geteuid() != 0,
                                reason="needs iproute2 and root for network namespaces")


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def ns(index: int) -> str:
    return f"{TAG}-h{index + 1}"


@pytest.fixture
def namespaces() -> Iterator[list[str]]:
    """Three host namespaces, 10.213.0.1-3/24, on a bridge of a fourth."""
    bridge = f"{TAG}-br"
    made = []
    try:
        ip("netns", "add", bridge)
        made.append(bridge)
        ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge, "link", "set", "br0", "up")
        for index in range(len(HOSTS)):
            name = ns(index)
            ip("netns", "add", name)
            made.append(name)
            port = f"p{index + 1}"
            ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns",
               bridge)
            ip("-n", bridge, "link", "set", port, "master", "br0", "up")
            ip("-n", name, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", "eth0")
            ip("-n", name, "link", "set", "eth0", "up")
            ip("-n", name, "link", "set", "lo", "up")
        yield [ns(i) for i in range(len(HOSTS))]
    finally:
        for name in reversed(made):  # the veths and the bridge go with their namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def host_file(index: int, tmp_path: Path, db_url: str) -> Path:
    """The guide's qmq.toml of host ``index``, moved to the test's addresses and directories."""
    text = HOST_FILES[index].split("```", 1)[0]
    text = text.replace("10.0.0.", f"{SUBNET}.").replace("/var/lib/qmq/", f"{tmp_path}/")
    lines = [f'db_url = "{db_url}"' if line.startswith("db_url") else line
             for line in text.splitlines()]
    path = tmp_path / f"{HOSTS[index]}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def in_host(index: int, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``qmq ARGS`` run on host ``index``."""
    return subprocess.run(["ip", "netns", "exec", ns(index), sys.executable, "-m", "qmq", *args],
                          capture_output=True, text=True, timeout=timeout_s, cwd=REPO_ROOT,
                          env={**os.environ, "QMQ_TOKEN": ADMIN_TOKEN})


@pytest.mark.timeout(300)
def test_the_three_hosts_of_the_deployment_guide_carry_traffic_and_lose_nothing(
        namespaces, pg_cluster: PgCluster, tmp_path) -> None:
    name = f"deploy_{TAG}"
    pg_cluster.create_database(name)
    socket_url = (f"postgresql+asyncpg://{pg_cluster.url_of(name).split('//')[1].split('@')[0]}"
                  f"@/{name}?host={pg_cluster.root}&port={pg_cluster.port}")
    servers: list[ServerProcess] = []
    try:
        for index, kinds in enumerate((("metaserver",), ("realtime", "delay"), ("realtime",))):
            config = host_file(index, tmp_path, socket_url)
            env = {**os.environ, ("QMQ_ADMIN_TOKEN" if index == 0 else "QMQ_TOKEN"): ADMIN_TOKEN}
            for kind in kinds:
                servers.append(start_server(f"{kind}@{HOSTS[index]}", [kind, "--config",
                                                                     str(config)], env=env,
                                            wrapper=("ip", "netns", "exec", namespaces[index])))

        def brokers() -> dict[str, str]:
            done = in_host(0, "admin", "brokers", "--json", "--meta", META_URL)
            rows = json.loads(done.stdout) if done.returncode == 0 else []
            return {row["group"]: f"{row['address']} {row['state']}" for row in rows}

        wait_until(lambda: brokers() == {"rt1": f"{SUBNET}.2:20881 rw",
                                         "rt2": f"{SUBNET}.3:20881 rw",
                                         "dl1": f"{SUBNET}.2:20801 rw"}, 60,
                   "rt1, rt2 and dl1 to register their advertised addresses")
        # The guide's "Checking it" block as written, from the meta host, with its addresses
        # moved and `QMQ_TOKEN=...` the admin token.
        script = (CHECK_BLOCK.replace("10.0.0.", f"{SUBNET}.")
                  .replace("QMQ_TOKEN=...", f"QMQ_TOKEN={ADMIN_TOKEN}"))
        checked = subprocess.run(
            ["ip", "netns", "exec", namespaces[0], "sh", "-e", "-c", script], capture_output=True,
            text=True, timeout=180, cwd=tmp_path,
            env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert "token: " in checked.stdout  # the shop token was created
        assert len([line for line in checked.stdout.splitlines()
                    if '"subject": "order.created"' in line]) == 10, checked.stdout

        sent = in_host(0, "send", "order.paid", "x", "--count", "40", "--json",
                       "--meta", META_URL)
        assert sent.returncode == 0, sent.stderr
        receipts = [json.loads(line) for line in sent.stdout.splitlines()]
        assert {r["group"] for r in receipts} == {"rt1", "rt2"}  # both realtime hosts
        delayed = in_host(0, "send", "order.paid", "later", "--count", "5", "--delay-ms",
                          "2000", "--json", "--meta", META_URL)
        assert delayed.returncode == 0, delayed.stderr
        receipts += [json.loads(line) for line in delayed.stdout.splitlines()]
        assert {r["group"] for r in receipts[40:]} == {"dl1"}

        consumed = in_host(0, "consume", "order.paid", "--group", "billing", "--start",
                           "earliest", "--count", "45", "--idle-timeout-s", "30",
                           "--meta", META_URL)
        assert consumed.returncode == 0, consumed.stderr
        got = [json.loads(line)["id"] for line in consumed.stdout.splitlines()]
        assert sorted(got) == sorted(r["id"] for r in receipts)  # each once, nothing lost
    finally:
        for server in reversed(servers):
            server.terminate(timeout_s=20)
