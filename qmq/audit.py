"""``qmq audit``: run the Spark audit over trace directories (docs/AUDIT.md).

    qmq audit (--trace-dir DIR | --data-dir DIR)... --out DIR [--since T] [--until T]
              [--deadline-ms N] [--master URL] [--driver-memory SIZE] [--conf KEY=VALUE]...
              [--allow-overdue] [--allow-lost] [--class-archive-dir DIR]
              [--launch-cache-dir DIR] [--json]

T is ISO 8601 (a time without a zone is UTC) or epoch milliseconds. ``--data-dir`` finds every
trace directory under a data dir (``tracelog.reading.find_trace_dirs``). Exit codes (one table,
docs/AUDIT.md): 0 nothing lost, overdue or early; 1 lost messages or early deliveries; 2 bad
arguments or no trace files; 3 the audit itself failed (Spark error); 4 overdue messages, and
nothing lost or early. pyspark is imported only when the command runs, so the rest of the CLI
works without the ``audit`` extra.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from datetime import datetime, timezone
from urllib.parse import urlparse

from qmq.exits import EXIT_UNAVAILABLE, EXIT_USAGE

DEADLINE_MS_DEFAULT = 300_000  # the same as spark_audit.main.DEADLINE_MS_DEFAULT (no pyspark here)
EXIT_BAD_ARGUMENTS = EXIT_USAGE
EXIT_AUDIT_FAILED = EXIT_UNAVAILABLE  # Spark or Java failed: not a verdict (that is exit 1)


def parse_time_ms(text: str) -> int:
    """Epoch ms from ``1767225600000`` or ISO 8601 (``2026-01-01T00:00:00Z``; no zone = UTC)."""
    value = text.strip()
    if value.isdigit():
        return int(value)
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"time {text!r} is neither ISO 8601 (2026-01-01T00:00:00Z) nor epoch ms") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


def _positive_ms(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"deadline {text!r} must be a positive number of ms")
    return value


def _conf(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--conf {text!r} is not KEY=VALUE "
                                         "(e.g. spark.executor.memory=4g)")
    return key.strip(), value


def add_audit_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``audit`` on the CLI's sub-parsers; returns its parser."""
    parser = subparsers.add_parser(
        "audit", help="audit the trace with Spark: lost, overdue, duplicate, late, early, "
                      "retried",
        description="Read trace directories, write Parquet results, report.md and report.html "
                    "under --out. Exit 0: nothing lost, overdue or early; 1: lost messages or "
                    "early deliveries; 2: bad arguments or no trace files; 3: the audit "
                    "failed; 4: overdue messages (nothing lost or early).")
    parser.add_argument("--trace-dir", action="append", default=[], dest="trace_dirs",
                        metavar="DIR", help="a trace directory or Hadoop URI (repeatable)")
    parser.add_argument("--data-dir", action="append", default=[], dest="data_dirs",
                        metavar="DIR", help="a local directory to search for trace directories: "
                        "a server's or qmq up's data dir, or a directory of several (repeatable)")
    parser.add_argument("--out", required=True, help="output directory or Hadoop URI")
    parser.add_argument("--since", type=parse_time_ms, default=None, metavar="T",
                        help="only events at or after T (ISO 8601 or epoch ms)")
    parser.add_argument("--until", type=parse_time_ms, default=None, metavar="T",
                        help="only events before T; messages due after T are in flight, not lost")
    parser.add_argument("--deadline-ms", type=_positive_ms, default=DEADLINE_MS_DEFAULT,
                        help="a message not acked this long after it became deliverable is lost "
                             f"(default {DEADLINE_MS_DEFAULT})")
    parser.add_argument("--master", default="local[*]", help="Spark master URL (default local[*])")
    parser.add_argument("--driver-memory", default="2g",
                        help="Spark driver memory for local masters (default 2g)")
    parser.add_argument("--conf", action="append", default=[], type=_conf, metavar="KEY=VALUE",
                        help="a Spark setting, applied last (repeatable)")
    parser.add_argument("--allow-overdue", action="store_true",
                        help="report overdue messages without failing the gate")
    parser.add_argument("--allow-lost", action="store_true",
                        help="report lost messages without failing the gate")
    parser.add_argument("--class-archive-dir", default=None, metavar="DIR",
                        help="where the driver JVM's class-data-sharing archive is kept, built "
                             "once in the background after the first audit and used by later "
                             "ones (default $QMQ_AUDIT_CLASS_ARCHIVE_DIR, else "
                             "~/.cache/pyqmq/audit-class-archive; 'off' turns it off)")
    parser.add_argument("--launch-cache-dir", default=None, metavar="DIR",
                        help="where a local audit keeps its driver JVM's command line, to "
                             "start that JVM directly instead of through spark-submit's "
                             "launcher JVM (default $QMQ_AUDIT_LAUNCH_CACHE_DIR, else "
                             "~/.cache/pyqmq/audit-launch; 'off' turns it off)")
    parser.add_argument("--json", action="store_true",
                        help="print the verdict and counts as one JSON document on stdout "
                             "(exit codes unchanged)")
    return parser


def _is_local(path: str) -> bool:
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or len(scheme) == 1


def _argument_error(args: argparse.Namespace) -> str | None:
    if not args.trace_dirs and not args.data_dirs:
        return "give at least one --trace-dir or --data-dir"
    if args.since is not None and args.until is not None and args.since >= args.until:
        return f"--since {args.since} must be before --until {args.until}"
    for path in args.trace_dirs:
        local = urlparse(path).path if path.startswith("file:") else path
        if _is_local(path) and not os.path.isdir(local):
            return f"--trace-dir {path} is not a directory"
    for path in args.data_dirs:
        if not _is_local(path):
            return (f"--data-dir {path} is not a local directory: name the trace directories "
                    "of remote storage with --trace-dir (a glob such as hdfs://nn/qmq/*/trace "
                    "works)")
        if not os.path.isdir(path):
            return f"--data-dir {path} is not a directory"
    return None


def trace_dirs_of(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The --trace-dir paths and the trace directories found under each --data-dir, each once
    (by real path for local ones), in order; or an error naming a data dir without any."""
    found: list[str] = []
    seen: set[str] = set()

    def add(path: str) -> None:
        key = os.path.realpath(path) if _is_local(path) and not path.startswith("file:") else path
        if key not in seen:
            seen.add(key)
            found.append(path)

    for path in args.trace_dirs:
        add(path)
    for data_dir in args.data_dirs:
        from tracelog.reading import find_trace_dirs  # lazily: the CLI's client commands load us

        under = find_trace_dirs(data_dir)
        if not under:
            return [], (f"--data-dir {data_dir} holds no trace directory (<dir>/<YYYYMMDDHH>/"
                        "*.jsonl)")
        for path in under:
            add(path)
    return found, None


def run_audit(args: argparse.Namespace) -> int:
    """Run ``qmq audit`` with parsed arguments; returns the exit code."""
    error = _argument_error(args)
    trace_dirs: list[str] = []
    if error is None:
        trace_dirs, error = trace_dirs_of(args)
    if error:
        print(f"qmq audit: {error}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    try:
        from spark_audit import launch
        from spark_audit.class_archive import default_directory
        from spark_audit.errors import AuditError
        from spark_audit.main import AuditOptions, run
    except ImportError as exc:
        print(f"qmq audit: needs PySpark ({exc}); install it with: pip install 'pyqmq[audit]'",
              file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    if args.data_dirs:
        print(f"qmq audit: trace directories: {', '.join(trace_dirs)}", file=sys.stderr)
    options = AuditOptions(trace_dirs=tuple(trace_dirs), out_dir=args.out,
                           since_ms=args.since, until_ms=args.until,
                           deadline_ms=args.deadline_ms, master=args.master,
                           driver_memory=args.driver_memory, conf=tuple(args.conf),
                           allow_lost=args.allow_lost, allow_overdue=args.allow_overdue,
                           json=args.json,
                           class_archive_dir=args.class_archive_dir or default_directory(),
                           launch_cache_dir=args.launch_cache_dir or launch.default_directory())
    try:
        return run(options)
    except AuditError as exc:
        print(f"qmq audit: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGUMENTS
    except Exception as exc:  # a Spark or Java failure: not a verdict, so not exit code 1
        traceback.print_exc()
        print(f"qmq audit: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_AUDIT_FAILED

