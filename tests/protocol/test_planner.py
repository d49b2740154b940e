"""The planner against a per-token reference: same bytes, minimum descriptors."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushkv.protocol import KVLayout, PlanError, plan_transfer
from pushkv.protocol.mapping import Assignment
from pushkv.transports.inmemory import copy_plan


def layout(num_blocks=32, block_size=4, heads=2, head_dim=4, dtype_bytes=2, order="NHD",
           stride=0, layers=2, planes=2):
    return KVLayout(num_blocks=num_blocks, block_size=block_size, num_heads=heads,
                    head_dim=head_dim, dtype_bytes=dtype_bytes, layer_end=layers,
                    planes=planes, order=order, block_stride=stride)


def elem(lo, ids, t, h):
    b, w = ids[t // lo.block_size], t % lo.block_size
    inner = w * lo.num_heads + h if lo.order == "NHD" else h * lo.block_size + w
    return b * lo.stride + inner * lo.head_dim * lo.dtype_bytes


def reference_pairs(src, dst, a, s_ids, d_ids, n, first):
    """Every element copy (src offset, dst offset), one per (token, head)."""
    return [(elem(src, s_ids, t, hs + i), elem(dst, d_ids, t, hd + i))
            for t in range(first, n) for hs, hd, c in a.heads for i in range(c)]


def minimum_descriptors(pairs, es):
    """Count of runs contiguous on both sides, by a plain loop in source order."""
    count, prev = 0, None
    for s, d in sorted(pairs):
        if prev is None or s != prev[0] + es or d != prev[1] + es:
            count += 1
        prev = (s, d)
    return count


@st.composite
def cases(draw):
    es_dim, dtype = draw(st.sampled_from([(4, 2), (8, 1)]))
    src_heads = draw(st.sampled_from([1, 2, 4]))
    dst_heads = draw(st.sampled_from([1, 2, 4]))
    count = draw(st.integers(1, min(src_heads, dst_heads)))
    hs = draw(st.integers(0, src_heads - count))
    hd = draw(st.integers(0, dst_heads - count))
    runs = ((hs, hd, count),) if draw(st.booleans()) or count == 1 else (
        (hs, hd, 1), (hs + 1, hd + 1, count - 1))
    bs_s = draw(st.sampled_from([1, 2, 4, 8, 16]))
    bs_d = draw(st.sampled_from([1, 2, 4, 8, 16]))
    n = draw(st.integers(0, 70))
    first = draw(st.integers(0, n))
    nb_s = draw(st.integers(max(1, -(-n // bs_s)), 80))
    nb_d = draw(st.integers(max(1, -(-n // bs_d)), 80))
    s_order = draw(st.sampled_from(["NHD", "HND"]))
    d_order = draw(st.sampled_from(["NHD", "HND"]))
    src = layout(nb_s, bs_s, src_heads, es_dim, dtype, s_order)
    dst = layout(nb_d, bs_d, dst_heads, es_dim, dtype, d_order,
                 stride=draw(st.sampled_from([0, 0, (bs_d * dst_heads * es_dim * dtype) * 2])))
    contiguous = draw(st.booleans())
    k_s, k_d = -(-n // bs_s), -(-n // bs_d)
    if contiguous:
        s0 = draw(st.integers(0, nb_s - k_s))
        d0 = draw(st.integers(0, nb_d - k_d))
        s_ids, d_ids = list(range(s0, s0 + k_s)), list(range(d0, d0 + k_d))
    else:
        s_ids = draw(st.permutations(range(nb_s)))[:k_s]
        d_ids = draw(st.permutations(range(nb_d)))[:k_d]
    a = Assignment(src_rank=0, dst_rank=0, layers=range(0, 2), heads=runs)
    return src, dst, a, s_ids, d_ids, n, first


@given(cases())
def test_plan_moves_exactly_the_reference_bytes(case):
    src, dst, a, s_ids, d_ids, n, first = case
    plan = plan_transfer(src, dst, a, s_ids, d_ids, n, first)
    rng = np.random.default_rng(0)
    s_mem = [rng.integers(1, 256, src.region_bytes, dtype=np.uint8) for _ in range(4)]
    got = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    want = [np.zeros(dst.region_bytes, np.uint8) for _ in range(4)]
    copy_plan(plan, s_mem, got)
    es = src.head_dim * src.dtype_bytes
    pairs = reference_pairs(src, dst, a, s_ids, d_ids, n, first)
    for r in range(4):
        for so, do in pairs:
            want[r][do:do + es] = s_mem[r][so:so + es]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    assert plan.runs_per_region == minimum_descriptors(pairs, es)
    assert plan.nbytes == len(pairs) * es * 4


def test_contiguous_allocation_is_one_run_per_region():
    lo = layout(num_blocks=2048, block_size=16, heads=1, head_dim=128, layers=64)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(64), heads=((0, 0, 1),))
    plan = plan_transfer(lo, lo, a, range(100, 1124), range(7, 1031), 16384)
    assert plan.runs_per_region == 1
    assert plan.descriptor_count == 128
    assert plan.nbytes == 16384 * 256 * 128


def test_fragmented_allocation_is_one_run_per_block():
    lo = layout(num_blocks=2048, block_size=16, heads=1, head_dim=128, layers=64)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(64), heads=((0, 0, 1),))
    rng = np.random.default_rng(1)
    plan = plan_transfer(lo, lo, a, rng.permutation(2048)[:1024] * 2 // 2,
                         rng.permutation(2048)[:1024], 16384)
    assert 1000 <= plan.runs_per_region <= 1024


def test_reversed_adjacent_blocks_still_merge():
    lo = layout(num_blocks=8, block_size=4, heads=1, head_dim=4)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 1),))
    plan = plan_transfer(lo, lo, a, [5, 4], [3, 2], 8)
    assert plan.runs_per_region == 1  # in memory order the two blocks are one run


def test_descriptors_are_nixl_shaped():
    lo = layout(num_blocks=8, block_size=4, heads=1, head_dim=4)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 1),))
    plan = plan_transfer(lo, lo, a, [1, 5], [2, 3], 8)
    src, dst = plan.descriptors([1000, 2000, 3000, 4000], [10, 20, 30, 40], 0, 1)
    assert src.shape == dst.shape == (plan.descriptor_count, 3)
    assert src[:, 1].tolist() == dst[:, 1].tolist()
    assert set(dst[:, 2].tolist()) == {1}
    assert src[0, 0] == 1000 + 1 * lo.stride


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"s_ids": [0, 99]}, "source block id outside"),
        ({"d_ids": [-1, 2]}, "destination block id outside"),
        ({"d_ids": [1]}, "destination has 1 blocks"),
        ({"n": 9}, "source has 2 blocks"),
        ({"first": 9}, "empty or reversed"),
        ({"dst": layout(head_dim=8)}, "element shape"),
        ({"dst": layout(planes=1)}, "planes differ"),
        ({"dst": layout(layers=1)}, "does not hold layers"),
        ({"heads": ((1, 0, 2),)}, "outside the ranks' heads"),
        ({"s_ids": [[0, 1]]}, "flat list"),
    ],
)
def test_unplannable_requests_are_rejected(kwargs, match):
    src = layout()
    args = {"dst": layout(), "s_ids": [0, 1], "d_ids": [2, 3], "n": 8, "first": 0,
            "heads": ((0, 0, 2),)} | kwargs
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=args["heads"])
    with pytest.raises(PlanError, match=match):
        plan_transfer(src, args["dst"], a, args["s_ids"], args["d_ids"], args["n"],
                      args["first"])


def test_empty_token_range_plans_nothing():
    lo = layout()
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 2),))
    for first in (0, 5, 8):
        plan = plan_transfer(lo, lo, a, (0, 1), (2, 3), first, first)
        assert plan.descriptor_count == 0 and plan.nbytes == 0


def test_opaque_blocks_move_whole_and_only_between_alike():
    lo = layout(order="BLOCK")
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 2),))
    plan = plan_transfer(lo, lo, a, (3, 7, 1), (2, 5, 6), 9)  # 9 tokens: 3 whole blocks
    assert plan.runs_per_region == 3 and plan.nbytes == 3 * lo.block_bytes * 4
    with pytest.raises(PlanError, match="its like"):
        plan_transfer(lo, layout(order="NHD"), a, (3,), (2,), 4)
    with pytest.raises(PlanError, match="block boundary"):
        plan_transfer(lo, lo, a, (3, 7), (2, 5), 8, 2)
    with pytest.raises(PlanError, match="slice of the heads"):
        plan_transfer(lo, lo, Assignment(src_rank=0, dst_rank=0, layers=range(2),
                                         heads=((0, 0, 1),)), (3,), (2,), 4)
