"""The producer's bookkeeping for messages on their way: who waits for which message, and how a
broker's answer to a ``send`` settles them. Pure data, no I/O and no asyncio beyond setting the
result of a caller's future.

The unit is a ``Part``: a run of messages of one ``send``/``send_many`` call that travel in the
same batch, kept as parallel lists (ids, payloads, due times) rather than as one object per
message, because the per-message objects, method calls and futures were most of the producer's
CPU per message. A ``Batch`` is the parts of one send frame; ``settle`` walks the broker's
``results`` once, part by part, and hands each part's receipts to its ``Call`` in one slice.
A single ``send`` is not even a Part while all goes well: its future, id, payload and due time
are columns of the Batch, settled by ``Batch.settle_stored`` from a compact answer; only a
resend, a failure or a per-message answer makes Parts of them (``Batch.all_parts``).

``Receipt`` is a named tuple for the same reason: making one costs a quarter of what a frozen
dataclass costs, and 100,000 of them are made per 100,000 messages sent.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Any, Literal, NamedTuple

from wire.errors import Internal, QmqError, error_from_wire
from wire.limits import MAX_SEND_BATCH_MESSAGES


class Receipt(NamedTuple):
    """What the broker said about one sent message. ``status`` is "stored", or "duplicate" when
    the broker already had this id (a resend, or the caller reusing an id). Immutable; being a
    named tuple it also unpacks as ``(message_id, subject, broker_group, status, deliver_at_ms)``.
    """

    message_id: str
    subject: str
    broker_group: str  # the realtime group, or for a delayed message the delay group holding it
    status: Literal["stored", "duplicate"]
    deliver_at_ms: int | None = None  # set for delayed messages; ``cancel`` needs it

    @property
    def delayed(self) -> bool:
        """True when a delay server holds the message until ``deliver_at_ms``."""
        return self.deliver_at_ms is not None


_new_tuple = tuple.__new__  # Receipt without its generated __new__: the hot path makes many
_get_id = itemgetter("id")
# What ``settle`` returns as the reason when nothing is resent (never raised; made once rather
# than per answer).
_NO_ERROR = Internal("no error")


class Call:
    """Where the outcomes of one ``send`` or ``send_many`` call gather: one slot per message
    (a Receipt or the exception that failed it) and one future, set when every slot is."""

    __slots__ = ("results", "remaining", "failed", "future")

    def __init__(self, count: int, future: asyncio.Future[list[Any]]) -> None:
        self.results: list[Any] = [None] * count  # None: not settled yet
        self.remaining = count
        self.failed = 0  # slots holding an exception
        self.future = future

    def settle(self, index: int, value: Any) -> None:
        """Fill slot ``index`` unless it already holds an outcome (the first one wins)."""
        if self.results[index] is None:
            self.results[index] = value
            if isinstance(value, BaseException):
                self.failed += 1
            self.remaining -= 1
            if self.remaining == 0 and not self.future.done():
                self.future.set_result(self.results)

    def settle_one(self, index: int, receipt: Receipt) -> None:
        """Fill the unsettled slot ``index`` with a receipt (``settle_run`` of one)."""
        self.results[index] = receipt
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.results)

    def settle_run(self, first: int, receipts: list[Receipt]) -> None:
        """Fill the unsettled slots ``first .. first + len(receipts) - 1`` in one slice."""
        self.results[first:first + len(receipts)] = receipts
        self.remaining -= len(receipts)
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(self.results)


class Part:
    """Messages of one Call that travel together: ``ids[k]``, ``payloads[k]`` and ``dues[k]``
    belong to the call's slot ``first + k``, or ``slots[k]`` once a resend picked a subset."""

    __slots__ = ("call", "first", "slots", "ids", "payloads", "dues")

    def __init__(self, call: Call, first: int, ids: list[str], payloads: list[bytes],
                 dues: list[int] | None, slots: list[int] | None = None) -> None:
        self.call = call
        self.first = first
        self.slots = slots  # None: consecutive slots from ``first``
        self.ids = ids
        self.payloads = payloads
        self.dues = dues  # None: realtime messages; else each one's deliver_at_ms

    def slot(self, k: int) -> int:
        """The call slot of this part's ``k``-th message."""
        return self.first + k if self.slots is None else self.slots[k]

    def fail(self, error: BaseException) -> None:
        """Fail every message of the part that has no outcome yet."""
        call = self.call
        for k in range(len(self.ids)):
            call.settle(self.slot(k), error)


class OneCall:
    """The ``Call`` of one ``send``, made only when its message needs settling as a Part (a
    resend, a failure, an answer with a result per message): ``send`` awaits the bare future,
    whose result is the Receipt or the exception that failed it. The first outcome wins."""

    __slots__ = ("future",)

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future

    def settle(self, index: int, value: Any) -> None:
        """The outcome of the one message (``index`` is 0), unless it has one already."""
        if not self.future.done():
            self.future.set_result(value)

    settle_one = settle

    def settle_run(self, first: int, receipts: list[Receipt]) -> None:
        """``settle`` with the one receipt of ``receipts``."""
        self.settle(first, receipts[0])


@dataclass
class Batch:
    """The open or sent batch of one (subject, delayed): the parts of one send frame, then the
    messages of single ``send`` calls as columns (``one_*``): one future and three list
    appends per ``send`` rather than a Call and a Part (``send``'s batch formation was a
    fifth of the producer's CPU per message with 32 senders)."""

    subject: str
    delayed: bool = False
    parts: list[Part] = field(default_factory=list)
    count: int = 0  # messages in all parts and singles
    size_bytes: int = 0  # payload bytes plus the per-payload framing allowance
    timer: asyncio.Handle | None = None
    # Its timer is the linger (linger_ms), not the end of the loop turn: it leaves when a batch
    # of its subject on the wire is answered (Producer._answered, _left_wire).
    lingering: bool = False
    # Its task is made (Producer._start): one that leaves after its loop turn gets it as it
    # opens, and is closed (taken out of the open batches) by the task's first step.
    started: bool = False
    # Its task counted it off the wire (Producer._left_wire: once, as the task ends).
    left_wire: bool = False
    # Leaves once it holds this many messages of single sends (Producer._open_batch sets it
    # below batch_size_max for a batch formed with nothing of its subject on the wire).
    split_at: int = MAX_SEND_BATCH_MESSAGES
    # Single sends, after the parts in the frame: each one's future, id, payload and (delayed
    # batches only) due time.
    one_futures: list[asyncio.Future[Any]] = field(default_factory=list)
    one_ids: list[str] = field(default_factory=list)
    one_payloads: list[bytes] = field(default_factory=list)
    one_dues: list[int] = field(default_factory=list)

    def payloads(self) -> list[bytes]:
        """Every payload of the batch, in order: the parts', then the single sends'."""
        if not self.parts:
            return self.one_payloads
        if len(self.parts) == 1 and not self.one_futures:
            return self.parts[0].payloads
        return [payload for part in self.parts for payload in part.payloads] + self.one_payloads

    def all_parts(self) -> list[Part]:
        """The batch as Parts, in frame order: its parts, then one per single send (for a
        resend, a failure or a per-message answer: ``settle_stored`` covers the usual case)."""
        dues = self.one_dues if self.delayed else None
        return self.parts + [
            Part(OneCall(future), 0, [message_id], [payload],  # type: ignore[arg-type]
                 None if dues is None else [dues[k]])
            for k, (future, message_id, payload) in enumerate(
                zip(self.one_futures, self.one_ids, self.one_payloads))]

    def settle_stored(self, broker_group: str, answer: dict[str, Any]) -> bool:
        """Settle every message as stored if ``answer`` is the compact "all stored" answer for
        this batch (True); else change nothing (False: ``settle`` the ``all_parts``)."""
        if (answer.get("results") is not None or type(answer.get("stored")) is not int
                or answer["stored"] != self.count):
            return False
        subject = self.subject
        _settle_stored(subject, broker_group, self.parts)
        if self.one_futures:
            receipts = map(_new_tuple, repeat(Receipt), zip(
                self.one_ids, repeat(subject), repeat(broker_group), repeat("stored"),
                self.one_dues if self.delayed else repeat(None)))
            for future, receipt in zip(self.one_futures, receipts):
                if not future.done():  # a caller gone (cancelled) needs no receipt
                    future.set_result(receipt)
        return True


def fail_parts(parts: list[Part], error: BaseException) -> None:
    """Fail every message of ``parts`` that has no outcome yet."""
    for part in parts:
        part.fail(error)


def settle(subject: str, broker_group: str, parts: list[Part],
           answer: dict[str, Any]) -> tuple[list[Part], QmqError]:
    """Resolve the messages of ``parts`` that the broker's send ``answer`` settles; return the
    parts to resend (same ids) and why.

    ``results`` must hold one entry per message, in order, each naming its message's id;
    anything else is resent whole, since nothing can be matched safely and the broker
    de-duplicates the ids."""
    results = answer.get("results")
    count = sum(len(part.ids) for part in parts)
    if results is None and type(answer.get("stored")) is int and answer["stored"] == count:
        # A compact answer (the send asked for one): every message stored, as sent.
        _settle_stored(subject, broker_group, parts)
        return [], _NO_ERROR
    if not isinstance(results, list) or len(results) != count:
        return parts, Internal(
            f"broker group {broker_group} answered a send of {count} messages with "
            f"{len(results) if isinstance(results, list) else 'no'} results"
        )
    retry: list[Part] = []
    retry_error: QmqError = _NO_ERROR
    pos = 0
    for part in parts:
        n = len(part.ids)
        if n == 1 and part.slots is None:
            # One ``send``'s message (the usual part when many callers send at once): its
            # receipt straight from its result when stored, without the columns of a run.
            result = results[pos]
            message_id = part.ids[0]
            if (type(result) is dict and result.get("status") == "stored"
                    and result.get("id") == message_id and result.get("error") is None):
                pos += 1
                part.call.settle_one(part.first, _stored_receipt(subject, broker_group, part))
                continue
        chunk = results[pos:pos + n] if n != count else results
        pos += n
        receipts = _receipts(subject, broker_group, part, chunk)
        if receipts is not None:
            _settle_part(part, receipts)
            continue
        left, error = _settle_one_by_one(subject, broker_group, part, chunk)
        if left is not None:
            retry.append(left)
            retry_error = error
    return retry, retry_error


def _settle_stored(subject: str, broker_group: str, parts: list[Part]) -> None:
    """Settle every message of ``parts`` as stored, each with the due time it was sent with."""
    for part in parts:
        if len(part.ids) == 1 and part.slots is None:
            part.call.settle_one(part.first, _stored_receipt(subject, broker_group, part))
        else:
            _settle_part(part, _stored_receipts(subject, broker_group, part))


def _settle_part(part: Part, receipts: list[Receipt]) -> None:
    """Settle ``part``'s messages with ``receipts`` (one each, in order)."""
    if part.slots is None:
        part.call.settle_run(part.first, receipts)
    else:
        for slot, receipt in zip(part.slots, receipts):
            part.call.settle(slot, receipt)


def _stored_receipt(subject: str, broker_group: str, part: Part) -> Receipt:
    """The receipt of a one-message ``part`` stored as sent."""
    return _new_tuple(Receipt, (part.ids[0], subject, broker_group, "stored",
                                None if part.dues is None else part.dues[0]))


def _stored_receipts(subject: str, broker_group: str, part: Part) -> list[Receipt]:
    """The receipts of ``part``'s messages stored as sent, built in C-level passes (map, zip)
    with no Python call per message."""
    return list(map(_new_tuple, repeat(Receipt), zip(
        part.ids, repeat(subject), repeat(broker_group), repeat("stored"),
        repeat(None) if part.dues is None else part.dues)))


def _receipts(subject: str, broker_group: str, part: Part,
              results: list[Any]) -> list[Receipt] | None:
    """The part's receipts when the broker stored (or had) every message, else None."""
    count = len(results)
    # Usually every result is {id, status: "stored"}: checked and turned into receipts by
    # C-level passes (map, zip, list equality), with no Python call per message.
    try:
        ids_back = list(map(_get_id, results))
        statuses = list(map(dict.get, results, repeat("status")))
        errors = list(map(dict.get, results, repeat("error")))
    except (TypeError, KeyError):  # a result that is not a map, or has no id
        ids_back = statuses = errors = []
    if ids_back == part.ids:
        if statuses.count("stored") == count and errors.count(None) == count:
            return _stored_receipts(subject, broker_group, part)
    receipts: list[Receipt] = []
    append = receipts.append
    for message_id, result, due in zip(part.ids, results,
                                       repeat(None) if part.dues is None else part.dues):
        if (type(result) is not dict or result.get("id") != message_id
                or result.get("error") is not None):
            return None
        status = "duplicate" if result.get("status") == "duplicate" else "stored"
        append(_new_tuple(Receipt, (message_id, subject, broker_group, status, due)))
    return receipts


def _settle_one_by_one(subject: str, broker_group: str, part: Part,
                       results: list[Any]) -> tuple[Part | None, QmqError]:
    """Settle a part message by message: receipts, refusals (failed now) and retriable
    failures, which come back as a new part holding just those messages."""
    call = part.call
    keep: list[int] = []
    error_kept: QmqError = _NO_ERROR
    for k, (message_id, result) in enumerate(zip(part.ids, results)):
        if type(result) is not dict or result.get("id") != message_id:
            keep.append(k)
            error_kept = Internal(f"broker group {broker_group} answered results out of order")
            continue
        error = result.get("error")
        if error is None:
            status: Literal["stored", "duplicate"] = (
                "duplicate" if result.get("status") == "duplicate" else "stored")
            due = None if part.dues is None else part.dues[k]
            call.settle(part.slot(k), Receipt(message_id, subject, broker_group, status, due))
            continue
        exc = error_from_wire(
            str(error.get("code")) if isinstance(error, dict) else "internal",
            str(error.get("message", "")) if isinstance(error, dict) else repr(error),
        )
        if exc.retriable:
            keep.append(k)
            error_kept = exc
        else:
            call.settle(part.slot(k), exc)
    if not keep:
        return None, error_kept
    return Part(call, 0, [part.ids[k] for k in keep], [part.payloads[k] for k in keep],
                None if part.dues is None else [part.dues[k] for k in keep],
                [part.slot(k) for k in keep]), error_kept


__all__ = ["Batch", "Call", "OneCall", "Part", "Receipt", "fail_parts", "settle"]
