"""Pipelined packed writes over real NIXL (UCX, host memory).

A staged write cut into chunks (``PackingConfig.pipeline_bytes``): the producer's
writer gathers and posts chunk by chunk, each with its own notification, and the
consumer's scatter thread copies each chunk into the blocks as soon as it lands;
the rank counts only once every chunk is scattered. The conformance suite runs
across processes with chunks of a few KiB (cancels, preemptions, faults and
reissues land between chunks); in one process, the bytes are exact for several
chunk counts (one, several, a short last chunk), and a transfer aborted while a
chunk's scatter is held keeps its staging and blocks until that scatter ends.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import PackingConfig
from pushkv.protocol.mapping import assignment
from pushkv.protocol.packing import PackedPlan, chunk_bounds
from pushkv.protocol.planner import plan_transfer
from pushkv.transports import conformance
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl

#: Chunks of 4 KiB: every packed write of the conformance suite is pipelined.
CHUNKED = PackingConfig(mode="always", staging_bytes=8 << 20, chunk_bytes=4096,
                        pipeline_bytes=4096)


class ChunkedCluster(NixlCluster):
    """A NIXL cluster whose packed writes are pipelined; what its ranks counted and
    the staging they still lent are kept (``seen``) when it closes."""

    seen: list[dict[str, Any]] = []

    def __init__(self, topology: conformance.Topology, pool: HostPool) -> None:
        super().__init__(topology, pool, packing=CHUNKED)

    def close(self) -> None:
        ChunkedCluster.seen.append(self.staging_report())
        super().close()


@pytest.mark.parametrize("name", list(conformance.CHECKS))
def test_conformance_pipelined(pool: HostPool, name: str) -> None:
    fn, kwargs = conformance.CHECKS[name]
    ChunkedCluster.seen = []
    fn(lambda topo: ChunkedCluster(topo, pool), **kwargs)
    for seen in ChunkedCluster.seen:
        assert not seen["leaked"], f"staging still lent: {seen['leaked']}"
        if name.startswith("transfer"):  # every write of a plain transfer is packed, in chunks
            assert seen["packed"] >= 1 and seen["scattered"] > seen["packed"], seen


# ----------------------------------------------------------------- one process

S_IDS, D_IDS, TOKENS = [9, 3, 40, 22, 17], [30, 2, 61, 11, 50], 75


def _pair(pipeline_bytes: int) -> tuple[Any, Any, Any, Any, Any, Any]:
    from pushkv.protocol import ConsumerConfig, ProducerConfig, uniform_ranks
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime

    pk = PackingConfig(mode="always", staging_bytes=8 << 20, chunk_bytes=4096,
                       pipeline_bytes=pipeline_bytes)
    p_info, c_info = uniform_ranks("prefill-0")[0], uniform_ranks("decode-0")[0]
    src = region_memory(p_info.layout, rng=np.random.default_rng(11))
    dst = region_memory(c_info.layout)
    prod = NixlRuntime(p_info, src, role="producer",
                       producer_config=ProducerConfig(packing=pk))
    cons = NixlRuntime(c_info, dst, role="consumer",
                       consumer_config=ConsumerConfig(packing=pk, fence_grace_s=60.0))
    cons.connect("prefill-0", [prod.address])
    return p_info, c_info, src, dst, prod, cons


def _packed(p_info: Any, c_info: Any) -> PackedPlan:
    plan = plan_transfer(p_info.layout, c_info.layout,
                         assignment(p_info.engine, c_info.engine, 0, 0), S_IDS, D_IDS,
                         TOKENS, 0)
    return PackedPlan(plan, 4096)


def _until(rt: Any, seen: list[object], kinds: tuple[type, ...], what: str) -> object:
    end = time.monotonic() + 30.0
    while True:
        for e in seen:
            if isinstance(e, kinds):
                return e
        assert time.monotonic() < end, f"no {what}: {seen}"
        rt.wait(0.5)
        seen += rt.poll()


def _settled(prod: Any) -> Any:
    view = prod.inspect()
    end = time.monotonic() + 10.0
    while view.writes_in_flight:  # the completion reaches the producer's I/O thread
        assert time.monotonic() < end, "the write never completed on the producer"
        prod.wait(0.05)
        view = prod.inspect()
    return view


@pytest.mark.parametrize("cut", ["one chunk", "halves", "short last", "many"])
def test_pipelined_write_lands_exactly(cut: str) -> None:
    from pushkv.protocol import TransferReady

    probe = _pair(0)
    nbytes = _packed(probe[0], probe[1]).nbytes
    for rt in probe[4:]:
        rt.close()
    unit = nbytes // (len(D_IDS) * 2)  # the bytes of one block run, at least
    size = {"one chunk": 0, "halves": -(-nbytes // 2), "short last": 3 * unit + 64,
            "many": 4096}[cut]
    p_info, c_info, src, dst, prod, cons = _pair(size)
    try:
        want_k = len(chunk_bounds(_packed(p_info, c_info), size)) - 1
        assert (want_k == 1) == (cut == "one chunk")
        cons.register("t", "prefill-0", D_IDS, TOKENS)
        prod.prefill_finished("t", S_IDS, TOKENS)
        seen: list[object] = []
        _until(cons, seen, (TransferReady,), "TransferReady")
        want = conformance.reference_destination([p_info], [src], c_info,
                                             [(S_IDS, D_IDS, TOKENS, 0)])
        assert all(np.array_equal(w, g) for w, g in zip(want, dst, strict=True))
        view = cons.inspect()
        assert view.stats.get("scatters_ok", 0) == want_k
        assert view.staging_lent == 0
        pview = _settled(prod)
        assert pview.stats.get("writes_packed", 0) == 1
        assert pview.staging_lent == 0
    finally:
        prod.close()
        cons.close()


def test_abort_while_a_chunk_scatters_keeps_staging_until_it_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunk 1's scatter is held; the transfer is aborted meanwhile: it is not
    cancelled, neither its staging nor its blocks released, until that scatter
    ends; then it is, with nothing lent on either side."""
    from pushkv.protocol import TransferCancelled, TransferReady
    from pushkv.transports.nixl import staging

    held, go = threading.Event(), threading.Event()
    scattered: list[int] = []
    orig = staging.StagingMemory.scatter

    def gated(self: Any, packed: Any, offset: int, start: int = 0,
              stop: int | None = None) -> None:
        if start > 0 and not held.is_set():
            held.set()
            assert go.wait(60.0), "the held scatter was never let go"
        orig(self, packed, offset, start, stop)
        scattered.append(start)

    monkeypatch.setattr(staging.StagingMemory, "scatter", gated)
    p_info, c_info, _src, _dst, prod, cons = _pair(4096)
    try:
        k = len(chunk_bounds(_packed(p_info, c_info), 4096)) - 1
        assert k >= 3
        cons.register("t", "prefill-0", D_IDS, TOKENS)
        prod.prefill_finished("t", S_IDS, TOKENS)
        assert held.wait(30.0), "no chunk after the first was scattered"
        cons.abort("t")
        seen: list[object] = []
        end = time.monotonic() + 2.0  # the consumer would have answered by now
        while time.monotonic() < end:
            cons.wait(0.1)
            seen += cons.poll()
        assert not any(isinstance(e, (TransferCancelled, TransferReady)) for e in seen), seen
        view = cons.inspect()
        assert view.staging_lent > 0 and view.lent  # the held scatter still uses both
        go.set()
        _until(cons, seen, (TransferCancelled,), "TransferCancelled")
        assert not any(isinstance(e, TransferReady) for e in seen), seen
        assert cons.inspect().staging_lent == 0
        assert len(scattered) <= k and not cons.inspect().lent
        assert _settled(prod).staging_lent == 0
    finally:
        go.set()
        prod.close()
        cons.close()
