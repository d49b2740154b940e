"""Packed writes on host memory: gather -> wire -> scatter moves the plan's bytes.

Every byte test runs on both copy paths: the row map (every run a multiple of one
unit of at least ``MIN_ROW_UNIT`` bytes) and the grouped one (smaller units); the
planner's cases have 8-byte elements, so the row path is forced for them by lowering
``MIN_ROW_UNIT`` inside the test."""

import contextlib
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pushkv.protocol import plan_transfer
from pushkv.protocol.errors import ConfigError
from pushkv.protocol.mapping import Assignment
from pushkv.protocol.packing import PackedPlan
from pushkv.transports import staging as staging_mod
from pushkv.transports.inmemory import copy_plan
from pushkv.transports.staging import (
    chunk_bounds,
    copy_staging,
    gather_host,
    gather_torch,
    row_map,
    scatter_host,
    scatter_torch,
)
from tests.protocol.test_planner import cases, layout

PATHS = ("rows", "grouped")


@contextlib.contextmanager
def copy_path(path):
    """Run with the row map (any unit of 1 byte or more) or without it."""
    saved = staging_mod.MIN_ROW_UNIT
    staging_mod.MIN_ROW_UNIT = 1 if path == "rows" else 1 << 62
    try:
        yield
    finally:
        staging_mod.MIN_ROW_UNIT = saved


def packed_copy(plan, src, dst, chunk=64):
    """Gather into one staging buffer, wire-copy into another, scatter; each staging
    image at an odd offset of its buffer, the bytes around it must stay untouched."""
    packed = PackedPlan(plan, chunk)
    n = packed.nbytes
    bufs = np.full(n + 100, 7, np.uint8), np.full(n + 50, 9, np.uint8)
    views = bufs[0][37:37 + n], bufs[1][13:13 + n]
    gather_host(packed, src, views[0])
    copy_staging(views[0], views[1], packed.wire)
    scatter_host(packed, views[1], dst)
    return bufs, n


@given(cases(), st.sampled_from(PATHS))
def test_packed_path_moves_exactly_the_direct_bytes(case, path):
    """Every layout pair of the planner's cases: TP head slices, block-size mapping,
    HND/NHD, strided blocks."""
    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    rng = np.random.default_rng(1)
    s_mem = [rng.integers(1, 256, src.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    got = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    with copy_path(path):
        (out, into), n = packed_copy(plan, s_mem, got)
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert not np.any(out[:37] != 7) and not np.any(out[37 + n:] != 7)
    assert not np.any(into[:13] != 9) and not np.any(into[13 + n:] != 9)


def chunked_copy(plan, s_mem, d_mem, gather_chunk, scatter_chunk):
    """Gather and scatter in (different) chunks of the staging image, each chunk in a
    buffer of its own size, as a pipelined write does."""
    packed = PackedPlan(plan, 64)
    image = np.zeros(packed.nbytes, np.uint8)
    g = chunk_bounds(packed, gather_chunk)
    assert g[0] == 0 and g[-1] == packed.nbytes and g == sorted(set(g))
    for a, b in itertools.pairwise(g):
        part = np.full(b - a, 0xEE, np.uint8)
        gather_host(packed, s_mem, part, a, b)
        image[a:b] = part
    s = chunk_bounds(packed, scatter_chunk)
    for a, b in itertools.pairwise(s):
        scatter_host(packed, image[a:b].copy(), d_mem, a, b)
    return g


@settings(max_examples=60)
@given(cases(), st.sampled_from(PATHS), st.integers(1, 300), st.integers(1, 300))
def test_chunked_gather_and_scatter_move_the_same_bytes(case, path, g_chunk, s_chunk):
    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    rng = np.random.default_rng(4)
    s_mem = [rng.integers(1, 256, src.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    got = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    with copy_path(path):
        chunked_copy(plan, s_mem, got, g_chunk, s_chunk)
    assert all(np.array_equal(x, w) for x, w in zip(got, want, strict=True))


def block_ids(rng, num_blocks, count, runs):
    """``count`` distinct block ids, in stretches of consecutive ids of random length
    (up to ``runs``): mixed run lengths once both sides are consecutive together."""
    free = list(rng.permutation(num_blocks // runs) * runs)
    out = []
    while len(out) < count:
        start = free.pop()
        out.extend(range(start, start + int(rng.integers(1, runs + 1))))
    return out[:count]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("order", ["NHD", "HND"])
def test_mixed_run_lengths_take_the_row_path_and_move_the_same_bytes(path, order):
    """Blocks consecutive on both sides merge into runs of 1-4 blocks: one plan with
    several run lengths, whose unit is still the block (whole heads)."""
    lo = layout(num_blocks=256, block_size=16, heads=1, head_dim=64, dtype_bytes=2,
                order=order)
    rng = np.random.default_rng(5)
    s_ids = block_ids(rng, 256, 120, 4)
    d_ids = [s + 3 for s in s_ids[:60]] + block_ids(rng, 250, 60, 3)
    d_ids = list(dict.fromkeys(d_ids))[:len(s_ids)]
    d_ids += [b for b in range(256) if b not in set(d_ids)][:len(s_ids) - len(d_ids)]
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 1),))
    plan = plan_transfer(lo, lo, a, s_ids, d_ids, 16 * len(s_ids))
    lengths = set(plan.runs[:, 2].tolist())
    assert len(lengths) >= 3
    packed = PackedPlan(plan, 1 << 14)
    rm = row_map(packed)
    assert rm is not None and rm.unit == lo.block_bytes  # the fast path is the one taken
    s_mem = [rng.integers(1, 256, lo.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    with copy_path(path):
        got = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
        packed_copy(plan, s_mem, got, chunk=1 << 14)
        assert all(np.array_equal(x, w) for x, w in zip(got, want, strict=True))
        got = [np.zeros(lo.region_bytes, np.uint8) for _ in range(4)]
        chunked_copy(plan, s_mem, got, 5000, 12345)
        assert all(np.array_equal(x, w) for x, w in zip(got, want, strict=True))


def test_ranges_off_the_cut_points_and_short_regions_are_refused():
    lo = layout(num_blocks=16, block_size=16, heads=1, head_dim=64, dtype_bytes=2)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 1),))
    plan = plan_transfer(lo, lo, a, [9, 3, 14, 0], [1, 15, 7, 8], 64)
    packed = PackedPlan(plan, 1 << 20)
    s_mem = [np.ones(lo.region_bytes, np.uint8) for _ in range(4)]
    out = np.zeros(packed.nbytes, np.uint8)
    for path in PATHS:
        with copy_path(path):
            with pytest.raises(ConfigError, match="range"):
                gather_host(packed, s_mem, out, 100, 2048)  # not a run start
            with pytest.raises(ConfigError, match="range"):
                gather_host(packed, s_mem, out, 0, packed.nbytes + 1)
    assert not out.any()
    short = [np.ones(lo.block_bytes * 10, np.uint8) for _ in range(4)]
    with pytest.raises(ConfigError, match="too small"):
        gather_host(packed, short, out)
    strided = np.zeros(2 * packed.nbytes, np.uint8)[::2]  # a reshape would copy it
    with pytest.raises(ConfigError, match="contiguous"):
        gather_host(packed, s_mem, strided)
    with pytest.raises(ConfigError, match="contiguous"):
        scatter_host(packed, out, [np.zeros(2 * lo.region_bytes, np.uint8)[::2]] * 4)
    assert not strided.any()


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


@contextlib.contextmanager
def torch_kernels(on):
    """CPU tensors through torch's own kernels (the device path) or numpy views."""
    saved = staging_mod.TORCH_CPU_VIA_NUMPY
    staging_mod.TORCH_CPU_VIA_NUMPY = not on
    try:
        yield
    finally:
        staging_mod.TORCH_CPU_VIA_NUMPY = saved


@settings(max_examples=40)
@given(cases(), st.sampled_from(PATHS), st.integers(1, 300), st.booleans())
def test_torch_gather_and_scatter_match_numpy(case, path, chunk, kernels):
    """The device path (torch kernels, here on CPU tensors) and CPU tensors through
    numpy land the same bytes as the direct copy, whole and in chunks."""
    torch = pytest.importorskip("torch")
    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    packed = PackedPlan(plan, 64)
    rng = np.random.default_rng(3)
    s_mem = [rng.integers(1, 256, src.region_bytes, dtype=np.uint8) for _ in range(4)]
    want = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, want)
    t_src = [torch.from_numpy(m.copy()) for m in s_mem]
    with copy_path(path), torch_kernels(kernels):
        t_dst = [torch.zeros(dst.region_bytes, dtype=torch.uint8) for _ in range(4)]
        staging = torch.zeros(max(packed.nbytes, 1), dtype=torch.uint8)
        gather_torch(packed, t_src, staging)
        scatter_torch(packed, staging, t_dst)
        assert all(np.array_equal(g.numpy(), w) for g, w in zip(t_dst, want, strict=True))
        t_dst = [torch.zeros(dst.region_bytes, dtype=torch.uint8) for _ in range(4)]
        bounds = chunk_bounds(packed, chunk)
        for lo, hi in itertools.pairwise(bounds):
            part = torch.zeros(hi - lo, dtype=torch.uint8)
            gather_torch(packed, t_src, part, start=lo, stop=hi)
            scatter_torch(packed, part, t_dst, start=lo, stop=hi)
        assert all(np.array_equal(g.numpy(), w) for g, w in zip(t_dst, want, strict=True))


@settings(max_examples=60)
@given(cases(), st.sampled_from(PATHS), st.integers(1, 400),
       st.one_of(st.none(), st.integers(1, 6)), st.floats(0, 1))
def test_pipeline_schedule_partitions_the_image_and_never_shares_a_live_slot(
        case, path, chunk, slots, share):
    """Chunks cover the staging image in order; in a ring, the chunks that can be in
    flight at once (``slots`` consecutive ones) sit in disjoint slots inside the ring;
    ``read_share`` of the chunks, evenly spread, are read by the consumer."""
    from pushkv.transports.packed_pipeline import PipelinePlan

    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    with copy_path(path):
        pipe = PipelinePlan(PackedPlan(plan, 64), chunk, slots, share)
    spans = [pipe.span(k) for k in range(pipe.chunks)]
    assert [lo for lo, _ in spans[1:]] == [hi for _, hi in spans[:-1]]
    assert (spans[0][0], spans[-1][1]) == (0, pipe.packed.nbytes) if spans else \
        pipe.packed.nbytes == 0
    for k, (lo, hi) in enumerate(spans):
        assert pipe.offset(k) >= 0 and pipe.offset(k) + hi - lo <= pipe.staging_bytes
    if slots is not None:
        for k in range(pipe.chunks):
            live = [(pipe.offset(j), pipe.offset(j) + spans[j][1] - spans[j][0])
                    for j in range(k, min(k + slots, pipe.chunks))]
            live.sort()
            assert all(x[1] <= y[0] for x, y in itertools.pairwise(live))
    reads = sum(pipe.read(k) for k in range(pipe.chunks))
    assert reads == int(pipe.chunks * share)
    assert all(pipe.acked(k) for k in range(pipe.chunks) if pipe.read(k) or slots)
