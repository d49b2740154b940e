"""A ready-made producer/consumer pair on the in-memory network, and the cluster
the conformance suites drive."""


from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from ...protocol import (
    ConsumerConfig,
    Peer,
    ProducerConfig,
    RankInfo,
)
from ...protocol.packing import PackingConfig
from .memory import region_memory
from .network import InMemoryNetwork
from .nodes import ConsumerNode, ProducerNode


def pair(
    producer: list[RankInfo],
    consumer: list[RankInfo],
    *,
    seed: int = 0,
    delivery_seed: int | None = None,
    producer_config: ProducerConfig | None = None,
    consumer_config: ConsumerConfig | None = None,
    **net_kwargs: Any,
) -> InMemoryNetwork:
    """A network with one producer and one consumer engine, handshakes done.

    Source memory is filled with random bytes seeded by ``seed``, destination
    memory with zeros; adversarial delivery draws from ``delivery_seed`` (None:
    ``seed`` too). Other keywords go to :class:`InMemoryNetwork`.
    """
    rng = np.random.default_rng(seed)
    net = InMemoryNetwork(seed=seed if delivery_seed is None else delivery_seed, **net_kwargs)
    for info in producer:
        net.add_producer(info, producer_config, region_memory(info.layout, rng=rng))
    for info in consumer:
        net.add_consumer(info, consumer_config)
    net.handshake()
    return net




class InMemoryCluster:
    """The conformance-suite :class:`~pushkv.transports.conformance.Cluster` over this transport.

    Waits run the network in simulated time, so a 3-second window takes no
    wall-clock time at all. ``delivery`` and ``seed`` (None: the topology's)
    choose the network's delivery model (:class:`InMemoryNetwork`).
    """

    def __init__(self, topology: Any, packing: PackingConfig | None = None, *,
                 delivery: str = "adversarial", seed: int | None = None) -> None:
        self.topology = topology
        self.net = pair(
            topology.producer_ranks(), topology.consumer_ranks(), seed=topology.seed,
            delivery_seed=seed,
            producer_config=topology.producer_config, consumer_config=topology.consumer_config,
            packing=packing, delivery=delivery,
        )

    # Everything an engine-level call does happens on every rank of that engine.
    def _consumers(self) -> list[ConsumerNode]:
        return [n for n in self.net.consumers.values() if n.alive]

    def _producers(self) -> list[ProducerNode]:
        return [n for n in self.net.producers.values() if n.alive]

    def register(self, transfer_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                 first_token: int = 0, *, incarnation: int = 0) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.register(transfer_id, "prefill-0", dst_block_ids, num_tokens,
                                        self.net.now, first_token, incarnation=incarnation))

    def prefill_finished(self, transfer_id: str, src_block_ids: Sequence[int],
                         num_tokens: int, *, incarnation: int = 0) -> None:
        for n in self._producers():
            n.apply(n.endpoint.prefill_finished(transfer_id, src_block_ids, num_tokens,
                                                self.net.now, incarnation=incarnation))

    def range_ready(self, transfer_id: str, src_block_ids: Sequence[int],
                    tokens: tuple[int, int], layers: tuple[int, int] | None = None) -> None:
        """Progressive push: part of the prefill is final (see Producer.range_ready)."""
        for n in self._producers():
            n.apply(n.endpoint.range_ready(transfer_id, src_block_ids, tokens, self.net.now,
                                           layers=layers))

    def preempt(self, transfer_id: str) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.preempt(transfer_id, self.net.now))

    def reissue(self, transfer_id: str, dst_block_ids: Sequence[int]) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.reissue(transfer_id, dst_block_ids, self.net.now))

    def abort(self, transfer_id: str) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.abort(transfer_id, self.net.now))

    def consumed(self, transfer_id: str) -> None:
        """Push: the engine's first decode step from the KV (rule 12's Consumed)."""
        for n in self._consumers():
            n.apply(n.endpoint.consumed(transfer_id, self.net.now))

    def prefill_aborted(self, transfer_id: str) -> None:
        for n in self._producers():
            n.apply(n.endpoint.prefill_aborted(transfer_id, self.net.now))

    def inject(self, side: str, rank: int, channel: str, frame: bytes) -> None:
        engine = "prefill-0" if side == "producer" else "decode-0"
        self.net.inject(Peer(engine, rank), frame)  # one channel carries both here

    def kill_producer(self) -> None:
        self.net.kill("prefill-0")

    def snapshot(self) -> Any:
        from ..conformance import Snapshot

        outcomes: dict[tuple[int, str], list[tuple[str, int]]] = {}
        dst_released: Counter[tuple[int, str, int]] = Counter()
        for c in self.net.consumers.values():
            for tid, seen in c.outcomes.items():
                outcomes[c.peer.rank, tid] = list(seen)
            for r in c.released:
                dst_released[c.peer.rank, r.transfer_id, r.attempt] += 1
        src_released = {
            (p.peer.rank, tid): n for p in self.net.producers.values()
            for tid, n in p.released.items()
        }
        rejected = {("producer", p.peer.rank): len(p.rejected)
                    for p in self.net.producers.values()}
        rejected |= {("consumer", c.peer.rank): len(c.rejected)
                     for c in self.net.consumers.values()}
        return Snapshot(
            outcomes=outcomes, src_released=src_released, dst_released=dict(dst_released),
            rejected=rejected,
            lent={c.peer.rank: c.endpoint.lent_blocks() for c in self.net.consumers.values()
                  if c.alive},
            held={p.peer.rank: sorted(p.endpoint.held_blocks())
                  for p in self.net.producers.values() if p.alive},
            registrations={p.peer.rank: sorted(p.registrations)
                           for p in self.net.producers.values()},
            writes={p.peer.rank: p.writes for p in self.net.producers.values()},
            violations=list(self.net.violations),
        )

    def wait(self, predicate: Any, timeout_s: float) -> Any:
        end = self.net.now + timeout_s
        while True:
            snap = self.snapshot()
            if predicate(snap) or self.net.now >= end:
                return snap
            step = min(end, self.net.now + 0.01)
            self.net.run(until=step)

    def source_memory(self, rank: int) -> list[np.ndarray]:
        return self.net.producers[Peer("prefill-0", rank)].memory

    def destination_memory(self, rank: int) -> list[np.ndarray]:
        return self.net.consumers[Peer("decode-0", rank)].memory

    def close(self) -> None:
        pass
