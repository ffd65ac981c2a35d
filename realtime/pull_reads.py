"""What a pull reads from the message store (a group behind the tail, a redelivery of an old
message), on the store thread, and the payload checks it makes without the tail's columns:
tag match and expiry, decoding a payload only when it may expire or a tag filter is set."""

from __future__ import annotations

import logging

from logstore.errors import LogStoreError
from realtime.storage import MessageStore
from realtime.storage.errors import StorageError
from wire.errors import QmqError
from wire.message import KEY_EXPIRE_AT_MS, decode_message, tag_hash

log = logging.getLogger(__name__)

# The msgpack bytes the payload key KEY_EXPIRE_AT_MS (one byte, "x") can take: a fixstr of 1
# byte, as our encoder writes it (b"\xa1x"), or a str 8/16/32 of length 1 from another encoder
# (msgpack allows each), which all end in b"\x01x". A payload that contains none of them has no
# expiry, so a pull without tags need not decode it.
_EXPIRE_KEY = b"\xa1" + KEY_EXPIRE_AT_MS.encode()
_EXPIRE_KEY_LONGHAND_END = b"\x01" + KEY_EXPIRE_AT_MS.encode()
_EXPIRE_KEYS_LONGHAND = tuple(kind + _EXPIRE_KEY_LONGHAND_END
                              for kind in (b"\xd9", b"\xda\x00", b"\xdb\x00\x00\x00"))


def may_expire(payload: bytes) -> bool:
    """False only when ``payload`` certainly has no expire_at_ms (no encoding of its key)."""
    # Every longhand form ends alike: one search rules them all out in the usual case.
    return _EXPIRE_KEY in payload or (
        _EXPIRE_KEY_LONGHAND_END in payload and any(key in payload for key in _EXPIRE_KEYS_LONGHAND))


def deliverable(payload: bytes, tags: frozenset[str], now_ms: int | None) -> bool:
    """Exact tag match (the consumer log's bloom mask is only a pre-filter) and not expired
    at ``now_ms`` (None: ignore expiry)."""
    try:
        message = decode_message(payload)
    except QmqError:
        return False
    if tags and not tags.intersection(message.tags):
        return False
    if now_ms is not None and message.expire_at_ms is not None and message.expire_at_ms <= now_ms:
        return False
    return True


def read_for_pull_io(store: MessageStore, subject: str, seqs: list[int], cursor: int,
                     end: int, count: int, tags: frozenset[str], now_ms: int,
                     payload_bytes_max: int, expired: list[bytes] | None = None,
                     unreadable: list[tuple[int, str | None]] | None = None,
                     ) -> tuple[dict[int, bytes], int]:
    """Store thread: the payloads of ``seqs`` (b"" when unreadable), then up to ``count``
    deliverable messages from ``cursor``; returns them and the new cursor. Messages passed
    over because they expired go to ``expired`` (for tracing); records the scan passed over
    because they fail verification go to ``unreadable`` as (sequence, id or None): a
    damaged record must not fail every pull of the group, forever. The payloads stop
    growing at ``payload_bytes_max`` bytes (one message always fits)."""
    payloads: dict[int, bytes] = {}
    for seq in seqs:
        try:
            payloads[seq] = store.read(subject, seq).payload
        except (LogStoreError, StorageError) as exc:
            # Deleted by retention's hard cap or damaged (the store raises its own
            # CorruptEntry / SequenceOutOfRange, not a LogStoreError: catching only that
            # failed every pull of the group, forever): it cannot be delivered again.
            log.error("redelivery of %s seq %d impossible: %s", subject, seq, exc)
            payloads[seq] = b""
    new_cursor = cursor
    if count > 0 and cursor < end:
        start = max(cursor, store.first_sequence(subject))
        hashes = [tag_hash(t) for t in tags] if tags else None
        found, new_cursor = store.scan(subject, start, count, hashes,
                                       unreadable=unreadable)
        budget_bytes = payload_bytes_max - sum(map(len, payloads.values()))
        for stored in found:
            if payloads and len(stored.payload) > budget_bytes:
                new_cursor = stored.sequence  # the rest waits for the next pull
                break
            if not tags and not may_expire(stored.payload):
                # Nothing to check without a decode: no tag filter, and the payload has no
                # expire_at_ms (its key's bytes do not occur in it). It was validated when
                # it was sent and its CRC verified on this read.
                payloads[stored.sequence] = stored.payload
                budget_bytes -= len(stored.payload)
            elif deliverable(stored.payload, tags, now_ms):
                payloads[stored.sequence] = stored.payload
                budget_bytes -= len(stored.payload)
            elif expired is not None and deliverable(stored.payload, tags, None):
                expired.append(stored.payload)  # it matched; only its expiry kept it back
    return payloads, new_cursor


__all__ = ["deliverable", "may_expire", "read_for_pull_io"]
