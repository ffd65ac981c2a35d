"""The pull log's on-disk codecs: action records and the checkpoint payload."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pulllog.actions import (
    ACTION_PULL,
    BODY_VERSION,
    U64_MAX,
    Ack,
    Closed,
    ConsumerRemoved,
    EpochStarted,
    GroupCreated,
    Opened,
    Pull,
    Release,
    decode_action,
    encode_action,
)
from pulllog import actions as action_codec
from pulllog.snapshot import decode_snapshot, encode_snapshot
from pulllog.state import PullState

names = st.text(min_size=1, max_size=20)
uints = st.integers(min_value=0, max_value=U64_MAX)
small_uints = st.integers(min_value=0, max_value=1 << 40)
ranges = st.tuples(small_uints, small_uints).map(lambda r: (min(r), max(r)))

actions = st.one_of(
    st.builds(GroupCreated, names, names, uints, uints),
    st.builds(Pull, names, names, names, small_uints,
              st.lists(uints, max_size=30).map(tuple), uints, uints),
    st.builds(Ack, names, names, names, st.lists(ranges, max_size=10).map(tuple), uints),
    st.builds(Release, names, names, names, st.lists(uints, max_size=30).map(tuple),
              st.just(1), uints),
    st.builds(ConsumerRemoved, names, names, names, uints),
    st.builds(EpochStarted, uints),
    st.just(Closed()),
    st.just(Opened()),
)


@given(actions)
def test_every_action_round_trips_through_its_record_body(action):
    assert decode_action(encode_action(action)) == action


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_decode_to_an_action_or_a_value_error(data):
    try:
        decode_action(data)
    except ValueError:
        pass


def test_an_unknown_action_type_is_refused():
    with pytest.raises(ValueError, match="unknown action type 99"):
        decode_action(bytes([99, BODY_VERSION]) + msgpack.packb([]))


def test_an_unknown_body_version_is_refused():
    body = bytearray(encode_action(Closed()))
    body[1] = BODY_VERSION + 1
    with pytest.raises(ValueError, match="unknown action body version"):
        decode_action(bytes(body))


def test_a_pull_with_a_negative_sequence_is_refused():
    body = bytes([ACTION_PULL, BODY_VERSION]) + msgpack.packb(["s", "g", "c", 0, [-1], 1, 0])
    with pytest.raises(ValueError, match="unsigned"):
        decode_action(body)


@pytest.mark.parametrize("seqs", [[1, -1], [0, -(2**63)], [0, True], [0, 1.0], [0, "1"], [None]])
def test_a_pull_with_any_sequence_that_is_no_u64_is_refused(seqs):
    body = bytes([ACTION_PULL, BODY_VERSION]) + msgpack.packb(["s", "g", "c", 0, seqs, 9, 0])
    with pytest.raises(ValueError, match="unsigned"):
        decode_action(body)


@given(st.builds(Pull, names, names, names, small_uints, st.lists(uints, max_size=30).map(tuple),
                 uints, uints))
def test_a_pull_is_encoded_to_the_same_bytes_as_its_fields_packed_one_by_one(action):
    fields = [action.subject, action.group, action.consumer, action.first_pull_seq,
              list(action.consumer_log_seqs), action.new_cursor, action.now_ms]
    assert encode_action(action) == (bytes([ACTION_PULL, BODY_VERSION])
                                     + msgpack.packb(fields, use_bin_type=True))


@pytest.mark.parametrize("action", [
    Pull("s", "g", "c", 0, (1, -1), 9, 0), Pull("s", "g", "c", 0, (0, True), 9, 0),
    Pull("s", "g", "c", 0, (0, 2**64), 9, 0), Pull("s", "g", "c", 0, (0, 1.0), 9, 0),
    Pull("s", "g", "c", -1, (), 9, 0), Pull("s", "g", "c", 0, (), 2**64, 0),
    Pull("s", "g", "c", 0, (), 9, True), Pull("s", b"g", "c", 0, (), 9, 0),
    Pull("s", "g", None, 0, (), 9, 0), Pull("s", "g", "c", 0, [0, "1"], 9, 0)])  # type: ignore[arg-type]
def test_a_pull_that_could_not_be_read_back_is_refused_by_the_codec(action):
    with pytest.raises(ValueError):
        encode_action(action)


def test_a_pull_record_too_large_to_keep_its_packer_is_written_whole_and_its_packer_replaced():
    encode_action(Pull("s", "g", "c", 0, (1, 2), 5, 0))
    kept = action_codec.packers.packer
    seqs = tuple(range(2**40, 2**40 + action_codec.PACKER_KEEP_BYTES_MAX // 9 + 1))
    action = Pull("s", "g", "c", 0, seqs, seqs[-1] + 1, 0)
    assert decode_action(encode_action(action)) == action
    assert action_codec.packers.packer is not kept
    small = Pull("s", "g", "c", 0, (7,), 8, 0)
    assert decode_action(encode_action(small)) == small


def test_a_pull_of_the_largest_u64_sequences_is_read_back():
    body = encode_action(Pull("s", "g", "c", 0, (0, 2**64 - 1), 5, 0))
    assert decode_action(body).consumer_log_seqs == (0, 2**64 - 1)


def test_an_ack_range_with_start_above_end_is_refused_by_the_codec():
    with pytest.raises(ValueError, match="bad ack range"):
        encode_action(Ack("s", "g", "c", ((5, 4),), 0))


def test_a_field_count_mismatch_is_refused():
    body = encode_action(ConsumerRemoved("s", "g", "c", 1))
    fields = msgpack.unpackb(body[2:])
    with pytest.raises(ValueError, match="needs 4 fields"):
        decode_action(body[:2] + msgpack.packb(fields[:3]))


def _sample_state() -> PullState:
    state = PullState()
    for action in [
        GroupCreated("orders", "g", 3, 10),
        Pull("orders", "g", "c1", 0, (3, 4, 6), 7, 20),
        Release("orders", "g", "c1", (1,), 1, 30),
        Ack("orders", "g", "c1", ((0, 0),), 31),
        EpochStarted(2),
    ]:
        state.check(action)
        state.apply(action)
    return state


def test_the_checkpoint_payload_round_trips_the_whole_state():
    state = _sample_state()
    decoded, offset, retained = decode_snapshot(encode_snapshot(state, 4242, [10, 200]))
    assert (decoded.to_plain(), offset, retained) == (state.to_plain(), 4242, [10, 200])


def test_a_checkpoint_payload_with_a_bad_magic_or_version_is_refused():
    payload = encode_snapshot(_sample_state(), 1, [])
    with pytest.raises(ValueError, match="bad magic"):
        decode_snapshot(b"XXXX" + payload[4:])
    with pytest.raises(ValueError, match="unknown version"):
        decode_snapshot(payload[:4] + bytes([9]) + payload[5:])


def test_a_checkpoint_payload_with_a_malformed_state_is_refused():
    header = struct.pack(">IB3xQ", 0x51504C53, 1, 0)
    with pytest.raises(ValueError, match="malformed pull state"):
        decode_snapshot(header + msgpack.packb([[], 0, [["s", "g", -1, 0, 0, [], []]]]))
