"""Pipelined packed writes over real NIXL agents (UCX, host memory), two processes:
every byte of a fragmented plan lands, in image and ring mode, chunks of any size,
chunks written by the producer, read by the consumer, or both."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")

from pushkv.protocol import plan_transfer
from pushkv.protocol.errors import ConfigError
from pushkv.protocol.mapping import Assignment
from pushkv.protocol.packing import PackedPlan
from pushkv.transports.inmemory import copy_plan
from pushkv.transports.nixl.agent import Agent
from pushkv.transports.nixl.config import NixlConfig
from pushkv.transports.nixl.memory import KVMemory
from pushkv.transports.packed_pipeline import PackedReceiver, PackedSender, PipelinePlan
from tests.protocol.test_planner import layout

pytestmark = pytest.mark.nixl

STAGING = 1 << 20


def _plan(seed: int) -> Any:
    lo = layout(num_blocks=64, block_size=16, heads=1, head_dim=64, dtype_bytes=2)
    rng = np.random.default_rng(seed)
    run = int(rng.integers(2, 10))  # blocks 30.. go to 10.. in one run: mixed lengths
    s_ids = [*range(30, 30 + run), *rng.permutation(np.arange(40, 64))[:40 - run].tolist(),
             *range(0, 30)][:40]
    d_ids = [*range(10, 10 + run), *rng.permutation(np.arange(20, 64))[:40 - run].tolist()]
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 1),))
    return lo, plan_transfer(lo, lo, a, s_ids, d_ids, 16 * 40)


def _source(lo: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(9)
    return [rng.integers(1, 256, lo.region_bytes, dtype=np.uint8) for _ in range(4)]


def consumer(conn: Any) -> None:
    agent = Agent("pipe-consumer", NixlConfig(), progress_thread=True)
    staging = np.zeros(STAGING, np.uint8)
    mem = KVMemory.from_regions([staging])
    agent.register(mem)
    conn.send((agent.metadata(), mem.bases[0]))
    meta, remote_base = conn.recv()
    peer = agent.add_peer(meta)
    receiver = PackedReceiver(agent, staging, peer, local_base=mem.bases[0],
                              remote_base=remote_base, timeout_s=60)
    while (cmd := conn.recv()) is not None:
        seed, chunk, slots, share, tag = cmd
        lo, plan = _plan(seed)
        dst = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
        pipe = PipelinePlan(PackedPlan(plan, 1 << 20), chunk, slots, share)
        times = receiver.receive(pipe, dst, tag)
        conn.send((dst, times.chunks, times.posted_by_peer))
    receiver.close()
    agent.close()


@pytest.fixture(scope="module")
def pair() -> Any:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=consumer, args=(child,), daemon=True)
    proc.start()
    meta, remote_base = conn.recv()
    agent = Agent("pipe-producer", NixlConfig(), progress_thread=False)
    staging = np.zeros(STAGING, np.uint8)
    mem = KVMemory.from_regions([staging])
    agent.register(mem)
    peer = agent.add_peer(meta)
    conn.send((agent.metadata(), mem.bases[0]))
    sender = PackedSender(agent, staging, mem.bases[0], remote_base, peer, timeout_s=60)
    try:
        yield conn, sender
    finally:
        conn.send(None)
        proc.join(30)
        sender.close()
        agent.close()


@pytest.mark.parametrize(("chunk", "slots", "share"), [
    (1 << 20, None, 0.0), (20_000, None, 0.0), (8192, 2, 0.0), (20_000, 3, 0.0),
    (4096, 1, 0.0), (50_000, 16, 0.0), (20_000, None, 0.5), (8192, 2, 0.5),
    (20_000, 3, 1.0), (4096, 1, 0.3), (20_000, None, -1.0), (4096, None, -1.0)])
def test_pipelined_write_lands_every_byte(pair: Any, chunk: int, slots: int | None,
                                          share: float) -> None:
    """share -1: an image write gathered one chunk ahead on a worker thread."""
    conn, sender = pair
    ahead, share = share < 0, max(share, 0.0)
    seed = chunk + (slots or 0) + int(share * 10)
    lo, plan = _plan(seed)
    src = _source(lo)
    want = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, src, want)
    pipe = PipelinePlan(PackedPlan(plan, 1 << 20), chunk, slots, share)
    assert len(set(plan.runs[:, 2].tolist())) > 1  # mixed run lengths
    tag = f"w{chunk}-{slots}-{share}-{ahead}".encode()
    conn.send((seed, chunk, slots, share, tag))
    sender.gather_ahead = ahead
    try:
        times = sender.send(pipe, src, tag)
    finally:
        sender.gather_ahead = False
    got, chunks, read = conn.recv()
    assert chunks == times.chunks == pipe.chunks >= (1 if chunk >= pipe.packed.nbytes else 2)
    assert read == times.posted_by_peer == sum(pipe.read(k) for k in range(pipe.chunks))
    assert (read > 0) == (share > 0)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    if slots is not None:
        assert pipe.staging_bytes <= slots * chunk


def test_a_write_larger_than_the_registered_staging_is_refused(pair: Any) -> None:
    _, sender = pair
    lo, plan = _plan(1)
    pipe = PipelinePlan(PackedPlan(plan, 1 << 20), 1 << 30)
    small = PackedSender(sender.agent, sender.staging[:1000], sender.local_base,
                         sender.remote_base, sender.peer)
    with pytest.raises(ConfigError, match="staging bytes"):
        small.send(pipe, _source(lo), b"never")
    with pytest.raises(ConfigError, match="slot"):
        PipelinePlan(PackedPlan(plan, 1 << 20), 4096, 0)
    with pytest.raises(ConfigError, match="read_share"):
        PipelinePlan(PackedPlan(plan, 1 << 20), 4096, None, 1.5)
