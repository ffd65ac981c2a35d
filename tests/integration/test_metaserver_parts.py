"""MetaServer parts without a server: config validation, routing plans, request limits, migrations."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from metaserver import validation as v
from metaserver.config import MetaConfig, sqlite_url
from metaserver.db import alembic_config, head_revision, migrations_dir
from metaserver.errors import BadRequest
from metaserver.routing import GroupView, plan_route

SQLITE = "sqlite+aiosqlite:////tmp/x.db"


# -- config ------------------------------------------------------------------------------------


def test_the_config_defaults_are_the_documented_ones() -> None:
    config = MetaConfig(db_url=SQLITE)
    assert (config.host, config.port) == ("127.0.0.1", 8090)
    assert (config.broker_expiry_ms, config.client_expiry_ms) == (15_000, 30_000)
    assert (config.route_groups_default, config.expiry_check_interval_ms) == (2, 1000)
    assert (config.lease_ms, config.lease_margin_ms) == (3000, 500)
    assert (config.failover_check_interval_ms, config.switchover_timeout_ms) == (250, 30_000)
    # A quarter of the lease (a third of the expiry would be 5000).
    assert config.heartbeat_interval_ms == 750
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("db_url", "mysql://x"),
        ("db_url", "sqlite:///plain-driver.db"),
        ("host", ""),
        ("port", -1),
        ("port", 65_536),
        ("port", "8090"),
        ("port", True),
        ("broker_expiry_ms", 0),
        ("client_expiry_ms", -5),
        ("route_groups_default", 0),
        ("expiry_check_interval_ms", 1.5),
    ],
)
def test_a_bad_config_value_fails_naming_the_key_and_the_value(key: str, value: Any) -> None:
    fields: dict[str, Any] = {"db_url": SQLITE, key: value}
    with pytest.raises(ValueError) as info:
        MetaConfig(**fields)
    assert key in str(info.value)
    assert str(value) in str(info.value)


def test_port_limits_are_accepted_at_zero_and_65535() -> None:
    assert MetaConfig(db_url=SQLITE, port=0).port == 0
    assert MetaConfig(db_url=SQLITE, port=65_535).port == 65_535


def test_sqlite_url_makes_the_path_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert sqlite_url("m.db") == f"sqlite+aiosqlite:///{tmp_path}/m.db"
    MetaConfig(db_url=sqlite_url("m.db"))


# -- routing plans ------------------------------------------------------------------------------


def test_a_new_subject_gets_the_least_loaded_groups_ties_broken_by_name() -> None:
    load = {"a": 3, "b": 1, "c": 1, "d": 0}
    assert plan_route([], {"a", "b", "c", "d"}, load, 2) == ["b", "d"]
    assert plan_route([], {"a", "b", "c", "d"}, {}, 2) == ["a", "b"]


def test_a_full_route_of_usable_groups_stays_as_it_is() -> None:
    assert plan_route(["a", "b"], {"a", "b", "c"}, {}, 2) is None


def test_an_unusable_group_is_replaced_only_when_a_spare_exists() -> None:
    assert plan_route(["a", "b"], {"b", "c"}, {"c": 5}, 2) == ["b", "c"]
    assert plan_route(["a", "b"], {"b"}, {}, 2) is None
    assert plan_route(["a"], set(), {}, 2) is None


def test_a_route_grows_when_more_groups_become_usable() -> None:
    assert plan_route(["a"], {"a", "b"}, {}, 2) == ["a", "b"]
    assert plan_route(["a"], {"a", "b"}, {}, 1) is None


def test_group_state_follows_its_brokers_and_the_admin_flag() -> None:
    assert GroupView("g", "realtime").state == "offline"
    assert GroupView("g", "realtime", rw_addresses=["h:1"]).state == "rw"
    assert GroupView("g", "realtime", readonly=True, rw_addresses=["h:1"]).state == "readonly"
    ro = GroupView("g", "realtime", readonly_addresses=["h:2"], rw_addresses=["h:1"])
    assert (ro.state, ro.online_addresses) == ("rw", ["h:1", "h:2"])


# -- request limits -------------------------------------------------------------------------------


def _backlog(n: int) -> list[dict[str, Any]]:
    return [{"subject": f"s{i}", "group": "g", "lag": i} for i in range(n)]


@pytest.mark.parametrize("n", [v.BACKLOG_ENTRIES_MAX - 1, v.BACKLOG_ENTRIES_MAX])
def test_a_backlog_of_up_to_the_limit_entries_is_accepted(n: int) -> None:
    assert len(v.check_backlog("backlog", _backlog(n))) == n


def test_a_backlog_over_the_limit_is_rejected_quoting_the_count_and_the_limit() -> None:
    with pytest.raises(BadRequest, match=f"{v.BACKLOG_ENTRIES_MAX + 1} entries.*{v.BACKLOG_ENTRIES_MAX}"):
        v.check_backlog("backlog", _backlog(v.BACKLOG_ENTRIES_MAX + 1))


def test_client_subject_lists_are_limited() -> None:
    subjects = [f"s{i}" for i in range(v.CLIENT_SUBJECTS_MAX)]
    assert len(v.check_subject_list("subjects", subjects[:-1])) == v.CLIENT_SUBJECTS_MAX - 1
    assert len(v.check_subject_list("subjects", subjects)) == v.CLIENT_SUBJECTS_MAX
    with pytest.raises(BadRequest):
        v.check_subject_list("subjects", [*subjects, "one.more"])


@pytest.mark.parametrize(
    ("name", "ok"),
    [("a" * 200, True), ("a" * 201, False), ("a", True), ("", False), ("a b", False),
     ("%retry%s%g", True), ("%dead%s%g", True), ("%other%s%g", False)],
)
def test_subject_names_follow_the_design_rule(name: str, ok: bool) -> None:
    if ok:
        assert v.check_subject("subject", name) == name
    else:
        with pytest.raises(BadRequest):
            v.check_subject("subject", name)


@pytest.mark.parametrize(
    ("address", "ok"),
    [("127.0.0.1:1", True), ("h:65535", True), ("h:65536", False), ("h:0", False),
     ("[::1]:20881", True), ("broker-1.example:20881", True), (":20881", False), ("h", False)],
)
def test_addresses_are_host_and_port(address: str, ok: bool) -> None:
    if ok:
        assert v.check_address("address", address) == address
    else:
        with pytest.raises(BadRequest):
            v.check_address("address", address)


# -- migrations -----------------------------------------------------------------------------------


def test_the_migrations_are_found_next_to_the_installed_package() -> None:
    config = alembic_config()
    assert Path(config.get_main_option("script_location") or "") == migrations_dir()
    assert (migrations_dir() / "env.py").exists()
    assert head_revision() == "0006_undecodable_at"


def test_alembic_by_hand_migrates_a_database_from_any_directory(tmp_path: Path) -> None:
    db = tmp_path / "hand.db"
    ini = migrations_dir() / "alembic.ini"
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(ini), "-x", f"db_url={sqlite_url(db)}",
         "upgrade", "head"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(migrations_dir().parent)},
    )
    assert result.returncode == 0, result.stderr
    import sqlite3

    with sqlite3.connect(db) as connection:
        (revision,) = connection.execute("SELECT version_num FROM alembic_version").fetchone()
    assert revision == head_revision()
