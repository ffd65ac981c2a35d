"""MessageLog: every subject's messages in one ``SegmentedLog`` under ``<data_dir>/messagelog/``.

Segments are ``<20-digit base offset>.log`` (logstore naming); each logstore record body is one
message record (``realtime.storage.message_record``). This class adds decoding and the timestamps
retention needs; framing, CRCs, torn-tail truncation and group-commit fsync are logstore's.
"""

from __future__ import annotations

from typing import Iterator

from logstore import (
    CorruptRecord, DiskFull, LogConfig, Opener, SegmentedLog, SegmentInfo,
)
from realtime.storage.control_record import decode_visible_message, is_control
from realtime.storage.held import is_held_control, message_header
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

    def append_durably(self, bodies: list[bytes]) -> list[int]:
        """Append records already encoded and make them durable per the flush mode
        (``sync_or_flush``); returns their offsets. On a full disk (``DiskFull``, retriable)
        the log is first cut back to where it ended before: the first records of a batch
        written before the disk filled (a segment roll inside the batch, a batch over the write
        buffer) would otherwise stay in the file unindexed, the next batch would reuse their
        sequences, and a slave copying the log would take them as written and refuse the real
        ones (review s14 rvb-2). ``LogWriteFailed`` propagates (the caller makes it sticky),
        also when that cut fails."""
        start = self.log.end_offset
        try:
            offsets = self.log.append_many(bodies)
            self.log.sync_or_flush()
        except DiskFull:
            self.log.cut_back(start)
            raise
        return offsets

    def append_copy_durably(self, offset: int, data: bytes) -> list[bytes]:
        """A slave: append records copied from the master at ``offset`` (this log's end) and
        make them durable per the flush mode; returns their bodies. On a full disk the log is
        cut back to ``offset`` first, as ``append_durably`` does: records of the copy written
        before the disk filled would stay unindexed, the next fetch would start past them, and
        their sequences would read as missing (review s14 rvb-6). The usual tail writes the
        master's bytes as they came (``SegmentedLog.append_raw_durably``)."""
        return self.log.append_raw_durably(offset, data)


    def read(self, offset: int) -> tuple[MessageRecord, int]:
        """The message at ``offset`` and its body size; CorruptRecord when it does not decode.
        A visible-message record (a held message made visible) reads as the message it is."""
        body = self.log.read(offset)
        try:
            if is_control(body):
                held, sequence, _held_offset, payload_at = decode_visible_message(body)
                return MessageRecord(held.timestamp_ms, sequence, held.tag_bloom, held.subject,
                                     held.message_id, bytes(body[payload_at:])), len(body)
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
            _ts, sequence, _bloom, subject, message_id, _held_offset = message_header(body)
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
        every message record, visible-message records included (held and cancelled records
        are passed over)."""
        for offset, body in self.log.iterate(from_offset):
            if is_held_control(body):
                continue
            try:
                header = message_header(body)
            except ValueError as exc:
                raise CorruptRecord(self.directory, offset, f"bad message record: {exc}") from exc
            yield offset, len(body), header[:5]

    def segments(self) -> list[SegmentInfo]:
        return self.log.segments()
