"""Errors of the audit job.

    AuditError          base; ``retriable`` False (the same input fails the same way again)
    └── NoTraceFiles    a trace path holds no ``*/*.jsonl`` file (``path``)
"""

from __future__ import annotations


class AuditError(Exception):
    """Base of the audit's own errors (bad input, not a Spark failure)."""

    retriable = False


class NoTraceFiles(AuditError):
    """A --trace-dir holds no trace file in the ``<hour>/<server>-<pid>.jsonl`` layout."""

    def __init__(self, path: str, detail: str = "") -> None:
        self.path = path
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"no trace files (<hour>/*.jsonl) under {path}{suffix}")
