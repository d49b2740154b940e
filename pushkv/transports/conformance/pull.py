"""The pull checks (the consumer reads): a transport that can pull opts in with
:data:`PULL_CHECKS`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ...protocol import ProducerConfig, ReadDone, encode
from .cluster import (
    MakeCluster,
    Snapshot,
    Topology,
    _await,
    _ranks,
    _settled,
    assert_clean,
    assert_destination,
)
from .push import TOPOLOGIES

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
