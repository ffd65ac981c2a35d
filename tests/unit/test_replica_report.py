"""A heartbeat's ``replica`` report (serverkit.replication.ReplicaReport.to_json): a field
added since session 15 (``undecodable_at``) goes only to a MetaServer whose answers list it in
``replica_fields``, as an older one refuses an unknown field with 400 (and a refused heartbeat
renews nothing); what goes is what the MetaServer checks."""

from __future__ import annotations

from metaserver.validation import REPLICA_FIELDS, UNDECODABLE_REASON_CHARS_MAX, check_replica
from serverkit.replication import ReplicaReport

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


def test_a_place_the_metaserver_would_refuse_is_left_out_not_sent():
    sent = ReplicaReport(undecodable_at={**AT, "offset": None}).to_json(REPLICA_FIELDS)
    assert "undecodable_at" not in sent
