"""``python -m metaserver --db URL [--host H] [--port P]``: run a MetaServer in the foreground."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from metaserver.app import run_metaserver
from metaserver.config import DEFAULT_PORT, MetaConfig, sqlite_url


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and serve until interrupted; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m metaserver", description=__doc__)
    parser.add_argument("--db", default=sqlite_url("metaserver.db"), help="database URL")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port, 0 = any")
    args = parser.parse_args(argv)
    try:
        config = MetaConfig(db_url=args.db, host=args.host, port=args.port)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        asyncio.run(run_metaserver(config))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
