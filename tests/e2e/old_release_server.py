"""``python -m tests.e2e.old_release_server <qmq arguments>``: ``qmq`` as a server of the release
before ``fetch.reads`` replicates: its fetches say nothing of the record kinds it reads (its
message log and done journal are built without the gated kinds, docs/REPLICATION.md 8.2), so
a master of this release counts it as reading none of them. It reads them all the same; the
test is of the master, which must neither write nor serve them to it."""

from __future__ import annotations

import sys

import delayserver.server
import realtime.server
from qmq.cli import main

if __name__ == "__main__":
    realtime.server.MESSAGE_KINDS = None  # type: ignore[assignment]
    delayserver.server.DONE_KINDS = None  # type: ignore[assignment]
    sys.exit(main())
