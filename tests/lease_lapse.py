"""A server's lease running out while a commit runs, for the tests of both servers' sends
(REPLICATION.md 5: a write that outlived the lease is not acknowledged)."""

from __future__ import annotations

from typing import Any

import pytest

from wire.errors import NotMaster


def lapse_after(monkeypatch: pytest.MonkeyPatch, role: Any, owner: Any, name: str) -> list[str]:
    """From the moment ``owner.name`` (a commit's store call) returns, ``role`` refuses
    writes, NotMaster naming why: the list returned holds that reason; clear it to make the
    role writable again (the lease renewed)."""
    refusing: list[str] = []
    check_writable = role.check_writable

    def check(group: str, now_ms: int) -> None:
        if refusing:
            raise NotMaster(f"server me is not the leased master of group {group}: "
                            f"{refusing[0]}")
        check_writable(group, now_ms)

    writable_now = role.writable_now
    monkeypatch.setattr(role, "check_writable", check)
    monkeypatch.setattr(role, "writable_now", lambda: not refusing and writable_now())
    commit = getattr(owner, name)

    def commit_then_lapse(*args: Any) -> Any:
        committed = commit(*args)
        refusing[:] = ["its lease ran out (epoch 1): no MetaServer renewed it in time"]
        return committed

    monkeypatch.setattr(owner, name, commit_then_lapse)
    return refusing
