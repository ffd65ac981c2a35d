"""What servers answer on the data plane, and the client's reading of an answer (docs/PROTOCOL.md):
pure maps, no sockets, no asyncio. Split from ``wire.protocol`` (which re-exports these names).
A server's handler returns these without ``rid``: the frame server adds it (FrameServer).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from wire.errors import BadRequest, QmqError, error_from_wire, type_name

# Request ids are msgpack unsigned integers.
_U64_MAX = 2**64 - 1


def error_response(rid: int | None, exc: QmqError) -> dict[str, Any]:
    """``{rid, error: {code, message}}``; rid is None when the request's rid was unreadable."""
    return {"rid": rid, "error": exc.to_wire()}


def hello_response(kind: str, group: str, node: str, role: str = "master",
                   epoch: int = 0, holds: bool = False) -> dict[str, Any]:
    """``{ok: True, server: {kind, group, node, role, epoch}}``: which server answered a
    ``hello``, and its role in its group (docs/REPLICATION.md). ``holds``: a realtime broker
    that takes ``hold`` and ``cancel_held`` says ``holds: true`` (absent: it does not)."""
    server = {"kind": kind, "group": group, "node": node, "role": role, "epoch": epoch}
    if holds:
        server["holds"] = True
    return {"ok": True, "server": server}


def send_result_ok(message_id: str, duplicate: bool = False) -> dict[str, Any]:
    """One entry of a send response's ``results``: stored, or a duplicate of an earlier send."""
    return {"id": message_id, "status": "duplicate" if duplicate else "stored"}


def send_results_stored(message_ids: Iterable[str]) -> list[dict[str, Any]]:
    """``send_result_ok`` of each id, stored: a whole commit's results in one call (no call
    per message on the broker's send path)."""
    return [{"id": message_id, "status": "stored"} for message_id in message_ids]


def send_stored_answer(count: int) -> dict[str, Any]:
    """The whole answer to a ``compact`` send whose ``count`` messages were all stored (as
    "stored", never "duplicate"; a delayed one at the ``deliver_at_ms`` its payload names):
    the client knows each id and due time it sent, so no result per message is encoded,
    written or decoded. Any other outcome is answered with ``results``."""
    return {"stored": count}


def delayed_send_result(message_id: str, deliver_at_ms: int) -> dict[str, Any]:
    """A delay server's send result for a stored message: ``deliver_at_ms`` is what a later
    ``cancel`` names it by."""
    return {"id": message_id, "status": "stored", "deliver_at_ms": deliver_at_ms}


def send_result_error(message_id: str, exc: QmqError) -> dict[str, Any]:
    """One failed entry of a send response's ``results``."""
    return {"id": message_id, "error": exc.to_wire()}


def cancel_result(message_id: str, status: str) -> dict[str, Any]:
    """One entry of a cancel response's ``results`` (``status`` as docs/PROTOCOL.md lists)."""
    return {"id": message_id, "status": status}


def pull_response(pull_seqs: Sequence[int], payloads: Sequence[bytes],
                  redelivered: Sequence[int]) -> dict[str, Any]:
    """The body of a pull response: three columns of one entry per message, in order (one
    array each rather than a map per message: nothing to build or parse per message)."""
    return {"pull_seqs": pull_seqs, "payloads": payloads, "redelivered": redelivered}


def pull_columns(answer: dict[str, Any]) -> tuple[list[int], list[Any], list[int]]:
    """Client side: the (pull_seqs, payloads, redelivered) columns of a pull response, checked
    to be arrays of one length with int pull seqs and redelivery counts (C loops, no call per
    message). Payloads are not checked here: each is decoded on its own. BadRequest names the
    defect."""
    pull_seqs: Any = answer.get("pull_seqs")
    payloads: Any = answer.get("payloads")
    redelivered: Any = answer.get("redelivered")
    for name, column in (("pull_seqs", pull_seqs), ("payloads", payloads),
                         ("redelivered", redelivered)):
        if type(column) is not list:
            raise BadRequest(f"pull response field {name} must be an array, got "
                             f"{type_name(column)}")
    if not len(pull_seqs) == len(payloads) == len(redelivered):
        raise BadRequest(f"pull response columns differ in length: pull_seqs {len(pull_seqs)}, "
                         f"payloads {len(payloads)}, redelivered {len(redelivered)}")
    for name, column in (("pull_seqs", pull_seqs), ("redelivered", redelivered)):
        if column and set(map(type, column)) != {int}:
            bad = next(value for value in column if type(value) is not int)
            raise BadRequest(f"pull response field {name} must hold int, got {type_name(bad)}")
    return pull_seqs, payloads, redelivered


def browsed_message(sequence: int, payload: bytes) -> dict[str, Any]:
    """One entry of a browse response's ``messages``."""
    return {"sequence": sequence, "payload": payload}


def parse_response(frame: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
    """Client side: ``(rid, the frame without rid)``: the frame itself, its rid taken out (no
    copy: the caller's freshly decoded frame is the answer); raise the matching QmqError (with
    ``.rid`` set) for an error response, and BadRequest for a map that is not a response."""
    if not isinstance(frame, dict):
        raise BadRequest(f"response must be a map, got {type_name(frame)}")
    if "rid" not in frame:
        raise BadRequest("response lacks field 'rid'")
    rid = frame["rid"]
    if rid is not None and (type(rid) is not int or not 0 <= rid <= _U64_MAX):
        raise BadRequest(f"response rid must be int or nil, got {type_name(rid)}")
    if "error" in frame:
        error = frame["error"]
        if not (
            isinstance(error, dict)
            and isinstance(error.get("code"), str)
            and isinstance(error.get("message"), str)
        ):
            raise BadRequest(f"response error must be {{code: str, message: str}}, got {error!r:.80}")
        raise error_from_wire(error["code"], error["message"], rid=rid)
    if rid is None:
        raise BadRequest("response without error must have an int rid")
    del frame["rid"]
    return rid, frame


__all__ = [
    "error_response", "hello_response", "send_result_ok", "send_results_stored",
    "send_stored_answer", "delayed_send_result", "send_result_error", "cancel_result",
    "pull_response", "pull_columns", "browsed_message", "parse_response",
]
