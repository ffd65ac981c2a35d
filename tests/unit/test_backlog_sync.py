"""serverkit.backlog and metaserver.backlog: a broker's backlog goes to the MetaServer as
changes against the version it acknowledged, so a heartbeat does not grow with the groups."""

from __future__ import annotations

from metaserver.backlog import plan_backlog
from metaserver.validation import BACKLOG_ENTRIES_MAX
from serverkit.backlog import BACKLOG_ROWS_PER_HEARTBEAT_MAX, BacklogSync, merge_rows


def rows(n: int, lag: int = 1, prefix: str = "s") -> list[dict]:
    return [{"subject": f"{prefix}{i:05d}", "group": "g", "lag": lag, "consumers": 1}
            for i in range(n)]


class MetaServer:
    """The MetaServer's side, over one broker's rows, as ``store_backlog`` applies a plan."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.rows: dict | None = None  # None: nothing held

    def heartbeat(self, fields: dict) -> int | None:
        plan = plan_backlog(
            self.version, backlog=fields.get("backlog"), base=fields.get("backlog_base"),
            changes=fields.get("backlog_changes", []), removed=fields.get("backlog_removed", []))
        if not plan.writes_rows:
            return plan.version
        rows = {} if plan.replace or self.rows is None else self.rows
        for key in plan.removals:
            rows.pop(key, None)
        rows.update(plan.upserts)
        self.rows, self.version = rows, plan.version
        return plan.version

    def backlog(self) -> dict:
        return merge_rows(self.rows.values())


def test_the_broker_sends_fewer_rows_per_heartbeat_than_the_metaserver_takes():
    assert BACKLOG_ROWS_PER_HEARTBEAT_MAX < BACKLOG_ENTRIES_MAX


def test_the_first_heartbeat_sends_the_whole_backlog_and_an_idle_one_sends_no_row():
    sync, meta = BacklogSync(), MetaServer()
    first = sync.fields(rows(3))
    assert len(first["backlog"]) == 3
    sync.acknowledged(meta.heartbeat(first))
    idle = sync.fields(rows(3))
    assert idle == {"backlog_base": sync.version, "backlog_changes": [], "backlog_removed": []}
    version = sync.version
    sync.acknowledged(meta.heartbeat(idle))
    assert sync.version == version  # nothing changed: the MetaServer rewrote nothing


def test_only_changed_and_removed_rows_follow_and_the_metaserver_ends_with_the_brokers_backlog():
    sync, meta = BacklogSync(), MetaServer()
    sync.acknowledged(meta.heartbeat(sync.fields(rows(5))))
    now = rows(5)[1:]  # s00000 gone
    now[0]["lag"] = 7  # s00001 changed
    now.append({"subject": "new", "group": "g", "lag": 2, "consumers": 0})
    delta = sync.fields(now)
    assert [r["subject"] for r in delta["backlog_changes"]] == ["new", "s00001"]
    assert delta["backlog_removed"] == [["s00000", "g"]]
    sync.acknowledged(meta.heartbeat(delta))
    assert meta.backlog() == merge_rows(now)


def test_a_backlog_over_the_per_heartbeat_rows_goes_over_several_heartbeats():
    sync, meta = BacklogSync(rows_max=4), MetaServer()
    backlog = rows(10)
    sizes = []
    for _ in range(5):
        fields = sync.fields(backlog)
        sizes.append(len(fields.get("backlog", fields.get("backlog_changes", []))))
        sync.acknowledged(meta.heartbeat(fields))
    assert sizes == [4, 4, 2, 0, 0]
    assert meta.backlog() == merge_rows(backlog)


def test_a_metaserver_that_lost_the_base_gets_the_whole_backlog_at_the_next_heartbeat():
    sync, meta = BacklogSync(), MetaServer()
    sync.acknowledged(meta.heartbeat(sync.fields(rows(3))))
    meta.version = meta.rows = None  # a fresh database
    delta = sync.fields(rows(3, lag=2))
    assert meta.heartbeat(delta) is None
    sync.acknowledged(None)
    again = sync.fields(rows(3, lag=2))
    assert len(again["backlog"]) == 3
    sync.acknowledged(meta.heartbeat(again))
    assert meta.backlog() == merge_rows(rows(3, lag=2))


def test_a_lost_answer_is_caught_by_the_version_and_nothing_is_lost():
    sync, meta = BacklogSync(), MetaServer()
    sync.acknowledged(meta.heartbeat(sync.fields(rows(3))))
    meta.heartbeat(sync.fields(rows(3, lag=5)))  # taken, but the answer never came
    sync.reset()
    sync.acknowledged(meta.heartbeat(sync.fields(rows(3, lag=6))))
    assert meta.backlog() == merge_rows(rows(3, lag=6))


def test_rows_of_one_subject_and_group_are_summed():
    merged = merge_rows([{"subject": "s", "group": "g", "lag": 2, "consumers": 1,
                          "redelivered": 2},
                         {"subject": "s", "group": "g", "lag": 3, "consumers": 1, "dead": 5}])
    assert merged == {("s", "g"): (5, 2, 2, 0, 5)}  # lag, consumers, redelivered, retried, dead


def test_a_delay_servers_stats_object_goes_whole_and_asks_for_no_version():
    sync, meta = BacklogSync(), MetaServer()
    fields = sync.fields({"pending": 4})
    assert fields == {"backlog": {"pending": 4}}
    assert meta.heartbeat(fields) is None
    sync.acknowledged(None)
    assert sync.fields({"pending": 5}) == {"backlog": {"pending": 5}}


def test_a_heartbeat_without_backlog_fields_changes_nothing_held():
    meta = MetaServer()
    meta.heartbeat({"backlog": rows(2)})
    held = meta.rows
    assert meta.heartbeat({}) is None and meta.rows is held


def test_redelivered_retried_and_dead_counts_reach_the_metaserver_and_a_change_of_one_is_sent():
    sync, meta = BacklogSync(), MetaServer()
    backlog = rows(2)
    first = sync.fields(backlog)
    assert "redelivered" not in first["backlog"][0]  # a count of 0 is left out of the row
    sync.acknowledged(meta.heartbeat(first))
    counted = rows(2)
    counted[1].update(redelivered=3, retried=2, dead=1)
    delta = sync.fields(counted)
    assert delta["backlog_changes"] == [{"subject": "s00001", "group": "g", "lag": 1,
                                         "consumers": 1, "redelivered": 3, "retried": 2,
                                         "dead": 1}]
    sync.acknowledged(meta.heartbeat(delta))
    assert meta.backlog() == merge_rows(counted)

