"""A realtime server whose data plane is a stand-in, for control-plane tests with real
processes (docs/REPLICATION.md 12).

It copies nothing. As master it proposes the ``--insync`` server ids as in sync, so the
MetaServer can promote them, and it reports a switchover's target as ready at once, so the
planned handover completes. Everything else is the real control plane: registration, leases,
epochs, role changes and the refusal of writes by anyone but the leased master. Tests that need
real copies belong to the data plane.

``python -m tests.replication_stub --meta URL --data-dir D --group G --host H [--insync ID]...``
prints ``listening on HOST:PORT`` once registered, and serves until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal

from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit.replication import ReplicaReport
from serverkit.role import RoleView, ServerRole


class StubReplication:
    """Proposes fixed peers as in sync when master; a handover is always ready at once."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = tuple(peers)
        self.role: ServerRole | None = None
        self.views: list[RoleView] = []

    def report(self) -> ReplicaReport:
        """The peers as in sync (master), and the switchover target as ready."""
        if self.role is None:  # not bound to its server yet
            return ReplicaReport()
        view = self.role.view()
        if view.role != "master":
            return ReplicaReport(position=0, lag_bytes=0, lag_ms=0)
        return ReplicaReport(position=0, insync=self.peers, handover_ready=view.switchover_to)

    async def on_role(self, view: RoleView) -> None:
        """Nothing to seal or truncate; remember what was told."""
        self.views.append(view)

    def last_epoch(self) -> int:
        """No epoch history."""
        return 0

    async def drain(self, timeout_ms: int) -> None:
        """Nothing copied, nothing to wait for."""


async def serve(args: argparse.Namespace) -> None:
    """Run one stub-replicated realtime server until a signal."""
    stub = StubReplication(args.insync)
    config = RealtimeConfig(data_dir=args.data_dir, meta_url=args.meta, group=args.group,
                            host=args.host, port=args.port, trace=False,
                            heartbeat_interval_ms=args.heartbeat_interval_ms)
    server = RealtimeServer(config, replication=stub)
    stub.role = server.role
    await server.start()
    print(f"listening on {server.address} ", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print(await server.stop(), flush=True)


def main() -> None:
    """Parse the flags and serve."""
    parser = argparse.ArgumentParser(prog="replication_stub")
    parser.add_argument("--meta", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--insync", action="append", default=[])
    parser.add_argument("--heartbeat-interval-ms", type=int, default=3_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: "
                        "%(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
