"""Network namespaces that stand for machines in tests (CONVENTIONS 20, docs/REPLICATION.md).

``Network(["meta", "m", "s"])`` makes one namespace per node plus a hub namespace holding a
bridge; every node has an ``eth0`` on the bridge with its own address in a /24 chosen at random
(checked against the host's routes), and the test process itself reaches the bridge through one
veth in the host namespace (``host_address``). Then:

* ``run(node, argv)`` starts a process inside a node (``ip netns exec``) and waits for its ready
  line; ``address(node)`` is where it can listen;
* ``cut(a, b)`` drops every packet between two nodes (or a node and ``"host"``), both ways: each
  side gets a permanent neighbour entry sending the other's address to a MAC that no port has,
  so frames leave, the bridge floods them, and every receiver discards them. The sender's stack
  believes the packets left, so TCP stalls and retransmits as on a real partition, and nothing
  is refused. (This kernel has no tc classifiers or nftables to drop with; a neighbour entry
  needs neither);
  ``heal`` undoes it; ``isolate(node)`` takes its link down, ``rejoin`` brings it back;
* ``close()`` kills the processes it started (by pid) and deletes the namespaces, which deletes
  their veths and the host's veth with them. It runs even when the test fails (use it as a
  context manager or a fixture), and ``sweep_stale()`` removes what a killed test run left.

Names carry the owning process id (``qmqt-<pid>-<token>-<node>``), so helpers running tests at
once never collide and a sweep removes only namespaces whose owner is dead. Needs root and
iproute2 (``ip``); ``available()`` says whether this machine can.
"""

from __future__ import annotations

import ipaddress
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from typing import Any

from tests.harness import ServerProcess, spawn
from tests.pg import _alive

NS_PREFIX = "qmqt"
HOST = "host"
# A locally administered unicast MAC that no interface of a test network has: frames sent to it
# are flooded by the bridge and dropped by every receiver.
NOWHERE_MAC = "02:de:ad:00:00:01"
# Seconds one ip command may take.
IP_TIMEOUT_S = 20
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-[0-9a-f]+-")


def available() -> str | None:
    """None when namespaces can be made here, else why not (for a skip reason)."""
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip`` command; CalledProcessError (with its stderr) when it fails and ``check``."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, ["ip", *args], result.stdout,
                                            result.stderr)
    return result


def sweep_stale() -> list[str]:
    """Delete the namespaces of test runs whose process is gone; returns their names."""
    removed = []
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _NS_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _kill_inside(name)
            ip("netns", "delete", name, check=False)
            removed.append(name)
    return removed


def _kill_inside(namespace: str) -> None:
    """SIGKILL what still runs in a namespace this test run made (a leftover of a crash)."""
    for pid in ip("netns", "pids", namespace, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.200-249.x.0/24 that no route of the host namespace overlaps."""
    routes = ip("-4", "route", "show", "table", "all", check=False).stdout
    taken = []
    for word in routes.split():
        try:
            taken.append(ipaddress.ip_network(word, strict=False))
        except ValueError:
            continue
    rng = random.Random(secrets.randbits(32))
    for _ in range(200):
        net = ipaddress.ip_network(f"10.{rng.randrange(200, 250)}.{rng.randrange(256)}.0/24")
        if not any(net.overlaps(t) for t in taken if t.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.200-249.x.0/24 for a test network")


@dataclass
class Network:
    """Namespaces for ``nodes`` on one bridge, plus the host's way in (see the module doc)."""

    nodes: list[str]
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network = field(default_factory=_free_subnet)
    processes: list[ServerProcess] = field(default_factory=list)
    _cuts: set[tuple[str, str]] = field(default_factory=set)
    _made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.nodes) < 250 and HOST not in self.nodes, self.nodes
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- names and addresses --------------------------------------------------------------------

    def namespace(self, node: str) -> str:
        """The namespace of ``node`` (``"hub"`` is the bridge's)."""
        return f"{NS_PREFIX}-{os.getpid()}-{self.token}-{node}"

    def address(self, node: str) -> str:
        """The IPv4 address of ``node`` (``"host"``: the test process's address)."""
        hosts = list(self.subnet.hosts())
        return str(hosts[-1] if node == HOST else hosts[self.nodes.index(node)])

    @property
    def host_address(self) -> str:
        """Where the test process is seen from the nodes."""
        return self.address(HOST)

    def _build(self) -> None:
        hub = self.namespace("hub")
        self._add_namespace(hub)
        ip("-n", hub, "link", "add", "br0", "type", "bridge")
        ip("-n", hub, "link", "set", "br0", "up")
        prefix = self.subnet.prefixlen
        for index, node in enumerate(self.nodes):
            ns = self.namespace(node)
            self._add_namespace(ns)
            outer, inner = f"h{self.token}{index:02d}", f"n{self.token}{index:02d}"
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            ip("link", "set", outer, "netns", hub)
            ip("link", "set", inner, "netns", ns)
            ip("-n", hub, "link", "set", outer, "master", "br0", "up")
            ip("-n", ns, "link", "set", inner, "name", "eth0")
            ip("-n", ns, "addr", "add", f"{self.address(node)}/{prefix}", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        # The host's veth: its peer lives in the hub, so deleting the hub deletes both ends.
        outer, inner = f"h{self.token}hx", f"q{self.token}h"
        ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        ip("link", "set", outer, "netns", hub)
        ip("-n", hub, "link", "set", outer, "master", "br0", "up")
        ip("addr", "add", f"{self.host_address}/{prefix}", "dev", inner)
        ip("link", "set", inner, "up")

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)

    # -- processes -------------------------------------------------------------------------------

    def run(self, node: str, name: str, argv: list[str], ready: re.Pattern[str],
            env: dict[str, str] | None = None) -> ServerProcess:
        """Start ``argv`` inside ``node`` and wait for a line matching ``ready`` (group 1 is
        the address it printed); it is killed by ``close`` if still running."""
        server = spawn(name, ["ip", "netns", "exec", self.namespace(node), *argv], ready, env)
        self.processes.append(server)
        return server

    # -- faults ------------------------------------------------------------------------------------

    def cut(self, a: str, b: str) -> None:
        """Drop every packet between ``a`` and ``b`` (nodes, or ``"host"``), both ways."""
        for here, there in ((a, b), (b, a)):
            self._drop(here, there, add=True)
        self._cuts.add((a, b))

    def heal(self, a: str, b: str) -> None:
        """Undo ``cut(a, b)``."""
        for here, there in ((a, b), (b, a)):
            self._drop(here, there, add=False)
        self._cuts.discard((a, b))

    def _dev(self, node: str) -> str:
        return f"q{self.token}h" if node == HOST else "eth0"

    def _drop(self, node: str, target: str, *, add: bool) -> None:
        """Point (or stop pointing) ``node``'s neighbour entry for ``target`` at NOWHERE_MAC."""
        where = [] if node == HOST else ["-n", self.namespace(node)]
        if add:
            ip(*where, "neigh", "replace", self.address(target), "lladdr", NOWHERE_MAC,
               "nud", "permanent", "dev", self._dev(node))
        else:
            ip(*where, "neigh", "del", self.address(target), "dev", self._dev(node), check=False)

    def isolate(self, node: str) -> None:
        """Take ``node``'s only link down: it reaches nobody and nobody reaches it."""
        ip("-n", self.namespace(node), "link", "set", "eth0", "down")

    def rejoin(self, node: str) -> None:
        """Undo ``isolate(node)``."""
        ip("-n", self.namespace(node), "link", "set", "eth0", "up")

    # -- cleanup -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill the processes started here and delete every namespace (and the veths)."""
        for server in reversed(self.processes):
            if server.process.poll() is None:
                server.process.kill()
            try:
                server.process.wait(10)
            except subprocess.TimeoutExpired:
                pass
        for a, b in list(self._cuts):
            if HOST in (a, b):  # the host's filters go with its veth, but say so explicitly
                self._drop(HOST, b if a == HOST else a, add=False)
        self._cuts.clear()
        for name in reversed(self._made):
            _kill_inside(name)
            ip("netns", "delete", name, check=False)
        self._made.clear()

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["HOST", "NOWHERE_MAC", "Network", "available", "ip", "sweep_stale"]
