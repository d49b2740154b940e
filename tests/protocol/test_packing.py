"""The packing cost model and the byte maps of a packed write."""

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushkv.protocol import ConfigError, plan_transfer
from pushkv.protocol.mapping import Assignment
from pushkv.protocol.packing import PackedPlan, PackingConfig, choose, packed_descriptors
from tests.protocol.test_planner import layout

GiB = 1 << 30


def test_small_plans_stay_direct_under_the_budget():
    cfg = PackingConfig()
    c = choose(cfg, descriptors=cfg.descriptor_budget, nbytes=64 << 20, staging_free=GiB)
    assert not c.packed and c.reason == "budget" and c.wire_descriptors == cfg.descriptor_budget


def test_fragmented_request_packs_when_posting_costs_more_than_two_copies():
    # One Qwen3-32B TP8 rank, 16k tokens, fragmented: 131,072 descriptors, 512 MiB.
    cfg = PackingConfig(post_per_descriptor_s=3e-6, gather_bytes_per_s=400e9,
                        scatter_bytes_per_s=400e9)
    c = choose(cfg, descriptors=131_072, nbytes=512 << 20, staging_free=GiB)
    assert c.packed and c.wire_descriptors == 32 and c.packed_s < c.direct_s


def test_slow_copies_or_cheap_posting_keep_writes_direct():
    nvlink = PackingConfig(post_per_descriptor_s=0.05e-6)
    assert choose(nvlink, descriptors=131_072, nbytes=512 << 20, staging_free=GiB).reason \
        == "cost"


def test_modes_and_staging_availability():
    args = {"descriptors": 10, "nbytes": 4096}
    assert choose(PackingConfig(mode="always"), staging_free=4096, **args).packed
    assert choose(PackingConfig(mode="always"), staging_free=4095, **args).reason == "staging"
    assert not choose(PackingConfig(mode="never"), staging_free=GiB,
                      descriptors=10**6, nbytes=1).packed
    assert choose(PackingConfig(mode="always"), staging_free=GiB, descriptors=0,
                  nbytes=0).reason == "empty"


@pytest.mark.parametrize("kwargs", [{"mode": "sometimes"}, {"chunk_bytes": 0},
                                    {"gather_bytes_per_s": 0}, {"descriptor_budget": -1},
                                    {"post_per_descriptor_s": -1.0}])
def test_bad_settings_are_typed_errors(kwargs):
    with pytest.raises(ConfigError):
        PackingConfig(**kwargs)


def test_wire_descriptors_cover_the_staging_image_in_chunks():
    assert packed_descriptors(0, 16) == 0
    assert packed_descriptors(33, 16) == 3


@given(st.integers(1, 5), st.permutations(range(12)), st.permutations(range(12)),
       st.integers(1, 40))
def test_packed_plan_maps_are_consistent(chunk, s_ids, d_ids, n):
    lo = layout(num_blocks=12, block_size=4)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 2),))
    plan = plan_transfer(lo, lo, a, list(s_ids), list(d_ids), n)
    p = PackedPlan(plan, chunk * 7)
    assert p.nbytes == plan.nbytes
    # staging offsets tile [0, nbytes) exactly once
    order = np.argsort(p.gather[:, 2])
    starts, lengths = p.gather[order, 2], p.gather[order, 3]
    assert starts[0] == 0 and np.array_equal(starts[1:], np.cumsum(lengths)[:-1])
    assert np.array_equal(p.gather[:, 2:], p.scatter[:, [0, 3]])
    assert int(p.wire[:, 1].sum()) == p.nbytes and p.wire_descriptors == -(-p.nbytes // (chunk * 7))


@given(st.integers(0, 300), st.integers(1, 5), st.permutations(range(12)),
       st.permutations(range(12)), st.integers(1, 40))
def test_chunk_bounds_cut_the_image_at_runs_and_wire_follows(size, chunk, s_ids, d_ids, n):
    """Rule 10, pipelined: the cut points tile the image in order, cut no run (or fall on
    the plan's unit), hold at most ``size`` bytes plus one run each (a run stays whole),
    and each chunk's wire descriptors cover exactly its bytes."""
    from pushkv.protocol.packing import MAX_CHUNKS, chunk_bounds, run_unit

    lo = layout(num_blocks=12, block_size=4)
    a = Assignment(src_rank=0, dst_rank=0, layers=range(2), heads=((0, 0, 2),))
    p = PackedPlan(plan_transfer(lo, lo, a, list(s_ids), list(d_ids), n), chunk * 7)
    b = chunk_bounds(p, size)
    assert b[0] == 0 and b[-1] == p.nbytes and list(b) == sorted(set(b))
    assert len(b) - 1 <= MAX_CHUNKS
    if size == 0:
        assert b == (0, p.nbytes)
    starts = set(p.gather[:, 2].tolist()) | {p.nbytes}
    unit = run_unit(p)
    longest = int(p.gather[:, 3].max())
    for x, y in itertools.pairwise(b):
        assert x in starts or (unit >= 64 and x % unit == 0)
        assert size == 0 or y - x <= size + longest
        w = p.wire_between(x, y)
        assert int(w[:, 1].sum()) == y - x and (w[:, 0] >= x).all()
        assert (w[:, 0] + w[:, 1] <= y).all()


def test_pipeline_bytes_is_a_checked_setting():
    assert PackingConfig().pipeline_bytes == 4 << 20
    with pytest.raises(ConfigError):
        PackingConfig(pipeline_bytes=-1)
