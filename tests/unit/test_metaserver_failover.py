"""metaserver.failover: when a lease has surely expired, whom to promote, and the switchover
steps, told the time by a fake clock (docs/REPLICATION.md 5, 6, 9)."""

from __future__ import annotations

import pytest

from metaserver.failover import (
    GroupState,
    LeaseWatch,
    ServerState,
    SwitchoverRefused,
    choose_successor,
    handover_completes,
    plan_failover,
    plan_switchover,
    switchover_verdict,
)

LEASE_MS, MARGIN_MS = 3000, 500


def group(epoch: int = 1, renewals: int = 7, **kw) -> GroupState:
    return GroupState("rt1", epoch, "m", renewals, **kw)


def servers(*, b_sync: bool = True, c_sync: bool = True, b_pos: int = 100, c_pos: int = 90,
            b_online: bool = True) -> list[ServerState]:
    return [ServerState("m", "master", True, True, 120),
            ServerState("b", "slave", b_sync, b_online, b_pos),
            ServerState("c", "slave", c_sync, True, c_pos)]


def test_a_lease_has_surely_expired_only_after_lease_plus_margin_without_a_renewal():
    watch = LeaseWatch(LEASE_MS, MARGIN_MS)
    watch.observe("rt1", 1, 7, now_ms=1000)
    watch.observe("rt1", 1, 7, now_ms=2000)  # the same pair again: the clock does not restart
    assert not watch.expired("rt1", 1000 + LEASE_MS + MARGIN_MS - 1)
    assert watch.expired("rt1", 1000 + LEASE_MS + MARGIN_MS)


def test_a_renewal_or_a_new_epoch_restarts_the_watch():
    watch = LeaseWatch(LEASE_MS, MARGIN_MS)
    watch.observe("rt1", 1, 7, now_ms=0)
    watch.observe("rt1", 1, 8, now_ms=3000)
    assert not watch.expired("rt1", 3499) and not watch.expired("rt1", 6499)
    assert watch.expired("rt1", 6500)
    watch.observe("rt1", 2, 8, now_ms=6600)
    assert not watch.expired("rt1", 6700)


def test_a_metaserver_that_never_saw_the_group_waits_a_whole_lease_from_its_first_look():
    watch = LeaseWatch(LEASE_MS, MARGIN_MS)
    assert not watch.expired("rt1", 10**9)
    assert watch.silent_ms("rt1", 0) is None


def test_the_most_caught_up_in_sync_online_slave_is_chosen():
    assert choose_successor(servers(), "m").server_id == "b"
    assert choose_successor(servers(b_pos=80), "m").server_id == "c"
    assert choose_successor(servers(b_sync=False), "m").server_id == "c"
    assert choose_successor(servers(b_online=False), "m").server_id == "c"


def test_ties_go_to_the_smallest_server_id_and_unknown_positions_come_last():
    tied = [ServerState("z", "slave", True, True, 5), ServerState("a", "slave", True, True, 5),
            ServerState("y", "slave", True, True, None)]
    assert choose_successor(tied, "m").server_id == "a"


def test_no_slave_in_sync_means_no_successor_unless_unclean():
    out_of_sync = servers(b_sync=False, c_sync=False)
    assert choose_successor(out_of_sync, "m") is None
    assert choose_successor(out_of_sync, "m", require_in_sync=False).server_id == "b"


def test_failover_promotes_once_the_lease_expired_at_the_next_epoch_it_checks():
    watch = LeaseWatch(LEASE_MS, MARGIN_MS)
    watch.observe("rt1", 1, 7, now_ms=0)
    assert plan_failover(group(), servers(), watch, now_ms=3499) is None
    promotion = plan_failover(group(), servers(), watch, now_ms=3500)
    assert promotion is not None
    assert (promotion.from_id, promotion.to_id, promotion.epoch, promotion.lease_renewals,
            promotion.reason) == ("m", "b", 1, 7, "lease expired")


def test_failover_waits_when_the_row_moved_since_it_was_watched():
    watch = LeaseWatch(LEASE_MS, MARGIN_MS)
    watch.observe("rt1", 1, 7, now_ms=0)
    assert plan_failover(group(renewals=8), servers(), watch, now_ms=10_000) is None


def test_a_solo_group_is_never_failed_over():
    watch = LeaseWatch(LEASE_MS, MARGIN_MS)
    watch.observe("rt1", 1, 7, now_ms=0)
    assert plan_failover(group(), servers(b_sync=False, c_sync=False), watch, 10**9) is None


def test_a_switchover_picks_the_best_in_sync_slave_or_checks_the_one_asked_for():
    assert plan_switchover(group(), servers(), None) == "b"
    assert plan_switchover(group(), servers(), "c") == "c"
    with pytest.raises(SwitchoverRefused, match="not in sync"):
        plan_switchover(group(), servers(c_sync=False), "c")
    with pytest.raises(SwitchoverRefused, match="already the master"):
        plan_switchover(group(), servers(), "m")
    with pytest.raises(SwitchoverRefused, match="not a server of group rt1"):
        plan_switchover(group(), servers(), "x")
    with pytest.raises(SwitchoverRefused, match="already switching over to b"):
        plan_switchover(group(switchover_to="b"), servers(), None)
    with pytest.raises(SwitchoverRefused, match="no online slave in sync"):
        plan_switchover(group(), servers(b_sync=False, c_sync=False), None)


def test_a_switchover_is_cancelled_when_its_deadline_passes_or_its_target_leaves():
    going = group(switchover_to="b", switchover_deadline_ms=5000)
    assert switchover_verdict(going, servers(), 5000) is None
    assert "deadline passed" in switchover_verdict(going, servers(), 5001)
    assert "went offline" in switchover_verdict(going, servers(b_online=False), 0)
    assert "fell out of sync" in switchover_verdict(going, servers(b_sync=False), 0)
    assert switchover_verdict(group(), servers(), 0) is None


def test_only_the_current_master_reporting_the_target_ready_completes_a_handover():
    going = group(epoch=4, switchover_to="b", switchover_deadline_ms=5000)
    assert handover_completes(going, "m", 4, "b").to_id == "b"
    assert handover_completes(going, "m", 3, "b") is None, "an old epoch"
    assert handover_completes(going, "c", 4, "b") is None, "not the master"
    assert handover_completes(going, "m", 4, "c") is None, "another target"
    assert handover_completes(group(epoch=4), "m", 4, "b") is None, "no switchover"
