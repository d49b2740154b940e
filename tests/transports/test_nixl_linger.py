"""Rule 12 after READY over real NIXL (UCX, host memory), the producer and the decode
engine in processes of their own: with ``retarget_hold_s`` a pushed source outlives
its write until the decode engine reports its first decode step (``consumed``, the
``Consumed`` frame over the side channel), so an engine lost in between is re-targeted
and written again from the held source, not computed again."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import ProducerConfig, TransferReady, uniform_ranks
from pushkv.transports.conformance import Topology
from pushkv.transports.inmemory import region_memory
from pushkv.transports.nixl import NixlRuntime
from pushkv.transports.nixl.testing import PRODUCER, HostPool, NixlCluster

pytestmark = pytest.mark.nixl

HOLD_S = 30.0  #: longer than any wait here: only a Consumed (or a re-target) ends a linger
WAIT_S = 30.0


@pytest.fixture
def cluster(pool: HostPool) -> Iterator[NixlCluster]:
    topo = Topology(producer_config=ProducerConfig(lease_s=60.0, retarget_hold_s=HOLD_S))
    c = NixlCluster(topo, pool)
    try:
        yield c
    finally:
        c.close()


def _producer(c: NixlCluster, pred: Any) -> dict[str, Any]:
    """Poll the producer process's report until ``pred`` holds (or the deadline)."""
    end = time.monotonic() + WAIT_S
    while True:
        p, _ = c.raw_snapshot(0.01)
        if pred(p) or time.monotonic() >= end:
            return p


def _counts(p: dict[str, Any]) -> dict[str, int]:
    return p["endpoint_stats"][0]


def _written_and_ready(c: NixlCluster, tid: str) -> dict[str, Any]:
    """The consumer engine registered ``tid``, prefill finished, the write landed: the
    consumer is READY and the producer's source lingers."""
    lingered = _counts(c.raw_snapshot()[0]).get("lingered", 0)
    c.register(tid, [5, 6], 32)
    c.prefill_finished(tid, [1, 4], 32)
    snap = c.wait(lambda s: s.outcome(0, tid) == "ready", WAIT_S)
    assert snap.outcome(0, tid) == "ready", snap.outcomes
    # the write is known complete at the producer: it lingers instead of releasing
    p = _producer(c, lambda p: _counts(p).get("lingered", 0) > lingered)
    assert _counts(p).get("lingered", 0) == lingered + 1, _counts(p)
    assert any(h[0] == tid for h in p["held"][0]), p["held"]
    assert (0, tid) not in p["src_released"], "released before the first decode step"
    return p


def test_a_written_source_is_held_until_its_engine_consumed_it(cluster) -> None:  # type: ignore[no-untyped-def]
    c = cluster
    p = _written_and_ready(c, "t")
    assert not _counts(p).get("consumed")
    c.consumed("t")  # every consumer rank: its first decode step
    p = _producer(c, lambda p: p["src_released"].get((0, "t")) == 1)
    assert p["src_released"].get((0, "t")) == 1 and not p["held"][0]
    assert _counts(p)["consumed"] == 1
    c.consumed("t")  # told once: a repeat sends nothing
    _, cons = c.raw_snapshot()
    assert cons["endpoint_stats"][0]["consumed_unknown"] == 1
    assert not p["errors"] and not cons["errors"]


def test_an_engine_lost_after_ready_is_retargeted_and_written_from_the_held_source(
        cluster) -> None:  # type: ignore[no-untyped-def]
    """The decode engine got READY and never took its first step (lost): a router's
    turn-1 registration from a second engine is written from the held source."""
    c = cluster
    _written_and_ready(c, "r")
    info = uniform_ranks("decode-e")[0]
    e_mem = region_memory(info.layout)
    e = NixlRuntime(info, e_mem, role="consumer")
    try:
        e.connect(PRODUCER, c.producer_addresses)
        e.register("r", PRODUCER, [2, 3], 32, target=1)
        seen: list[object] = []
        end = time.monotonic() + WAIT_S
        while not any(isinstance(x, TransferReady) for x in seen) and time.monotonic() < end:
            e.wait(0.05)
            seen += e.poll()
        assert TransferReady(transfer_id="r", attempt=0) in seen, seen
        src = c.source_memory(0)[0]
        tb = src.size // 64  # bytes per block
        for got, want in ((2, 1), (3, 4)):
            assert np.array_equal(e_mem[0][got * tb:(got + 1) * tb],
                                  src[want * tb:(want + 1) * tb])
        # Held for E now (its own linger): the old engine's report changes nothing...
        stale = _counts(c.raw_snapshot()[0]).get("stale", 0)
        c.consumed("r")
        p = _producer(c, lambda p: _counts(p).get("stale", 0) > stale)
        assert _counts(p).get("stale", 0) == stale + 1
        assert any(h[0] == "r" for h in p["held"][0]) and _counts(p)["retargeted"] == 1
        # ...E's first decode step releases it.
        e.consumed("r")
        p = _producer(c, lambda p: p["src_released"].get((0, "r")) == 1)
        assert p["src_released"].get((0, "r")) == 1 and not p["held"][0]
        assert _counts(p)["consumed"] == 1 and _counts(p)["lingered"] == 2  # D's, then E's
        assert not p["errors"]
    finally:
        e.close()
