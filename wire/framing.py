"""Frames on a byte stream: ``u32 big-endian length | msgpack map`` (docs/PROTOCOL.md), pure
bytes <-> maps, no sockets, no asyncio. Split from ``wire.protocol`` (which re-exports these
names) so that module keeps to the requests and responses.

``FrameDecoder`` turns a byte stream into maps. A declared length over the limit raises TooLarge
before anything is allocated; a frame that is not a msgpack map with str keys raises BadRequest.
Either means the stream can no longer be trusted: the server answers with an error (rid nil) and
closes the connection. The decoder stays failed and re-raises on every later ``feed``.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
from msgpack import unpackb

from wire.errors import BadRequest, QmqError, TooLarge, type_name
from wire.limits import MAX_FRAME_BYTES
from wire.packing import PACKER_KEEP_BYTES_MAX, packers

# The frame header: one field.
_HEADER = struct.Struct(
    ">I"  # payload length in bytes, big-endian u32, not counting these 4 bytes
)
HEADER_BYTES = _HEADER.size
FRAME_HEADER = _HEADER  # for a caller that encodes a frame inline (serverkit.frame_server)


def encode_frame(obj: dict[str, Any], max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """``u32 length | msgpack(obj)``; TooLarge if the payload exceeds ``max_frame_bytes``."""
    if type(obj) is not dict and not isinstance(obj, dict):
        raise BadRequest(f"a frame must be a map, got {type_name(obj)}")
    try:
        # This thread's Packer straight (``wire.packing.packb``'s bytes and errors, one Python
        # call less per frame); the size below is also its keep rule's.
        payload = packers.pack(obj)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(f"frame cannot be encoded: {exc}") from None
    size = len(payload)
    if size > PACKER_KEEP_BYTES_MAX:
        packers.renew()  # not kept with its grown buffer
    if size > max_frame_bytes:
        raise TooLarge(f"frame of {size} bytes exceeds MAX_FRAME_BYTES {max_frame_bytes}")
    return _HEADER.pack(size) + payload


def decode_frame_payload(payload: bytes | memoryview) -> dict[str, Any]:
    """One frame's msgpack payload -> map with str keys; BadRequest otherwise."""
    try:
        obj = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # ExtraData, FormatError, StackError, ValueError, UnicodeDecodeError
        raise BadRequest(f"frame is not valid msgpack: {type(exc).__name__}: {exc}"[:200]) from None
    if type(obj) is not dict:
        raise BadRequest(f"frame must be a msgpack map, got {type_name(obj)}")
    try:
        # strict_map_key leaves str and bytes keys: joining the keys is one call that fails on
        # a bytes key, where an isinstance per key was one call per field of every request.
        "".join(obj)
    except TypeError:
        for key in obj:
            if not isinstance(key, str):
                raise BadRequest(f"frame keys must be str, got {type_name(key)}") from None
        raise
    return obj


class FrameDecoder:
    """Buffers a byte stream and returns the complete frames in it, in order.

    ``max_frame_bytes`` bounds the declared payload length; a longer declaration raises TooLarge as
    soon as its 4-byte header is seen, before the payload is buffered. After any error the
    decoder is failed: frames decoded earlier in the same ``feed`` are dropped and every later
    ``feed`` raises the same error, because the stream is out of sync.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        assert 0 < max_frame_bytes <= 0xFFFFFFFF, max_frame_bytes
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._error: QmqError | None = None
        # Bytes received but not yet part of a complete frame (read-only outside ``feed``): a
        # plain attribute, as the server asks it after every read.
        self.buffered_bytes = 0

    @property
    def failed(self) -> bool:
        """True once a bad frame was seen; the connection should be closed."""
        return self._error is not None

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Add ``data`` and return every frame it completes; raises TooLarge or BadRequest.

        The frames are decoded straight from ``data`` when nothing was buffered before it (a
        request that arrives whole, the usual case, is never copied into the buffer)."""
        if self._error is not None:
            raise self._error
        buffer = self._buffer
        if buffer:
            buffer += data
            source: bytes | bytearray = buffer
        else:
            source = data
        size = len(source)
        frames: list[dict[str, Any]] = []
        pos = 0
        try:
            with memoryview(source) as view:
                while size - pos >= HEADER_BYTES:
                    (length,) = _HEADER.unpack_from(source, pos)
                    if length > self.max_frame_bytes:
                        # Refuse from the header alone: the payload is never awaited nor
                        # allocated.
                        raise TooLarge(f"frame of {length} bytes exceeds MAX_FRAME_BYTES "
                                       f"{self.max_frame_bytes}")
                    end = pos + HEADER_BYTES + length
                    if size < end:
                        break
                    # decode_frame_payload's work for a frame that passes, done here: one
                    # Python call fewer a frame (issue 18). Anything amiss is decoded again by
                    # it, which raises the BadRequest that names what is wrong. (No slice of
                    # the view is kept: a live one would pin the buffer cut below.)
                    try:
                        frame = unpackb(view[pos + HEADER_BYTES:end], raw=False, use_list=True,
                                        strict_map_key=True)
                        if type(frame) is not dict:
                            raise TypeError(type(frame))
                        "".join(frame)  # a bytes key fails here (see decode_frame_payload)
                    except Exception:
                        frame = decode_frame_payload(view[pos + HEADER_BYTES:end])
                    frames.append(frame)
                    pos = end
        except QmqError as exc:
            self._error = exc
            self._buffer = bytearray()  # nothing more will be read from a failed stream
            self.buffered_bytes = 0
            raise
        if source is buffer:
            del buffer[:pos]
        elif pos < size:
            buffer += data[pos:] if pos else data
        self.buffered_bytes = size - pos
        return frames


__all__ = ["FRAME_HEADER", "HEADER_BYTES", "encode_frame", "decode_frame_payload", "FrameDecoder"]
