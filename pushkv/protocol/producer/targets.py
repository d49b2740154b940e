"""The consumer ranks one producer rank knows (handshaken) and the ones it writes into.

A consumer engine's ranks are learned by handshake; the mapping
(:func:`~..mapping.targets_of`) decides which of them this rank writes and
what part of each. :class:`Targets` owns that directory: the endpoint asks it,
never the dictionaries behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, ValidationError
from ..events import Peer
from ..layout import RankInfo
from ..mapping import Assignment, expected_writers, targets_of


@dataclass(slots=True)
class Targets:
    """Handshaken consumer ranks, and per consumer engine the legs this rank writes."""

    peers: dict[Peer, RankInfo] = field(default_factory=dict)
    by_engine: dict[str, tuple[Peer, ...]] = field(default_factory=dict)  # legs to write
    assigned: dict[Peer, Assignment] = field(default_factory=dict)  # what goes into each

    def add(self, own: RankInfo, info: RankInfo) -> None:
        """Learn consumer rank ``info``. Raises ConfigError if it cannot pair with ``own``
        (and then learns nothing)."""
        info.validate()
        expected_writers(own.engine, info.engine, info.rank)  # compatibility
        peer = Peer(info.engine_id, info.rank)
        known = self.peers.get(peer)
        if known is not None and known != info:
            # Same name, other memory: a restarted engine must use a new engine id, or
            # old registrations could land in the new incarnation's memory.
            raise ConfigError(f"{info.engine_id!r} rank {info.rank} changed its layout")
        if info.layout.head_dim != own.layout.head_dim or (
            info.layout.dtype_bytes != own.layout.dtype_bytes
        ):
            raise ConfigError("consumer KV element shape differs from the producer's")
        self.peers[peer] = info
        assigned = targets_of(own.engine, info.engine, own.rank)
        self.by_engine[info.engine_id] = legs = tuple(
            Peer(info.engine_id, a.dst_rank) for a in assigned)
        self.assigned.update(zip(legs, assigned, strict=True))

    def drop(self, engine_id: str) -> None:
        """Forget every rank of ``engine_id`` (the transport lost it)."""
        for peer in [p for p in self.peers if p.engine_id == engine_id]:
            del self.peers[peer]
        for p in self.by_engine.pop(engine_id, ()):
            self.assigned.pop(p, None)

    def known(self, engine_id: str, rank: int) -> RankInfo:
        """The handshaken rank; ValidationError if there was no handshake."""
        info = self.peers.get(Peer(engine_id, rank))
        if info is None:
            raise ValidationError(f"no handshake with {engine_id!r} rank {rank}")
        return info

    def writes_into(self, peer: Peer) -> bool:
        """This rank writes part of the KV into ``peer``."""
        return peer in self.assigned

    def legs(self, engine_id: str) -> tuple[Peer, ...] | None:
        """The ranks of ``engine_id`` this rank writes into (None: engine unknown)."""
        return self.by_engine.get(engine_id)
