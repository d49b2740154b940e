"""Near saturation: a request's tokens that pile up on the frontend queue leave as one
chunk (host.merge_tokens, vLLM's RequestOutputCollector), not one job each; with
host.token_item_s every token ready for a decode API server joins its one wake-up."""

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


#: a token's way out in two jobs: 1 ms alone, 0.6 of it its API server's; 0.4 ms when
#: it shares its wake-ups, 0.2 of it its API server's
TWO = {"api_s": 0.0006, "item_s": 0.0004, "api_item_s": 0.0002}


def _frontend(merge: int, **two: float) -> tuple[simpy.Environment, Frontend]:
    """One frontend core busy for 10 ms from t=0; a token's way out 1 ms alone."""
    env = simpy.Environment()
    fe = Frontend(env, 1, token_s=0.001, merge=merge, **two)
    fe.serve(0.010, lambda: None)
    return env, fe


def _wake_up(merge: int, **two: float) -> tuple[dict[str, list[float]], int]:
    """At t=1 ms r0 emits 3 tokens and r1 2 on decode-0, r2 one on decode-1: the client
    times by request and the jobs served."""
    env, fe = _frontend(merge, **two)
    reqs = {name: SimpleNamespace(transfer_id=name, decode=decode, client_times=[])
            for name, decode in (("r0", "decode-0"), ("r1", "decode-0"), ("r2", "decode-1"))}

    def emit(_: object) -> None:
        for name in ("r0", "r0", "r0", "r1", "r1", "r2"):
            fe.token(reqs[name])

    env.timeout(0.001).callbacks.append(emit)
    env.run()
    return {name: r.client_times for name, r in reqs.items()}, fe.jobs


def test_an_api_server_takes_every_token_ready_in_one_wake_up() -> None:
    """decode-0's five tokens, of two requests, are one job of its loop (0.6 ms and
    four items: done at 2.4 ms), decode-1's one of its own (1.6 ms); the three chunks
    are one relay job behind the busy frontend (0.4 ms and two items, 10.0-10.8 ms),
    passed on in turn."""
    got, jobs = _wake_up(24, **TWO)
    assert got["r2"] == pytest.approx([0.0104])
    assert got["r0"] == pytest.approx([0.0106] * 3)
    assert got["r1"] == pytest.approx([0.0108] * 2)
    assert jobs == 4  # the busy job, two API jobs, one relay job


def test_a_request_past_merge_tokens_starts_the_next_wake_up() -> None:
    """Two of a request's tokens a chunk at most: r0's third starts decode-0's next
    job, which r1's tokens join; four chunks to relay."""
    got, jobs = _wake_up(2, **TWO)
    assert got["r2"] == pytest.approx([0.0104])
    assert got["r0"] == pytest.approx([0.0106, 0.0106, 0.0108])
    assert got["r1"] == pytest.approx([0.011] * 2)
    assert jobs == 5


def test_a_request_merges_only_while_its_api_server_is_behind() -> None:
    """r0's tokens at 1.0, 1.3 and 1.5 ms, the frontend queue busy until 10 ms: its API
    server runs the first at once (until 1.6 ms), so only the two that came meanwhile
    merge -- two chunks, where one job on the busy queue merged all three into one."""
    def times(**two: float) -> list[float]:
        env, fe = _frontend(24, **two)
        req = SimpleNamespace(transfer_id="r0", decode="decode-0", client_times=[])
        for at in (0.001, 0.0013, 0.0015):
            env.timeout(at).callbacks.append(lambda _: fe.token(req))
        env.run()
        return req.client_times

    assert times(**TWO) == pytest.approx([0.0104, 0.0106, 0.0106])
    assert times() == pytest.approx([0.011] * 3)


def test_an_api_servers_intake_queues_on_its_own_loop() -> None:
    """With the two jobs each API server is a loop of its own: a leg's 2 ms intake at
    0.5 ms runs at once beside the busy frontend queue, and a token of the same server
    at 1 ms waits behind it there (until 2.5 ms), merging the token that follows."""
    env, fe = _frontend(24, **TWO)
    assert fe.loops
    took: list[float] = []
    req = SimpleNamespace(transfer_id="r0", decode="decode-0", client_times=[])
    env.timeout(0.0005).callbacks.append(lambda _: fe.serve(
        0.002, lambda: took.append(env.now), process="decode-0", own_loop=True))
    for at in (0.001, 0.002):
        env.timeout(at).callbacks.append(lambda _: fe.token(req))
    env.run()
    assert took == pytest.approx([0.0025])
    assert req.client_times == pytest.approx([0.0104] * 2)  # one chunk, relayed at 10 ms


def test_without_merging_the_two_jobs_are_off() -> None:
    """merge_tokens 0: every token one job of its own on the frontend queue."""
    assert _wake_up(0, **TWO) == _wake_up(0)
    each, jobs = _wake_up(0, **TWO)
    assert jobs == 7 and each["r2"] == pytest.approx([0.016])
    assert not _frontend(0, **TWO)[1].loops and not _frontend(24)[1].loops


def _keys(merge: int, return_s: float = 0.002, **two: float) -> object:
    return with_profile(prefill={"ingest_s": 0.002},
                        decode={"ingest_s": 0.003, "return_s": return_s},
                        host={"model": "shared-cpu", "frontend_cores": 1,
                              "merge_tokens": merge, **two})


def test_a_frontend_that_keeps_up_merges_nothing() -> None:
    """At light load no token waits behind another of its request: the same times; and
    a request streaming alone has its way out in two jobs at the same times."""
    cfg = config("push", qps=2.0, input_len=256, output_len=16, num_prompts=8)
    on = run(dataclasses.replace(cfg, profile=_keys(16))).result
    off = run(dataclasses.replace(cfg, profile=_keys(0))).result
    assert on["ttfts"] == off["ttfts"] and on["itls"] == off["itls"]
    alone = config("push", qps=0.2, input_len=256, output_len=16, num_prompts=4)
    two = run(dataclasses.replace(alone, profile=_keys(16, token_api_s=0.0012,
                                                       token_item_s=0.0008,
                                                       token_api_item_s=0.0004))).result
    one = run(dataclasses.replace(alone, profile=_keys(0))).result
    assert two["ttfts"] == pytest.approx(one["ttfts"])
    assert [x for r in two["itls"] for x in r] == pytest.approx(
        [x for r in one["itls"] for x in r])


def test_shared_wake_ups_let_the_frontend_keep_up_where_one_a_token_cannot() -> None:
    """20 requests a second of 32 tokens at 2 ms a token is 1.3 cores of work on one: a
    token sharing its processes' wake-ups for 0.8 ms brings it under one core, so TTFT
    stays within twice light load's, where one job a token falls further behind."""
    two = {"token_api_s": 0.0012, "token_item_s": 0.0008, "token_api_item_s": 0.0004}

    def ttft(qps: float, n: int, merge: int) -> float:
        cfg = config("push", qps=qps, input_len=256, output_len=32, num_prompts=n,
                     profile=_keys(merge, 0.002, **two))
        res = run(cfg).result
        assert res["completed"] == n
        return res["mean_ttft_ms"]

    light, shared, each = ttft(1.0, 4, 32), ttft(20.0, 100, 32), ttft(20.0, 100, 0)
    assert shared < 2 * light
    assert each > 5 * shared


def test_the_two_jobs_keys_are_times_of_the_shared_cpu_host() -> None:
    for key in ("token_api_s", "token_item_s", "token_api_item_s"):
        with pytest.raises(ProfileError, match=key):
            with_profile(host={"model": "shared-cpu", "frontend_cores": 1, key: -0.001})
        with pytest.raises(ProfileError, match=key):  # the GPU nodes run no host
            with_profile(host={key: 0.001})


def test_merge_tokens_is_a_count_of_the_shared_cpu_host() -> None:
    for bad in (-1, 2.5, True):
        with pytest.raises(ProfileError, match="merge_tokens"):
            with_profile(host={"model": "shared-cpu", "frontend_cores": 1,
                               "merge_tokens": bad})
    with pytest.raises(ProfileError, match="merge_tokens"):  # the GPU nodes run no host
        with_profile(host={"merge_tokens": 24})
