"""Logging of the ``qmq`` processes: ``--log-level`` and ``--log-format text|json``.

``text`` (the default) writes ``time LEVEL logger: message`` lines to stderr. ``json`` writes one
JSON object per line to stderr, for a log pipeline (journald, Loki, Elasticsearch):

    {"ts": "2026-11-25T18:11:38.513Z", "level": "info", "logger": "qmq.status",
     "message": "realtime group rt1 listening on 10.0.0.2:20881 ...", "pid": 4242}

plus ``exc`` (the formatted traceback) when a record carries one. The status lines a server
command prints for its operator (listening, stopping, stopped) go through ``say``: printed to
stdout in text mode, logged as records of the ``qmq.status`` logger in JSON mode, so a JSON log
has them too and nothing is written twice. Light on purpose: the client commands import it.
"""

from __future__ import annotations

import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")
_format = "text"
# The status lines' logger: INFO whatever --log-level says, as they are printed in text mode.
_say_log = logging.getLogger("qmq.status")
_say_log.setLevel(logging.INFO)


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (UTC, ms), level, logger, message, pid, and exc."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {"ts": f"{ts}.{int(record.msecs):03d}Z", "level": record.levelname.lower(),
                "logger": record.name, "message": record.getMessage(), "pid": record.process}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


# The name of the handler setup_logging installs, so whoever set it up can find it again.
CLI_HANDLER_NAME = "qmq-cli"


def setup_logging(level: str, log_format: str = "text") -> None:
    """Log to stderr at ``level`` (debug, info, warning, error) in ``log_format``."""
    global _format
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    _format = log_format
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(CLI_HANDLER_NAME)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    # Alembic narrates every migration check at INFO; only its warnings matter to an operator.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))


def say(line: str) -> None:
    """A status line for the operator: stdout in text mode, an INFO record in JSON mode."""
    if _format == "json":
        _say_log.info("%s", line)
    else:
        print(line, flush=True)


def json_mode() -> bool:
    """True when ``--log-format json`` is in force."""
    return _format == "json"


__all__ = ["CLI_HANDLER_NAME", "JsonFormatter", "LOG_FORMATS", "json_mode", "say", "setup_logging"]
