"""A heartbeat's ``replica`` report (serverkit.replication.ReplicaReport.to_json): a field
added since session 15 (``undecodable_at``) goes only to a MetaServer whose answers list it in
``replica_fields``, as an older one refuses an unknown field with 400 (and a refused heartbeat
renews nothing, so one refusal makes the next heartbeat go without it); what goes is what the
MetaServer checks."""

from __future__ import annotations

from typing import Any

import pytest

from metaserver.errors import BadRequest
from metaserver.validation import REPLICA_FIELDS, check_replica
from serverkit.registration import Registration
from serverkit.replication import NoReplication, ReplicaReport
from wire.limits import REPLICA_INSYNC_MAX, REPLICA_POSITIONS_MAX, UNDECODABLE_REASON_CHARS_MAX

AT = {"log": "done", "offset": 10, "kind": 1, "version": 9, "reason": "unknown version 9"}


def test_undecodable_at_goes_only_to_a_metaserver_that_takes_it():
    report = ReplicaReport(position=5, undecodable_at=AT)
    assert "undecodable_at" not in report.to_json()  # an older MetaServer's answers
    sent = report.to_json(REPLICA_FIELDS)
    assert sent["undecodable_at"] == AT
    assert check_replica("replica", sent)["undecodable_at"] == AT


def test_what_is_sent_passes_the_metaservers_check_a_long_reason_cut_and_unknown_kinds_null():
    at = {**AT, "kind": None, "version": None, "reason": "x" * 1000}
    sent = ReplicaReport(undecodable_at=at).to_json(REPLICA_FIELDS)["undecodable_at"]
    assert len(sent["reason"]) == UNDECODABLE_REASON_CHARS_MAX
    assert check_replica("replica", {"undecodable_at": sent})["undecodable_at"] == sent


def test_the_metaserver_takes_a_reason_up_to_undecodable_reason_chars_max_and_refuses_longer():
    # One constant (wire.limits) for the server's cut and the MetaServer's check.
    for chars in (UNDECODABLE_REASON_CHARS_MAX - 1, UNDECODABLE_REASON_CHARS_MAX):
        at = {**AT, "reason": "x" * chars}
        assert check_replica("replica", {"undecodable_at": at})["undecodable_at"] == at
    with pytest.raises(BadRequest, match="over UNDECODABLE_REASON_CHARS_MAX 400"):
        check_replica("replica", {"undecodable_at": {
            **AT, "reason": "x" * (UNDECODABLE_REASON_CHARS_MAX + 1)}})


def test_a_report_of_more_logs_or_in_sync_slaves_than_the_metaserver_takes_is_cut_to_its_limits():
    report = ReplicaReport(
        positions={f"log{n}": n for n in range(REPLICA_POSITIONS_MAX + 1)},
        insync=tuple(f"{n:016x}" for n in range(REPLICA_INSYNC_MAX + 1)))
    sent = report.to_json(REPLICA_FIELDS)
    assert len(sent["positions"]) == REPLICA_POSITIONS_MAX
    assert len(sent["insync"]) == REPLICA_INSYNC_MAX
    assert check_replica("replica", sent)["positions"] == sent["positions"]


def test_a_place_the_metaserver_would_refuse_is_left_out_not_sent():
    sent = ReplicaReport(undecodable_at={**AT, "offset": None}).to_json(REPLICA_FIELDS)
    assert "undecodable_at" not in sent


_STOPPED_AT = {"log": "done", "offset": 40, "kind": 9, "version": 1, "reason": "kind 9 unknown"}


class _Stopped(NoReplication):
    def report(self) -> ReplicaReport:
        return ReplicaReport(position=40, positions={"delay": 40}, undecodable_at=_STOPPED_AT)


async def test_a_heartbeat_an_older_metaserver_refuses_for_undecodable_at_is_followed_by_one_without_it():
    reg = Registration("http://127.0.0.1:1", group="g", kind="delay", address="127.0.0.1:2",
                       heartbeat_interval_ms=1000, report=_noop, on_state=lambda s: None,
                       replication=_Stopped())
    reg.registered = True
    answers: list[int] = []
    newer = {"value": True}

    async def post(path: str, body: dict[str, Any], *, patient: bool = False):
        if newer["value"]:
            answers.append(200)
            return 200, {"state": "rw", "replica_fields": ["lag_bytes", "lag_ms", "position",
                                                           "positions", "undecodable_at"]}
        if "undecodable_at" in body.get("replica", {}):  # an older MetaServer: unknown field
            answers.append(400)
            return 400, {"error": {"code": "bad_request",
                                   "message": "replica has unknown field(s) 'undecodable_at'"}}
        answers.append(200)
        return 200, {"state": "rw"}

    reg._post = post  # type: ignore[method-assign]
    await reg.heartbeat_now()  # the newer MetaServer: learns the fields
    newer["value"] = False     # the list's other MetaServer (older) answers from now on
    for _ in range(5):
        await reg.heartbeat_now()
    assert answers == [200, 400, 200, 200, 200, 200], answers  # one refused, then renewed


async def _noop() -> Any:
    return None
