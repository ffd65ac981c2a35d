"""The exit codes of every ``qmq`` command, one table for all (docs/CLI.md prints it).

=====  ==================  ==========================================================================
code   name                meaning
=====  ==================  ==========================================================================
0      EXIT_OK             done
1      EXIT_FAILED         the service answered no: refused (unauthorized, forbidden), not found,
                           conflict, a bad value it checked, a broker of an admin command failed,
                           ``cancel`` found nothing to cancel, ``audit`` found a problem
2      EXIT_USAGE          bad arguments or configuration: nothing was sent (argparse's code too)
3      EXIT_UNAVAILABLE    could not be done now: the MetaServer or a broker cannot be reached,
                           or answered an error that may pass (overloaded, readonly, internal,
                           no route); trying again later may work. ``audit``: Spark or Java failed
4      (spark_audit)       ``audit`` only: overdue messages found, and nothing lost or early
130    EXIT_INTERRUPTED    stopped by Ctrl-C before it finished
=====  ==================  ==========================================================================

Server commands (``up``, ``metaserver``, ``realtime``, ``delay``) exit 0 after a graceful stop
and 2 on a bad setting (a config file's or a flag's), naming the key and the value.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130


def exit_code_of_error(retriable: bool) -> int:
    """The exit code of a QmqError (or an HTTP error of the MetaServer) by its retriable flag."""
    return EXIT_UNAVAILABLE if retriable else EXIT_FAILED


def exit_code_of_http_status(status: int) -> int:
    """The exit code of an error answer of the MetaServer's HTTP API: a 5xx (or 429) may pass."""
    return EXIT_UNAVAILABLE if status >= 500 or status == 429 else EXIT_FAILED


__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_UNAVAILABLE", "EXIT_USAGE",
           "exit_code_of_error", "exit_code_of_http_status"]
