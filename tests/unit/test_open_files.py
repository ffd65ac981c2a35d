"""serverkit.open_files: a server raises its soft open-files limit to the hard one at start and
gives its descriptor cache a bounded share of it."""

from __future__ import annotations

import logging
import resource

import pytest

from logstore.descriptors import CAPACITY_MIN
from serverkit import open_files
from serverkit.open_files import (
    FILES_CACHED_MAX, OPEN_FILES_WANTED_MAX, files_cached_budget, raise_open_files_limit,
)


class FakeLimits:
    """resource.getrlimit/setrlimit of RLIMIT_NOFILE, over values the test sets."""

    def __init__(self, soft: int, hard: int, refuse: bool = False) -> None:
        self.soft, self.hard, self.refuse = soft, hard, refuse

    def getrlimit(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        if self.refuse:
            raise ValueError("not allowed to raise maximum limit")
        self.soft, self.hard = limits


@pytest.fixture
def limits(monkeypatch) -> FakeLimits:
    fake = FakeLimits(1024, 524288)
    monkeypatch.setattr(open_files.resource, "getrlimit", fake.getrlimit)
    monkeypatch.setattr(open_files.resource, "setrlimit", fake.setrlimit)
    return fake


def test_the_soft_limit_is_raised_to_the_hard_one_and_both_are_logged(limits, caplog):
    with caplog.at_level(logging.INFO, logger="serverkit.open_files"):
        found = raise_open_files_limit()
    assert (found.soft_before, found.soft, found.hard) == (1024, 524288, 524288)
    assert limits.soft == 524288
    assert "open-files limit: soft 524288 (was 1024), hard 524288" in caplog.text


def test_an_unlimited_hard_limit_raises_the_soft_one_to_what_linux_allows(limits):
    limits.hard = resource.RLIM_INFINITY
    assert raise_open_files_limit().soft == OPEN_FILES_WANTED_MAX


def test_a_refused_raise_is_logged_and_the_soft_limit_kept(limits, caplog):
    limits.refuse = True
    with caplog.at_level(logging.WARNING, logger="serverkit.open_files"):
        found = raise_open_files_limit()
    assert found.soft == 1024 and limits.soft == 1024
    assert "could not raise the soft limit 1024 to 524288" in caplog.text


def test_the_cache_gets_a_quarter_of_the_limit_between_its_minimum_and_maximum():
    assert files_cached_budget(1024) == 256
    assert files_cached_budget(4) == CAPACITY_MIN
    assert files_cached_budget(1 << 20) == FILES_CACHED_MAX
    assert files_cached_budget(resource.RLIM_INFINITY) == FILES_CACHED_MAX


def test_a_broker_config_refuses_a_descriptor_cache_below_its_minimum_naming_the_key(tmp_path):
    from realtime.config import RealtimeConfig

    with pytest.raises(ValueError, match=r"consumer_log_files_open_max must be an integer >= 2 "
                                         r"or None, got 1"):
        RealtimeConfig(data_dir=str(tmp_path), consumer_log_files_open_max=1)
    assert RealtimeConfig(data_dir=str(tmp_path)).consumer_log_files_open_max is None
