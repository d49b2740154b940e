"""Outputs of the endpoints: what the driver must do next.

Endpoints never act; every method returns a list of these and the driver (a
transport, the simulator, the vLLM connector) carries them out. They are
frozen, keyword-only, slotted dataclasses with Python-valid reprs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from .errors import RemoteProtocolError
from .messages import FailReason, Hello, Message, Notify
from .packing import PackedPlan
from .planner import TransferPlan


class Peer(NamedTuple):
    """One rank of one engine."""

    engine_id: str
    rank: int


def sender_of(message: Message) -> Peer:
    """The rank a message claims to come from."""
    if isinstance(message, Hello):
        return Peer(message.info.engine_id, message.info.rank)
    return Peer(message.engine_id, message.rank)


class Mode(enum.Enum):
    """How a transfer's bytes move."""

    __hash__ = object.__hash__  # members are singletons: hash by identity, fast


    PUSH = "push"  #: the producer writes into registered consumer blocks
    PULL = "pull"  #: the consumer reads the producer's published blocks


class FailurePolicy(enum.Enum):
    """What a consumer engine does when a transfer fails."""

    __hash__ = object.__hash__  # members are singletons: hash by identity, fast


    FAIL = "fail"  #: the request errors
    RECOMPUTE = "recompute"  #: the consumer computes the prefill itself


@dataclass(frozen=True, slots=True, kw_only=True)
class SendMessage:
    """Send ``message`` to ``peer`` on the control plane."""

    peer: Peer
    message: Message


@dataclass(frozen=True, slots=True, kw_only=True)
class PackedWrite:
    """How a write is packed: gather ``packed`` from the source blocks into the
    local staging range at ``src_offset``, write its ``wire`` chunks to the
    consumer's staging at ``dst_offset``; the consumer scatters (:class:`Scatter`)."""

    packed: PackedPlan
    src_offset: int  #: producer staging, lent until the write completes
    dst_offset: int  #: consumer staging, lent by the registration
    #: Pipelined (rule 10): the image's chunk cut points (:func:`~.packing.chunk_bounds`);
    #: chunk ``k`` is gathered and written on its own, notified by ``IssueWrite.chunk_notify``.
    bounds: tuple[int, ...] = ()
    chunk_bytes: int = 0  #: the chunk size it was cut at (0: one chunk)

    @property
    def chunks(self) -> int:
        return max(1, len(self.bounds) - 1)

    def span(self, k: int) -> tuple[int, int]:
        """Staging image bytes ``[start, stop)`` of chunk ``k``."""
        if len(self.bounds) < 2:
            return 0, self.packed.nbytes
        return self.bounds[k], self.bounds[k + 1]


@dataclass(frozen=True, slots=True)
class WriteScope:
    """The logical rectangle of KV one write covers, as one side sees it: tokens
    ``[first_token, num_tokens)`` of the request in ``block_ids`` (that side's
    blocks), global layers ``layers``, and head runs ``(local head, logical head,
    count)`` -- the logical head is the consumer rank's local index (the
    mapping's ``(src, dst, n)`` runs on the producer, ``(dst, dst, n)`` on the
    consumer). Pure data: what a digest of the write is computed over
    (:mod:`pushkv.integrity`); the core computes none."""

    block_ids: tuple[int, ...]
    first_token: int
    num_tokens: int
    layers: range
    heads: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class IssueWrite:
    """Producer: copy ``plan`` from local source blocks into ``peer``'s blocks,
    then deliver ``notify`` to it. Report back with ``write_completed``.

    ``packed`` set: move the bytes as a packed write instead (``notify.staged``)."""

    transfer_id: str
    attempt: int
    peer: Peer
    plan: TransferPlan
    notify: Notify
    incarnation: int = 0  #: which use of the transfer id
    packed: PackedWrite | None = None
    #: The logical KV this write moves, on the producer's side (for a digest).
    scope: WriteScope | None = None

    def chunk_notify(self, k: int) -> Notify:
        """The notification of chunk ``k`` of a pipelined packed write (``notify`` is
        chunk 0's); a write of one chunk has only ``notify``."""
        return notify_chunk(self.notify, k)


def notify_chunk(notify: Notify, k: int) -> Notify:
    """Chunk ``k``'s notification of a pipelined packed write whose chunk 0 notifies
    ``notify`` (rule 10)."""
    return notify if k == 0 else msgspec.structs.replace(notify, chunk=k)


@dataclass(frozen=True, slots=True, kw_only=True)
class Scatter:
    """Consumer: producer rank ``peer``'s staged write landed in local staging at
    ``offset``; copy ``packed.scatter`` out of it into the destination blocks, then
    report with ``scatter_done``. Until then the attempt is not fenced: neither its
    blocks nor its staging go back. Pipelined: only image bytes ``[start, stop)``
    (chunk ``chunk``), staged at ``offset + start``."""

    transfer_id: str
    attempt: int
    peer: Peer
    packed: PackedPlan
    offset: int
    incarnation: int = 0  #: which use of the transfer id
    chunk: int = 0
    start: int = 0
    stop: int = -1  #: -1: the whole image

    @property
    def span(self) -> tuple[int, int]:
        return self.start, self.packed.nbytes if self.stop < 0 else self.stop


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseStaging:
    """Consumer: the staging range an attempt was lent is free again (nothing can
    land in it nor be scattered from it any more)."""

    transfer_id: str
    attempt: int
    offset: int
    nbytes: int
    incarnation: int = 0  #: which use of the transfer id


@dataclass(frozen=True, slots=True, kw_only=True)
class IssueRead:
    """Consumer (pull): copy ``plan`` from ``peer``'s source blocks into local
    blocks. Report back with ``read_completed``.

    ``scope`` (rule 11): the logical rectangle the read lands, as this consumer
    rank sees it -- its blocks, tokens, layers and head runs ``(local head,
    producer's local head, count)``: a pull's digest numbers heads as the
    producer rank does, which the consumer knows from the mapping."""

    transfer_id: str
    attempt: int
    peer: Peer
    plan: TransferPlan
    incarnation: int = 0  #: which use of the transfer id
    scope: WriteScope | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Publish:
    """Producer (pull): tell the consumer (through the router) where the KV is.

    ``lease_s``: how long from now the source stays held at least (its lease; a
    heartbeat may extend it, an abort does not shorten it). Relay it to the
    consumer's ``start_pull`` less the relay's own delay bound: a read that could
    end after it fails closed (rule 4)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    incarnation: int = 0  #: which use of the transfer id
    lease_s: float = float("inf")
    #: Rule 11: the logical rectangle this rank publishes (its blocks, tokens ``[0,
    #: num_tokens)``, its layers, every local head numbered as its own).
    scope: WriteScope | None = None
    #: Rule 11: the digests of ``scope`` a transport that checks integrity fills in
    #: (``pushkv.integrity``; the core leaves it empty). Relay it unchanged with the
    #: block ids, to the consumer's pull (this producer rank's entry).
    seal: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseSource:
    """Producer: the source blocks of this transfer may be freed. Emitted once."""

    transfer_id: str
    block_ids: tuple[int, ...]
    incarnation: int = 0  #: which use of the transfer id


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseDestination:
    """Consumer: no write of this attempt can land any more; the blocks may be reused."""

    transfer_id: str
    attempt: int
    block_ids: tuple[int, ...]
    incarnation: int = 0  #: which use of the transfer id


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferReady:
    """Consumer: every expected writer notified; the KV is in place."""

    transfer_id: str
    attempt: int
    incarnation: int = 0  #: which use of the transfer id


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferFailed:
    """Consumer: the transfer failed and is fenced; apply ``policy``."""

    transfer_id: str
    attempt: int
    reason: str  #: for people: what happened
    policy: FailurePolicy
    code: FailReason = FailReason.WRITE_FAILED  #: for programs: why, to count by cause
    incarnation: int = 0  #: which use of the transfer id


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferCancelled:
    """Consumer: an aborted transfer is fenced and over."""

    transfer_id: str
    attempt: int
    incarnation: int = 0  #: which use of the transfer id


@dataclass(frozen=True, slots=True, kw_only=True)
class Connect:
    """Consumer: registrations wait for producer engine ``engine_id``; handshake
    with its ranks, then call ``add_peer`` for each (or ``handshake_failed``).
    Emitted once per engine until it is usable or has failed."""

    engine_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Rejected:
    """A peer's message was refused; state is unchanged."""

    peer: Peer | None
    error: RemoteProtocolError


Action = (
    SendMessage
    | IssueWrite
    | IssueRead
    | Publish
    | ReleaseSource
    | ReleaseDestination
    | ReleaseStaging
    | Scatter
    | TransferReady
    | TransferFailed
    | TransferCancelled
    | Connect
    | Rejected
)
