"""Each switchable mechanism's limiting case against its closed form."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from sim_helpers import config, with_profile

from pushkv.sim import costs, run
from pushkv.sim.profile import DEFAULT

H8 = sum(1 / k for k in range(1, 9))  # the slowest of 8 exponentials: H_8 x the mean


def _alone(mode: str, **sections: dict) -> tuple[float, float]:
    """TTFT of one request alone, and the duration of its transfer as one rank sees it
    (from the start of posting to the end of the wire)."""
    r = run(config(mode, qps=1.0, input_len=4096, output_len=4, num_prompts=1,
                   profile=with_profile(**sections) if sections else DEFAULT),
            keep_objects=True)
    assert r.transport is not None
    (n,) = r.transport.descriptors
    net = DEFAULT.network
    kv = 4096 * DEFAULT.model.kv_bytes_per_token(DEFAULT.decode.tp)
    moved = costs.pipelined_s(net, kv, n, read=mode != "push",
                              posting_left_s=costs.post_s(net, n))
    return r.result["ttfts"][0], moved


@pytest.mark.parametrize("mode", ["pull", "pull-async", "push"])
def test_ready_waits_for_the_slowest_rank(mode: str) -> None:
    """With a fixed skew the slowest rank takes (1 + 2s) times as long: TTFT grows by
    exactly 2s times the transfer."""
    base, moved = _alone(mode)
    skewed, _ = _alone(mode, network={"rank_skew": 0.1, "rank_skew_dist": "fixed"})
    assert skewed - base == pytest.approx(0.2 * moved, abs=2e-7)  # ttfts: 7 decimals


def test_exponential_skew_makes_the_slowest_of_eight_h8_times_late() -> None:
    r = run(config("push", qps=8.0, input_len=1024, output_len=4, num_prompts=400,
                   profile=with_profile(network={"rank_skew": 0.05})), keep_objects=True)
    assert r.transport is not None
    skews = r.transport.skews
    assert len(skews) == 400
    assert sum(skews) / len(skews) == pytest.approx(0.05 * H8, rel=0.08)
