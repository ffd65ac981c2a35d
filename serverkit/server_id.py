"""A server's stable identity: ``<data_dir>/server.id``, made on first start and kept.

The id names a server's *data*, not its address: a server restarted on another port keeps it,
and a new (empty) data dir is a new server. The MetaServer keys brokers by it and records
roles and the in-sync set by it (docs/REPLICATION.md 1, 13.1).

```
Offset | Size | Field
-------+------+--------------------------------------------------------------
0      | 4    | magic: "QSID" (0x51534944)
4      | 2    | version: 1
6      | 2    | reserved: 0
8      | 8    | id: 8 random bytes, shown as 16 lowercase hex digits
16     | 4    | crc32: CRC-32 (zlib) of bytes 0..15
```

The file is written whole: temp file, fsync, rename, fsync of the directory. A file that fails
any check is an error, never silently replaced: a new identity for old data would let the
MetaServer take a copy with history for an empty one.

It does NOT guarantee that two data dirs copied from one another differ: copying a data dir
clones the server. Delete ``server.id`` in the copy before its first start.
"""

from __future__ import annotations

import os
import secrets
import struct
import zlib

SERVER_ID_FILE = "server.id"
MAGIC = 0x51534944  # "QSID"
VERSION = 1
ID_BYTES = 8
_FORMAT = struct.Struct(
    ">I"   # magic
    "H"    # version
    "H"    # reserved, 0
    "8s"   # id
)
_CRC = struct.Struct(">I")  # CRC-32 of the fields above
FILE_BYTES = _FORMAT.size + _CRC.size  # 20


class ServerIdError(Exception):
    """``server.id`` exists but cannot be trusted (wrong size, magic, version or CRC)."""


def encode(server_id: bytes) -> bytes:
    """The 20 bytes of a ``server.id`` file holding ``server_id`` (8 bytes)."""
    assert len(server_id) == ID_BYTES, f"a server id is {ID_BYTES} bytes, not {len(server_id)}"
    body = _FORMAT.pack(MAGIC, VERSION, 0, server_id)
    return body + _CRC.pack(zlib.crc32(body))


def decode(data: bytes, path: str = SERVER_ID_FILE) -> str:
    """The id (16 hex digits) in the bytes of a ``server.id`` file; ServerIdError if bad."""
    if len(data) != FILE_BYTES:
        raise ServerIdError(f"{path} has {len(data)} bytes, expected {FILE_BYTES}")
    body, (crc,) = data[:_FORMAT.size], _CRC.unpack(data[_FORMAT.size:])
    if zlib.crc32(body) != crc:
        raise ServerIdError(f"{path} fails its CRC (stored {crc:#010x}, computed "
                            f"{zlib.crc32(body):#010x})")
    magic, version, _reserved, raw = _FORMAT.unpack(body)
    if magic != MAGIC:
        raise ServerIdError(f"{path} has magic {magic:#010x}, expected {MAGIC:#010x}")
    if version != VERSION:
        raise ServerIdError(f"{path} has version {version}, this build reads {VERSION}")
    return raw.hex()


def load_or_create(data_dir: str) -> str:
    """The server id kept in ``data_dir`` (made and stored durably on first use)."""
    os.makedirs(data_dir, exist_ok=True)
    path = os.path.join(data_dir, SERVER_ID_FILE)
    try:
        with open(path, "rb") as handle:
            return decode(handle.read(), path)
    except FileNotFoundError:
        pass
    return write(data_dir, secrets.token_bytes(ID_BYTES))


def write(data_dir: str, server_id: bytes) -> str:
    """Store ``server_id`` in ``data_dir/server.id`` (temp, fsync, rename, fsync of the
    directory) and return it as hex. Tests use it to give a server a known id."""
    path = os.path.join(data_dir, SERVER_ID_FILE)
    temp = path + ".tmp"
    with open(temp, "wb") as handle:
        handle.write(encode(server_id))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)
    directory = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return server_id.hex()


__all__ = ["FILE_BYTES", "SERVER_ID_FILE", "ServerIdError", "decode", "encode", "load_or_create",
           "write"]
