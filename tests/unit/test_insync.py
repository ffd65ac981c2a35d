"""``serverkit.insync.InSyncTracker``: what a master knows of its slaves' copies, told the time
(docs/REPLICATION.md 7 and 8.3)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from serverkit.insync import InSyncTracker

LOGS = ("message", "actions")
LAG_MAX_MS = 5_000
MEMBERS = ("s1", "s2")  # the group's registered slaves, as the MetaServer names them


def new_tracker(now_ms: int = 0) -> InSyncTracker:
    tracker = InSyncTracker(LOGS, LAG_MAX_MS, now_ms=now_ms)
    tracker.set_members(MEMBERS)
    return tracker


def caught_up(tracker: InSyncTracker, slave: str, ends: dict[str, int], now_ms: int) -> None:
    for log, end in ends.items():
        tracker.on_fetch(slave, log, end, end, now_ms)


def test_a_slave_is_in_sync_once_it_reached_the_end_of_every_log():
    tracker = new_tracker()
    tracker.on_fetch("s1", "message", 100, 100, 10)
    assert tracker.proposal(10) == ()
    tracker.on_fetch("s1", "actions", 40, 40, 20)
    assert tracker.proposal(20) == ("s1",)


def test_a_slave_behind_for_longer_than_the_lag_limit_leaves_the_in_sync_set():
    tracker = new_tracker()
    caught_up(tracker, "s1", {"message": 100, "actions": 40}, 1_000)
    tracker.on_fetch("s1", "message", 100, 500, 2_000)  # behind from now on
    assert tracker.proposal(1_000 + LAG_MAX_MS) == ("s1",)
    assert tracker.proposal(1_000 + LAG_MAX_MS + 1) == ()


def test_a_sync_write_waits_for_the_slowest_slave_it_waits_for():
    tracker = new_tracker()
    caught_up(tracker, "s1", {"message": 100, "actions": 40}, 10)
    caught_up(tracker, "s2", {"message": 80, "actions": 40}, 10)
    assert tracker.replicated("message", 10) == 80
    assert tracker.caught_up_to("s1", {"message": 100, "actions": 40})
    assert not tracker.caught_up_to("s2", {"message": 100, "actions": 40})


def test_with_no_slave_to_wait_for_nothing_is_waited_for():
    tracker = new_tracker()
    assert tracker.replicated("message", 0) is None
    assert tracker.waiting_set(0) == ()


def test_a_slave_the_database_counts_is_waited_for_until_the_database_drops_it():
    # A new master has not heard from the database's in-sync slave yet: it gets the lag limit
    # to show up, and writes wait for it meanwhile and after (until the set is confirmed).
    tracker = new_tracker(1_000)
    tracker.set_confirmed(("s1",))
    assert tracker.proposal(1_000 + LAG_MAX_MS) == ("s1",)
    assert tracker.proposal(1_000 + LAG_MAX_MS + 1) == ()
    assert tracker.waiting_set(1_000 + LAG_MAX_MS + 1) == ("s1",)
    assert tracker.replicated("message", 1_000 + LAG_MAX_MS + 1) == 0
    tracker.set_confirmed(())
    assert tracker.replicated("message", 1_000 + LAG_MAX_MS + 1) is None


def test_an_older_fetch_offset_never_moves_what_a_slave_acknowledged_back():
    tracker = new_tracker()
    tracker.on_fetch("s1", "message", 100, 200, 10)
    tracker.on_fetch("s1", "message", 60, 200, 20)  # a fetch that was overtaken
    assert tracker.acked("s1", "message") == 100


def test_a_fetcher_that_is_not_a_registered_slave_of_the_group_never_counts():
    # Any admin token may fetch; only the group's own slaves may hold a write for the master.
    tracker = new_tracker()
    assert not tracker.on_fetch("stranger", "message", 100, 100, 10)
    assert not tracker.on_fetch("stranger", "actions", 40, 40, 10)
    assert tracker.proposal(10) == ()
    assert tracker.replicated("message", 10) is None
    assert tracker.acked("stranger", "message") == 0


def test_a_slave_the_metaserver_no_longer_names_is_forgotten():
    tracker = new_tracker()
    caught_up(tracker, "s1", {"message": 100, "actions": 40}, 10)
    assert tracker.proposal(10) == ("s1",)
    tracker.set_members(("s2",))
    assert tracker.proposal(10) == ()
    assert tracker.acked("s1", "message") == 0


def test_a_slave_that_keeps_having_what_its_previous_fetch_saw_stays_in_sync_under_load():
    # A steady stream of writes: every fetch finds the end moved on since the previous one, so
    # no fetch is ever at the end; the slave is caught up as of its previous fetch (Kafka).
    tracker = new_tracker()
    end = 0
    for n in range(1, 40):  # 250 ms apart, 10 s in all: twice the lag limit
        now_ms = n * 250
        for log in LOGS:
            tracker.on_fetch("s1", log, end, end + 100, now_ms)
        end += 100
    assert tracker.proposal(now_ms) == ("s1",)


def test_a_slave_that_falls_behind_what_its_previous_fetch_saw_leaves_the_in_sync_set():
    tracker = new_tracker()
    caught_up(tracker, "s1", {"message": 100, "actions": 40}, 1_000)
    for n in range(1, 40):  # it fetches, but each time from further behind the end
        tracker.on_fetch("s1", "message", 100 + n, 100 + 1_000 * n, 1_000 + n * 250)
        tracker.on_fetch("s1", "actions", 40, 40, 1_000 + n * 250)  # at the end of this one
    assert tracker.proposal(1_000 + 39 * 250) == ()


def test_an_acknowledgement_alone_raises_what_a_slave_has_but_never_makes_it_caught_up():
    tracker = new_tracker()
    caught_up(tracker, "s1", {"message": 100, "actions": 40}, 1_000)
    assert tracker.acknowledge("s1", "message", 300)
    assert tracker.acked("s1", "message") == 300
    assert not tracker.acknowledge("s1", "message", 200)  # never lowered
    assert tracker.acked("s1", "message") == 300
    assert not tracker.acknowledge("stranger", "message", 300)  # not a slave of the group
    assert tracker.acked("stranger", "message") == 0
    # Caught-up is judged by fetches only: the last one was at 1,000 ms.
    assert tracker.proposal(1_000 + LAG_MAX_MS + 1) == ()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("fetch"), st.sampled_from(("s1", "s2", "s3")), st.sampled_from(LOGS),
              st.integers(0, 4), st.integers(0, 4)),
    st.tuples(st.just("members"), st.sets(st.sampled_from(("s1", "s2", "s3")))),
    st.tuples(st.just("confirmed"), st.sets(st.sampled_from(("s1", "s2", "s3")))),
    st.tuples(st.just("forget"), st.sampled_from(("s1", "s2", "s3"))),
    st.tuples(st.just("wait"), st.one_of(st.integers(0, 2 * LAG_MAX_MS),
                                         st.sampled_from((1, LAG_MAX_MS - 1, LAG_MAX_MS)))),
), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_the_sets_a_tracker_keeps_between_changes_are_those_its_rule_gives_at_every_time(ops):
    # The proposal and the waiting set are judged once and kept until a fetch of a slave not
    # in sync, a change of members or of the database's set, a forgotten slave, or the time
    # the first slave in sync falls out; at every step (the clock never goes back) they equal
    # the rule applied afresh.
    tracker = new_tracker(now_ms=1_000)
    now_ms = 1_000
    for op in ops:
        if op[0] == "fetch":
            _, slave, log, offset, behind = op
            tracker.on_fetch(slave, log, offset * 100, (offset + behind) * 100, now_ms)
        elif op[0] == "members":
            tracker.set_members(tuple(sorted(op[1])))
        elif op[0] == "confirmed":
            tracker.set_confirmed(tuple(sorted(op[1])))
        elif op[0] == "forget":
            tracker.forget(op[1])
        else:
            now_ms += op[1]
        fresh = tuple(sorted(s for s in set(tracker.slaves) | set(tracker.confirmed)
                             if tracker.in_sync(s, now_ms)))
        assert tracker.proposal(now_ms) == fresh
        assert tracker.waiting_set(now_ms) == tuple(sorted(set(fresh) | set(tracker.confirmed)))
