"""Forwarding already-encoded message payloads to the brokers of a subject, with failover.

The servers use this among themselves: the delay server dispatches due messages to the
subject's realtime brokers, and a realtime broker hands nacked messages to a delay server. The
payload bytes are sent verbatim (never re-encoded), so a resend after a failure carries the same
message id; and each id has a home group among the subject's groups (a hash of the id), so the
resend reaches the broker that stored the first copy, whose de-duplication makes it harmless.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import zlib
from collections.abc import Sequence
from typing import Any

from sdk.connection import ConnectionPool
from wire.errors import (ConnectionLost, Internal, NoRoute, NotEnoughReplicas, NotMaster,
                         NotSupported, QmqError, error_from_wire)
from wire.limits import MAX_SEND_BATCH_MESSAGES
from wire.message import peek_message_id
from sdk.routes import RouteCache

log = logging.getLogger(__name__)

SEND_TIMEOUT_MS_DEFAULT = 5_000
# Retriable failures after which a broker may have stored the request all the same (the
# connection died or timed out after the write, a failure past it, a write its slaves did not
# confirm): a hold failing so is never held again, by any group (see PayloadSender.send).
ANSWER_UNKNOWN = (ConnectionLost, Internal, NotEnoughReplicas)
# A hold's failures after which its home group may hold it: those, and NotMaster, which a
# broker also answers after the held records were written (its lease lapsed during the store
# call, or it was demoted while waiting for its slaves: a promoted slave may hold the copy).
# The delay server cannot tell it from a NotMaster refused before any write, so it takes every
# one as "maybe held" (review s11 rvho-3).
HOLD_ANSWER_UNKNOWN = (*ANSWER_UNKNOWN, NotMaster)
# A broker's answer to ``cancel_held`` for one id: held and dropped now, or dropped at an
# earlier cancel_held (never visible; docs/PROTOCOL.md "cancel_held").
HELD_DROPPED = "dropped"
HELD_DROPPED_BEFORE = "dropped_before"


class PayloadSender:
    """Sends payload batches for a subject to the live brokers of ``kind`` the MetaServer names.

    A hold (``send`` with ``visible_at_ms``) is never retried in another group: a part whose
    home may have held it although the answer was lost, or refused with NotMaster, which may
    come after the write (HOLD_ANSWER_UNKNOWN; an error outside QmqError a part raised is taken
    as Internal, its group may hold it), raises that error at once, without refreshing the
    route (a refresh usually drops a home whose master just died, so the ids' homes would
    move), and the caller sends such messages at their due time instead of holding them again
    (docs/REPLICATION.md 16); the error's ``holders`` names, per payload, the group its hold
    went to (or that held it on the first try), and that send names it in ``to_groups`` (one
    per payload, None: its home): such a payload goes to that group alone (``_send_pinned``).
    """

    def __init__(
        self,
        meta_url: str | Sequence[str],
        *,
        kind: str,
        client_id: str,
        app: str = "qmq-internal",
        token: str | None = None,
        send_timeout_ms: int = SEND_TIMEOUT_MS_DEFAULT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.kind = kind
        self.send_timeout_ms = send_timeout_ms
        # ``token`` (an admin token when auth is on) opens both the MetaServer and the brokers.
        self.routes = RouteCache(meta_url, kind=kind, token=token, ssl_context=ssl_context)
        self.pool = ConnectionPool(client_id=client_id, app=app, token=token,
                                   ssl_context=ssl_context)

    async def send(self, subject: str, payloads: list[bytes],
                   visible_at_ms: list[int] | None = None,
                   to_groups: Sequence[str | None] | None = None
                   ) -> tuple[str, list[dict[str, Any]]]:
        """Send ``payloads`` (all of ``subject``) and return (the broker group that took the
        first payload, per-payload results in the order given).

        With ``visible_at_ms`` (one per payload) the batch is handed off ahead of its due time
        (the ``hold`` op): only to brokers whose hello says ``holds``; NotSupported (not
        retriable) when none it would go to does, so the caller dispatches at the due time
        instead. A hold's part that its home group refused (``not_supported``: an older
        server during a rolling upgrade; a retriable refusal on both tries: read-only,
        overloaded, no route) is answered per message with that error while the other
        parts' results are kept (the caller must know which messages a group holds); the
        refusal is raised only when every part was refused alike. Each result of
        a group's answer then also says ``group``: which group holds that message, and
        ``broker_now_ms``: that broker's clock as the hold arrived (when it says it).

        Each payload goes to its message id's home group (``home_group``), so a resend of an id
        (a dispatch repeated after a crash, a retry copy handed off twice) reaches the same
        group, whose de-duplication absorbs it. A part whose home refuses with a retriable
        failure moves on to the next groups in turn; the route is refreshed once. A plain send
        keeps each part's own result: a part no group took (a retriable failure on both tries,
        or an error outside QmqError, taken as Internal: its home may have stored it, and the
        second try starts at its home again) is answered per message with its error, so the
        caller retries or reports those messages alone; the error is raised when no part was
        stored (a resend of the whole batch is absorbed by the groups that may hold theirs;
        a non-retriable refusal is raised before a retriable error). A part refused for good
        (a non-retriable error: ``forbidden``...) is not tried again and fails only its own
        messages, the same way. Such a result made from its part's error says
        ``part_refused``: the error refused the part's request, not that message, so a caller
        must not take it as the broker's verdict on the message (the delay server retries
        it). A per-payload error is returned in its result, not raised; a plain send's error
        result says ``group`` when one group gave it (a broker's answer for that message, a
        refusal for good of its part; not when no group took the part).

        A hold is never retried in another group (the class docstring says what is raised
        then, and what ``to_groups`` does).
        """
        if not payloads:
            return "", []
        if to_groups is not None and any(to_groups):
            return await self._send_pinned(subject, payloads, to_groups)
        holding = visible_at_ms is not None
        tries = _Tries(len(payloads), holding,
                       NoRoute(f"no {self.kind} broker for subject {subject!r}"))
        for attempt in range(2):
            try:
                route = await (self.routes.refresh(subject, "producer") if attempt
                               else self.routes.get(subject, "producer"))
            except QmqError as exc:
                tries.route_failed(exc, attempt)  # raises, or refuses what is pending
                break
            # Sorted by name: every sender computes the same home for an id.
            groups = sorted((g for g in route.groups if g.addresses), key=lambda g: g.group)
            if not groups:
                continue
            parts: dict[int, list[int]] = {}
            for position in tries.pending:
                home = home_group(payloads[position], len(groups))
                parts.setdefault(home, []).append(position)
            outcomes = await self._send_parts(subject, groups, parts, payloads, visible_at_ms)
            if holding:
                _raise_unknown(parts, groups, outcomes, tries.results)
            tries.take(parts, outcomes)
            if not tries.pending:
                break
        return tries.answer(payloads)

    async def _send_parts(self, subject: str, groups: list[Any], parts: dict[int, list[int]],
                          payloads: list[bytes], visible_at_ms: list[int] | None,
                          ) -> list[Any]:
        """One try of ``send``: each home group's part (``parts``: home index -> positions) at
        once; every outcome, an error other than QmqError taken as Internal (``_as_internal``)."""
        outcomes = await asyncio.gather(*(
            self._send_part(subject, groups, home, [payloads[p] for p in positions],
                            None if visible_at_ms is None
                            else [visible_at_ms[p] for p in positions])
            for home, positions in parts.items()
        ), return_exceptions=True)
        holding = visible_at_ms is not None
        return [_as_internal(o, groups[home].group, holding) for home, o in zip(parts, outcomes)]

    async def _send_pinned(self, subject: str, payloads: list[bytes],
                           groups: Sequence[str | None]) -> tuple[str, list[dict[str, Any]]]:
        """``send`` of payloads some of which must go to one named group (``groups``, None:
        the home over the route now): a hold to that group whose answer said nothing sure, so
        that group may hold it and only its de-duplication absorbs this copy. The group is
        looked up in the consumer route (which keeps a group producers may not use now:
        failing over, read-only) and only its brokers are tried; a group not in it raises
        NoRoute (retriable: the caller retries, waiting out a failover). Returns as ``send``:
        a part that failed (outside QmqError: Internal) or was refused is answered per message
        with its error (``part_refused``) while the other parts keep their results; raised
        when every part failed (a refusal for good before a retriable error)."""
        parts: dict[str | None, list[int]] = {}
        for position, group in enumerate(groups):
            parts.setdefault(group, []).append(position)

        async def one(name: str | None, positions: list[int]
                      ) -> tuple[str, list[dict[str, Any]]]:
            chunk = [payloads[p] for p in positions]
            if name is None:
                return await self.send(subject, chunk)
            group = _named(await self.routes.get(subject, "consumer"), name)
            if group is None:
                group = _named(await self.routes.refresh(subject, "consumer"), name)
            if group is None:
                raise NoRoute(f"{self.kind} group {name}, which may hold messages of "
                              f"{subject!r} (a hold's answer was lost), is not in the route")
            outcome = await self._send_part(subject, [group], 0, chunk)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        outcomes = await asyncio.gather(*(one(name, positions) for name, positions in
                                          parts.items()), return_exceptions=True)
        results: list[dict[str, Any]] = [{}] * len(payloads)
        first_group = ""
        failed: list[QmqError] = []
        for (name, positions), outcome in zip(parts.items(), outcomes):
            outcome = _as_internal(outcome, name or "its home group", False)
            if isinstance(outcome, BaseException):
                # Every part has finished. A failure or refusal is that part's answer, so the
                # caller retries its messages alone (each still pinned); every part failed:
                # raised, and the caller retries or reports the batch.
                if not isinstance(outcome, QmqError):
                    raise outcome  # a cancel
                failed.append(outcome)
                for position in positions:
                    results[position] = _error_result(payloads[position], outcome)
                continue
            group_name, part_results = outcome
            if 0 in positions:
                first_group = group_name
            for position, result in zip(positions, part_results):
                results[position] = result
        if len(failed) == len(parts):
            raise next((e for e in failed if not e.retriable), failed[0])
        return first_group, results

    async def _send_part(self, subject: str, groups: list[Any], home: int,
                         payloads: list[bytes], visible_at_ms: list[int] | None = None,
                         ) -> tuple[str, list[dict[str, Any]]] | QmqError:
        """Send one home group's part, trying the other groups in turn on a retriable failure
        (a hold: only the home group's brokers); returns (group, results) or the last
        retriable error (a non-retriable one is raised)."""
        # Every address of every group: a group's list can still hold a broker that died
        # (kill -9) beside its restarted replacement until the MetaServer expires it. A hold
        # stays in its home group: one whose answer was lost (its master died after the
        # write) may be held there, and a second group holding it too would deliver it
        # whatever a cancel dropped in the other; the caller retries, or sends it when due.
        rotated = groups[home:] + groups[:home] if visible_at_ms is None else [groups[home]]
        targets = [(group, address) for group in rotated for address in group.addresses]
        last_error: QmqError = NoRoute(f"no {self.kind} broker for subject {subject!r}")
        unknown: QmqError | None = None  # a hold some address may have stored regardless
        for group, address in targets:
            try:
                results: list[dict[str, Any]] = []
                if visible_at_ms is not None \
                        and not (await self.pool.get(address)).server.get("holds"):
                    raise NotSupported(f"{self.kind} broker {group.group} at {address} does "
                                       f"not take hold (an older server)")
                for start in range(0, len(payloads), MAX_SEND_BATCH_MESSAGES):
                    chunk = payloads[start:start + MAX_SEND_BATCH_MESSAGES]
                    request: dict[str, Any] = {"op": "send", "messages": chunk}
                    if visible_at_ms is not None:
                        request = {"op": "hold", "messages": chunk, "visible_at_ms":
                                   visible_at_ms[start:start + MAX_SEND_BATCH_MESSAGES]}
                    answer = await self.pool.request(address, request, self.send_timeout_ms)
                    part = answer.get("results", [])
                    if visible_at_ms is not None and type(answer.get("now_ms")) is int:
                        for result in part:  # the broker's clock as the hold arrived
                            result["broker_now_ms"] = answer["now_ms"]
                    results.extend(part)
                if _all_retriable_failures(results):
                    error = results[0]["error"]
                    raise error_from_wire(error["code"], error["message"])
                return group.group, results
            except QmqError as exc:
                if not exc.retriable:
                    if unknown is not None:  # an earlier broker of the group may hold it
                        return unknown
                    exc.group = group.group  # type: ignore[attr-defined]  # who refused it
                    raise
                log.info("%s broker %s (%s) refused a batch of %s, trying another: %s",
                         self.kind, group.group, address, subject, exc)
                last_error = exc
                if visible_at_ms is not None and isinstance(exc, HOLD_ANSWER_UNKNOWN):
                    unknown = exc
                if isinstance(exc, ConnectionLost):
                    await self.pool.discard(address)
        return unknown or last_error

    async def cancel_held_answers(self, subject: str, message_ids: list[str]) -> list[str]:
        """Ask every broker group of ``subject`` to drop these held messages (``cancel_held``):
        for each id HELD_DROPPED when some group held it and dropped it now, else
        HELD_DROPPED_BEFORE when some group says it dropped it at an earlier cancel
        (``dropped_before``; a broker without the field: never), else "". Raises the error of a group
        that could not be asked (the caller cannot know whether it held them). The groups are
        the consumer route's: every live group, also one producers may not use now (failing
        over, short of in-sync slaves, read-only) that may hold a message handed to it."""
        route = await self.routes.get(subject, "consumer")
        dropped = [False] * len(message_ids)
        before = [False] * len(message_ids)
        for group in sorted((g for g in route.groups if g.addresses), key=lambda g: g.group):
            last_error: QmqError = NoRoute(f"no {self.kind} broker for subject {subject!r}")
            for address in group.addresses:
                try:
                    if not (await self.pool.get(address)).server.get("holds"):
                        break  # an older broker: it holds nothing
                    answer = await self.pool.request(
                        address, {"op": "cancel_held", "subject": subject, "ids": message_ids},
                        self.send_timeout_ms)
                except QmqError as exc:
                    if not exc.retriable:
                        raise
                    last_error = exc
                    if isinstance(exc, ConnectionLost):
                        await self.pool.discard(address)
                    continue
                dropped = [a or bool(b) for a, b in zip(dropped, answer.get("cancelled", []))]
                earlier = answer.get("dropped_before")  # an older broker: absent
                if earlier:
                    before = [a or bool(b) for a, b in zip(before, earlier)]
                break
            else:
                raise last_error
        return [HELD_DROPPED if now else HELD_DROPPED_BEFORE if earlier else ""
                for now, earlier in zip(dropped, before)]

    async def close(self) -> None:
        """Close connections and the route cache's HTTP session."""
        await self.pool.close()
        await self.routes.close()


class _Tries:
    """One ``PayloadSender.send`` across its tries: each payload's result (None: no group
    took it yet), the positions refused and why (retriable: tried again), those still
    pending, the last retriable error, and the group that took the first payload."""

    __slots__ = ("results", "refused", "pending", "last_error", "first_group", "holding")

    def __init__(self, count: int, holding: bool, no_route: QmqError) -> None:
        self.results: list[dict[str, Any] | None] = [None] * count
        self.refused: dict[int, QmqError] = {}
        self.pending = list(range(count))
        self.last_error = no_route
        self.first_group = ""
        self.holding = holding

    def route_failed(self, exc: QmqError, attempt: int) -> None:
        """The route could not be had on try ``attempt``: raise ``exc``, unless some group
        held (stored) its part on the first try and ``exc`` leaves that standing: then only
        the part still pending is refused, with ``exc``; raising it for the whole hold would
        make the caller take the held part as held by none (review s14 rva-1), and for a
        plain send, retry the stored part too."""
        if not (attempt and any(r is not None for r in self.results)
                and (self.holding or exc.retriable)):
            raise exc
        self.refused.update(dict.fromkeys(self.pending, exc))
        self.pending, self.last_error = [], exc

    def take(self, parts: dict[int, list[int]], outcomes: list[Any]) -> None:
        """One try's outcomes, part by part (``parts``: home -> positions, in the same order):
        a part's results are kept (each says its ``group`` for a hold, and for an error of a
        plain send); a part's error refuses its positions, and a retriable one leaves them
        pending for the next try."""
        holding, results, refused = self.holding, self.results, self.refused
        pending: list[int] = []
        for positions, outcome in zip(parts.values(), outcomes):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, QmqError):
                    raise outcome  # a cancel; every part has finished: nothing is left running
                refused.update(dict.fromkeys(positions, outcome))
                if outcome.retriable:
                    self.last_error = outcome
                    pending.extend(positions)
                continue
            group_name, part_results = outcome
            if 0 in positions:
                self.first_group = group_name
            for position, result in zip(positions, part_results):
                results[position] = result
                refused.pop(position, None)
                if holding:  # who holds it (the delay server traces it)
                    result["group"] = group_name
                elif "error" in result:  # who refused it (a redrive reports it)
                    result["group"] = group_name
        pending.sort()
        self.pending = pending

    def answer(self, payloads: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
        """``send``'s answer once the tries are over: raised when no part of a plain send was
        stored (a refusal for good before a retriable error), or a hold's refusal when
        ``_raise_refusal`` says so; else each payload's result, one no group took answered
        with its part's error (``_error_result``)."""
        results, refused, pending = self.results, self.refused, self.pending
        if (pending or refused) and not self.holding and all(r is None for r in results):
            # No part was stored: the caller retries the batch, or has its refusal
            raise next((e for e in refused.values() if not e.retriable), self.last_error)
        if refused or pending:
            refused.update((p, self.last_error) for p in pending if p not in refused)
            _raise_refusal(refused, results, self.last_error)
            for position, error in refused.items():
                results[position] = _error_result(payloads[position], error, self.holding)
        return self.first_group, [r if r is not None else {} for r in results]


def _raise_unknown(parts: dict[int, list[int]], groups: list[Any], outcomes: Sequence[Any],
                   results: Sequence[dict[str, Any] | None]) -> None:
    """A hold's try: raise a part's HOLD_ANSWER_UNKNOWN (its group may hold it), every part
    having finished, with ``holders``: per payload, the group its hold went to now, or the
    group that held it on an earlier try ("" for neither)."""
    unknown = [o for o in outcomes if isinstance(o, HOLD_ANSWER_UNKNOWN)]
    if not unknown:
        return
    holders = [r.get("group", "") if r is not None else "" for r in results]
    for home, positions in parts.items():
        for position in positions:
            holders[position] = groups[home].group
    unknown[0].holders = holders  # type: ignore[attr-defined]
    raise unknown[0]


def _as_internal(outcome: Any, group: str, holding: bool) -> Any:
    """A part's ``outcome``, an error other than QmqError (a bug, an answer the sender cannot
    read) made Internal (retriable; for a hold, a HOLD_ANSWER_UNKNOWN): it may come after the
    part's write, so ``group`` may hold (or have stored) the part; raised alone it would drop
    what the other parts held or stored (review s14 rva; a plain send: session 16). What is
    not an Exception (a cancel, KeyboardInterrupt, SystemExit) is kept as it is."""
    if not isinstance(outcome, Exception) or isinstance(outcome, QmqError):
        return outcome
    what = (f"hold to {group} failed, it may hold" if holding
            else f"send to {group} failed, it may have stored")
    error = Internal(f"{what} the part: {type(outcome).__name__}: {outcome}")
    error.__cause__ = outcome
    return error


def _error_result(payload: bytes, error: QmqError, holding: bool = False) -> dict[str, Any]:
    """The result of a payload its part's ``error`` answers (no group took it): marked
    ``part_refused``, the error is its part's request's, not the broker's answer for it. A
    plain send's refusal for good also says ``group``: the group that refused it."""
    result = {"id": peek_message_id(payload),
              "error": {"code": error.code, "message": str(error)}, "part_refused": True}
    group = getattr(error, "group", None)
    if group is not None and not holding:
        result["group"] = group
    return result


def _raise_refusal(refused: dict[int, QmqError], results: Sequence[dict[str, Any] | None],
                   last_error: QmqError) -> None:
    """A hold some parts of which were refused (``refused``: position -> why): raise when no
    part was held and every refusal is alike (all ``not_supported``: the caller pauses its
    hand-offs; all retriable: the last one, the caller retries; else the one kind there is);
    otherwise return, and the caller answers the refused ones per message. (A plain send
    comes here only when some part was stored: it returns.)"""
    if any(r is not None for r in results):
        return
    errors = list(refused.values())
    if all(e.retriable for e in errors):
        raise last_error
    if all(type(e) is type(errors[0]) for e in errors):
        raise errors[0]


def _named(route: Any, name: str) -> Any:
    """The group of ``route`` called ``name`` with an address, or None."""
    return next((g for g in route.groups if g.group == name and g.addresses), None)


def home_group(payload: bytes, group_count: int) -> int:
    """Index, among ``group_count`` groups sorted by name, of the home of ``payload``'s message
    id: CRC-32 of the id, so it is the same in every process and after every restart. A payload
    whose id cannot be read goes to the first group."""
    if group_count <= 1:
        return 0
    return zlib.crc32(peek_message_id(payload).encode()) % group_count


def _all_retriable_failures(results: list[dict[str, Any]]) -> bool:
    """True when every result is an error with a retriable code (try another broker)."""
    if not results:
        return False
    for result in results:
        error = result.get("error")
        if not error or not error_from_wire(error.get("code", ""), "").retriable:
            return False
    return True
