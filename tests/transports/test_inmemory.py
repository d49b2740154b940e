"""The in-memory transport passes the conformance suite, and runs pull too."""

import numpy as np
import pytest

from pushkv.protocol import Mode, Peer, uniform_ranks
from pushkv.protocol.packing import PackingConfig
from pushkv.transports import testing, testing_progressive
from pushkv.transports.inmemory import InMemoryCluster, pair


@pytest.mark.parametrize("name", list(testing.CHECKS))
def test_conformance(name):
    fn, kwargs = testing.CHECKS[name]
    fn(InMemoryCluster, **kwargs)


@pytest.mark.parametrize("name", list(testing.REUSED_ID_CHECKS))
def test_conformance_reused_ids(name):
    fn, kwargs = testing.REUSED_ID_CHECKS[name]
    fn(InMemoryCluster, **kwargs)


@pytest.mark.parametrize("name", list(testing_progressive.PROGRESSIVE_CHECKS))
def test_conformance_progressive(name):
    fn, kwargs = testing_progressive.PROGRESSIVE_CHECKS[name]
    fn(InMemoryCluster, **kwargs)


def test_progressive_check_catches_a_write_before_its_range_is_ready(monkeypatch):
    """Not vacuous: a producer that treats the first range as the whole prefill
    reads bytes that are not final yet and fails the byte check."""
    from pushkv.protocol import Producer

    real = Producer.range_ready

    def too_early(self, transfer_id, block_ids, tokens, now, *, layers=None, incarnation=0):
        whole = len(block_ids) * self.info.layout.block_size
        return real(self, transfer_id, block_ids, (0, whole), now, incarnation=incarnation)

    monkeypatch.setattr(Producer, "range_ready", too_early)
    with pytest.raises(AssertionError, match="bytes differ"):
        testing_progressive.check_progressive(InMemoryCluster, register_after=0)


def test_reused_id_check_catches_a_consumer_that_ignores_incarnations(monkeypatch):
    """Not vacuous: registering every use under one incarnation fails the check."""
    real = InMemoryCluster.register

    def one_incarnation(self, *args, incarnation=0, **kwargs):
        real(self, *args, incarnation=0, **kwargs)

    monkeypatch.setattr(InMemoryCluster, "register", one_incarnation)
    with pytest.raises(AssertionError):
        testing.check_reused_id(InMemoryCluster)


def test_conformance_suite_catches_a_corrupting_transport(monkeypatch):
    """The suite is not vacuous: a transport that flips one byte per write fails it."""
    from pushkv.transports import inmemory

    real = inmemory.copy_plan

    def corrupting(plan, src, dst):
        real(plan, src, dst)
        dst[int(plan.dst_regions[0])][int(plan.runs[0, 1])] ^= 0xFF

    monkeypatch.setattr(inmemory, "copy_plan", corrupting)
    with pytest.raises(AssertionError, match="bytes differ"):
        testing.check_either_order(InMemoryCluster)


def test_pull_moves_the_same_bytes_and_releases_once():
    prod = uniform_ranks("P", tp=2, num_kv_heads=2, block_size=32)
    cons = uniform_ranks("D", num_kv_heads=2, block_size=16)
    net = pair(prod, cons)
    for p in net.producers.values():
        p.apply(p.endpoint.prefill_finished("t", [9, 3], 50, net.now, mode=Mode.PULL))
    published = net.producers[Peer("P", 0)].published["t"]
    (c,) = net.consumers.values()
    c.apply(c.endpoint.start_pull("t", "P", published.block_ids, [5, 6, 7, 8], 50, net.now))
    net.run()
    assert c.outcomes["t"] == [("ready", 0)]
    assert all(p.released["t"] == 1 for p in net.producers.values())
    want = testing.reference_destination(prod, [p.memory for p in net.producers.values()],
                                         c.info, [([9, 3], [5, 6, 7, 8], 50, 0)])
    assert all(np.array_equal(w, g) for w, g in zip(want, c.memory, strict=True))
    assert not c.endpoint.lent_blocks() and not net.violations


def test_pull_read_from_a_dead_producer_fails_cleanly():
    net = pair(uniform_ranks("P"), uniform_ranks("D"), detect_s=0.5)
    (p,) = net.producers.values()
    (c,) = net.consumers.values()
    p.apply(p.endpoint.prefill_finished("t", [1, 2], 20, net.now, mode=Mode.PULL))
    c.apply(c.endpoint.start_pull("t", "P", [1, 2], [3, 4], 20, net.now))
    net.kill("P")
    net.run(until=5.0)
    assert c.outcomes["t"][-1][0] == "failed"
    assert not c.endpoint.lent_blocks()


def test_consumer_death_frees_the_producer():
    net = pair(uniform_ranks("P"), uniform_ranks("D"), detect_s=0.5)
    (p,) = net.producers.values()
    (c,) = net.consumers.values()
    c.apply(c.endpoint.register("t", "P", [1, 2], 20, net.now))
    net.run(until=0.1)
    net.kill("D")
    p.apply(p.endpoint.prefill_finished("t", [5, 6], 20, net.now))
    net.run(until=3.0)
    assert p.released["t"] == 1 and not p.endpoint.held_blocks()


def _staging_lent(net):
    """Staging bytes every live endpoint still lends (0: nothing leaked)."""
    return sum(n.endpoint.staging_lent for n in (*net.producers.values(),
                                                 *net.consumers.values()) if n.alive)


ALWAYS = PackingConfig(mode="always", staging_bytes=64 << 20, chunk_bytes=4096)


@pytest.mark.parametrize("name", list(testing.CHECKS))
def test_conformance_packed(name):
    """The whole suite with every write packed: same bytes, staging never leaked."""
    made = []

    def make(topology):
        made.append(InMemoryCluster(topology, packing=ALWAYS))
        return made[-1]

    fn, kwargs = testing.CHECKS[name]
    fn(make, **kwargs)
    for c in made:
        # Every whole-request write is packed (rule 10: parts of a progressive push,
        # and writes whose registration lent no staging, are direct).
        unlent = sum(p.endpoint.stats["pack_unlent"] + p.endpoint.stats["pack_staging"]
                     for p in c.net.producers.values())
        assert unlent == 0
        assert c.net.stats["packed_writes"] == c.net.stats["writes"] - c.net.stats[
            "part_writes"]
        assert c.net.stats["scatters"] <= c.net.stats["packed_writes"]
        assert _staging_lent(c.net) == 0


def test_packed_writes_happen_in_the_conformance_transfers():
    """Not vacuous: a resharding transfer check goes through the packed path."""
    made = []

    def make(topology):
        made.append(InMemoryCluster(topology, packing=ALWAYS))
        return made[-1]

    name = next(n for n in testing.CHECKS if "transfer" in n)
    fn, kwargs = testing.CHECKS[name]
    fn(make, **kwargs)
    assert sum(c.net.stats["packed_writes"] for c in made) > 0


def test_auto_packs_only_over_the_budget():
    """Default behaviour under the budget is the direct write; a fragmented plan over
    it is packed, and both land the same bytes."""
    cfg = PackingConfig(descriptor_budget=8, post_per_descriptor_s=1.0,
                        staging_bytes=1 << 20)
    prod, cons = uniform_ranks("P", num_blocks=64), uniform_ranks("D", num_blocks=64)
    net = pair(prod, cons, packing=cfg)
    (p,), (c,) = net.producers.values(), net.consumers.values()
    cases = {"contiguous": ([1, 2, 3, 4, 5], [5, 6, 7, 8, 9]),  # 4 descriptors: direct
             "fragmented": ([9, 3, 40, 22, 17], [30, 2, 61, 11, 50])}  # 20: packed
    for tid, (s_ids, d_ids) in cases.items():
        p.apply(p.endpoint.prefill_finished(tid, s_ids, 70, net.now))
        c.apply(c.endpoint.register(tid, "P", d_ids, 70, net.now))
        net.run()
        assert c.outcomes[tid] == [("ready", 0)]
    assert net.stats["writes"] == 2 and net.stats["packed_writes"] == 1
    want = testing.reference_destination(
        prod, [p.memory], c.info,
        [(s, d, 70, 0) for s, d in cases.values()])
    assert all(np.array_equal(w, g) for w, g in zip(want, c.memory, strict=True))
    assert not net.violations and _staging_lent(net) == 0


def test_progressive_check_catches_a_consumer_that_ignores_parts(monkeypatch):
    """Not vacuous: READY on the first part's notification fails the suite (the
    later parts land in blocks no longer lent, or the bytes are short)."""
    from pushkv.protocol import consumer

    monkeypatch.setattr(consumer, "_parts", lambda a, rank, inp, msg: inp)
    with pytest.raises(AssertionError):
        testing_progressive.check_progressive(InMemoryCluster, register_after=0)
