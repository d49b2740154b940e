"""Rule 11 over NIXL across processes (host memory, UCX): the producer process
seals each write's notification with the digest of its source bytes, the
consumer process checks the landed bytes; each injected fault fails exactly its
transfer with CORRUPT, the rest are READY with exact bytes."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.integrity import KINDS
from pushkv.protocol import PackingConfig
from pushkv.transports.conformance import Topology, assert_destination, reference_destination
from pushkv.transports.nixl import NixlConfig
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl


def _transfers(n, tokens=40):
    rng = np.random.default_rng(5)
    return [(f"t{i}", rng.permutation(64)[:3].tolist(), list(range(3 * i, 3 * i + 3)), tokens)
            for i in range(n)]


def _ready_exact(c, transfers, ready):
    """The blocks of the READY transfers hold exactly the source's bytes (those of
    the failed ones hold whatever landed, corrupted)."""
    topo = c.topology
    prods = topo.producer_ranks()
    (info,) = topo.consumer_ranks()
    want = reference_destination(prods, [c.source_memory(p.rank) for p in prods], info,
                                 [(s, d, n, 0) for _, s, d, n in transfers])
    got = c.destination_memory(0)
    bb = info.layout.block_bytes
    for _, _, dst, _ in ready:
        for w, g in zip(want, got, strict=True):
            for b in dst:
                assert np.array_equal(w[b * bb:(b + 1) * bb], g[b * bb:(b + 1) * bb])


def _raw(c, role):
    """The host's own snapshot: per-rank runtime stats and fail codes."""
    return c.host_call(role, "snapshot", 0.0)


def _run(c, transfers):
    for tid, src, dst, n in transfers:
        c.register(tid, dst, n)
        c.prefill_finished(tid, src, n)
    ranks = list(range(len(c.topology.consumer_ranks())))
    return c.wait(lambda s: all(s.outcomes.get((r, t[0])) for r in ranks for t in transfers)
                  and not any(s.lent.values()) and not any(s.held.values()), 60.0)


@pytest.mark.parametrize("packing", [None, PackingConfig(mode="always", staging_bytes=1 << 20)],
                         ids=["direct", "packed"])
def test_every_fault_is_caught_across_processes(pool: HostPool, packing) -> None:
    """One write in two corrupted on landing, cycling through every kind of fault."""
    topo = Topology(producer=dict(num_kv_heads=2), consumer=dict(num_kv_heads=2))
    c = NixlCluster(topo, pool, NixlConfig(integrity="on"), packing=packing,
                    consumer_nixl=NixlConfig(integrity="on", inject=",".join(KINDS) + ":2"))
    try:
        transfers = _transfers(8)
        snap = _run(c, transfers)
        raw = _raw(c, "consumer")
        failed = [t for t in transfers if snap.outcomes[(0, t[0])] == [("failed", 0)]]
        ready = [t for t in transfers if snap.outcomes[(0, t[0])] == [("ready", 0)]]
        # which four depends on the order the notifications arrive in
        assert len(failed) == len(ready) == 4, snap.outcomes
        assert all(raw["fail_codes"][(0, t[0])] == ["CORRUPT"] for t in failed)
        stats = raw["stats"][0]
        assert stats["integrity_injected"] == stats["integrity_corrupt"] == 4
        assert stats["integrity_checked"] == 8 and stats.get("served_from_corrupt", 0) == 0
        _ready_exact(c, transfers, ready)
    finally:
        c.close()


def test_heterogeneous_tp_and_block_sizes_verify_across_processes(pool: HostPool) -> None:
    """P TP2 (block 32, NHD) -> D TP1 (block 16, HND): two writers per consumer rank,
    each write's digest taken over the producer's layout and checked over the
    consumer's; every transfer READY, every check passed."""
    topo = Topology(producer=dict(tp=2, num_kv_heads=2, block_size=32),
                    consumer=dict(num_kv_heads=2, order="HND"))
    c = NixlCluster(topo, pool, NixlConfig(integrity="on"))
    try:
        transfers = [(f"h{i}", [9 + i, 3], [5 + 3 * i, 6 + 3 * i, 7 + 3 * i], 40)
                     for i in range(3)]
        snap = _run(c, transfers)
        assert all(snap.outcomes[(0, t[0])] == [("ready", 0)] for t in transfers)
        stats = _raw(c, "consumer")["stats"][0]
        assert stats["integrity_checked"] == stats["integrity_passed"] == 6
        assert_destination(c, [(s, d, n, 0) for _, s, d, n in transfers])
    finally:
        c.close()


def test_off_sends_no_digest_and_the_injector_shows_what_is_served(pool: HostPool) -> None:
    topo = Topology()
    c = NixlCluster(topo, pool, NixlConfig(), consumer_nixl=NixlConfig(inject="flip:1"))
    try:
        transfers = _transfers(2)
        snap = _run(c, transfers)
        assert all(snap.outcomes[(0, t[0])] == [("ready", 0)] for t in transfers)
        stats = _raw(c, "consumer")["stats"][0]
        assert stats["integrity_injected"] == stats["served_from_corrupt"] == 2
        assert stats.get("integrity_checked", 0) == 0
        assert _raw(c, "producer")["stats"][0].get("sealed", 0) == 0
    finally:
        c.close()


# ------------------------------------------------------------------------ pull


def _pull(c, transfers, **kw):
    """Pull each transfer: prefill finishes in pull mode, the relay hands every
    consumer rank the published block ids with each producer rank's seal."""
    for tid, src, _, n in transfers:
        c.publish(tid, src, n)
    for tid, _, dst, n in transfers:
        c.start_pull(tid, dst, n, **kw)
    ranks = list(range(len(c.topology.consumer_ranks())))
    return c.wait(lambda s: all(s.outcomes.get((r, t[0])) for r in ranks for t in transfers)
                  and not any(s.lent.values()) and not any(s.held.values()), 60.0)


def test_pull_faults_are_caught_across_processes(pool: HostPool) -> None:
    """P TP2 -> D TP1: every consumer rank reads from two producer ranks, each
    read's landed bytes checked against its producer rank's published digests;
    one read in four corrupted (every kind in turn) fails its pull with CORRUPT,
    the others are READY with exact bytes."""
    topo = Topology(producer=dict(tp=2, num_kv_heads=2, block_size=32),
                    consumer=dict(num_kv_heads=2, order="HND"))
    c = NixlCluster(topo, pool, NixlConfig(integrity="on"),
                    consumer_nixl=NixlConfig(integrity="on", inject=",".join(KINDS) + ":4"))
    try:
        transfers = [(f"p{i}", [9 + i, 3], [5 + 3 * i, 6 + 3 * i, 7 + 3 * i], 40)
                     for i in range(8)]
        snap = _pull(c, transfers)
        raw = _raw(c, "consumer")
        stats = raw["stats"][0]
        failed = [t for t in transfers if snap.outcomes[(0, t[0])] == [("failed", 0)]]
        ready = [t for t in transfers if snap.outcomes[(0, t[0])] == [("ready", 0)]]
        assert len(failed) + len(ready) == 8 and failed and ready, snap.outcomes
        assert all(raw["fail_codes"][(0, t[0])] == ["CORRUPT"] for t in failed)
        assert stats["integrity_injected"] == stats["integrity_corrupt"] == 4  # each kind once
        assert stats["integrity_checked"] == 16 and stats.get("served_from_corrupt", 0) == 0
        assert _raw(c, "producer")["stats"][0]["sealed"] == 8
        _ready_exact(c, transfers, ready)
    finally:
        c.close()


def test_clean_pulls_verify_and_bad_seals_are_refused(pool: HostPool) -> None:
    """Clean sealed pulls are READY with every read checked; a pull relayed a torn
    seal or none for a rank is refused (CallFailed), leaving nothing lent."""
    topo = Topology(producer=dict(num_kv_heads=2), consumer=dict(tp=2, num_kv_heads=2,
                                                                  block_size=8))
    c = NixlCluster(topo, pool, NixlConfig(integrity="on"))
    try:
        transfers = [(f"c{i}", [9 + i, 3, 17], list(range(6 * i, 6 * i + 6)), 40)
                     for i in range(2)]
        snap = _pull(c, transfers)
        assert all(snap.outcomes[(r, t[0])] == [("ready", 0)] for r in (0, 1) for t in transfers)
        raw = _raw(c, "consumer")
        assert all(raw["stats"][r]["integrity_checked"] == raw["stats"][r]["integrity_passed"]
                   == 2 for r in (0, 1))
        assert_destination(c, [(s, d, n, 0) for _, s, d, n in transfers])
        c.publish("bad", [20, 21, 22], 40)
        end = time.monotonic() + 30.0  # the publication is asynchronous: wait for it
        # (a snapshot with a wait blocks on the producer runtime's next event)
        while (seal := c.host_call("producer", "snapshot", 0.05)["seals"].get(
                (0, "bad", 0))) is None:
            assert time.monotonic() < end, "never published"
        c.start_pull("bad", [30, 31, 32, 33, 34, 35], 40, seals={0: seal[:-3]})
        c.start_pull("bad", [30, 31, 32, 33, 34, 35], 40, seals={1: seal})
        snap = c.wait(lambda s: len(s.violations) >= 4, 30.0)
        assert len(snap.violations) == 4 and all(
            "start_pull" in e and "seal" in e for e in snap.violations), snap.violations
        assert not any(s for s in snap.lent.values()) and not snap.outcomes.get((0, "bad"))
    finally:
        c.close()


def test_pulls_of_part_of_a_source_are_checked_against_the_producers_answer(
        pool: HostPool) -> None:
    """A pull of the remainder after a cached prefix (tokens [16, 40) of 40): each
    read is checked against the digests its producer rank gives, over the side
    channel, for exactly that part; injected faults fail CORRUPT, the rest are
    READY with exact bytes, and nothing is served unchecked."""
    topo = Topology(producer=dict(num_kv_heads=2), consumer=dict(num_kv_heads=2, order="HND"))
    c = NixlCluster(topo, pool, NixlConfig(integrity="on"),
                    consumer_nixl=NixlConfig(integrity="on", inject="flip,zero:3"))
    try:
        transfers = [(f"q{i}", [9 + i, 3, 30 + i], [5 + 3 * i, 6 + 3 * i, 7 + 3 * i], 40)
                     for i in range(6)]
        snap = _pull(c, transfers, first_token=16)
        stats = _raw(c, "consumer")["stats"][0]
        failed = [t for t in transfers if snap.outcomes[(0, t[0])] == [("failed", 0)]]
        ready = [t for t in transfers if snap.outcomes[(0, t[0])] == [("ready", 0)]]
        assert len(failed) == 2 and len(ready) == 4, snap.outcomes
        assert stats["integrity_injected"] == stats["integrity_corrupt"] == 2
        assert stats["integrity_checked"] == 6 and not stats.get("integrity_unchecked")
        assert stats.get("served_from_corrupt", 0) == 0
        assert _raw(c, "producer")["stats"][0]["integrity_queries_answered"] == 6
    finally:
        c.close()
