"""The producer engines one consumer rank knows, and rule 8's handshake on demand.

A producer engine's ranks are learned by handshake. Of them, the mapping
(:func:`~..mapping.expected_writers`) names the ranks that write into this
rank; the others write nothing here and are told so with ``Skip`` (rank ``r``
by consumer rank ``r`` mod the consumer's world size). An engine is *usable*
once every rank writing into this one is handshaken. :class:`Producers` owns
that directory and what waits on it: the handshakes asked for, the transfers
abandoned before their engine became usable, and the Skips owed to ranks not
handshaken yet. The endpoint drives transfers; it asks the directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, LocalProtocolError
from ..events import Action, Peer, SendMessage
from ..layout import EngineSpec, RankInfo
from ..mapping import expected_writers, targets_of
from ..messages import Cancel, Skip
from ..records import Key


@dataclass(slots=True)
class Producers:
    """Handshaken producer ranks, by engine: who writes into this rank, who is silent."""

    peers: dict[Peer, RankInfo] = field(default_factory=dict)
    engines: dict[str, EngineSpec] = field(default_factory=dict)
    writers: dict[str, frozenset[int]] = field(default_factory=dict)  # ranks writing here
    silent: dict[str, tuple[int, ...]] = field(default_factory=dict)  # ranks told by Skip
    ready: set[str] = field(default_factory=set)  # every rank writing here is handshaken
    connecting: dict[str, float] = field(default_factory=dict)  # Connect sent: its deadline
    # Transfers cancelled while their registration waited for the handshake, by
    # engine: abandoned (final Cancel, Skip) once it is usable; bounded by the
    # handshake timeout, which forgets them.
    abandoned: dict[str, list[Key]] = field(default_factory=dict)
    # Transfers whose Skip could not reach a rank that writes nothing (no
    # handshake yet), by engine, oldest first; bounded by ``max_untold``.
    untold: dict[str, dict[Key, int]] = field(default_factory=dict)  # -> its turn (rule 12)

    # ------------------------------------------------------------ learning

    def add(self, own: RankInfo, info: RankInfo) -> None:
        """Learn producer rank ``info``. Raises ConfigError (learning nothing) if it
        cannot pair with ``own``."""
        info.validate()
        writers = expected_writers(info.engine, own.engine, own.rank)  # compatibility
        eid = info.engine_id
        known = self.engines.get(eid)
        if known is not None and known != info.engine:
            raise ConfigError(f"engine {eid!r} changed its spec")
        self.peers[Peer(eid, info.rank)] = info
        self.engines[eid] = info.engine
        self.writers[eid] = writers
        if eid not in self.silent:
            src, dst = info.engine, own.engine
            self.silent[eid] = tuple(
                r for r in range(src.world_size)
                if r % dst.world_size == own.rank and not targets_of(src, dst, r))
        if all(Peer(eid, r) in self.peers for r in writers):
            self.ready.add(eid)

    def drop(self, engine_id: str) -> None:
        """Forget ``engine_id`` (the transport confirmed it dead)."""
        for p in [p for p in self.peers if p.engine_id == engine_id]:
            del self.peers[p]
        self.engines.pop(engine_id, None)
        self.writers.pop(engine_id, None)
        self.silent.pop(engine_id, None)
        self.ready.discard(engine_id)
        self.untold.pop(engine_id, None)

    def usable(self, engine_id: str) -> bool:
        """Every producer rank that writes into this rank is handshaken (ranks that
        write nothing are told with Skip if known, never waited for)."""
        return engine_id in self.ready

    def engine(self, engine_id: str) -> EngineSpec:
        spec = self.engines.get(engine_id)
        if spec is None:
            raise LocalProtocolError(f"no handshake with producer engine {engine_id!r}")
        return spec

    # ------------------------------------------------------ rule 8: on demand

    def ask(self, engine_id: str, deadline: float) -> bool:
        """Note a Connect for ``engine_id`` bounded by ``deadline``; False if one is
        already under way."""
        if engine_id in self.connecting:
            return False
        self.connecting[engine_id] = deadline
        return True

    def connected(self, engine_id: str) -> list[Key]:
        """The engine became usable: the transfers abandoned while it was not."""
        self.connecting.pop(engine_id, None)
        return self.abandoned.pop(engine_id, [])

    def failed(self, engine_id: str) -> None:
        """The handshake failed: nothing waits on it any more (with no channel, the
        producer's lease decides what was abandoned)."""
        self.connecting.pop(engine_id, None)
        self.abandoned.pop(engine_id, None)
        self.untold.pop(engine_id, None)

    def abandon_later(self, engine_id: str, key: Key) -> None:
        """A transfer cancelled before its registration went out: tell the engine's
        ranks when it becomes usable."""
        self.abandoned.setdefault(engine_id, []).append(key)

    # ------------------------------------------------------------ messages

    def abandons(self, me: Peer, key: Key, producer: str, max_untold: int) -> list[Action]:
        """A final Cancel to the ranks that would have written, Skip to the others."""
        return [
            SendMessage(peer=Peer(producer, r), message=Cancel(
                transfer_id=key[0], attempt=0, engine_id=me.engine_id, rank=me.rank,
                final=True, incarnation=key[1]))
            for r in sorted(self.writers[producer])
        ] + self.skips(me, key, producer, max_untold)

    def skips(self, me: Peer, key: Key, producer: str, max_untold: int,
              only: int | None = None, target: int = 0) -> list[Action]:
        """Skip to the producer ranks this rank speaks for that write nothing (and
        has handshaken with; ``only``: to that rank alone). A silent rank not
        handshaken yet is told when it is (:meth:`told_late`)."""
        silent = self.silent.get(producer, ())
        if only is None and any(Peer(producer, r) not in self.peers for r in silent):
            untold = self.untold.setdefault(producer, {})
            untold[key] = target
            while len(untold) > max_untold:
                del untold[next(iter(untold))]
        return [
            SendMessage(peer=Peer(producer, r), message=Skip(
                transfer_id=key[0], engine_id=me.engine_id, rank=me.rank,
                producer_engine_id=producer, incarnation=key[1], target=target))
            for r in silent
            if Peer(producer, r) in self.peers and only in (None, r)
        ]

    def told_late(self, me: Peer, info: RankInfo, max_untold: int) -> list[Action]:
        """A silent rank just handshaken: Skip every transfer it missed."""
        eid = info.engine_id
        silent = self.silent[eid]
        if info.rank not in silent:
            return []
        untold = self.untold.get(eid, {})
        out = [a for key, target in untold.items()
               for a in self.skips(me, key, eid, max_untold, only=info.rank, target=target)]
        if all(Peer(eid, r) in self.peers for r in silent):
            self.untold.pop(eid, None)
        return out
