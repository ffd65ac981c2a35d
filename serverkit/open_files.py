"""The process's open-files limit: raised at start, and the share of it a store may keep open.

A broker keeps a descriptor per client connection, per message-log segment it writes or reads,
and, through ``logstore.descriptors.DescriptorCache``, a bounded number of consumer-log files
(one per subject would be 10,000 at 10,000 subjects). The usual soft limit of a service is
1024 while the hard limit is far higher, so a server starts by raising its soft
``RLIMIT_NOFILE`` to the hard limit (as the NATS server and Kafka's scripts expect of their
operators) and logs both, then gives the cache ``FILES_CACHED_SHARE`` of what it got.

What it does NOT do: raise the hard limit (only root may; docs/OPERATIONS.md says how), or
guarantee a descriptor later: sockets of clients take the rest, and the cache closes its own
when an open finds none left.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from logstore.descriptors import CAPACITY_MIN

log = logging.getLogger(__name__)

# Soft limit asked for when the hard limit is unlimited (Linux caps RLIMIT_NOFILE at
# /proc/sys/fs/nr_open, 1048576 by default, and refuses RLIM_INFINITY).
OPEN_FILES_WANTED_MAX = 1 << 20
# A store's descriptor cache gets 1/FILES_CACHED_SHARE of the soft limit: the rest is for
# client sockets, log segments, the pull log, trace files and the MetaServer's connections.
FILES_CACHED_SHARE = 4
# Most consumer-log files one store keeps open, whatever the limit: past this, a cache miss
# (an open and a close, some microseconds) is cheaper than the kernel's memory for idle files.
FILES_CACHED_MAX = 4096


@dataclass(frozen=True)
class OpenFilesLimit:
    """``RLIMIT_NOFILE`` of this process: the soft limit found at start, now, and the hard one
    (``resource.RLIM_INFINITY`` when unlimited)."""

    soft_before: int
    soft: int
    hard: int


def raise_open_files_limit() -> OpenFilesLimit:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (idempotent) and log both; a refusal
    is logged and the soft limit kept."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED_MAX if hard == resource.RLIM_INFINITY else hard
    raised = soft
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            raised = wanted
        except (ValueError, OSError) as exc:
            log.warning("open-files limit: could not raise the soft limit %d to %d (hard %s): "
                        "%s", soft, wanted, _text(hard), exc)
    limit = OpenFilesLimit(soft, raised, hard)
    log.info("open-files limit: soft %s (was %s), hard %s; consumer-log files cached: %d",
             _text(raised), _text(soft), _text(hard), files_cached_budget(raised))
    return limit


def files_cached_budget(soft: int | None = None) -> int:
    """How many files a store's descriptor cache may keep open under the soft limit ``soft``
    (this process's current one when None): a ``FILES_CACHED_SHARE`` share of it, between
    ``CAPACITY_MIN`` and ``FILES_CACHED_MAX``."""
    if soft is None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return FILES_CACHED_MAX
    return max(CAPACITY_MIN, min(FILES_CACHED_MAX, soft // FILES_CACHED_SHARE))


def _text(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


__all__ = ["FILES_CACHED_MAX", "FILES_CACHED_SHARE", "OPEN_FILES_WANTED_MAX", "OpenFilesLimit",
           "files_cached_budget", "raise_open_files_limit"]
