"""What a :class:`~.api.NixlRuntime` reports to its engine thread."""

from __future__ import annotations

from dataclasses import dataclass, field

from pushkv.protocol import (
    Publish,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)

from ..writer import WriteResult


@dataclass(frozen=True, slots=True, kw_only=True)
class CallFailed:
    """An engine-thread call could not be carried out (misuse, unknown engine...)."""

    operation: str
    transfer_id: str | None
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class WritesDone:
    """Producer: what the writes of one transfer (this incarnation, every attempt and
    part) cost, reported just before its ``ReleaseSource``."""

    transfer_id: str
    incarnation: int
    writes: int  #: writes posted (parts, and attempts re-posted)
    descriptors: int  #: NIXL descriptors of those writes
    nbytes: int  #: bytes those writes moved (the ones that completed)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerLost:
    """Every rank of ``engine_id`` is confirmed dead; its transfers were fenced."""

    engine_id: str


Event = (
    TransferReady
    | TransferFailed
    | TransferCancelled
    | ReleaseDestination
    | ReleaseSource
    | Rejected
    | CallFailed
    | PeerLost
    | Publish
    | WritesDone
)
"""What :meth:`NixlRuntime.poll` returns. All but ``CallFailed``, ``PeerLost`` and
``WritesDone`` are the protocol's own actions, passed through unchanged (``Publish``: a pull
producer's blocks are ready to be read)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeView:
    """A consistent picture of a runtime's state (diagnostics and tests)."""

    lent: dict[int, tuple[str, int]]  #: consumer: blocks a write may still land in, by use
    held: dict[tuple[str, int], tuple[int, ...]]  #: producer: source blocks held, by use
    ready_engines: tuple[str, ...]
    writes_in_flight: int
    stats: dict[str, int]
    #: producer: the last writes, newest last (timings of preparation and posting)
    recent_writes: tuple[WriteResult, ...] = ()
    transfers: int = 0  #: transfers the endpoint tracks
    reads_in_flight: int = 0  #: consumer (pull): reads posted and not finished
    staging_lent: int = 0  #: bytes of staging the endpoint lends (packed writes; 0: none)
    #: producer: the last registrations taken in, newest last -- (transfer id,
    #: incarnation, consumer rank) of each ``Register``, or ``Skip`` (nothing to
    #: write for that consumer rank)
    recent_registrations: tuple[tuple[str, int, int], ...] = ()
    #: the protocol endpoint's own counters (e.g. rule 12's ``lingered``, ``consumed``)
    endpoint_stats: dict[str, int] = field(default_factory=dict)
