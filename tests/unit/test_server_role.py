"""serverkit.role: the server side of roles, epochs and leases, told the time by a fake clock
(docs/REPLICATION.md 3-5)."""

from __future__ import annotations

import pytest

from serverkit.role import LEASE_GUARD_DIVISOR, RoleGrant, ServerRole
from wire.errors import NotMaster

LEASE_MS = 3000
GUARD_MS = LEASE_MS // LEASE_GUARD_DIVISOR


def grant(role: str = "master", epoch: int = 1, *, lease_required: bool = True,
          master_id: str | None = "me", switchover_to: str | None = None,
          insync: tuple[str, ...] = ()) -> RoleGrant:
    return RoleGrant(role=role, epoch=epoch, lease_ms=LEASE_MS, lease_required=lease_required,
                     master_id=master_id, master_address="10.0.0.1:20881" if master_id else None,
                     insync=insync, switchover_to=switchover_to)


def leased_master(now_ms: int = 1000, epoch: int = 1) -> ServerRole:
    role = ServerRole("me")
    sent = role.before_heartbeat(now_ms, proposes_slaves=False)
    change = role.on_answer(sent, grant(epoch=epoch), proposed_slaves=False)
    assert change.changed
    assert role.activate(epoch)
    return role


def test_a_server_that_has_heard_from_no_metaserver_refuses_writes():
    role = ServerRole("me")
    assert not role.may_write(0)
    with pytest.raises(NotMaster, match="no MetaServer has answered"):
        role.check_writable("rt1", 0)


def test_a_standalone_server_is_a_master_that_needs_no_lease():
    role = ServerRole("me", standalone=True)
    assert role.may_write(10**12)
    assert role.lease_remaining_ms(0) is None


def test_a_master_accepts_writes_until_its_lease_minus_the_guard_counted_from_the_send():
    role = leased_master(now_ms=1000)
    last_ok = 1000 + LEASE_MS - GUARD_MS - 1
    assert role.may_write(last_ok)
    assert not role.may_write(last_ok + 1)
    with pytest.raises(NotMaster, match="lease ran out"):
        role.check_writable("rt1", last_ok + 1)


def test_the_lease_is_measured_from_when_the_heartbeat_was_sent_not_answered():
    role = ServerRole("me")
    sent = role.before_heartbeat(1000, proposes_slaves=False)
    # The answer took 2 s to come back: the lease still ends 2.7 s after the send.
    role.on_answer(sent, grant(), proposed_slaves=False)
    role.activate(1)
    assert role.lease_until_ms == 1000 + LEASE_MS - GUARD_MS


def test_each_renewal_extends_the_lease_and_a_late_old_answer_never_shortens_it():
    role = leased_master(now_ms=1000)
    role.on_answer(1750, grant(), proposed_slaves=False)
    assert role.lease_until_ms == 1750 + LEASE_MS - GUARD_MS
    role.on_answer(1100, grant(), proposed_slaves=False)
    assert role.lease_until_ms == 1750 + LEASE_MS - GUARD_MS


def test_a_new_master_refuses_writes_until_the_data_plane_activates_its_epoch():
    role = ServerRole("me")
    role.on_answer(role.before_heartbeat(0, False), grant(epoch=3), proposed_slaves=False)
    assert not role.may_write(1)
    with pytest.raises(NotMaster, match="sealing its logs"):
        role.check_writable("rt1", 1)
    assert not role.activate(2), "activating another epoch does nothing"
    assert role.activate(3)
    assert role.may_write(1)


def test_a_renewal_at_the_same_epoch_keeps_the_master_active():
    role = leased_master(now_ms=0)
    change = role.on_answer(500, grant(), proposed_slaves=False)
    assert not change.changed
    assert role.active and role.may_write(600)


def test_an_answer_naming_another_master_at_a_higher_epoch_demotes_at_once():
    role = leased_master(now_ms=0)
    change = role.on_answer(500, grant("slave", epoch=2, master_id="other"), proposed_slaves=False)
    assert change.changed and change.view.role == "slave"
    assert not role.may_write(501)
    with pytest.raises(NotMaster, match="slave at epoch 2; the master is other"):
        role.check_writable("rt1", 501)


def test_an_answer_older_than_the_epoch_known_is_ignored_and_grants_nothing():
    role = leased_master(now_ms=0, epoch=5)
    before = role.lease_until_ms
    change = role.on_answer(2000, grant(epoch=4), proposed_slaves=False)
    assert change.stale and not change.changed
    assert role.epoch == 5 and role.lease_until_ms == before


def test_a_higher_epoch_seen_in_a_fetch_stops_writes_before_any_answer():
    role = leased_master(now_ms=0, epoch=2)
    assert role.observe_epoch(3)
    assert not role.may_write(1)
    assert role.role == "unknown" and role.epoch == 3
    assert not role.observe_epoch(3), "the same epoch again changes nothing"
    with pytest.raises(NotMaster, match="saw epoch 3"):
        role.check_writable("rt1", 1)


def test_a_solo_master_keeps_writing_without_a_lease():
    role = ServerRole("me")
    role.on_answer(role.before_heartbeat(0, False), grant(lease_required=False),
                   proposed_slaves=False)
    role.activate(1)
    assert role.solo
    assert role.may_write(10**9), "nobody can be promoted, so the MetaServer being gone is fine"


def test_proposing_a_slave_in_sync_ends_solo_before_the_heartbeat_is_sent():
    role = ServerRole("me")
    role.on_answer(role.before_heartbeat(0, False), grant(lease_required=False),
                   proposed_slaves=False)
    role.activate(1)
    role.before_heartbeat(1000, proposes_slaves=True)
    assert not role.solo
    # The answer to that heartbeat is lost: the lease of the first answer still bounds writes.
    assert role.may_write(LEASE_MS - GUARD_MS - 1)
    assert not role.may_write(LEASE_MS - GUARD_MS)


def test_an_answer_to_a_heartbeat_that_proposed_a_slave_does_not_make_the_master_solo():
    role = ServerRole("me")
    sent = role.before_heartbeat(0, proposes_slaves=True)
    role.on_answer(sent, grant(lease_required=False), proposed_slaves=True)
    role.activate(1)
    assert not role.solo
    assert not role.may_write(LEASE_MS)


def test_a_master_handing_over_refuses_writes_and_resumes_when_the_switchover_is_cancelled():
    role = leased_master(now_ms=0)
    change = role.on_answer(100, grant(switchover_to="s2"), proposed_slaves=False)
    assert change.changed
    with pytest.raises(NotMaster, match="handing the group over to s2"):
        role.check_writable("rt1", 200)
    change = role.on_answer(300, grant(), proposed_slaves=False)
    assert change.changed and role.may_write(400)


def test_a_master_that_steps_down_refuses_writes_even_with_a_lease():
    role = leased_master(now_ms=0)
    role.step_down()
    with pytest.raises(NotMaster, match="shutting down"):
        role.check_writable("rt1", 1)


def test_a_grant_is_read_from_an_answer_and_malformed_ones_grant_nothing():
    answer = {"role": "master", "epoch": 4, "lease_ms": 3000, "lease_required": False,
              "master": {"server_id": "ab", "address": "h:1"}, "insync": ["cd", 5],
              "replication": {"mode": "async", "min_insync": 1}, "switchover_to": None}
    parsed = RoleGrant.from_answer(answer)
    assert parsed is not None
    assert (parsed.role, parsed.epoch, parsed.lease_required, parsed.master_id,
            parsed.insync, parsed.replication.mode, parsed.replication.min_insync) == (
        "master", 4, False, "ab", ("cd",), "async", 1)
    assert RoleGrant.from_answer({"ok": True, "state": "rw"}) is None, "an older MetaServer"
    assert RoleGrant.from_answer({**answer, "epoch": True}) is None
    assert RoleGrant.from_answer({**answer, "lease_ms": 0}) is None
    assert RoleGrant.from_answer({**answer, "role": "boss"}) is None


def test_a_metaserver_that_knows_nothing_of_roles_makes_a_solo_master_until_one_that_does():
    role = ServerRole("me")
    assert role.on_roleless_answer()
    assert role.may_write(10**9) and role.solo
    role.on_answer(role.before_heartbeat(0, False), grant("slave", master_id="x"),
                   proposed_slaves=False)
    assert not role.may_write(1)
    assert not role.on_roleless_answer(), "once roles were seen, a roleless answer changes nothing"


def test_only_a_lapsed_lease_of_an_active_master_counts_as_only_lease_ran_out():
    role = leased_master(now_ms=0)
    lapsed = LEASE_MS  # past the lease minus the guard
    assert not role.only_lease_ran_out(1)  # writable: nothing refused
    assert role.only_lease_ran_out(lapsed)
    role.on_answer(100, grant(switchover_to="s2"), proposed_slaves=False)
    assert not role.only_lease_ran_out(lapsed)  # handing over
    demoted = leased_master(now_ms=0)
    demoted.on_answer(100, grant(role="slave", epoch=2, master_id="s2"), proposed_slaves=False)
    assert not demoted.only_lease_ran_out(lapsed)
    stopping = leased_master(now_ms=0)
    stopping.step_down()
    assert not stopping.only_lease_ran_out(lapsed)
    assert not ServerRole("me").only_lease_ran_out(0)  # role not known yet


# -- the answer worked out once per change of state --------------------------------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

_STEPS = st.lists(st.one_of(
    st.tuples(st.just("answer"), st.sampled_from(["master", "slave"]), st.integers(0, 3),
              st.booleans(), st.booleans(), st.sampled_from([None, "other"]),
              st.integers(0, 10_000)),
    st.tuples(st.just("activate"), st.integers(0, 3)),
    st.tuples(st.just("observe_epoch"), st.integers(0, 4)),
    st.tuples(st.just("propose"), st.integers(0, 10_000)),
    st.tuples(st.just("roleless")),
    st.tuples(st.just("step_down")),
), max_size=12)


def _apply(role: ServerRole, step: tuple) -> None:
    kind = step[0]
    if kind == "answer":
        _, who, epoch, lease_required, proposed, switchover, sent_ms = step
        role.on_answer(sent_ms, RoleGrant(role=who, epoch=epoch, lease_ms=LEASE_MS,
                                          lease_required=lease_required, master_id="me",
                                          master_address="10.0.0.1:20881",
                                          switchover_to=switchover), proposed_slaves=proposed)
    elif kind == "activate":
        role.activate(step[1])
    elif kind == "observe_epoch":
        role.observe_epoch(step[1])
    elif kind == "propose":
        role.before_heartbeat(step[1], proposes_slaves=True)
    elif kind == "roleless":
        role.on_roleless_answer()
    else:
        role.step_down()


@settings(max_examples=400, deadline=None)
@given(_STEPS, st.booleans(), st.lists(st.integers(-1, 20_000), min_size=1, max_size=5))
def test_what_the_state_allows_is_forgotten_at_every_change_and_matches_the_refusal(
        steps, standalone, times):
    role = ServerRole("me", standalone=standalone)
    for step in steps:
        # Asked before each change, so a stale answer would show after it.
        role.writable_until_ms()
        _apply(role, step)
        for now_ms in times:
            assert (now_ms < role.writable_until_ms()) == (role.refusal(now_ms) is None), (
                step, now_ms)


def test_a_demoted_master_refuses_the_next_write_check_at_once():
    role = ServerRole("me")
    sent = role.before_heartbeat(0, proposes_slaves=False)
    role.on_answer(sent, grant(lease_required=False), proposed_slaves=False)
    assert role.activate(1)
    role.check_writable_now("rt1")  # a solo master: allowed, without a lease
    role.observe_epoch(2)
    with pytest.raises(NotMaster, match="saw epoch 2"):
        role.check_writable_now("rt1")
