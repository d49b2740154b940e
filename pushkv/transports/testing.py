"""A conformance suite every pushkv transport runs against itself.

A transport provides a :class:`Cluster` -- one producer engine and one
consumer engine of a given :class:`Topology`, with source memory filled with
seeded random bytes and destination memory zeroed -- and calls
:func:`run_conformance` (or each ``check_*`` on its own, e.g. one pytest test
per check). Every check drives real transfers and compares the **bytes** that
landed against a per-token reference computed here, independently of the
planner: the whole destination memory must equal the reference, so a byte
written anywhere it should not be fails the check too.

The in-memory transport runs these in simulated time; a real transport runs
them in wall-clock time across processes, so every wait has a timeout and
configurations keep deadlines short. Where a check needs one event to happen
before another (the registration before the prefill's end, or after it), it
waits until the cluster shows the first one -- the producer took the
registration in (:attr:`Snapshot.registrations`), holds the source
(:attr:`Snapshot.held`) -- never for a fixed time, so the order tested holds
on any transport at any speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..protocol import (
    Cancel,
    ConsumerConfig,
    EngineSpec,
    ProducerConfig,
    RankInfo,
    ReadDone,
    Register,
    encode,
    uniform_ranks,
)
from ..protocol.layout import KVLayout


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


# --------------------------------------------------------------------- checks


def check_either_order(make: MakeCluster, topo: Topology | None = None) -> None:
    """Registration first or prefill first: the same bytes land, both complete."""
    topo = topo or Topology()
    c = make(topo)
    try:
        c.register("reg-first", [4, 9, 2], 40)
        _await(c, registered(topo, "reg-first"), "the producer took the registration in")
        c.prefill_finished("reg-first", [20, 3, 7], 40)
        c.prefill_finished("kv-first", [30, 31, 32], 40)
        _await(c, source_held(topo, "kv-first"), "the producer holds the source")
        c.register("kv-first", [10, 11, 12], 40)
        snap = c.wait(lambda s: _settled(s, topo, ["reg-first", "kv-first"], "ready"), 20)
        assert _settled(snap, topo, ["reg-first", "kv-first"], "ready"), snap.outcomes
        assert_destination(c, [([20, 3, 7], [4, 9, 2], 40, 0), ([30, 31, 32], [10, 11, 12], 40, 0)])
        assert_clean(c)
    finally:
        c.close()


def check_reissue(make: MakeCluster, topo: Topology | None = None) -> None:
    """Preempted before prefill, reissued into new blocks: attempt 1 lands there only."""
    topo = topo or Topology()
    c = make(topo)
    _, cranks = _ranks(topo)
    try:
        c.register("t", [1, 2, 3], 33)
        _await(c, registered(topo, "t"), "the producer took the registration in")
        c.preempt("t")
        snap = c.wait(lambda s: not any(s.lent.values()), 20)
        assert not any(snap.lent.values()), "preempted blocks never released"
        c.reissue("t", [5, 6, 7])
        c.prefill_finished("t", [40, 41, 42], 33)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        for r in cranks:
            assert snap.outcomes.get((r, "t")) == [("ready", 1)], snap.outcomes
        assert_destination(c, [([40, 41, 42], [5, 6, 7], 33, 0)])
        assert_clean(c)
    finally:
        c.close()


def check_reissue_after_kv(make: MakeCluster, topo: Topology | None = None) -> None:
    """Prefill done, then preempt and reissue: the source is kept for attempt 1."""
    topo = topo or Topology()
    c = make(topo)
    try:
        c.prefill_finished("t", [40, 41, 42], 33)
        _await(c, source_held(topo, "t"), "the producer holds the source")
        c.register("t", [1, 2, 3], 33)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready")
        # a second transfer preempted before its write, reissued elsewhere
        c.register("u", [10, 11, 12], 33)
        c.preempt("u")
        c.wait(lambda s: not any(s.lent.values()), 20)
        c.prefill_finished("u", [50, 51, 52], 33)
        _await(c, source_held(topo, "u"), "the producer holds the source")
        c.reissue("u", [20, 21, 22])
        snap = c.wait(lambda s: _settled(s, topo, ["u"], "ready"), 20)
        assert _settled(snap, topo, ["u"], "ready"), snap.outcomes
        assert_destination(c, [([40, 41, 42], [1, 2, 3], 33, 0),
                               ([50, 51, 52], [20, 21, 22], 33, 0)])
        assert_clean(c)
    finally:
        c.close()


def check_cancel(make: MakeCluster, topo: Topology | None = None) -> None:
    """A consumer abort fences and cancels; no byte lands; the source is released."""
    topo = topo or Topology()
    c = make(topo)
    try:
        c.register("t", [1, 2, 3], 40)
        _await(c, registered(topo, "t"), "the producer took the registration in")
        c.abort("t")
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "cancelled"), 20)
        assert _settled(snap, topo, ["t"], "cancelled"), snap.outcomes
        c.prefill_finished("t", [7, 8, 9], 40)
        assert_destination(c, [])
        assert_clean(c)
    finally:
        c.close()


def check_prefill_aborted(make: MakeCluster, topo: Topology | None = None) -> None:
    """The producer aborts before prefill finished: the consumer fails, fenced."""
    topo = topo or Topology()
    c = make(topo)
    try:
        c.register("t", [1, 2, 3], 40)
        _await(c, registered(topo, "t"), "the producer took the registration in")
        c.prefill_aborted("t")
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "failed"), 20)
        assert _settled(snap, topo, ["t"], "failed"), snap.outcomes
        assert_destination(c, [])
        assert_clean(c)
    finally:
        c.close()


def check_transfer(make: MakeCluster, topo: Topology, *, num_tokens: int = 100,
                   fragmented: bool = True, first_token: int = 0) -> None:
    """One transfer between arbitrary layouts; bytes checked on every consumer rank."""
    c = make(topo)
    rng = np.random.default_rng(topo.seed)
    try:
        pl, cl = topo.producer_ranks()[0].layout, topo.consumer_ranks()[0].layout
        n_src = -(-num_tokens // pl.block_size)
        n_dst = -(-num_tokens // cl.block_size)
        if fragmented:
            src = rng.permutation(pl.num_blocks)[:n_src].tolist()
            dst = rng.permutation(cl.num_blocks)[:n_dst].tolist()
        else:
            src, dst = list(range(n_src)), list(range(1, n_dst + 1))
        c.register("t", dst, num_tokens, first_token)
        c.prefill_finished("t", src, num_tokens)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 60)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        assert_destination(c, [(src, dst, num_tokens, first_token)])
        assert_clean(c)
    finally:
        c.close()


def check_producer_killed(make: MakeCluster, topo: Topology | None = None) -> None:
    """The producer dies with a registration pending: the consumer fails within its
    window + grace (or sooner, when the transport detects the death), nothing hangs."""
    topo = topo or Topology()
    c = make(topo)
    cfg = topo.consumer_config
    try:
        c.register("t", [1, 2, 3], 40)
        _await(c, registered(topo, "t"), "the producer took the registration in")
        c.kill_producer()
        limit = cfg.window_s + cfg.fence_grace_s + 5.0
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "failed")
                      and not any(s.lent.values()), limit)
        assert _settled(snap, topo, ["t"], "failed"), snap.outcomes
        assert not any(snap.lent.values()), snap.lent
        assert not snap.violations, snap.violations
    finally:
        c.close()


def check_out_of_range_registration(make: MakeCluster, topo: Topology | None = None) -> None:
    """A registration naming blocks outside the consumer's memory is rejected before
    any byte moves, and changes nothing."""
    topo = topo or Topology()
    c = make(topo)
    prod, cons = topo.producer_ranks(), topo.consumer_ranks()
    try:
        lo = cons[0].layout
        for p in prod:
            bad = Register(transfer_id="evil", attempt=0, engine_id=cons[0].engine_id,
                           rank=cons[0].rank, producer_engine_id=p.engine_id,
                           block_ids=(lo.num_blocks, lo.num_blocks + 5), num_tokens=20)
            c.inject("producer", p.rank, "control", encode(bad))
        before = sum(c.snapshot().rejected.values())
        snap = c.wait(lambda s: sum(s.rejected.values()) >= before + len(prod)
                      or sum(s.rejected.values()) >= len(prod), 10)
        assert sum(snap.rejected.values()) >= len(prod), snap.rejected
        c.prefill_finished("evil", [1, 2], 20)  # KV ready: still nothing may move
        snap = _await(c, source_held(topo, "evil"), "the producer holds the source")
        assert not any(snap.writes.values()), f"a write started: {snap.writes}"
        assert_destination(c, [])
        c.prefill_aborted("evil")  # frees the source without waiting for its lease
        assert_clean(c)
    finally:
        c.close()


def check_garbage(make: MakeCluster, topo: Topology | None = None) -> None:
    """Garbage on every channel is rejected and counted; transfers still work after."""
    topo = topo or Topology()
    c = make(topo)
    prod, cons = topo.producer_ranks(), topo.consumer_ranks()
    rng = np.random.default_rng(topo.seed + 1)
    frames = [b"", b"PK", b"PK\x01", b"PK\x09\x90", b"\x00" * 64, rng.bytes(300),
              b"PK\x01" + rng.bytes(40),
              encode(Cancel(transfer_id="x", attempt=0, engine_id="nobody", rank=0))]
    try:
        for f in frames:
            for p in prod:
                c.inject("producer", p.rank, "control", f)
            for r in cons:
                c.inject("consumer", r.rank, "control", f)
                c.inject("consumer", r.rank, "notify", f)
        want = len(frames) * (len(prod) + 2 * len(cons))
        snap = c.wait(lambda s: sum(s.rejected.values()) >= want, 20)
        assert sum(snap.rejected.values()) >= want, snap.rejected
        c.register("t", [4, 5, 6], 40)
        c.prefill_finished("t", [7, 8, 9], 40)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        assert_destination(c, [([7, 8, 9], [4, 5, 6], 40, 0)])
        assert_clean(c)
    finally:
        c.close()


def check_reused_id(make: MakeCluster, topo: Topology | None = None) -> None:
    """A transfer id used again at once is a new transfer (a new incarnation):
    an old use's held source is never written into the new one, a new use
    registered right after the old one's READY completes with its own bytes,
    and a use cancelled before its prefill does not touch the next."""
    topo = topo or Topology()
    c = make(topo)
    _, cranks = _ranks(topo)

    def uses(n: int) -> Callable[[Snapshot], bool]:
        return lambda s: all(len(s.outcomes.get((r, "t"), [])) >= n for r in cranks)

    try:
        c.prefill_finished("t", [30, 31, 32], 40, incarnation=101)  # nobody registers it
        _await(c, source_held(topo, "t", 101), "the producer holds the source")
        c.register("t", [1, 2, 3], 40, incarnation=102)
        c.prefill_finished("t", [7, 8, 9], 40, incarnation=102)
        snap = c.wait(uses(1), 20)
        assert snap.all_outcomes("t", cranks) == {"ready"}, snap.outcomes
        c.register("t", [4, 5, 6], 40, incarnation=103)  # at once, same id
        c.prefill_finished("t", [10, 11, 12], 40, incarnation=103)
        snap = c.wait(uses(2), 20)
        assert snap.all_outcomes("t", cranks) == {"ready"}, snap.outcomes
        c.register("t", [13, 14, 15], 40, incarnation=104)
        _await(c, registered(topo, "t", 104), "the producer took the registration in")
        c.abort("t")
        snap = c.wait(uses(3), 20)
        assert snap.all_outcomes("t", cranks) == {"cancelled"}, snap.outcomes
        c.register("t", [16, 17, 18], 40, incarnation=105)
        c.prefill_finished("t", [19, 20, 21], 40, incarnation=105)
        snap = c.wait(uses(4), 20)
        assert snap.all_outcomes("t", cranks) == {"ready"}, snap.outcomes
        c.prefill_finished("t", [22, 23, 24], 40, incarnation=104)  # the cancelled use's
        assert_destination(c, [([7, 8, 9], [1, 2, 3], 40, 0), ([10, 11, 12], [4, 5, 6], 40, 0),
                               ([19, 20, 21], [16, 17, 18], 40, 0)])
        snap = c.wait(lambda s: not any(s.lent.values()) and not any(s.held.values()), 20)
        assert not snap.violations, snap.violations
        assert not any(snap.lent.values()) and not any(snap.held.values()), snap
        # Five prefills of "t" on every producer rank, each released once.
        assert all(n == 5 for n in snap.src_released.values()), snap.src_released
    finally:
        c.close()


#: Checks that need the cluster to pass incarnations (``register`` and
#: ``prefill_finished`` take ``incarnation=``); a transport opts in.
REUSED_ID_CHECKS: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    "reused_id": (check_reused_id, {}),
    "reused_id_tp2-1": (check_reused_id, {"topo": Topology(
        producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2})}),
    "reused_id_replicated": (check_reused_id, {"topo": Topology(
        producer={"tp": 2, "num_kv_heads": 1}, consumer={"num_kv_heads": 1})}),
}


#: Topologies every transport must handle (name -> topology).
TOPOLOGIES: dict[str, Topology] = {
    "tp1-1": Topology(),
    "tp2-1": Topology(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2}),
    "tp1-2": Topology(producer={"num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2}),
    "bs16-32": Topology(consumer={"block_size": 32}),
    "bs32-16": Topology(producer={"block_size": 32}),
    "nhd-hnd": Topology(producer={"num_kv_heads": 2, "order": "NHD"},
                        consumer={"num_kv_heads": 2, "order": "HND"}),
    "opaque-blocks": Topology(producer={"num_kv_heads": 2, "order": "BLOCK"},
                              consumer={"num_kv_heads": 2, "order": "BLOCK"}),
}

#: Every check, by name, as (function, keyword arguments).
CHECKS: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    "either_order": (check_either_order, {}),
    "reissue": (check_reissue, {}),
    "reissue_after_kv": (check_reissue_after_kv, {}),
    "cancel": (check_cancel, {}),
    "prefill_aborted": (check_prefill_aborted, {}),
    "producer_killed": (check_producer_killed, {}),
    "out_of_range_registration": (check_out_of_range_registration, {}),
    "garbage": (check_garbage, {}),
    **{
        f"transfer_{name}": (check_transfer, {"topo": topo})
        for name, topo in TOPOLOGIES.items()
    },
    "transfer_16k_fragmented": (
        check_transfer,
        {"topo": Topology(producer={"num_blocks": 1100}, consumer={"num_blocks": 1100}),
         "num_tokens": 16384},
    ),
    "transfer_partial_prefix": (check_transfer, {"topo": Topology(), "num_tokens": 90,
                                                 "first_token": 37}),
}


# ----------------------------------------------------------------- pull checks
#
# A pull cluster also has ``publish(tid, src, n, *, incarnation=0)`` (prefill
# finished, blocks published) and ``start_pull(tid, dst, n, first_token=0, *,
# incarnation=0, src_block_ids=None, lease_s=None)``, which waits for the
# publication, as a sequential router does, then has every consumer rank read
# (``lease_s``: how long the source is known held, as the router relays it).


def check_pull_transfer(make: MakeCluster, topo: Topology, *, num_tokens: int = 100,
                        first_token: int = 0) -> None:
    """Pull: the consumer reads the published blocks; bytes checked on every
    consumer rank; the producer releases its source on the readers' ReadDone."""
    c: Any = make(topo)
    rng = np.random.default_rng(topo.seed)
    try:
        pl, cl = topo.producer_ranks()[0].layout, topo.consumer_ranks()[0].layout
        src = rng.permutation(pl.num_blocks)[:-(-num_tokens // pl.block_size)].tolist()
        dst = rng.permutation(cl.num_blocks)[:-(-num_tokens // cl.block_size)].tolist()
        c.publish("t", src, num_tokens)
        c.start_pull("t", dst, num_tokens, first_token)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 60)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        assert_destination(c, [(src, dst, num_tokens, first_token)])
        assert_clean(c, timeout_s=4.0)  # well before the lease: released by ReadDone
    finally:
        c.close()


def check_pull_producer_killed(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: the producer dies after publishing: the reads fail or the peer is
    confirmed dead; the consumer fails, its blocks come back, nothing hangs."""
    topo = topo or Topology()
    c: Any = make(topo)
    cfg = topo.consumer_config
    _, cranks = _ranks(topo)

    def pulling(s: Snapshot) -> bool:  # every consumer rank took the pull in ("t" alone runs)
        return all(s.outcome(r, "t") is not None or bool(s.lent.get(r)) for r in cranks)

    try:
        c.publish("t", [1, 2, 3], 40)
        c.start_pull("t", [4, 5, 6], 40)  # waits for the publication
        _await(c, pulling, "the consumer took the pull in")
        c.kill_producer()
        c.start_pull("u", [7, 8, 9], 40, src_block_ids=[1, 2, 3])
        limit = cfg.window_s + cfg.fence_grace_s + 5.0
        snap = c.wait(lambda s: s.outcome(0, "u") is not None and not any(s.lent.values()),
                      limit)
        for r in cranks:
            assert snap.outcome(r, "u") == "failed", snap.outcomes
            assert snap.outcome(r, "t") in ("ready", "failed"), snap.outcomes
        assert not any(snap.lent.values()), snap.lent
    finally:
        c.close()


def check_pull_cancel(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: an abort racing the reads ends the transfer (cancelled, or ready if the
    reads won); the destination is released once no read can land, and the
    producer's source at once (a final cancel, or the read report), not at the end
    of its lease (which outlasts the test)."""
    topo = topo or Topology(producer_config=ProducerConfig(lease_s=600.0))
    c: Any = make(topo)
    try:
        c.publish("t", [7, 8, 9], 40)
        c.start_pull("t", [1, 2, 3], 40)
        c.abort("t")
        snap = c.wait(lambda s: all(s.outcome(r, "t") is not None for r in _ranks(topo)[1])
                      and not any(s.lent.values()), 20)
        assert snap.all_outcomes("t", _ranks(topo)[1]) <= {"cancelled", "ready"}, snap.outcomes
        assert not any(snap.lent.values()), snap.lent
        assert not [v for v in snap.violations if "abort" not in v], snap.violations
        snap = c.wait(lambda s: not any(s.held.values()), 20)
        assert not any(snap.held.values()), snap.held
    finally:
        c.close()


def check_pull_bad_source(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: source block ids outside the producer's memory (a router relays them:
    untrusted) are refused before any read; nothing is lent, nothing lands; a
    forged ReadDone is rejected and releases nothing; a good pull still works."""
    topo = topo or Topology()
    c: Any = make(topo)
    prod, cons = topo.producer_ranks(), topo.consumer_ranks()
    try:
        n = prod[0].layout.num_blocks
        c.publish("t", [1, 2, 3], 40)
        c.start_pull("evil", [4, 5, 6], 40, src_block_ids=[n, n + 1, n + 2])
        snap = c.wait(lambda s: len(s.violations) >= len(cons), 10)
        assert len(snap.violations) == len(cons), snap.violations
        assert all("start_pull" in v for v in snap.violations), snap.violations
        assert not any(snap.lent.values()), snap.lent
        for p in prod:  # a ReadDone from a rank that never handshook
            forged = ReadDone(transfer_id="t", attempt=0, engine_id="nobody", rank=0,
                              producer_engine_id=p.engine_id)
            c.inject("producer", p.rank, "control", encode(forged))
        snap = c.wait(lambda s: sum(s.rejected.values()) >= len(prod), 10)
        assert sum(snap.rejected.values()) >= len(prod), snap.rejected
        assert all(snap.held.values()), "a forged ReadDone released the source"
        c.start_pull("t", [10, 11, 12], 40)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        assert_destination(c, [([1, 2, 3], [10, 11, 12], 40, 0)])
        snap = c.wait(lambda s: not any(s.held.values()), 10)
        assert not any(snap.held.values()), snap.held
    finally:
        c.close()


def check_pull_garbage(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: garbage on the control channels is rejected; a pull works after it."""
    topo = topo or Topology()
    c: Any = make(topo)
    prod, cons = topo.producer_ranks(), topo.consumer_ranks()
    frames = [b"", b"PK\x01", b"\x00" * 64, np.random.default_rng(1).bytes(200)]
    try:
        for f in frames:
            for p in prod:
                c.inject("producer", p.rank, "control", f)
            for r in cons:
                c.inject("consumer", r.rank, "control", f)
        want = len(frames) * (len(prod) + len(cons))
        snap = c.wait(lambda s: sum(s.rejected.values()) >= want, 20)
        assert sum(snap.rejected.values()) >= want, snap.rejected
        c.publish("t", [7, 8, 9], 40)
        c.start_pull("t", [4, 5, 6], 40)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        assert_destination(c, [([7, 8, 9], [4, 5, 6], 40, 0)])
        assert_clean(c)
    finally:
        c.close()


def check_pull_reused_id(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: the same id published twice under two incarnations: each read gets
    its own bytes, each source is released once."""
    topo = topo or Topology()
    c: Any = make(topo)
    _, cranks = _ranks(topo)
    try:
        c.publish("t", [30, 31, 32], 40, incarnation=7)
        c.publish("t", [7, 8, 9], 40, incarnation=8)
        c.start_pull("t", [1, 2, 3], 40, incarnation=8)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        c.start_pull("t", [4, 5, 6], 40, incarnation=7)
        snap = c.wait(lambda s: all(len(s.outcomes.get((r, "t"), [])) >= 2 for r in cranks),
                      20)
        assert snap.all_outcomes("t", cranks) == {"ready"}, snap.outcomes
        assert_destination(c, [([7, 8, 9], [1, 2, 3], 40, 0), ([30, 31, 32], [4, 5, 6], 40, 0)])
        snap = c.wait(lambda s: not any(s.lent.values()) and not any(s.held.values()), 10)
        assert not snap.violations, snap.violations
        assert not any(snap.lent.values()) and not any(snap.held.values()), snap
        # Two uses of "t" on every producer rank, each released once.
        assert all(n == 2 for n in snap.src_released.values()), snap.src_released
    finally:
        c.close()


def check_pull_lease(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: published and never read: the source is released when its lease ends."""
    topo = topo or Topology()
    c: Any = make(topo)
    try:
        c.publish("t", [7, 8, 9], 40)
        snap = c.wait(lambda s: any(s.held.values()), 10)
        assert any(snap.held.values()), snap.held
        limit = topo.producer_config.lease_s + 10
        snap = c.wait(lambda s: not any(s.held.values()), limit)
        assert not any(snap.held.values()), snap.held
        assert all(n == 1 for n in snap.src_released.values()), snap.src_released
    finally:
        c.close()


def check_pull_past_the_lease(make: MakeCluster, topo: Topology | None = None) -> None:
    """Pull: the decode side is told the source's lease has ended before it reads
    (``lease_s`` 0): it reads nothing, fails the transfer (LEASE_EXPIRED) and tells
    the producer, which releases the source at once; no block stays lent."""
    topo = topo or Topology()
    c: Any = make(topo)
    try:
        c.publish("t", [7, 8, 9], 40)
        c.start_pull("t", [4, 5, 6], 40, lease_s=0.0)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "failed"), 30)
        assert _settled(snap, topo, ["t"], "failed"), snap.outcomes
        assert_clean(c, timeout_s=topo.producer_config.lease_s / 2)  # not its lease end
    finally:
        c.close()


#: Checks of pull (the consumer reads): a transport that can pull opts in.
PULL_CHECKS: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    **{
        f"pull_transfer_{name}": (check_pull_transfer, {"topo": topo})
        for name, topo in TOPOLOGIES.items()
    },
    "pull_transfer_16k_fragmented": (
        check_pull_transfer,
        {"topo": Topology(producer={"num_blocks": 1100}, consumer={"num_blocks": 1100}),
         "num_tokens": 16384},
    ),
    "pull_transfer_partial_prefix": (check_pull_transfer, {"topo": Topology(),
                                                           "num_tokens": 90,
                                                           "first_token": 37}),
    "pull_producer_killed": (check_pull_producer_killed, {}),
    "pull_cancel": (check_pull_cancel, {}),
    "pull_bad_source": (check_pull_bad_source, {}),
    "pull_garbage": (check_pull_garbage, {}),
    "pull_reused_id": (check_pull_reused_id, {}),
    "pull_reused_id_tp2-1": (check_pull_reused_id, {"topo": TOPOLOGIES["tp2-1"]}),
    "pull_lease": (check_pull_lease, {}),
    "pull_past_the_lease": (check_pull_past_the_lease, {}),
}


def run_conformance(make: MakeCluster, only: Sequence[str] | None = None) -> dict[str, float]:
    """Run every check (or ``only`` those); return seconds per check. Raises on failure."""
    times: dict[str, float] = {}
    for name, (fn, kwargs) in CHECKS.items():
        if only is not None and name not in only:
            continue
        t0 = time.perf_counter()
        fn(make, **kwargs)
        times[name] = time.perf_counter() - t0
    return times
