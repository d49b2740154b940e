"""Near saturation: a request's tokens that pile up on the frontend queue leave as one
chunk (host.merge_tokens, vLLM's RequestOutputCollector), not one job each."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("simpy")

import simpy
from sim_helpers import config, with_profile

from pushkv.sim import run
from pushkv.sim.host.frontend import Frontend
from pushkv.sim.profile import ProfileError


def _burst(merge: int) -> tuple[list[float], int]:
    """One core busy for 10 ms from t=0; a request's 5 tokens reach the queue at t=1 ms,
    each 1 ms of service: the client times and the jobs served."""
    env = simpy.Environment()
    fe = Frontend(env, 1, token_s=0.001, merge=merge)
    fe.serve(0.010, lambda: None)
    req = SimpleNamespace(transfer_id="r0", decode="decode-0", client_times=[])

    def emit(_: object) -> None:
        for _ in range(5):
            fe.token(req)

    env.timeout(0.001).callbacks.append(emit)
    env.run()
    return req.client_times, fe.jobs


def test_tokens_waiting_together_leave_as_one_chunk() -> None:
    merged, jobs = _burst(24)
    assert merged == pytest.approx([0.011] * 5)
    assert jobs == 2  # the busy job and one chunk
    capped, jobs = _burst(2)  # two tokens a chunk at most
    assert capped == pytest.approx([0.011, 0.011, 0.012, 0.012, 0.013])
    assert jobs == 4
    for off in (0, 1):
        each, jobs = _burst(off)
        assert each == pytest.approx([0.011, 0.012, 0.013, 0.014, 0.015])
        assert jobs == 6


def _keys(merge: int, return_s: float = 0.002) -> object:
    return with_profile(prefill={"ingest_s": 0.002},
                        decode={"ingest_s": 0.003, "return_s": return_s},
                        host={"model": "shared-cpu", "frontend_cores": 1,
                              "merge_tokens": merge})


def test_a_frontend_that_keeps_up_merges_nothing() -> None:
    """At light load no token waits behind another of its request: the same times."""
    cfg = config("push", qps=2.0, input_len=256, output_len=16, num_prompts=8)
    on = run(dataclasses.replace(cfg, profile=_keys(16))).result
    off = run(dataclasses.replace(cfg, profile=_keys(0))).result
    assert on["ttfts"] == off["ttfts"] and on["itls"] == off["itls"]


def test_past_the_frontends_capacity_merging_keeps_ttft_bounded() -> None:
    """Tokens come faster than one frontend core passes them on one by one (20 requests
    a second, 32 tokens each, 2 ms a token: 1.3 cores of work): one job a token falls
    further behind with every step, and new requests' legs wait behind the backlog;
    merged, a request's backlog is one job, and the first tokens stay within twice
    light load's."""
    def ttft(qps: float, merge: int, n: int) -> float:
        cfg = config("push", qps=qps, input_len=256, output_len=32, num_prompts=n,
                     profile=_keys(merge, 0.002))
        res = run(cfg).result
        assert res["completed"] == n
        return res["mean_ttft_ms"]

    light, on, off = ttft(1.0, 32, 4), ttft(20.0, 32, 100), ttft(20.0, 0, 100)
    assert off > 5 * on
    assert on < 2 * light


def test_merge_tokens_is_a_count_of_the_shared_cpu_host() -> None:
    for bad in (-1, 2.5, True):
        with pytest.raises(ProfileError, match="merge_tokens"):
            with_profile(host={"model": "shared-cpu", "frontend_cores": 1,
                               "merge_tokens": bad})
    with pytest.raises(ProfileError, match="merge_tokens"):  # the GPU nodes run no host
        with_profile(host={"merge_tokens": 24})
