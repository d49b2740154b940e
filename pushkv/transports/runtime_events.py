"""What a :class:`~.runtime.NixlRuntime` reports to its engine thread."""

from __future__ import annotations

from dataclasses import dataclass

from ..protocol import (
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)
from .nixl_writer import WriteResult


@dataclass(frozen=True, slots=True, kw_only=True)
class CallFailed:
    """An engine-thread call could not be carried out (misuse, unknown engine...)."""

    operation: str
    transfer_id: str | None
    error: str


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
)
"""What :meth:`NixlRuntime.poll` returns. The first six are the protocol's own
actions, passed through unchanged."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeView:
    """A consistent picture of a runtime's state (diagnostics and tests)."""

    lent: dict[int, str]  #: consumer: destination blocks a write may still land in
    held: dict[str, tuple[int, ...]]  #: producer: source blocks held, by transfer
    ready_engines: tuple[str, ...]
    writes_in_flight: int
    stats: dict[str, int]
    #: producer: the last writes, newest last (timings of preparation and posting)
    recent_writes: tuple[WriteResult, ...] = ()
    transfers: int = 0  #: transfers the endpoint tracks
