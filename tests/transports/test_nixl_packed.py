"""Packed writes over real NIXL (UCX, host memory), across two processes.

Every rank has staging memory registered with NIXL and every whole-request
write is packed (rule 10): the producer's writer gathers into its staging and
writes the wire chunks into the consumer's, whose scatter thread copies them
into the blocks before READY. The conformance suite runs unchanged (bytes
compared with the source); afterwards no staging may stay lent on any rank.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import PackingConfig
from pushkv.transports import conformance
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl

ALWAYS = PackingConfig(mode="always", staging_bytes=8 << 20, chunk_bytes=4096)


class PackedCluster(NixlCluster):
    """A NIXL cluster with staging on every rank; what its ranks counted is kept
    (``seen``) when it closes, with the staging they still lent."""

    seen: list[dict[str, Any]] = []

    def __init__(self, topology: conformance.Topology, pool: HostPool) -> None:
        super().__init__(topology, pool, packing=ALWAYS)

    def close(self) -> None:
        PackedCluster.seen.append(self.staging_report())
        super().close()


@pytest.mark.parametrize("name", list(conformance.CHECKS))
def test_conformance_packed(pool: HostPool, name: str) -> None:
    fn, kwargs = conformance.CHECKS[name]
    PackedCluster.seen = []
    fn(lambda topo: PackedCluster(topo, pool), **kwargs)
    for seen in PackedCluster.seen:
        assert not seen["leaked"], f"staging still lent: {seen['leaked']}"
        assert seen["scattered"] <= seen["packed"]
        if name.startswith("transfer"):  # every write of a plain transfer is packed
            assert seen["packed"] >= 1 and seen["scattered"] == seen["packed"], seen


def test_a_fragmented_transfer_is_packed_and_lands_exactly(pool: HostPool) -> None:
    """Not vacuous: a scattered destination goes through gather, wire and scatter."""
    topo = conformance.Topology(producer={"tp": 2, "num_kv_heads": 2, "num_blocks": 64},
                            consumer={"num_kv_heads": 2, "num_blocks": 64})
    cluster = PackedCluster(topo, pool)
    PackedCluster.seen = []
    try:
        src, dst = [9, 3, 40, 22, 17, 5], [30, 2, 61, 11, 50, 7]
        n = 6 * topo.consumer_ranks()[0].layout.block_size - 3
        cluster.register("t", dst, n)
        cluster.prefill_finished("t", src, n)
        snap = cluster.wait(lambda s: s.outcome(0, "t") is not None, 30.0)
        assert snap.outcome(0, "t") == "ready", snap.outcomes
        want = conformance.reference_destination(
            topo.producer_ranks(), [cluster.source_memory(r) for r in range(2)],
            topo.consumer_ranks()[0], [(src, dst, n, 0)])
        got = cluster.destination_memory(0)
        assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
    finally:
        cluster.close()
    (seen,) = PackedCluster.seen
    assert seen["packed"] == 2 and seen["scattered"] == 2, seen
    assert not any(seen["lent"].values()), seen


@pytest.mark.parametrize(("producer_staging", "consumer_staging"),
                         [(True, True), (True, False), (False, True)])
def test_one_side_without_staging_writes_directly(producer_staging: bool,
                                                  consumer_staging: bool) -> None:
    """In one process: a packed write needs staging on both ranks; with staging on one
    side only the write is direct, and the bytes and the fence are the same."""
    from pushkv.protocol import ConsumerConfig, ProducerConfig, TransferReady, uniform_ranks
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime

    p_info, c_info = uniform_ranks("prefill-0")[0], uniform_ranks("decode-0")[0]
    src = region_memory(p_info.layout, rng=np.random.default_rng(5))
    dst = region_memory(c_info.layout)
    prod = NixlRuntime(p_info, src, role="producer", producer_config=ProducerConfig(
        packing=ALWAYS if producer_staging else None))
    cons = NixlRuntime(c_info, dst, role="consumer", consumer_config=ConsumerConfig(
        packing=ALWAYS if consumer_staging else None))
    try:
        cons.connect("prefill-0", [prod.address])
        s_ids, d_ids = [9, 3, 40, 22], [30, 2, 61, 11]
        cons.register("t", "prefill-0", d_ids, 60)
        prod.prefill_finished("t", s_ids, 60)
        seen: list[object] = []
        while not any(isinstance(e, TransferReady) for e in seen):
            assert cons.wait(10.0), f"no TransferReady: {seen}"
            seen += cons.poll()
        want = conformance.reference_destination([p_info], [src], c_info, [(s_ids, d_ids, 60, 0)])
        assert all(np.array_equal(w, g) for w, g in zip(want, dst, strict=True))
        packed = producer_staging and consumer_staging
        view = cons.inspect()
        assert view.stats.get("scatters_ok", 0) == (1 if packed else 0)
        assert view.staging_lent == 0
        pview = prod.inspect()
        end = time.monotonic() + 10.0
        while pview.writes_in_flight:  # the completion reaches the producer's I/O thread
            assert time.monotonic() < end, "the write never completed on the producer"
            prod.wait(0.05)
            pview = prod.inspect()
        assert pview.stats.get("writes_packed", 0) == (1 if packed else 0)
        assert pview.staging_lent == 0
    finally:
        prod.close()
        cons.close()
