"""Rule 11 through the in-memory transport (host memory, adversarial delivery):
digests of the source bytes ride on the notifications, the consumer checks its
landed bytes first, every injected fault fails its transfer with CORRUPT and
nothing is READY from corrupt bytes."""

from __future__ import annotations

import numpy as np
import pytest

from pushkv.integrity import KINDS, Injector, IntegrityConfig
from pushkv.protocol import FailReason, TransferFailed, TransferReady, uniform_ranks
from pushkv.protocol.packing import PackingConfig
from pushkv.transports import conformance
from pushkv.transports.inmemory import pair

ON = IntegrityConfig("on")


def _push(net, tid, src, dst, n, *, ranges=()):
    """Register on every consumer rank, then (optionally range by range) finish
    prefill on every producer rank, and run to quiescence."""
    for c in net.consumers.values():
        c.apply(c.endpoint.register(tid, "P", list(dst), n, net.now))
    net.run(until=net.now + 0.05)
    for p in net.producers.values():
        for lo, hi in ranges:
            p.apply(p.endpoint.range_ready(tid, list(src), (lo, hi), net.now))
        p.apply(p.endpoint.prefill_finished(tid, list(src), n, net.now))
    net.run()


def _outcomes(net, tid):
    return [(type(a).__name__, getattr(a, "code", None)) for c in net.consumers.values()
            for _, a in c.log if isinstance(a, TransferReady | TransferFailed)
            and a.transfer_id == tid]


def _exact(net, transfers):
    prod = [p.info for p in net.producers.values()]
    for c in net.consumers.values():
        want = conformance.reference_destination(prod, [p.memory for p in net.producers.values()],
                                             c.info, transfers)
        assert all(np.array_equal(w, g) for w, g in zip(want, c.memory, strict=True))


TOPOLOGIES = {
    "TP1 -> TP1": (dict(), dict()),
    "TP1 -> TP2, HND, block 8": (dict(num_kv_heads=2),
                                 dict(tp=2, num_kv_heads=2, order="HND", block_size=8)),
    "TP2 -> TP1, block 32 -> 16": (dict(tp=2, num_kv_heads=2, block_size=32),
                                   dict(num_kv_heads=2)),
}


@pytest.mark.parametrize("packing", [None, PackingConfig(mode="always", staging_bytes=1 << 20),
                                     PackingConfig(mode="always", staging_bytes=1 << 20,
                                                   pipeline_bytes=1024)],
                         ids=["direct", "packed", "pipelined"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_checked_transfers_verify_and_are_ready(topo, packing):
    p_kw, c_kw = TOPOLOGIES[topo]
    net = pair(uniform_ranks("P", **p_kw), uniform_ranks("D", **c_kw), integrity=ON,
               keep_log=True, seed=3, packing=packing)
    src, dst = (9, 3, 17), (5, 6, 7, 8, 11, 12)
    _push(net, "t", src, dst, 40)
    assert {o for o in _outcomes(net, "t")} == {("TransferReady", None)}
    _exact(net, [(list(src), list(dst), 40, 0)])
    checked = sum(c.integrity.stats["checked"] for c in net.consumers.values())
    passed = sum(c.integrity.stats["passed"] for c in net.consumers.values())
    sealed = sum(p.integrity.stats["sealed"] for p in net.producers.values())
    assert checked == passed == sealed >= len(net.consumers)
    assert not net.violations


def test_progressive_parts_are_checked_one_by_one():
    net = pair(uniform_ranks("P", num_layers=4), uniform_ranks("D", num_layers=4),
               integrity=ON, keep_log=True, seed=5)
    _push(net, "t", (9, 3, 17), (5, 6, 7), 40, ranges=[(0, 16), (16, 32)])
    (c,) = net.consumers.values()
    assert _outcomes(net, "t") == [("TransferReady", None)]
    assert c.integrity.stats["checked"] == c.integrity.stats["passed"] >= 2
    _exact(net, [([9, 3, 17], [5, 6, 7], 40, 0)])


@pytest.mark.parametrize("packing", [None, PackingConfig(mode="always", staging_bytes=1 << 20)],
                         ids=["direct", "packed"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_injected_fault_fails_its_transfer_with_corrupt(kind, packing):
    inj = Injector((kind,), every=2, seed=1)  # transfers 0, 2, 4 corrupted
    net = pair(uniform_ranks("P", num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               integrity=ON, injector=inj, keep_log=True, seed=7, packing=packing)
    (c,) = net.consumers.values()
    for i in range(6):
        _push(net, f"t{i}", (9 + i, 3, 17), (5 + 3 * i, 6 + 3 * i, 7 + 3 * i), 40)
    assert inj.injected == 3
    for i in range(6):
        want = ("TransferFailed", FailReason.CORRUPT) if i % 2 == 0 else ("TransferReady", None)
        assert _outcomes(net, f"t{i}") == [want], (kind, i)
    assert c.integrity.stats["corrupt"] == c.endpoint.stats["corrupt"] == 3
    assert net.stats["served_from_corrupt"] == 0
    assert c.endpoint.lent_blocks() == {} and c.endpoint.num_transfers == 0
    assert all(p.endpoint.held_blocks() == {} for p in net.producers.values())
    bad = c.integrity.corruptions[-1]
    assert bad.expected != bad.got and bad.transfer_id == "t4" and "digest" in bad.detail()
    fails = [a for _, a in c.log if isinstance(a, TransferFailed)]
    assert all("producer" in f.reason and "landed" in f.reason for f in fails)


def test_a_corrupt_part_of_a_progressive_push_fails_it_once_every_part_landed():
    inj = Injector(("flip",), every=1, limit=1)  # the first part
    net = pair(uniform_ranks("P", num_layers=4), uniform_ranks("D", num_layers=4),
               integrity=ON, injector=inj, keep_log=True, seed=11)
    _push(net, "t", (9, 3, 17), (5, 6, 7), 40, ranges=[(0, 16), (16, 32)])
    (c,) = net.consumers.values()
    assert _outcomes(net, "t") == [("TransferFailed", FailReason.CORRUPT)]
    assert c.endpoint.lent_blocks() == {} and not net.violations
    assert all(p.endpoint.held_blocks() == {} for p in net.producers.values())


def test_two_writers_one_corrupt_the_other_cancelled():
    inj = Injector(("zero",), every=1, limit=1)
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               integrity=ON, injector=inj, keep_log=True, seed=2)
    _push(net, "t", (9, 3, 17), (5, 6, 7), 40)
    (c,) = net.consumers.values()
    assert _outcomes(net, "t") == [("TransferFailed", FailReason.CORRUPT)]
    assert c.endpoint.lent_blocks() == {} and not net.violations


def test_off_sends_plain_frames_and_serves_what_lands():
    """Integrity off: the notifications are the plain frames, byte for byte, and
    an injected fault is served (what the check exists to prevent)."""
    inj = Injector(("flip",), every=1)
    net = pair(uniform_ranks("P"), uniform_ranks("D"), injector=inj, keep_log=True, seed=1)
    frames = []
    orig = net._enqueue_at

    def spy(kind, src, dst, payload, at, sent):
        if kind == "frame":
            frames.append(payload)
        return orig(kind, src, dst, payload, at, sent)

    net._enqueue_at = spy
    for i in range(3):
        _push(net, f"t{i}", (9 + i, 3), (5 + 2 * i, 6 + 2 * i), 20)
    assert frames and not any(f[:2] == b"PD" for f in frames)
    assert inj.injected == 3 and net.stats["served_from_corrupt"] == 3
    assert all(_outcomes(net, f"t{i}") == [("TransferReady", None)] for i in range(3))


def test_sample_checks_only_the_sampled_transfers():
    net = pair(uniform_ranks("P"), uniform_ranks("D"), integrity=IntegrityConfig("sample", 3),
               keep_log=True, seed=4)
    for i in range(12):
        _push(net, f"t{i}", (9, 3), (5, 6), 20)
    (c,) = net.consumers.values()
    want = sum(IntegrityConfig("sample", 3).checks(f"t{i}") for i in range(12))
    assert 0 < c.integrity.stats["checked"] == c.integrity.stats["passed"] == want < 12


@pytest.mark.parametrize("seed", range(12))
def test_corruption_under_adversarial_delivery_never_breaks_a_fence(seed):
    """Parts of progressive pushes from two writers, one write in three corrupted,
    delivered in adversarial order: each transfer is READY exactly when none of its
    writes was corrupted, else FAILED(CORRUPT); no write ever lands in a block
    after its release, and nothing stays lent or held."""
    inj = Injector(KINDS, every=3, seed=seed)
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2, num_layers=3),
               uniform_ranks("D", num_kv_heads=2, num_layers=3, block_size=8),
               integrity=ON, injector=inj, keep_log=True, seed=seed)
    (c,) = net.consumers.values()
    for i in range(4):
        _push(net, f"t{i}", (9 + i, 3, 17), tuple(range(10 * i, 10 * i + 5)), 40,
              ranges=[(0, 8), (8, 24)][: seed % 3])
    hit = {k[0] for k in inj.log}
    for i in range(4):
        want = ("TransferFailed", FailReason.CORRUPT) if f"t{i}" in hit else (
            "TransferReady", None)
        assert _outcomes(net, f"t{i}") == [want], (seed, i)
    assert not net.violations and net.stats["served_from_corrupt"] == 0
    assert c.endpoint.lent_blocks() == {} and c.endpoint.num_transfers == 0
    assert all(p.endpoint.held_blocks() == {} for p in net.producers.values())
