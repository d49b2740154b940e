"""host.wake_beside_s: a frontend woken while other requests are in flight waits on
a run queue first -- off by default, validated, its limiting cases, and measured from
the core probe's wake-ups against a point's timeline."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simpy")

import simpy
from sim_helpers import config, on_host

from pushkv.fit.cpu_profile import MeasurementError
from pushkv.fit.measure_connector import wake_beside
from pushkv.fit.segments import wakes_by_flight
from pushkv.fit.sim_vs_real.keys import WAKE_QUANTILES, wake_beside_of, without_wake
from pushkv.fit.sim_vs_real.runs import WAKES
from pushkv.sim.host.frontend import Frontend
from pushkv.sim.host.profile import MAX_SPREAD, MAX_WAKE_S
from pushkv.sim.host.spread import Spread
from pushkv.sim.profile import ProfileError, load_profile, profile_from_dict
from pushkv.sim.request import SimRequest
from pushkv.sim.runner import run

ROOT = Path(__file__).resolve().parents[2]
TINY = load_profile(ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml")
#: the frontends as a queue on the host's two shared cores, as the benchmark runs them
SHARED = on_host(TINY, frontend_cores=1, cores=2)


def _with(waits: tuple[float, ...]):  # type: ignore[no-untyped-def]
    return on_host(SHARED, wake_beside_s=waits)


def _run(profile, mode: str = "push", qps: float = 8.0, n: int = 40, **kw):  # type: ignore[no-untyped-def]
    cfg = dataclasses.replace(config(mode, qps=qps, input_len=128, output_len=8,
                                     num_prompts=n, **kw), profile=profile)
    return run(cfg)


def test_it_is_off_by_default_and_bad_values_are_refused() -> None:
    assert TINY.host.wake_beside_s == ()
    assert profile_from_dict({"host": {"model": "shared-cpu", "wake_beside_s": [0, 0.001]}}
                             ).host.wake_beside_s == (0.0, 0.001)
    for doc, words in [
        ({"wake_beside_s": [0.001, -0.001]}, r"must be in \[0"),
        ({"wake_beside_s": [MAX_WAKE_S * 2]}, r"must be in \[0"),
        ({"wake_beside_s": [math.nan]}, "finite"),
        ({"wake_beside_s": ["x"]}, "must be a list of numbers"),
        ({"wake_beside_s": [0.001] * (MAX_SPREAD + 1)}, f"at most {MAX_SPREAD}"),
    ]:
        with pytest.raises(ProfileError, match=words):
            profile_from_dict({"host": {"model": "shared-cpu", **doc}})


def _frontend(wait: float, in_flight: int) -> tuple[simpy.Environment, Frontend]:
    env = simpy.Environment()
    fe = Frontend(env, cores=1, token_s=0.0)
    fe.wakes = Spread((wait,), np.random.default_rng(0))
    fe.in_flight = lambda: in_flight
    return env, fe


def test_a_frontend_woken_beside_another_request_waits_first() -> None:
    w, s = 0.010, 0.001
    got: dict[int, float] = {}
    for n in (1, 2):
        env, fe = _frontend(w, n)
        fe.serve(s, lambda n=n, env=env: got.setdefault(n, env.now))
        env.run()
        assert fe.woken == (n - 1) and fe.woke_s == pytest.approx((n - 1) * w)
    assert got == {1: pytest.approx(s), 2: pytest.approx(w + s)}


def test_a_job_behind_another_finds_the_frontend_awake() -> None:
    """Two jobs at once: the first wakes it (and waits), the second finds it pending
    and queues without a wait of its own -- so it runs first; a job after the
    frontends went idle again waits."""
    w, s = 0.010, 0.001
    env, fe = _frontend(w, 3)
    done: list[tuple[str, float]] = []
    fe.serve(s, lambda: done.append(("first", env.now)))
    fe.serve(s, lambda: done.append(("second", env.now)))
    env.timeout(0.5).callbacks.append(
        lambda _: fe.serve(s, lambda: done.append(("later", env.now))))
    env.run()
    assert done == [("second", pytest.approx(s)), ("first", pytest.approx(w + s)),
                    ("later", pytest.approx(0.5 + w + s))]
    assert fe.woken == 2


def test_each_process_wakes_on_its_own() -> None:
    """Two legs at once, to prefill's and decode's API servers: each process was asleep,
    so each waits its own wake-up; a second job of a process already pending does not."""
    w, s = 0.010, 0.001
    env, fe = _frontend(w, 2)
    done: list[tuple[str, float]] = []
    for name, proc in (("prefill", "prefill-0"), ("decode", "decode-0"),
                       ("decode again", "decode-0")):
        fe.serve(s, lambda name=name: done.append((name, env.now)), process=proc)
    env.run()
    assert done == [("decode again", pytest.approx(s)), ("prefill", pytest.approx(w + s)),
                    ("decode", pytest.approx(w + 2 * s))]  # both woke at w: one core
    assert fe.woken == 2


def test_a_requests_tokens_stay_in_order_behind_a_waiting_one() -> None:
    """Token 1 wakes the frontend and waits; tokens 2 and 3 come meanwhile and reach
    the client after it, in order; another request's token does not wait for it."""
    w = 0.010
    env, fe = _frontend(w, 2)
    fe.token_s = 0.001
    a, b = SimRequest(spec=None, transfer_id="a"), SimRequest(spec=None, transfer_id="b")  # type: ignore[arg-type]
    for t, req in ((0.0, a), (0.002, a), (0.004, a), (0.003, b)):
        env.timeout(t).callbacks.append(lambda _, req=req: fe.token(req))
    env.run()
    assert a.client_times == [pytest.approx(w + 0.001), pytest.approx(w + 0.002),
                              pytest.approx(w + 0.003)]
    assert b.client_times == [pytest.approx(0.004)]  # queued behind nothing waiting


def test_the_router_woken_beside_another_request_takes_it_up_after_a_wait() -> None:
    """A process that queues no work (the router): alone in flight, no wait; beside
    another, exactly its draw; a request reaching it meanwhile waits out the same
    wake-up (one process, woken once); once awake and idle again, a new draw."""
    w = 0.010
    env, fe = _frontend(0.0, 1)
    fe.intake_wakes = Spread((w,), np.random.default_rng(0))
    assert fe.wake_wait("router") == 0.0 and fe.woken == 0  # alone
    fe.in_flight = lambda: 2
    got: list[float] = []
    env.timeout(0.100).callbacks.append(lambda _: got.append(fe.wake_wait("router")))
    env.timeout(0.104).callbacks.append(lambda _: got.append(fe.wake_wait("router")))
    env.timeout(0.104).callbacks.append(lambda _: got.append(fe.wake_wait("other")))
    env.timeout(0.200).callbacks.append(lambda _: got.append(fe.wake_wait("router")))
    env.run()
    assert got == [pytest.approx(w), pytest.approx(w - 0.004), pytest.approx(w),
                   pytest.approx(w)]
    assert fe.woken == 3 and fe.woke_s == pytest.approx(3 * w)


def _received(profile, n: int = 2):  # type: ignore[no-untyped-def]
    """Each request's 'received' mark less its send time, ``n`` sent at once."""
    from pushkv.sim.marks import Timeline

    cfg = dataclasses.replace(config("push", qps=math.inf, input_len=128, output_len=8,
                                     num_prompts=n), profile=profile)
    tl = Timeline()
    res = run(cfg, timeline=tl)
    return [tl.requests[f"req-{i}"]["received"] - res.result["start_times"][i]
            for i in range(n)]


def test_a_request_reaching_the_router_beside_another_is_taken_up_a_wake_later() -> None:
    """Two requests sent at once: the first finds none in flight and is taken up at
    once; the second, beside it, a constant wake-up later. Without waits, both at once."""
    w = 0.004
    assert _received(SHARED) == [0.0, 0.0]
    assert _received(_with((w,))) == [0.0, pytest.approx(w)]


def test_waits_of_zero_give_the_old_result_exactly() -> None:
    """Its draws come from a stream of their own: nothing else moves."""
    for mode in ("push", "pull"):
        a, b = _run(SHARED, mode).result, _run(_with((0.0, 0.0)), mode).result
        assert json.dumps(a) == json.dumps(b)


def test_requests_that_meet_no_other_pay_nothing() -> None:
    """Far apart, every request is alone in flight: even long waits change nothing."""
    a = _run(SHARED, "pull", qps=0.1, n=8).result
    b = _run(_with((0.050,)), "pull", qps=0.1, n=8).result
    assert json.dumps(a) == json.dumps(b)


def test_under_load_longer_waits_mean_later_first_tokens_and_nothing_is_lost() -> None:
    means = []
    for w in (0.0, 0.002, 0.008):
        res = _run(_with((0.0, w, 2 * w)), "pull", qps=8.0, n=60)
        assert res.result["completed"] == 60 and res.leaked_blocks == 0
        means.append(statistics.fmean(res.result["ttfts"]))
    assert means[0] < means[1] < means[2]


def test_it_is_deterministic_per_seed_and_moves_with_the_seed() -> None:
    prof = _with((0.0, 0.001, 0.004, 0.020))
    a, b = _run(prof).result, _run(prof).result
    assert json.dumps(a) == json.dumps(b)
    assert _run(prof, iteration=1).result["ttfts"] != a["ttfts"]


def test_wake_ups_by_the_requests_in_flight_when_due() -> None:
    reqs = {"a": {"legs_sent": 1.0, "last_token": 2.0},
            "b": {"legs_sent": 1.5, "last_token": 3.0},
            "c": {"legs_sent": 1.2}}  # never ended: left out
    wakes = [(0.5, 0.1), (1.0, 0.2), (1.6, 0.3), (2.0, 0.4), (3.0, 0.5)]
    assert wakes_by_flight(reqs, wakes) == {0: [0.1, 0.5], 1: [0.2, 0.4], 2: [0.3]}
    assert wakes_by_flight({}, wakes) == {0: [0.1, 0.2, 0.3, 0.4, 0.5]}


def test_the_extra_wait_is_beside_less_alone_at_each_quantile() -> None:
    one = [0.001 * i for i in range(100)]
    two = [0.003 * i for i in range(50)]
    three = [0.003 * i + 0.0015 for i in range(50)]  # 2+ pooled: 0.0015 steps
    # none in flight is no group of its; quantile (i + 1/2) / 10: the sample at index
    # 10 i + 5 of 100 -- alone 1 ms a step, beside (2 and 3 pooled) 1.5 ms a step
    got = wake_beside({0: [9.0], 1: one, 2: two, 3: three}, quantiles=10)
    assert got == pytest.approx([0.0005 * (10 * i + 5) for i in range(10)])
    assert wake_beside({1: [0.002] * 10, 2: [0.001] * 10}, quantiles=4) == (0.0,) * 4
    assert wake_beside({1: one}) == () and wake_beside({2: two}) == ()
    with pytest.raises(MeasurementError, match="quantiles"):
        wake_beside({1: one, 2: two}, quantiles=0)


def test_the_benchmark_pools_every_points_wake_ups(tmp_path: Path) -> None:
    (tmp_path / WAKES).mkdir()
    reqs = {"a": {"legs_sent": 1.0, "last_token": 2.0},
            "b": {"legs_sent": 1.5, "last_token": 3.0}}
    for i, name in enumerate(("push_qps2_in64_out24_iter0", "pull_qps2_in64_out24_iter0")):
        (tmp_path / WAKES / f"{name}.json").write_text(json.dumps(
            {"0": [[1.2, 0.001 + i * 0.001]], "1": [[1.7, 0.011 + i * 0.001]]}))
    points = {f"{n}.json": {"window": [0.0, 9.0]} for n in
              ("push_qps2_in64_out24_iter0", "pull_qps2_in64_out24_iter0",
               "push_qps8_in64_out24_iter0")}  # the last has no wake-ups: skipped
    got = wake_beside_of(tmp_path, points, lambda f, router, w: reqs)
    # alone 1 and 2 ms, beside 11 and 12 ms: 10 ms at every quantile
    assert got == pytest.approx([0.010] * WAKE_QUANTILES)
    assert wake_beside_of(tmp_path, {}, lambda f, router, w: reqs) == ()


def test_the_benchmark_simulates_without_it_too() -> None:
    points = {"p.json": {"host": {"cores": 2, "wake_beside_s": [0.001]},
                         "decode": {"ingest_s": 0.003}}}
    assert without_wake(points) == {"p.json": {"host": {"cores": 2},
                                               "decode": {"ingest_s": 0.003}}}
    assert points["p.json"]["host"]["wake_beside_s"] == [0.001]  # a copy
