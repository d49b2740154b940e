"""Rule 11 for pull through the in-memory transport: each producer rank seals
what it publishes (one digest per head, over the source when the pull is
offered), the relay hands the seals to the consumer's pull, and the consumer
checks the bytes each read landed before the read counts: a corrupted read fails
its transfer with CORRUPT, a clean one is READY with exact bytes."""

from __future__ import annotations

import pytest

from pushkv.integrity import (
    KINDS,
    Injector,
    Integrity,
    IntegrityConfig,
    PullTag,
    seal_pull,
    unseal_pull,
)
from pushkv.protocol import (
    ConfigError,
    DecodeError,
    FailReason,
    Mode,
    TransferFailed,
    TransferReady,
    uniform_ranks,
)
from pushkv.transports.inmemory import pair

from .test_inmemory import TOPOLOGIES, _exact, _outcomes

ON = IntegrityConfig("on")


def _pull(net, tid, src, dst, n, first=0, *, seals=True):
    """Prefill finishes in pull mode on every producer rank; the relay hands the
    published block ids (and, unless told not to, each rank's seal) to every
    consumer rank's pull; run to quiescence."""
    for p in net.producers.values():
        p.apply(p.endpoint.prefill_finished(tid, list(src), n, net.now, mode=Mode.PULL))
    net.run(until=net.now + 0.05)
    pub = {p.peer.rank: p.published[tid] for p in net.producers.values()}
    relay = {r: a.seal for r, a in pub.items() if a.seal} if seals else None
    for c in net.consumers.values():
        c.start_pull(tid, "P", list(src), list(dst), n, first, seals=relay or None)
    net.run()


def _clean(net):
    assert not net.violations
    assert all(c.endpoint.lent_blocks() == {} for c in net.consumers.values())
    assert all(p.endpoint.held_blocks() == {} for p in net.producers.values())


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_a_sealed_pull_is_checked_and_ready(topo):
    """Heterogeneous TP and block sizes: each consumer rank sums the digests of the
    heads it read, and they verify."""
    p_kw, c_kw = TOPOLOGIES[topo]
    net = pair(uniform_ranks("P", **p_kw), uniform_ranks("D", **c_kw), integrity=ON,
               keep_log=True, seed=3)
    src, dst = (9, 3, 17), (5, 6, 7, 8, 11, 12)
    _pull(net, "t", src, dst, 40)
    assert {o for o in _outcomes(net, "t")} == {("TransferReady", None)}
    _exact(net, [(list(src), list(dst), 40, 0)])
    sealed = sum(p.integrity.stats["sealed"] for p in net.producers.values())
    checked = sum(c.integrity.stats["checked"] for c in net.consumers.values())
    passed = sum(c.integrity.stats["passed"] for c in net.consumers.values())
    reads = sum(c.endpoint.stats["reads_ok"] for c in net.consumers.values())
    assert sealed == len(net.producers) and checked == passed == reads >= len(net.consumers)
    _clean(net)


@pytest.mark.parametrize("kind", KINDS)
def test_every_injected_fault_in_a_read_fails_its_pull_with_corrupt(kind):
    inj = Injector((kind,), every=2, seed=1)  # pulls 0, 2 corrupted
    net = pair(uniform_ranks("P", num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               integrity=ON, injector=inj, keep_log=True, seed=7)
    (c,) = net.consumers.values()
    for i in range(4):
        _pull(net, f"t{i}", (9 + i, 3, 17), (5 + 3 * i, 6 + 3 * i, 7 + 3 * i), 40)
    assert inj.injected == 2
    for i in range(4):
        want = ("TransferFailed", FailReason.CORRUPT) if i % 2 == 0 else ("TransferReady", None)
        assert _outcomes(net, f"t{i}") == [want], (kind, i)
    assert c.integrity.stats["corrupt"] == c.endpoint.stats["corrupt"] == 2
    assert net.stats["served_from_corrupt"] == 0
    bad = c.integrity.corruptions[-1]
    assert bad.kind == "read" and bad.transfer_id == "t2" and bad.expected != bad.got
    fails = [a for _, a in c.log if isinstance(a, TransferFailed)]
    assert all("read" in f.reason and "landed" in f.reason for f in fails)
    assert c.endpoint.num_transfers == 0
    _clean(net)


def test_one_of_two_reads_corrupt_fails_the_pull_once_both_ended():
    inj = Injector(("zero",), every=1, limit=1)
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               integrity=ON, injector=inj, keep_log=True, seed=2)
    _pull(net, "t", (9, 3, 17), (5, 6, 7), 40)
    assert _outcomes(net, "t") == [("TransferFailed", FailReason.CORRUPT)]
    _clean(net)


def test_an_unsealed_pull_serves_what_landed():
    """No seal relayed (integrity off at the producer, or a relay that drops it):
    nothing is checked, and an injected fault is served -- what the check prevents."""
    inj = Injector(("flip",), every=1)
    net = pair(uniform_ranks("P"), uniform_ranks("D"), integrity=ON, injector=inj,
               keep_log=True, seed=1)
    _pull(net, "t", (9, 3), (5, 6), 20, seals=False)
    assert _outcomes(net, "t") == [("TransferReady", None)]
    assert net.stats["served_from_corrupt"] == 1
    (c,) = net.consumers.values()
    assert c.integrity.stats["checked"] == 0


def test_sample_seals_the_same_transfers_as_push():
    cfg = IntegrityConfig("sample", 3)
    net = pair(uniform_ranks("P"), uniform_ranks("D"), integrity=cfg, keep_log=True, seed=4)
    for i in range(9):
        _pull(net, f"t{i}", (9, 3), (5 + 2 * i, 6 + 2 * i), 20)
    (c,) = net.consumers.values()
    want = sum(cfg.checks(f"t{i}") for i in range(9))
    assert 0 < c.integrity.stats["checked"] == c.integrity.stats["passed"] == want < 9
    assert all(_outcomes(net, f"t{i}") == [("TransferReady", None)] for i in range(9))


def test_a_cached_prefix_is_read_unchecked():
    """A pull of tokens [first, n): the published digests cover [0, n), so the read
    is counted unchecked (not failed)."""
    net = pair(uniform_ranks("P"), uniform_ranks("D"), integrity=ON, keep_log=True, seed=5)
    _pull(net, "t", (9, 3, 17), (5, 6, 7), 40, first=16)
    (c,) = net.consumers.values()
    assert _outcomes(net, "t") == [("TransferReady", None)]
    assert c.integrity.stats["unchecked"] == 1 and c.integrity.stats["checked"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_corrupt_reads_under_adversarial_delivery_never_break_a_fence(seed):
    inj = Injector(KINDS, every=3, seed=seed)
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2, num_layers=3),
               uniform_ranks("D", num_kv_heads=2, num_layers=3, block_size=8),
               integrity=ON, injector=inj, keep_log=True, seed=seed)
    for i in range(4):
        _pull(net, f"t{i}", (9 + i, 3, 17), tuple(range(10 * i, 10 * i + 5)), 40)
    hit = {k[0] for k in inj.log}
    for i in range(4):
        want = ("TransferFailed", FailReason.CORRUPT) if f"t{i}" in hit else (
            "TransferReady", None)
        assert _outcomes(net, f"t{i}") == [want], (seed, i)
    assert net.stats["served_from_corrupt"] == 0
    _clean(net)


def test_bad_and_missing_seals_are_typed_errors_that_change_nothing():
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               integrity=ON, keep_log=True, seed=6)
    for p in net.producers.values():
        p.apply(p.endpoint.prefill_finished("t", [9, 3], 20, net.now, mode=Mode.PULL))
    net.run(until=net.now + 0.05)
    good = {p.peer.rank: p.published["t"].seal for p in net.producers.values()}
    (c,) = net.consumers.values()
    bad_cases = [
        ({0: good[0]}, ConfigError),                      # rank 1's seal missing
        ({**good, 2: good[0]}, ConfigError),              # a rank that reads nothing
        ({0: good[0], 1: good[1][:-1]}, DecodeError),     # torn
        ({0: good[0], 1: b"PD" + good[1][2:]}, DecodeError),  # another magic
        ({0: good[0], 1: good[1][:2] + b"\x09" + good[1][3:]}, DecodeError),  # version
        ({0: good[0], 1: "PR"}, ConfigError),             # not bytes
    ]
    for seals, err in bad_cases:
        with pytest.raises(err):
            c.start_pull("t", "P", [9, 3], [5, 6], 20, seals=seals)
        assert c.endpoint.num_transfers == 0 and c.endpoint.lent_blocks() == {}
    c.start_pull("t", "P", [9, 3], [5, 6], 20, seals=good)
    net.run()
    assert _outcomes(net, "t") == [("TransferReady", None)]


def test_a_relay_of_every_ranks_seal_gives_each_reader_its_own():
    """Behind a router every consumer rank gets the one answer, with every producer
    rank's seal: ``every_rank`` takes the ranks read (each must be there)."""
    tag = PullTag(0, 40, range(0, 2), (1, 2))
    seals = {r: seal_pull(PullTag(0, 40, range(0, 2), (r, r + 1))) for r in range(4)}
    got = Integrity.pull_seals(seals, [1, 2], every_rank=True)
    assert got == {1: PullTag(0, 40, range(0, 2), (1, 2)),
                   2: PullTag(0, 40, range(0, 2), (2, 3))}
    assert Integrity.pull_seals({0: seal_pull(tag)}, [0], every_rank=True) == {0: tag}
    with pytest.raises(ConfigError):  # a rank read has no seal
        Integrity.pull_seals({0: seals[0]}, [0, 1], every_rank=True)
    with pytest.raises(ConfigError):  # without every_rank an extra one is refused
        Integrity.pull_seals(seals, [1, 2])
    with pytest.raises(DecodeError):  # a torn seal of a rank read
        Integrity.pull_seals({**seals, 1: seals[1][:-1]}, [1], every_rank=True)


def test_the_pull_seal_round_trips_and_refuses_what_it_is_not():
    tag = PullTag(0, 40, range(2, 5), (1, 2**64 - 1, 7))
    assert unseal_pull(seal_pull(tag)) == tag
    for raw in (b"", b"PR", seal_pull(tag) + b"\0",
                seal_pull(PullTag(5, 4, range(0, 1), (1,)))):
        with pytest.raises(DecodeError):
            unseal_pull(raw)
    assert Integrity.pull_seals(None, [0]) is None and Integrity.pull_seals({}, [0]) is None


def test_ready_needs_every_read_checked():
    """The consumer's READY comes only after the last read's check (the reads of a
    2-rank producer complete one by one; READY follows the second check)."""
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2), uniform_ranks("D", num_kv_heads=2),
               integrity=ON, keep_log=True, seed=8)
    _pull(net, "t", (9, 3, 17), (5, 6, 7), 40)
    (c,) = net.consumers.values()
    assert [type(a) for _, a in c.log if isinstance(a, TransferReady)] == [TransferReady]
    assert c.integrity.stats["checked"] == 2
