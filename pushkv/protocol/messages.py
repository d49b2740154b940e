"""Control-plane messages and their wire codec.

Every message is an immutable, keyword-only msgspec struct whose repr is valid
Python. On the wire a frame is ``b"PK"``, one version byte, then the message
as a MessagePack array whose first element is the message tag. Decoding is
defensive: a frame that is too large, has the wrong magic or version, is not
MessagePack, names an unknown tag, or carries an out-of-range field raises
:class:`~pushkv.protocol.errors.DecodeError` -- and nothing else.

Identities carried by every per-transfer message: ``transfer_id`` (chosen by
the router, shared by both legs), ``incarnation`` (which use of that id: a
nonce drawn by whoever created the transfer, the same on every rank; 0 when
none was given), ``attempt`` (the consumer's epoch for that transfer) and the
sender's ``engine_id`` + global ``rank``. ``(transfer_id, incarnation)`` names
one transfer: messages of another incarnation never touch it.
"""

from __future__ import annotations

import enum
from typing import Annotated, Final

import msgspec

from .errors import DecodeError
from .layout import MAX_ID_LEN, MAX_RANKS, RankInfo

MAGIC: Final = b"PK"
VERSION: Final = 3
#: Largest frame accepted (bytes). A 1M-token request at block size 16 is 64k ids.
MAX_FRAME: Final = 4 << 20
MAX_BLOCK_IDS: Final = 1 << 19
MAX_HEARTBEAT_ITEMS: Final = 1 << 16
#: Rule 12: the highest turn a consumer engine may have at a source.
MAX_TARGET: Final = 1 << 16
MAX_TOKENS: Final = 1 << 31

TransferId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
EngineId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
Attempt = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
Incarnation = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS * MAX_RANKS)]
BlockId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]
Detail = Annotated[str, msgspec.Meta(max_length=1024)]
#: Writes of one attempt of one leg (progressive push numbers them).
Parts = Annotated[int, msgspec.Meta(ge=0, lt=1 << 24)]
StagingBytes = Annotated[int, msgspec.Meta(ge=0, lt=1 << 48)]


class FailReason(enum.IntEnum):
    """Why a producer gives up on an attempt (carried by :class:`Fail`)."""

    PREFILL_ABORTED = 1  #: the producer engine aborted the request
    WRITE_FAILED = 2  #: the write failed to post or to complete
    DEADLINE = 3  #: the registration's window passed before KV was ready
    SOURCE_RELEASED = 4  #: a reissue arrived after the source KV was released
    OVERLOADED = 5  #: too many registrations are waiting for KV
    INVALID = 6  #: the registration was rejected (see detail)
    PEER_DIED = 7  #: the transport lost the peer
    READ_FAILED = 8  #: pull: the consumer's own read failed (never on the wire)
    HANDSHAKE_FAILED = 9  #: the producer engine could not be reached (never on the wire)
    LEASE_EXPIRED = 10  #: the source's lease ended before this attempt could be written
    CORRUPT = 11  #: a landed range failed its digest check (consumer-local, never on the wire)
    RETARGETED = 12  #: rule 12: the source now goes to another consumer engine

    def __repr__(self) -> str:  # valid Python, so failing examples replay
        return f"FailReason.{self.name}"


class Hello(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=1):
    """Handshake: who I am and how my KV memory is laid out."""

    info: RankInfo


class Register(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=2):
    """Consumer rank -> producer rank: write this transfer into these blocks."""

    transfer_id: TransferId
    attempt: Attempt
    engine_id: EngineId
    rank: Rank
    producer_engine_id: EngineId
    block_ids: Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)]
    num_tokens: Tokens
    first_token: Tokens = 0
    #: The producer must not *start* the write later than this after receipt.
    window_ms: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)] = 480_000
    incarnation: Incarnation = 0
    #: Packed writes: the range of the consumer's staging memory lent to this rank
    #: for this attempt (``staging_nbytes`` 0: none; write directly).
    staging_offset: StagingBytes = 0
    staging_nbytes: StagingBytes = 0
    #: Rule 12: this consumer engine's turn at the source (0: the first engine
    #: chosen; a router re-targeting the source to another engine counts up).
    target: Annotated[int, msgspec.Meta(ge=0, le=MAX_TARGET)] = 0


class Cancel(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=3):
    """Consumer -> producer: do not write this attempt.

    ``final`` means the consumer gave the transfer up (abort): the producer may
    release its source KV. A non-final cancel (preemption) keeps the source
    for a reissue.
    """

    transfer_id: TransferId
    attempt: Attempt
    engine_id: EngineId
    rank: Rank
    final: bool = True
    incarnation: Incarnation = 0


class CancelAck(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=4):
    """Producer -> consumer: I will post no (more) write of this attempt.

    Not a fence on its own: writes already posted may still be on the wire, and
    this message may overtake their bytes. ``posted``: how many writes of the
    attempt I posted in all; ``failed``: how many of those failed (their bytes
    may land in part, for up to the consumer's fence grace, and they may never
    notify). The consumer's fence holds once the notifications of the other
    ``posted - failed`` arrived and, if ``failed``, the grace passed."""

    transfer_id: TransferId
    attempt: Attempt
    engine_id: EngineId
    rank: Rank
    incarnation: Incarnation = 0
    posted: Parts = 0
    failed: Parts = 0


class Fail(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=5):
    """Producer -> consumer: this attempt failed; I will post no more of it.

    Like :class:`CancelAck`, not a fence on its own (see ``posted``/``failed``)."""

    transfer_id: TransferId
    attempt: Attempt
    engine_id: EngineId
    rank: Rank
    reason: FailReason
    detail: Detail = ""
    incarnation: Incarnation = 0
    posted: Parts = 0  #: as for CancelAck: writes of the attempt posted in all
    failed: Parts = 0  #: as for CancelAck: how many of them failed


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=6):
    """Consumer -> producer: these transfers are alive; renew their leases.

    Items are ``(transfer_id, attempt, incarnation)``."""

    engine_id: EngineId
    rank: Rank
    transfers: Annotated[
        tuple[tuple[TransferId, Attempt, Incarnation], ...],
        msgspec.Meta(max_length=MAX_HEARTBEAT_ITEMS),
    ]


class Notify(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=7):
    """Write notification, riding on the WRITE: producer rank finished writing.

    A leg written in several writes (progressive push) numbers them: ``part`` is
    this write's index, and the last write says how many there are (``parts``;
    0 on the others). The rank has finished once ``parts`` distinct parts
    arrived, in any order. A whole-request write is part 0 of 1.

    ``staged``: the write went into the staging range the registration lent, as
    the staging image of :class:`~.packing.PackedPlan` of the plan from the
    producer's ``src_block_ids`` (sent so that the consumer plans the same
    scatter); only a whole-request write (part 0 of 1) is staged. A pipelined
    staged write (``chunk_bytes`` > 0) notifies once per chunk: this is chunk
    ``chunk`` of ``chunks``, the image cut by :func:`~.packing.chunk_bounds` at
    ``chunk_bytes``; the consumer scatters each chunk as it lands."""

    transfer_id: TransferId
    attempt: Attempt
    engine_id: EngineId
    rank: Rank
    incarnation: Incarnation = 0
    part: Parts = 0
    parts: Parts = 1
    staged: bool = False
    src_block_ids: Annotated[tuple[BlockId, ...], msgspec.Meta(max_length=MAX_BLOCK_IDS)] = ()
    chunk: Parts = 0
    chunks: Parts = 1
    chunk_bytes: StagingBytes = 0


class ReadDone(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=8):
    """Pull mode, consumer -> producer: I have read my slice; release when all have."""

    transfer_id: TransferId
    attempt: Attempt
    engine_id: EngineId
    rank: Rank
    producer_engine_id: EngineId
    incarnation: Incarnation = 0


class Skip(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=9):
    """Consumer rank -> a producer rank that writes nothing into the consumer
    engine for this transfer (replicated heads, MLA, producer TP above consumer
    TP): nothing will be asked of you, release the source. Not answered."""

    transfer_id: TransferId
    engine_id: EngineId
    rank: Rank
    producer_engine_id: EngineId
    incarnation: Incarnation = 0
    #: Rule 12: the consumer engine's turn at the source (see :class:`Register`).
    target: Annotated[int, msgspec.Meta(ge=0, le=MAX_TARGET)] = 0


class Consumed(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=10):
    """Push, consumer rank -> each producer rank that wrote into it: the engine has
    taken its first decode step from this transfer's KV, or gave the transfer up
    (ended it after READY, or failed it after this rank wrote or failed its write):
    it will not want the source again. Rule 12: a source the producer keeps for a
    re-target (``retarget_hold_s``) may go now. Not answered; one from an engine the
    source is not bound to changes nothing."""

    transfer_id: TransferId
    engine_id: EngineId
    rank: Rank
    producer_engine_id: EngineId
    incarnation: Incarnation = 0


Message = (Hello | Register | Cancel | CancelAck | Fail | Heartbeat | Notify | ReadDone | Skip
           | Consumed)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_HEADER = MAGIC + bytes([VERSION])


def encode(message: Message) -> bytes:
    """Serialise a message to one frame."""
    return _HEADER + _encoder.encode(message)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    """Parse one frame from an untrusted peer.

    Raises :class:`DecodeError` (only) if the frame is not a valid message.
    """
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise DecodeError(f"frame is not bytes: {type(frame).__name__}")
    data = bytes(frame)
    if len(data) > MAX_FRAME:
        raise DecodeError(f"frame of {len(data)} bytes exceeds {MAX_FRAME}")
    if len(data) < 3 or data[:2] != MAGIC:
        raise DecodeError("not a pushkv frame (bad magic)")
    if data[2] != VERSION:
        raise DecodeError(f"unsupported wire version {data[2]} (this side speaks {VERSION})")
    try:
        msg: Message = _decoder.decode(memoryview(data)[3:])
    except msgspec.MsgspecError as exc:
        raise DecodeError(f"malformed message: {exc}") from exc
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise DecodeError(f"malformed message: {exc!r}") from exc
    return msg

