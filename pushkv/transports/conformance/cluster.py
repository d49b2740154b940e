"""What a transport offers the conformance suite and what the checks observe: the
:class:`Topology` of a cluster, its :class:`Snapshot`, the :class:`Cluster` protocol,
the per-token reference of the bytes that must land (:func:`reference_destination`),
and the conditions the checks wait on (:func:`registered`, :func:`source_held`,
:func:`assert_clean`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ...protocol import (
    ConsumerConfig,
    EngineSpec,
    ProducerConfig,
    RankInfo,
    uniform_ranks,
)
from ...protocol.layout import KVLayout


@dataclass(frozen=True, kw_only=True)
class Topology:
    """One producer engine, one consumer engine, and the endpoint settings."""

    producer: dict[str, Any] = field(default_factory=dict)  #: uniform_ranks() kwargs
    consumer: dict[str, Any] = field(default_factory=dict)
    producer_config: ProducerConfig = field(
        default_factory=lambda: ProducerConfig(lease_s=5.0)
    )
    consumer_config: ConsumerConfig = field(
        default_factory=lambda: ConsumerConfig(window_s=3.0, fence_grace_s=1.0, heartbeat_s=0.5)
    )
    seed: int = 0

    def producer_ranks(self) -> list[RankInfo]:
        return uniform_ranks("prefill-0", **self.producer)

    def consumer_ranks(self) -> list[RankInfo]:
        return uniform_ranks("decode-0", **self.consumer)


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """What the cluster has seen so far."""

    #: (consumer rank, transfer id) -> outcomes reported, in order: ("ready", attempt), ...
    outcomes: dict[tuple[int, str], list[tuple[str, int]]]
    #: (producer rank, transfer id) -> number of ReleaseSource actions
    src_released: dict[tuple[int, str], int]
    #: (consumer rank, transfer id, attempt) -> ReleaseDestination count
    dst_released: dict[tuple[int, str, int], int]
    #: ("producer" | "consumer", rank) -> rejected frames
    rejected: dict[tuple[str, int], int]
    #: consumer rank -> blocks still lent to transfers
    lent: dict[int, dict[int, tuple[str, int]]]
    #: producer rank -> the transfers still holding source blocks: (transfer id,
    #: incarnation), or transfer ids where the endpoint keys them so
    held: dict[int, list[Any]]
    #: producer rank -> (transfer id, incarnation, consumer rank) of each registration
    #: it took in: a ``Register``, or a ``Skip`` (nothing to write for that rank)
    registrations: dict[int, list[tuple[str, int, int]]]
    #: producer rank -> writes it started (every attempt and part)
    writes: dict[int, int]
    #: safety violations the transport observed (writes into unlent blocks...)
    violations: list[str]

    def outcome(self, rank: int, transfer_id: str) -> str | None:
        seen = self.outcomes.get((rank, transfer_id))
        return seen[-1][0] if seen else None

    def all_outcomes(self, transfer_id: str, ranks: Sequence[int]) -> set[str | None]:
        return {self.outcome(r, transfer_id) for r in ranks}


class Cluster(Protocol):
    """What a transport offers the conformance suite."""

    topology: Topology

    def register(self, transfer_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                 first_token: int = 0, *, incarnation: int = 0) -> None:
        """Every consumer rank registers the same (engine-level) blocks.

        ``incarnation`` is needed only by :data:`REUSED_ID_CHECKS`."""

    def prefill_finished(self, transfer_id: str, src_block_ids: Sequence[int],
                         num_tokens: int, *, incarnation: int = 0) -> None:
        """Every producer rank reports prefill done."""

    def preempt(self, transfer_id: str) -> None: ...
    def reissue(self, transfer_id: str, dst_block_ids: Sequence[int]) -> None: ...
    def abort(self, transfer_id: str) -> None: ...
    def consumed(self, transfer_id: str) -> None:
        """Push: every consumer rank took its first decode step from the KV (rule 12)."""
    def prefill_aborted(self, transfer_id: str) -> None: ...

    def inject(self, side: str, rank: int, channel: str, frame: bytes) -> None:
        """Raw bytes into a rank's ``"control"`` or ``"notify"`` channel."""

    def kill_producer(self) -> None:
        """The producer engine dies abruptly (its process is killed)."""

    def snapshot(self) -> Snapshot: ...

    def wait(self, predicate: Callable[[Snapshot], bool], timeout_s: float) -> Snapshot:
        """Let the cluster run until ``predicate`` holds or ``timeout_s`` passes."""

    def source_memory(self, rank: int) -> list[np.ndarray]: ...
    def destination_memory(self, rank: int) -> list[np.ndarray]: ...
    def close(self) -> None: ...


MakeCluster = Callable[[Topology], Cluster]


# ------------------------------------------------------------------ reference


def _element(lo: KVLayout, ids: Sequence[int], token: int, head: int) -> int:
    b = ids[token // lo.block_size]
    w = token % lo.block_size
    inner = w * lo.num_heads + head if lo.order == "NHD" else head * lo.block_size + w
    return b * lo.stride + inner * lo.head_dim * lo.dtype_bytes


def reference_destination(
    producers: Sequence[RankInfo],
    src_memory: Sequence[Sequence[np.ndarray]],
    consumer: RankInfo,
    transfers: Sequence[tuple[Sequence[int], Sequence[int], int, int]],
    base: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """Destination memory after ``transfers`` = [(src ids, dst ids, tokens, first)].

    Per token, per head, per layer and plane, straight from the layouts: each
    destination head comes from the producer rank holding it (the replica
    ``holders[tp_rank % len(holders)]`` when replicated), in the stage holding
    the layer.
    """
    lo = consumer.layout
    out = [np.array(b, copy=True) for b in base] if base is not None else [
        np.zeros(lo.region_bytes, dtype=np.uint8) for _ in range(lo.num_regions)
    ]
    spec: EngineSpec = producers[0].engine
    dspec = consumer.engine
    tp_rank, _ = dspec.split(consumer.rank)
    es = lo.head_dim * lo.dtype_bytes
    dst_heads = dspec.heads_of(tp_rank)
    for src_ids, dst_ids, n, first in transfers:
        for layer in range(lo.layer_start, lo.layer_end):
            stage = next(s for s in range(spec.pp_size) if layer in spec.layers_of(s))
            for h in dst_heads:
                holders = spec.holders_of(h)
                writer = spec.rank_of(holders[tp_rank % len(holders)], stage)
                p = producers[writer]
                sh = h - spec.heads_of(holders[tp_rank % len(holders)]).start
                dh = h - dst_heads.start
                for plane in range(lo.planes):
                    s_buf = src_memory[writer][p.layout.region_index(layer, plane)]
                    d_buf = out[lo.region_index(layer, plane)]
                    if lo.order == "BLOCK":  # opaque blocks move whole
                        for b in range(first // lo.block_size, -(-n // lo.block_size)):
                            so, do = src_ids[b] * p.layout.stride, dst_ids[b] * lo.stride
                            d_buf[do:do + lo.block_bytes] = s_buf[so:so + lo.block_bytes]
                        continue
                    for t in range(first, n):
                        so = _element(p.layout, src_ids, t, sh)
                        do = _element(lo, dst_ids, t, dh)
                        d_buf[do:do + es] = s_buf[so:so + es]
    return out


def assert_destination(cluster: Cluster, transfers: Sequence[tuple[Sequence[int], Sequence[int],
                       int, int]], ranks: Sequence[int] | None = None) -> None:
    """Every consumer rank's whole memory equals the reference after ``transfers``."""
    topo = cluster.topology
    producers = topo.producer_ranks()
    src = [cluster.source_memory(p.rank) for p in producers]
    for c in topo.consumer_ranks():
        if ranks is not None and c.rank not in ranks:
            continue
        want = reference_destination(producers, src, c, transfers)
        got = cluster.destination_memory(c.rank)
        for i, (w, g) in enumerate(zip(want, got, strict=True)):
            if not np.array_equal(w, g):
                bad = np.flatnonzero(w != g)
                raise AssertionError(
                    f"consumer rank {c.rank} region {i}: {bad.size} bytes differ, "
                    f"first at offset {int(bad[0])}"
                )


def _ranks(topo: Topology) -> tuple[list[int], list[int]]:
    return [p.rank for p in topo.producer_ranks()], [c.rank for c in topo.consumer_ranks()]


def _settled(snap: Snapshot, topo: Topology, tids: Sequence[str], want: str) -> bool:
    _, cranks = _ranks(topo)
    return all(snap.outcome(r, t) == want for r in cranks for t in tids)


def registered(topo: Topology, tid: str, incarnation: int = 0) -> Callable[[Snapshot], bool]:
    """The registration of ``tid`` has reached the producer engine: each consumer
    rank's has been taken in by a producer rank, and each producer rank has taken
    one in (a ``Register``, or a ``Skip`` when it writes nothing)."""
    pranks, cranks = _ranks(topo)

    def holds(s: Snapshot) -> bool:
        pairs = {(p, c) for p, got in s.registrations.items()
                 for t, inc, c in got if (t, inc) == (tid, incarnation)}
        return (all(any((p, c) in pairs for p in pranks) for c in cranks)
                and all(any((p, c) in pairs for c in cranks) for p in pranks))

    return holds


def source_held(topo: Topology, tid: str, incarnation: int = 0) -> Callable[[Snapshot], bool]:
    """Every producer rank has taken the end of ``tid``'s prefill in: it holds the source."""
    pranks, _ = _ranks(topo)
    # A key is (transfer id, incarnation), or the bare id from an endpoint that keys
    # its held sources by id alone.
    return lambda s: all(any(k in ((tid, incarnation), tid) for k in s.held.get(p, ()))
                         for p in pranks)


def _await(c: Cluster, predicate: Callable[[Snapshot], bool], what: str,
           timeout_s: float = 20.0) -> Snapshot:
    """Wait until ``predicate`` holds; AssertionError naming ``what`` if it never does."""
    snap = c.wait(predicate, timeout_s)
    assert predicate(snap), f"{what} within {timeout_s} s: {snap}"
    return snap


def assert_clean(cluster: Cluster, timeout_s: float = 10.0) -> Snapshot:
    """No lent destination blocks, no held source blocks, no violation, once idle."""
    snap = cluster.wait(lambda s: not any(s.lent.values()) and not any(s.held.values()),
                        timeout_s)
    assert not snap.violations, snap.violations
    assert not any(snap.lent.values()), f"destination blocks still lent: {snap.lent}"
    assert not any(snap.held.values()), f"source blocks still held: {snap.held}"
    for key, n in snap.src_released.items():
        assert n == 1, f"source of {key} released {n} times"
    return snap
