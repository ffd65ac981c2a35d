"""logstore.descriptors: the bounded LRU of open files shared by a store's consumer logs."""

from __future__ import annotations

import errno
import os

import pytest

from logstore import OsFile
from logstore.descriptors import CAPACITY_MIN, DescriptorCache, out_of_descriptors


def test_the_cache_keeps_at_most_its_capacity_open_closing_the_least_recently_used(tmp_path):
    cache = DescriptorCache(OsFile, 2)
    paths = [str(tmp_path / f"f{i}") for i in range(3)]
    cache.get(paths[0]).append(b"a")
    cache.get(paths[1]).append(b"b")
    cache.get(paths[0])  # now the most recently used
    cache.get(paths[2]).append(b"c")  # evicts f1
    assert cache.open_count == 2 and cache.evicted == 1 and cache.opened == 3
    assert cache.get(paths[1]).pread(0, 1) == b"b"  # reopened; f0 evicted now
    assert cache.opened == 4 and cache.evicted == 2
    cache.close()
    assert cache.open_count == 0


def test_a_capacity_below_the_minimum_is_refused_naming_it():
    with pytest.raises(ValueError, match=f"capacity 1 .* CAPACITY_MIN {CAPACITY_MIN}"):
        DescriptorCache(OsFile, 1)


def test_an_open_that_finds_no_descriptor_left_is_retried_after_the_cache_lets_go(tmp_path):
    cache = DescriptorCache(OsFile, 4)
    for i in range(3):
        cache.get(str(tmp_path / f"f{i}"))
    calls = []

    def refuse_once(path: str) -> OsFile:
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files (injected)", path)
        return OsFile(path)

    handle = cache.opener(refuse_once)(str(tmp_path / "g"))
    assert len(calls) == 2 and cache.relieved == 1 and cache.open_count == 0
    handle.close()
    cache.close()


def test_with_nothing_cached_the_spare_descriptor_is_given_up_for_the_retry(tmp_path):
    cache = DescriptorCache(OsFile, 2)
    assert cache._spare >= 0
    attempts = []

    def refuse_once(path: str) -> str:
        attempts.append(path)
        if len(attempts) == 1:
            raise OSError(errno.ENFILE, "File table overflow (injected)", path)
        return path

    assert cache.retry_on_emfile(refuse_once, "x") == "x"
    assert cache.relieved == 1
    assert cache._spare >= 0  # taken back after the retry succeeded
    cache.close()
    assert cache._spare == -1


def test_other_errors_are_not_retried():
    cache = DescriptorCache(OsFile, 2)

    def missing(path: str) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file", path)

    with pytest.raises(FileNotFoundError):
        cache.retry_on_emfile(missing, "x")
    assert cache.relieved == 0 and not out_of_descriptors(FileNotFoundError())
    assert out_of_descriptors(OSError(errno.EMFILE, os.strerror(errno.EMFILE)))
    cache.close()
