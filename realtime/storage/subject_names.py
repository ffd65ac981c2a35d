"""Subject name <-> consumer-log directory name.

Bytes of the subject's UTF-8 form in ``[A-Za-z0-9._-]`` are kept; every other byte (``%`` of the
internal subjects, anything else) becomes ``~`` and two lowercase hex digits, so
``%retry%order%billing`` is stored as ``~25retry~25order~25billing``. ``~`` is never kept
literally, so the mapping is reversible, and a name that would start with ``.`` is escaped too
(no ``.``/``..`` or hidden directories).

A name longer than ``DIRECTORY_NAME_CHARS_MAX`` (filesystems allow 255 bytes) is stored as its
first 100 encoded characters, ``~~`` and the SHA-256 of the subject in hex; the real subject is
then kept in a ``SUBJECT`` file inside the directory (``subject_of_directory`` reads it).
"""

from __future__ import annotations

import hashlib
import os
import string

from logstore import write_file_atomically

DIRECTORY_NAME_CHARS_MAX = 200
SUBJECT_FILE_NAME = "SUBJECT"
_KEPT = frozenset((string.ascii_letters + string.digits + "._-").encode("ascii"))
_LONG_MARK = "~~"


def encode_subject(subject: str) -> str:
    """The directory name of ``subject``."""
    out = []
    for index, byte in enumerate(subject.encode("utf-8")):
        if byte in _KEPT and not (index == 0 and byte == ord(".")):
            out.append(chr(byte))
        else:
            out.append(f"~{byte:02x}")
    name = "".join(out)
    if len(name) > DIRECTORY_NAME_CHARS_MAX:
        digest = hashlib.sha256(subject.encode("utf-8")).hexdigest()
        name = name[:100] + _LONG_MARK + digest
    return name


def is_hashed(name: str) -> bool:
    """True when ``name`` is a long subject's hashed directory name."""
    return _LONG_MARK in name


def decode_subject(name: str) -> str:
    """The subject of a (non-hashed) directory name; raises ValueError on a malformed name."""
    if is_hashed(name):
        raise ValueError(f"directory name {name!r} is hashed; read its {SUBJECT_FILE_NAME} file")
    out = bytearray()
    index = 0
    while index < len(name):
        char = name[index]
        if char == "~":
            digits = name[index + 1 : index + 3]
            if len(digits) != 2 or any(d not in "0123456789abcdef" for d in digits):
                raise ValueError(f"bad escape {name[index:index + 3]!r} in directory name {name!r}")
            out.append(int(digits, 16))
            index += 3
        else:
            if ord(char) not in _KEPT:
                raise ValueError(f"character {char!r} is never kept in directory name {name!r}")
            out.append(ord(char))
            index += 1
    return out.decode("utf-8")


def write_subject_file(directory: str, subject: str) -> None:
    """Record a hashed directory's subject (atomically)."""
    write_file_atomically(os.path.join(directory, SUBJECT_FILE_NAME), subject.encode("utf-8"))


def subject_of_directory(parent: str, name: str) -> str:
    """The subject stored in directory ``parent/name``; raises ValueError when it cannot tell."""
    if not is_hashed(name):
        return decode_subject(name)
    path = os.path.join(parent, name, SUBJECT_FILE_NAME)
    try:
        with open(path, "rb") as f:
            subject = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the subject of {name!r}: {exc}") from exc
    if encode_subject(subject) != name:
        raise ValueError(f"{path} names subject {subject!r}, which does not encode to {name!r}")
    return subject
