"""TP 2 -> TP 1 over NIXL with each producer rank in its own process, as vLLM
runs a TP 2 server: both ranks handshake with the consumer, each writes its KV
head into the consumer's blocks, and the consumer is READY once both notified."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

pytestmark = pytest.mark.nixl

DEADLINE_S = 60.0


def _producer_rank(rank: int, out: Any, go: Any, done: Any) -> None:
    from pushkv.protocol import ReleaseSource, uniform_ranks
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime

    info = uniform_ranks("prefill-tp2", tp=2, num_kv_heads=2)[rank]
    src = region_memory(info.layout, rng=np.random.default_rng(10 + rank))
    rt = NixlRuntime(info, src, role="producer")
    try:
        out.put(("address", rank, rt.address))
        if not go.wait(DEADLINE_S):
            return
        rt.prefill_finished("t", [1], 16, incarnation=3)
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            if any(isinstance(e, ReleaseSource) for e in rt.poll()):
                out.put(("released", rank, None))
                break
            rt.wait(0.05)
        done.wait(DEADLINE_S)
    finally:
        rt.close()


def test_each_producer_rank_in_its_own_process_writes_its_head() -> None:
    from pushkv.protocol import TransferReady, uniform_ranks
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime

    ctx = mp.get_context("spawn")
    out, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_producer_rank, args=(r, out, go, done)) for r in range(2)]
    for p in procs:
        p.start()
    cons = None
    try:
        addresses: dict[int, str] = {}
        for _ in range(2):
            _, rank, address = out.get(timeout=DEADLINE_S)
            addresses[rank] = address
        info = uniform_ranks("decode-tp1", num_kv_heads=2)[0]
        dst = region_memory(info.layout)
        cons = NixlRuntime(info, dst, role="consumer")
        cons.connect("prefill-tp2", addresses)
        cons.register("t", "prefill-tp2", [4], 16, incarnation=3)
        go.set()
        seen: list[object] = []
        end = time.monotonic() + DEADLINE_S
        while not any(isinstance(e, TransferReady) for e in seen) and time.monotonic() < end:
            cons.wait(0.05)
            seen += cons.poll()
        assert any(isinstance(e, TransferReady) for e in seen), seen
        assert cons.connected("prefill-tp2")
        released = {out.get(timeout=DEADLINE_S)[1] for _ in range(2)}
        assert released == {0, 1}
        assert any(r.any() for r in dst), "no byte landed"  # bytes: the conformance suite
    finally:
        done.set()
        if cons is not None:
            cons.close()
        for p in procs:
            p.join(DEADLINE_S)
            if p.is_alive():
                p.kill()
