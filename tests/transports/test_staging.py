"""Packed writes on host memory: gather -> wire -> scatter moves the plan's bytes."""

import numpy as np
import pytest
from hypothesis import given, settings

from pushkv.protocol import plan_transfer
from pushkv.protocol.mapping import Assignment
from pushkv.protocol.packing import PackedPlan
from pushkv.transports.inmemory import copy_plan
from pushkv.transports.staging import (
    StagingExhausted,
    StagingPool,
    copy_staging,
    gather_host,
    gather_torch,
    scatter_host,
    scatter_torch,
)
from tests.protocol.test_planner import cases, layout


def packed_copy(plan, src, dst, chunk=64):
    packed = PackedPlan(plan, chunk)
    pools = StagingPool(packed.nbytes + 100), StagingPool(packed.nbytes + 50)
    if not packed.nbytes:
        return pools
    offs = [p.lend(packed.nbytes) for p in pools]
    views = [p.view(o, packed.nbytes) for p, o in zip(pools, offs, strict=True)]
    gather_host(packed, src, views[0])
    copy_staging(views[0], views[1], packed.wire)
    scatter_host(packed, views[1], dst)
    for p, o in zip(pools, offs, strict=True):
        p.give_back(o)
    return pools


@given(cases())
def test_packed_path_moves_exactly_the_direct_bytes(case):
    """Every layout pair of the planner's cases: TP head slices, block-size mapping,
    HND/NHD, strided blocks."""
    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    rng = np.random.default_rng(1)
    s_mem = [rng.integers(1, 256, src.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    got = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    pools = packed_copy(plan, s_mem, got)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert [p.lent_bytes for p in pools] == [0, 0]


def test_opaque_blocks_through_the_packed_path():
    lo = layout(order="BLOCK", num_blocks=16)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 2),))
    plan = plan_transfer(lo, lo, a, [9, 3, 14, 0], [1, 15, 7, 8], 13)
    rng = np.random.default_rng(2)
    s_mem = [rng.integers(1, 256, lo.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
    got = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    packed_copy(plan, s_mem, got, chunk=100)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


def test_pool_lends_disjoint_ranges_and_coalesces_on_return():
    pool = StagingPool(100)
    a, b, c = pool.lend(30), pool.lend(30), pool.lend(40)
    assert sorted([a, b, c]) == [0, 30, 60]
    with pytest.raises(StagingExhausted):
        pool.lend(1)
    pool.give_back(b)
    assert pool.largest_free() == 30
    pool.give_back(a)
    pool.give_back(c)
    assert pool.lent_bytes == 0 and pool.largest_free() == 100
    with pytest.raises(KeyError):
        pool.give_back(a)  # a range is given back once


@settings(max_examples=30)
@given(cases())
def test_torch_gather_and_scatter_match_numpy(case):
    """The device path (here on CPU tensors) lands the same bytes as the direct copy."""
    torch = pytest.importorskip("torch")
    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    packed = PackedPlan(plan, 64)
    rng = np.random.default_rng(3)
    s_mem = [rng.integers(1, 256, src.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    t_src = [torch.from_numpy(m.copy()) for m in s_mem]
    t_dst = [torch.zeros(dst.region_bytes, dtype=torch.uint8) for _ in range(4)]
    staging = torch.zeros(max(packed.nbytes, 1), dtype=torch.uint8)
    gather_torch(packed, t_src, staging)
    scatter_torch(packed, staging, t_dst)
    assert all(np.array_equal(g.numpy(), w) for g, w in zip(t_dst, want, strict=True))
