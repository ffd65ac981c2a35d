"""MessageLog: every subject's messages in one ``SegmentedLog`` under ``<data_dir>/messagelog/``.

Segments are ``<20-digit base offset>.log`` (logstore naming); each logstore record body is one
message record (``realtime.storage.message_record``). This class adds decoding and the timestamps
retention needs; framing, CRCs, torn-tail truncation and group-commit fsync are logstore's.
"""

from __future__ import annotations

from typing import Iterator

from logstore import CorruptRecord, LogConfig, Opener, SegmentedLog, SegmentInfo
from realtime.storage.control_record import decode_held, is_control
from realtime.storage.message_record import (
    MessageRecord,
    decode_message_header,
    decode_message_record,
    encode_message_record,
)


class MessageLog:
    """Appends and reads message records by message-log offset."""

    def __init__(self, directory: str, config: LogConfig, *, opener: Opener,
                 verify_from_offset: int) -> None:
        self.log = SegmentedLog(directory, config, opener=opener,
                                verify_from_offset=verify_from_offset)
        self.directory = directory

    @property
    def first_offset(self) -> int:
        return self.log.first_offset

    @property
    def end_offset(self) -> int:
        return self.log.end_offset

    @property
    def durable_offset(self) -> int:
        return self.log.durable_offset

    def append(self, timestamp_ms: int, subject_sequence: int, tag_bloom: int, subject: str,
               message_id: str, payload: bytes) -> tuple[int, int]:
        """Buffer one record; returns (offset, body size in bytes)."""
        body = encode_message_record(timestamp_ms, subject_sequence, tag_bloom, subject,
                                     message_id, payload)
        return self.log.append(body), len(body)

    def append_many(
        self, records: list[tuple[int, int, int, str, str, bytes]]
    ) -> list[tuple[int, int]]:
        """Buffer several records, each (timestamp_ms, subject_sequence, tag_bloom, subject,
        message_id, payload); returns (offset, body size in bytes) for each, in order."""
        bodies = [encode_message_record(*record) for record in records]
        return list(zip(self.log.append_many(bodies), map(len, bodies)))

    def append_bodies(self, bodies: list[bytes]) -> list[int]:
        """Buffer records already encoded (``encode_subject_records``); returns their offsets."""
        return self.log.append_many(bodies)

    def read(self, offset: int) -> tuple[MessageRecord, int]:
        """The message at ``offset`` and its body size; CorruptRecord when it does not decode.
        A held record (made visible, so a consumer-log entry points at it) reads as a message
        whose ``subject_sequence`` is None: its sequence is the entry's."""
        body = self.log.read(offset)
        try:
            if is_control(body):
                held, payload_at = decode_held(body)
                return MessageRecord(held.timestamp_ms, None, held.tag_bloom,  # type: ignore
                                     held.subject, held.message_id,
                                     bytes(body[payload_at:])), len(body)
            return decode_message_record(body), len(body)
        except ValueError as exc:
            raise CorruptRecord(self.directory, offset, f"bad message record: {exc}") from exc

    def read_id_unverified(self, offset: int) -> tuple[str, int, str] | None:
        """(subject, subject sequence, message id) of the record at ``offset`` decoded WITHOUT
        its CRC check, or None when even that fails: names a record ``read`` refuses."""
        body = self.log.read_unverified(offset)
        if body is None:
            return None
        try:
            if is_control(body):
                held, _at = decode_held(body)
                return held.subject, None, held.message_id  # type: ignore[return-value]
            _ts, sequence, _bloom, subject, message_id, _at = decode_message_header(body)
        except ValueError:
            return None
        return subject, sequence, message_id

    def timestamp_at(self, offset: int) -> int:
        """The timestamp of the record at ``offset`` (bytes 0-7 of every record kind)."""
        body = self.log.read(offset)
        if len(body) < 8:
            raise CorruptRecord(self.directory, offset, f"record of {len(body)} bytes")
        return int.from_bytes(body[:8], "big")

    def iterate_bodies(self, from_offset: int) -> Iterator[tuple[int, bytes]]:
        """Yield (offset, body) of every record from ``from_offset``, message or control."""
        return self.log.iterate(from_offset)

    def iterate_headers(self, from_offset: int) -> Iterator[tuple[int, int, tuple]]:
        """Yield (offset, body size, (timestamp_ms, sequence, bloom, subject, message_id)) of
        every message record (control records are passed over)."""
        for offset, body in self.log.iterate(from_offset):
            if is_control(body):
                continue
            try:
                header = decode_message_header(body)
            except ValueError as exc:
                raise CorruptRecord(self.directory, offset, f"bad message record: {exc}") from exc
            yield offset, len(body), header[:5]

    def segments(self) -> list[SegmentInfo]:
        return self.log.segments()
