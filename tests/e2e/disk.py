"""A small real disk that fills up: a tmpfs mounted for one test, and a filler file.

Mounting needs root (or CAP_SYS_ADMIN); where the machine forbids it the test is skipped and
says why. The filler writes until the kernel answers ENOSPC, so the disk is full for every
process, and deleting it gives the space back.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FILL_CHUNK_BYTES = 256 << 10  # filler write size; the last chunks shrink down to one byte
FILL_WRITES_MAX = 1_000_000  # bound on the filling loop


@contextmanager
def tmpfs(directory: Path, size_bytes: int) -> Iterator[Path]:
    """Mount a tmpfs of ``size_bytes`` on ``directory`` for the block; skip the test if the
    machine does not allow mounting."""
    directory.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs for a full-disk test needs root; running as uid "
                    f"{os.geteuid()}")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs",
                           str(directory)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {directory}: {done.stderr.strip()}")
    try:
        yield directory
    finally:
        # Lazy: a server that failed to stop may still hold files; the mount goes when it exits.
        subprocess.run(["umount", "-l", str(directory)], capture_output=True, timeout=30)


def fill(directory: Path, name: str = "filler") -> Path:
    """Write ``directory/name`` until the file system is full (ENOSPC); returns its path."""
    path = directory / name
    chunk = FILL_CHUNK_BYTES
    with open(path, "ab", buffering=0) as out:
        for _ in range(FILL_WRITES_MAX):
            try:
                out.write(b"\xff" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if chunk == 1:
                    return path
                chunk //= 2
    raise AssertionError(f"{directory} did not fill after {FILL_WRITES_MAX} writes")


def free_bytes(directory: Path) -> int:
    """Bytes still free for writing on the file system of ``directory``."""
    stat = os.statvfs(directory)
    return stat.f_bavail * stat.f_frsize
