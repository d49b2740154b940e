"""The digest's envelope around a write notification.

A sealed notification is ``b"PD"``, a version byte, the rectangle the write
covered and its digest, then the plain notification frame unchanged::

    "PD" | ver u8 | first_token u32 | num_tokens u32 | layer_start u16 |
    layer_stop u16 | digest u64 (little-endian) | frame ("PK" ...)

Every plain pushkv frame starts with ``b"PK"``, so a sealed one is never taken
for a plain one, and with integrity off the wire bytes are exactly the plain
frames. The envelope belongs to the transports, not to the protocol: the core
never sees it.

A pull's digests travel the other way round, with the publication the consumer
reads from (``Publish.seal``, relayed to its pull): one producer rank's
rectangle and one digest per head of it, as the producer rank numbers its heads
(an opaque ``BLOCK`` layout: one digest of every head), so that a consumer rank
reading only some of the heads sums theirs::

    "PR" | ver u8 | first_token u32 | num_tokens u32 | layer_start u16 |
    layer_stop u16 | count u16 | count x digest u64 (little-endian)
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


PULL_MAGIC = b"PR"
PULL_VERSION = 1
_PULL_HEAD = struct.Struct("<2sBIIHHH")
#: Heads a pull seal may name (the layout's own bound on heads per rank).
MAX_PULL_DIGESTS = 4096


@dataclass(frozen=True, slots=True)
class PullTag:
    """What a producer rank computed over the source it published for a pull:
    its rectangle and one digest per head (``digests[h]``: its local head ``h``;
    one entry for an opaque layout: every head)."""

    first_token: int
    num_tokens: int
    layers: range
    digests: tuple[int, ...]

    def describe(self) -> str:
        return (f"tokens [{self.first_token}, {self.num_tokens}) layers "
                f"[{self.layers.start}, {self.layers.stop})")


def seal_pull(tag: PullTag) -> bytes:
    """The bytes of ``tag`` (``Publish.seal``)."""
    if not 0 < len(tag.digests) <= MAX_PULL_DIGESTS:
        raise ValueError(f"a pull seal holds 1 to {MAX_PULL_DIGESTS} digests, "
                         f"not {len(tag.digests)}")
    return _PULL_HEAD.pack(PULL_MAGIC, PULL_VERSION, tag.first_token, tag.num_tokens,
                           tag.layers.start, tag.layers.stop, len(tag.digests)) + struct.pack(
        f"<{len(tag.digests)}Q", *tag.digests)


def unseal_pull(data: bytes | bytearray | memoryview) -> PullTag:
    """The :class:`PullTag` in ``data``. DecodeError for anything else: another magic
    or version, a short or long body, an empty or reversed range, no digest."""
    raw = bytes(data)
    if len(raw) < _PULL_HEAD.size or raw[:2] != PULL_MAGIC:
        raise DecodeError(f"not a pull seal ({len(raw)} bytes, magic {raw[:2]!r}; "
                          f"expected {PULL_MAGIC!r})")
    _, ver, first, n, l0, l1, count = _PULL_HEAD.unpack_from(raw)
    if ver != PULL_VERSION:
        raise DecodeError(f"unsupported pull seal version {ver} (this side: {PULL_VERSION})")
    if first > n or l0 >= l1 or not 0 < count <= MAX_PULL_DIGESTS:
        raise DecodeError(f"pull seal names an empty or reversed range or no digest "
                          f"(tokens [{first}, {n}), layers [{l0}, {l1}), {count} digests)")
    if len(raw) != _PULL_HEAD.size + 8 * count:
        raise DecodeError(f"pull seal of {len(raw)} bytes for {count} digests "
                          f"(expected {_PULL_HEAD.size + 8 * count})")
    digests = struct.unpack_from(f"<{count}Q", raw, _PULL_HEAD.size)
    return PullTag(first, n, range(l0, l1), tuple(digests))


__all__ = ["HEADER_BYTES", "MAGIC", "PULL_MAGIC", "PULL_VERSION", "PullTag", "Tag", "seal",
           "seal_pull", "unseal", "unseal_pull"]
