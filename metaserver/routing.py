"""Routing rules, as pure functions over plain values (the registry feeds them from the database).

* A group is **live** when at least one of its brokers is online (rw or readonly).
* A group is **usable** by producers when it is live, the admin has not made it readonly, its
  master has not reported that it refuses writes (``writable``: too few slaves in sync), and at
  least one of its online brokers is rw. Producers only get the rw brokers' addresses.
* Only a group's master serves clients, so a group's addresses are its master's alone
  (docs/REPLICATION.md 3); the registry leaves slaves out of ``GroupView``.
* A subject's realtime route holds ``min(route_groups_default, number of usable groups)`` active
  groups. When it holds fewer usable ones (a group went offline or readonly, or the subject is new,
  or new groups appeared), the missing ones are filled with the usable groups that carry the
  fewest active routes (ties: by name), the unusable ones leave the active set, and the version
  goes up. Otherwise the route is left alone, so versions are stable.
* Consumers get every live group that has ever been in the route, rw or readonly, so everything
  written anywhere is drained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ONLINE_STATES = ("rw", "readonly")


@dataclass
class GroupView:
    """A broker group as routing sees it: its admin flag and its online brokers by state."""

    name: str
    kind: str
    readonly: bool = False
    epoch: int = 0  # the group's replication epoch, told to clients beside the addresses
    writable: bool = True  # False while the master refuses writes for want of in-sync slaves
    rw_addresses: list[str] = field(default_factory=list)
    readonly_addresses: list[str] = field(default_factory=list)

    @property
    def live(self) -> bool:
        """True when at least one broker of the group is online."""
        return bool(self.rw_addresses or self.readonly_addresses)

    @property
    def usable(self) -> bool:
        """True when producers may send to this group."""
        return not self.readonly and self.writable and bool(self.rw_addresses)

    @property
    def state(self) -> str:
        """``rw`` (producers welcome), ``readonly`` (drain only) or ``offline``."""
        if not self.live:
            return "offline"
        return "rw" if self.usable else "readonly"

    @property
    def online_addresses(self) -> list[str]:
        """Addresses of every online broker, sorted."""
        return sorted(self.rw_addresses + self.readonly_addresses)


def broker_state(group_readonly: bool) -> str:
    """Return the state the MetaServer wants an online broker in: its group's admin switch.

    The broker's own report is not trusted for this: a broker echoes back the state it was last
    told, so honouring a reported ``readonly`` would keep it readonly after the admin cleared it.
    """
    return "readonly" if group_readonly else "rw"


def plan_route(
    active: list[str], usable: set[str], load: dict[str, int], groups_wanted: int
) -> list[str] | None:
    """Return the new active groups of a subject, or None when its route stays as it is.

    ``active``: the groups the subject is routed to now; ``usable``: groups producers may use;
    ``load``: active routes per group (to spread subjects); ``groups_wanted``: the configured N.
    """
    keep = [g for g in active if g in usable]
    want = min(groups_wanted, len(usable))
    if len(keep) >= want:
        return None
    candidates = sorted(usable - set(keep), key=lambda g: (load.get(g, 0), g))
    return sorted(keep + candidates[: want - len(keep)])


def producer_groups(active: list[str], views: dict[str, GroupView]) -> list[dict[str, object]]:
    """Return the route answer for producers: active usable groups with their rw addresses."""
    out = []
    for name in sorted(active):
        view = views.get(name)
        if view is not None and view.usable:
            out.append(_answer(view, sorted(view.rw_addresses)))
    return out


def consumer_groups(ever: list[str], views: dict[str, GroupView]) -> list[dict[str, object]]:
    """Return the route answer for consumers: every live group ever routed, all online addresses."""
    out = []
    for name in sorted(ever):
        view = views.get(name)
        if view is not None and view.live:
            out.append(_answer(view, view.online_addresses))
    return out


def delay_groups(role: str, views: dict[str, GroupView]) -> list[dict[str, object]]:
    """Return the live delay groups: usable ones for producers, every live one otherwise."""
    out = []
    for name in sorted(views):
        view = views[name]
        if view.kind != "delay":
            continue
        if role == "producer" and view.usable:
            out.append(_answer(view, sorted(view.rw_addresses)))
        elif role != "producer" and view.live:
            out.append(_answer(view, view.online_addresses))
    return out


def _answer(view: GroupView, addresses: list[str]) -> dict[str, object]:
    """Return one group entry of a route answer."""
    return {"group": view.name, "kind": view.kind, "state": view.state, "addresses": addresses,
            "epoch": view.epoch}
