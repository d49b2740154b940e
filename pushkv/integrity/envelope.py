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

A consumer rank that reads less than a producer rank published (the remainder
after a cached prefix, some of its layers) cannot check against the relayed
seal, which sums over the whole source. It asks the producer rank for the
digests of exactly what it reads, over the side channel, while the read runs
(:class:`SealQuery`, ``"PQ"``); the producer rank answers (:class:`SealAnswer`,
``"PA"``) with a ``"PR"`` seal of that rectangle, once it found its whole
source unchanged since it published it::

    "PQ" | ver u8 | incarnation u64 | attempt u32 | rank u16 | first_token u32 |
    num_tokens u32 | layer_start u16 | layer_stop u16 | len u16 | transfer id |
    len u16 | consumer engine id
    "PA" | ver u8 | incarnation u64 | attempt u32 | rank u16 | status u8 |
    len u16 | transfer id | seal ("PR" ..., status OK only)
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


QUERY_MAGIC = b"PQ"
ANSWER_MAGIC = b"PA"
QUERY_VERSION = 1
_QUERY_HEAD = struct.Struct("<2sBQIHIIHH")
_ANSWER_HEAD = struct.Struct("<2sBQIHB")
_LEN = struct.Struct("<H")


@dataclass(frozen=True, slots=True)
class SealQuery:
    """Consumer rank ``(engine_id, rank)`` -> a producer rank: the digests of tokens
    ``[first_token, num_tokens)`` x ``layers`` of its published source, which read
    ``attempt`` of the transfer lands."""

    transfer_id: str
    incarnation: int
    attempt: int
    engine_id: str
    rank: int
    first_token: int
    num_tokens: int
    layers: range


#: :class:`SealAnswer` statuses: the seal of the rectangle; the producer rank holds
#: no such publication (never published here, released, or forgotten); its source
#: bytes differ from what it sealed when it published them (reused, overwritten).
ANSWER_OK, ANSWER_UNKNOWN, ANSWER_CHANGED = 0, 1, 2
ANSWER_STATUSES = (ANSWER_OK, ANSWER_UNKNOWN, ANSWER_CHANGED)


@dataclass(frozen=True, slots=True)
class SealAnswer:
    """Producer rank ``rank`` -> the consumer that asked: ``seal`` (``"PR"``) of the
    rectangle asked for, when ``status`` is :data:`ANSWER_OK`."""

    transfer_id: str
    incarnation: int
    attempt: int
    rank: int
    status: int
    seal: bytes = b""


def _text(raw: bytes, at: int, what: str) -> tuple[str, int]:
    if len(raw) < at + _LEN.size:
        raise DecodeError(f"seal query or answer cut short before its {what}")
    (n,) = _LEN.unpack_from(raw, at)
    at += _LEN.size
    if not 0 < n <= 256 or len(raw) < at + n:
        raise DecodeError(f"seal query or answer with a {what} of {n} bytes")
    try:
        return raw[at:at + n].decode("utf-8"), at + n
    except UnicodeDecodeError:
        raise DecodeError(f"seal query or answer with a {what} that is not UTF-8") from None


def _pack_text(text: str) -> bytes:
    b = text.encode("utf-8")
    if not 0 < len(b) <= 256:
        raise ValueError(f"an id of {len(b)} bytes (1 to 256)")
    return _LEN.pack(len(b)) + b


def encode_query(q: SealQuery) -> bytes:
    return _QUERY_HEAD.pack(QUERY_MAGIC, QUERY_VERSION, q.incarnation, q.attempt, q.rank,
                            q.first_token, q.num_tokens, q.layers.start, q.layers.stop
                            ) + _pack_text(q.transfer_id) + _pack_text(q.engine_id)


def encode_answer(a: SealAnswer) -> bytes:
    return _ANSWER_HEAD.pack(ANSWER_MAGIC, QUERY_VERSION, a.incarnation, a.attempt, a.rank,
                             a.status) + _pack_text(a.transfer_id) + a.seal


def decode_seal_frame(data: bytes | bytearray | memoryview) -> SealQuery | SealAnswer:
    """A side channel's seal frame. DecodeError for anything malformed."""
    raw = bytes(data)
    if raw[:2] == QUERY_MAGIC and len(raw) >= _QUERY_HEAD.size:
        _, ver, inc, attempt, rank, first, n, l0, l1 = _QUERY_HEAD.unpack_from(raw)
        if ver != QUERY_VERSION:
            raise DecodeError(f"unsupported seal query version {ver}")
        if first >= n or l0 >= l1:
            raise DecodeError(f"seal query for an empty or reversed range (tokens [{first}, "
                              f"{n}), layers [{l0}, {l1}))")
        tid, at = _text(raw, _QUERY_HEAD.size, "transfer id")
        engine, at = _text(raw, at, "engine id")
        if at != len(raw):
            raise DecodeError(f"seal query with {len(raw) - at} trailing bytes")
        return SealQuery(tid, inc, attempt, engine, rank, first, n, range(l0, l1))
    if raw[:2] == ANSWER_MAGIC and len(raw) >= _ANSWER_HEAD.size:
        _, ver, inc, attempt, rank, status = _ANSWER_HEAD.unpack_from(raw)
        if ver != QUERY_VERSION:
            raise DecodeError(f"unsupported seal answer version {ver}")
        if status not in ANSWER_STATUSES:
            raise DecodeError(f"seal answer with status {status}")
        tid, at = _text(raw, _ANSWER_HEAD.size, "transfer id")
        seal_bytes = raw[at:]
        if status == ANSWER_OK:
            unseal_pull(seal_bytes)  # a malformed seal: DecodeError here
        elif seal_bytes:
            raise DecodeError("a seal answer without a seal carries bytes")
        return SealAnswer(tid, inc, attempt, rank, status, seal_bytes)
    raise DecodeError(f"not a seal query or answer ({len(raw)} bytes, magic {raw[:2]!r})")


__all__ = ["ANSWER_CHANGED", "ANSWER_OK", "ANSWER_UNKNOWN", "HEADER_BYTES", "MAGIC",
           "PULL_MAGIC", "PULL_VERSION", "PullTag", "SealAnswer", "SealQuery", "Tag",
           "decode_seal_frame", "encode_answer", "encode_query", "seal", "seal_pull",
           "unseal", "unseal_pull"]
