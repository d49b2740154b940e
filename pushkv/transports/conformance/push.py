"""The push checks (the producer writes): every transport runs :data:`CHECKS` and
:data:`REUSED_ID_CHECKS`, each over the cluster a :data:`~.cluster.MakeCluster` builds;
:func:`run_conformance` runs them all."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ...protocol import Cancel, Register, encode
from .cluster import (
    MakeCluster,
    Snapshot,
    Topology,
    _await,
    _ranks,
    _settled,
    assert_clean,
    assert_destination,
    registered,
    source_held,
)


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
