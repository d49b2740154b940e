"""Arrivals and the block allocator."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("simpy")

from pushkv.sim.blocks import BlockPool, OutOfBlocks, fragmented_order
from pushkv.sim.workload import WorkloadConfig, WorkloadError, arrivals, generate


def test_last_request_leaves_at_n_over_rate_like_vllm() -> None:
    cfg = WorkloadConfig(request_rate=4.0, num_prompts=100)
    t = arrivals(cfg, np.random.default_rng(1))
    assert t[-1] == pytest.approx(25.0)
    assert np.all(np.diff(t) >= 0)
    assert t[0] > 0


def test_same_seed_same_arrivals_other_seed_other_arrivals() -> None:
    cfg = WorkloadConfig(request_rate=2.0, num_prompts=50)
    a = arrivals(cfg, np.random.default_rng(7))
    b = arrivals(cfg, np.random.default_rng(7))
    c = arrivals(cfg, np.random.default_rng(8))
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_lower_burstiness_gives_burstier_gaps() -> None:
    rng = np.random.default_rng(0)
    smooth = np.diff(arrivals(WorkloadConfig(request_rate=8, num_prompts=4000,
                                             burstiness=4.0), rng))
    bursty = np.diff(arrivals(WorkloadConfig(request_rate=8, num_prompts=4000,
                                             burstiness=0.25), rng))
    cv = lambda x: x.std() / x.mean()  # noqa: E731
    assert cv(bursty) > 1.5 > 0.7 > cv(smooth)


def test_infinite_rate_sends_everything_at_once() -> None:
    reqs = generate(WorkloadConfig(request_rate=float("inf"), num_prompts=5),
                    np.random.default_rng(0))
    assert [r.arrival for r in reqs] == [0.0] * 5
    assert [r.index for r in reqs] == list(range(5))


@pytest.mark.parametrize("kw", [{"request_rate": 0}, {"request_rate": -1},
                                {"request_rate": float("nan")}, {"burstiness": 0},
                                {"input_len": 0}, {"output_len": 0}, {"num_prompts": 0}])
def test_bad_workloads_are_refused(kw: dict[str, float]) -> None:
    with pytest.raises(WorkloadError):
        WorkloadConfig(**kw)  # type: ignore[arg-type]


def test_unfragmented_pool_hands_out_consecutive_blocks() -> None:
    pool = BlockPool(1000, 0.0, np.random.default_rng(0))
    assert pool.allocate(10) == list(range(10))


def test_fragmentation_sets_the_mean_run_length() -> None:
    order = fragmented_order(200_000, 0.1, np.random.default_rng(0))
    assert sorted(order.tolist()) == list(range(200_000))  # a permutation
    breaks = np.count_nonzero(np.diff(order) != 1)
    assert breaks / len(order) == pytest.approx(0.1, rel=0.05)


def test_fully_fragmented_pool_rarely_has_neighbours() -> None:
    order = fragmented_order(100_000, 1.0, np.random.default_rng(0))
    assert np.count_nonzero(np.diff(order) == 1) < 10


def test_pool_accounts_and_refuses_overdraw() -> None:
    pool = BlockPool(8, 0.5, np.random.default_rng(3))
    a = pool.allocate(5)
    assert (pool.num_used, pool.num_free) == (5, 3)
    with pytest.raises(OutOfBlocks):
        pool.allocate(4)
    pool.free(a)
    assert (pool.num_used, pool.num_free) == (0, 8)
    assert sorted(pool.allocate(8)) == list(range(8))
