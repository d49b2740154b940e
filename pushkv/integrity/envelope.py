"""The digest's envelope around a write notification.

A sealed notification is ``b"PD"``, a version byte, the rectangle the write
covered and its digest, then the plain notification frame unchanged::

    "PD" | ver u8 | first_token u32 | num_tokens u32 | layer_start u16 |
    layer_stop u16 | digest u64 (little-endian) | frame ("PK" ...)

Every plain pushkv frame starts with ``b"PK"``, so a sealed one is never taken
for a plain one, and with integrity off the wire bytes are exactly the plain
frames. The envelope belongs to the transports, not to the protocol: the core
never sees it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pushkv.protocol.errors import DecodeError

MAGIC = b"PD"
VERSION = 1
_HEAD = struct.Struct("<2sBIIHHQ")
HEADER_BYTES = _HEAD.size


@dataclass(frozen=True, slots=True)
class Tag:
    """What the producer computed over the exact source bytes of one write."""

    first_token: int
    num_tokens: int
    layers: range
    digest: int

    def describe(self) -> str:
        return (f"tokens [{self.first_token}, {self.num_tokens}) layers "
                f"[{self.layers.start}, {self.layers.stop})")


def seal(frame: bytes, tag: Tag) -> bytes:
    """``frame`` with ``tag`` in front."""
    return _HEAD.pack(MAGIC, VERSION, tag.first_token, tag.num_tokens, tag.layers.start,
                      tag.layers.stop, tag.digest) + frame


def unseal(data: bytes | bytearray | memoryview) -> tuple[bytes, Tag | None]:
    """(the plain frame, its tag or None). DecodeError for a malformed envelope."""
    raw = bytes(data)
    if raw[:2] != MAGIC:
        return raw, None
    if len(raw) < HEADER_BYTES:
        raise DecodeError(f"sealed notification of {len(raw)} bytes is shorter than its "
                          f"{HEADER_BYTES}-byte envelope")
    _, ver, first, n, l0, l1, dig = _HEAD.unpack_from(raw)
    if ver != VERSION:
        raise DecodeError(f"unsupported integrity envelope version {ver} (this side: {VERSION})")
    if first > n or l0 > l1:
        raise DecodeError(f"sealed notification names an empty or reversed range "
                          f"(tokens [{first}, {n}), layers [{l0}, {l1}))")
    return raw[HEADER_BYTES:], Tag(first, n, range(l0, l1), dig)


__all__ = ["HEADER_BYTES", "MAGIC", "Tag", "seal", "unseal"]
