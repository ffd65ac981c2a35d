"""The pull log's checkpoint payload: the whole pull state plus where the action log resumes.

The payload is stored by ``logstore.CheckpointStore`` (which adds its own magic, sequence, length
and CRC-32 around it and writes it temp -> fsync -> rename -> fsync directory)::

    Offset | Size | Field
    -------+------+---------------------------------------------------------------
    0      | 4    | magic: 0x51504C53 ("QPLS")
    4      | 1    | version: 1
    5      | 3    | reserved, 0
    8      | 8    | action_offset: u64, the first action-log offset NOT reflected in the state
    16     | N    | body: msgpack array [retained_offsets, epoch, groups]

    retained_offsets  [uint]  action_offset of the older checkpoints still kept, oldest first;
                              action segments are kept back to the oldest of them so a damaged
                              newest checkpoint can fall back to an older one
    epoch             uint    pull-seq epoch (see ``pulllog.state.PULL_SEQ_EPOCH_SHIFT``)
    groups            [[subject str, group str, start_sequence uint, created_ms uint, cursor uint,
                        queue [[consumer_log_seq uint, times_released uint]] (release order),
                        consumers [[consumer str, next_pull_seq uint, last_pull_ms uint,
                                    held [[pull_seq, consumer_log_seq, redelivered, pulled_at_ms]]]]
                      ]]  sorted by (subject, group); consumers by id; held by pull seq

What it does NOT guarantee: it describes the state only up to ``action_offset``; the actions after
it must be replayed. Acked history is not stored (only what is still held or queued).
"""

from __future__ import annotations

import struct

import msgpack

from pulllog.state import PullState

HEADER = struct.Struct(
    ">I"  # magic
    "B"  # version
    "3x"  # reserved
    "Q"  # action_offset
)
MAGIC = 0x51504C53
VERSION = 1


def encode_snapshot(state: PullState, action_offset: int, retained_offsets: list[int]) -> bytes:
    """The checkpoint payload for ``state`` taken at ``action_offset``."""
    epoch, groups = state.to_plain()
    body = msgpack.packb([list(retained_offsets), epoch, groups], use_bin_type=True)
    return HEADER.pack(MAGIC, VERSION, action_offset) + body


def decode_snapshot(payload: bytes) -> tuple[PullState, int, list[int]]:
    """Parse a payload into (state, action_offset, retained_offsets); ValueError on any defect."""
    if len(payload) < HEADER.size:
        raise ValueError(f"payload of {len(payload)} bytes is shorter than its {HEADER.size}-byte header")
    magic, version, action_offset = HEADER.unpack_from(payload)
    if magic != MAGIC:
        raise ValueError(f"bad magic 0x{magic:08x}")
    if version != VERSION:
        raise ValueError(f"unknown version {version}")
    try:
        retained, epoch, groups = msgpack.unpackb(payload[HEADER.size:], raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ValueError(f"undecodable body: {exc}") from exc
    if type(retained) is not list or not all(type(o) is int and 0 <= o <= action_offset
                                             for o in retained):
        raise ValueError(f"bad retained offsets {retained!r:.80}")
    return PullState.from_plain([epoch, groups]), action_offset, retained
