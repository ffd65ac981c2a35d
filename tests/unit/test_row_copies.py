"""A group's or server's row copy (metaserver.row_copies): the replication rules change it as
they would the ORM's object, and a heartbeat writes only what changed."""

from __future__ import annotations

from typing import Any

import pytest

from metaserver.models import BrokerGroup
from metaserver.row_copies import RowCopy


def _group_row() -> dict[str, Any]:
    return {column.name: None for column in BrokerGroup.__table__.columns} | {
        "name": "realtime-1", "kind": "realtime", "epoch": 3, "master_id": "a"}


def test_a_changed_column_is_the_one_change_a_heartbeat_writes():
    group = RowCopy(BrokerGroup.__table__, _group_row())
    group.epoch = 4
    group.master_id = "a"  # the same value: nothing to write
    assert group.changes() == {"epoch": 4}
    assert group.key() == {"name": "realtime-1"}
    group.mark_written()
    assert group.changes() == {}


def test_setting_a_name_that_is_no_column_raises_naming_it_instead_of_never_being_written():
    group = RowCopy(BrokerGroup.__table__, _group_row())
    with pytest.raises(AttributeError, match="broker_groups has no column 'master'"):
        group.master = "b"
    with pytest.raises(AttributeError, match="has no column 'masterid'"):
        group.masterid  # noqa: B018  (a read of a typo raises too)
    assert group.changes() == {}
