"""The host's cores as one processor-sharing pool (host.cores): the pool
against closed forms and an independent fluid model, then in whole runs."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("simpy")

import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import TINY, config, on_host, tiny_on_host, tiny_result

from pushkv.sim.host.cores import SharedCores
from pushkv.sim.profile import ProfileError, profile_from_dict
from pushkv.sim.runner import run


def _finish(cores: int, jobs: list[tuple[float, float]]) -> list[float]:
    """When each (arrival, work) job ends on ``cores`` shared cores."""
    env = simpy.Environment()
    pool = SharedCores(env, cores)
    ends = [math.nan] * len(jobs)

    def job(i: int, at: float, work: float):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield pool.run(work)
        ends[i] = env.now

    for i, (at, work) in enumerate(jobs):
        env.process(job(i, at, work))
    env.run()
    return ends


def _fluid(cores: int, jobs: list[tuple[float, float]]) -> list[float]:
    """The same by a plain event loop over the fluid model: between events every
    active job advances at min(1, cores / active)."""
    order = sorted(range(len(jobs)), key=lambda i: jobs[i][0])
    left: dict[int, float] = {}
    ends = [math.nan] * len(jobs)
    t, k = 0.0, 0
    while k < len(order) or left:
        nxt = jobs[order[k]][0] if k < len(order) else math.inf
        rate = min(1.0, cores / len(left)) if left else 1.0
        first = min(left.values()) / rate if left else math.inf
        step = min(nxt - t, first)
        for i in left:
            left[i] -= step * rate
        t += step
        for i in [i for i, v in left.items() if v <= 1e-9]:
            del left[i]
            ends[i] = t
        while k < len(order) and jobs[order[k]][0] <= t:
            i = order[k]
            if jobs[i][1] <= 1e-9:
                ends[i] = t
            else:
                left[i] = jobs[i][1]
            k += 1
    return ends


@pytest.mark.parametrize(("cores", "n"), [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 7)])
def test_equal_jobs_started_together_end_at_the_closed_form(cores: int, n: int) -> None:
    ends = _finish(cores, [(0.0, 0.004)] * n)
    assert ends == pytest.approx([0.004 * max(1.0, n / cores)] * n)


def test_a_late_job_shares_a_core_with_the_one_running() -> None:
    """One core: A (2 s of work) from 0, B (1 s) from 0.5; A runs alone until 0.5 (1.5
    left), both at half speed until B is done at 2.5 (A has 0.5 left), A alone to 3."""
    assert _finish(1, [(0.0, 2.0), (0.5, 1.0)]) == pytest.approx([3.0, 2.5])


@settings(max_examples=200, deadline=None)
@given(cores=st.integers(1, 4),
       jobs=st.lists(st.tuples(st.floats(0, 0.05), st.floats(0, 0.02)), min_size=1,
                     max_size=12))
def test_the_pool_is_the_fluid_model(cores: int, jobs: list[tuple[float, float]]) -> None:
    got = _finish(cores, jobs)
    assert got == pytest.approx(_fluid(cores, jobs), abs=1e-7)
    for (at, work), end in zip(jobs, got, strict=True):
        assert end >= at + work - 2e-9  # never faster than a core of one's own (1 ns: done)
    env = simpy.Environment()
    pool = SharedCores(env, cores)

    def job(at: float, work: float):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield pool.run(work)

    for at, work in jobs:
        env.process(job(at, work))
    env.run()
    assert pool.busy_s == pytest.approx(sum(w for _, w in jobs if w > 1e-9), abs=1e-7)
    assert pool.runnable == 0


@settings(max_examples=100, deadline=None)
@given(cores=st.integers(1, 3),
       jobs=st.lists(st.tuples(st.floats(0, 0.05), st.floats(1e-6, 0.02),
                               st.sampled_from(["api", "relay", None])),
                     min_size=1, max_size=10),
       spin=st.sampled_from([0.0, 0.5, 1.0]))
def test_the_pool_serves_each_process_exactly_its_work(
        cores: int, jobs: list[tuple[float, float, str | None]], spin: float) -> None:
    """``busy_by_process``: each process's work served to it, a spinner's share of the
    cores to its own, and the whole is ``busy_s`` (a piece given no process: "")."""
    env = simpy.Environment()
    pool = SharedCores(env, cores)
    h = pool.spin(spin, process="engine") if spin else None

    def job(at: float, work: float, process: str | None):  # type: ignore[no-untyped-def]
        yield env.timeout(at)
        yield pool.run(work, process=process)

    for at, work, process in jobs:
        env.process(job(at, work, process))
    env.run(until=1.0)
    if h is not None:
        pool.unspin(h)
    by = pool.busy_by_process
    for name in {p for _, _, p in jobs}:
        assert by[name or ""] == pytest.approx(sum(w for _, w, p in jobs if p == name),
                                               abs=1e-7)
    assert sum(by.values()) == pytest.approx(pool.busy_s, abs=1e-7)
    assert by.get("engine", 0.0) == pytest.approx(pool.busy_s - sum(w for _, w, _ in jobs),
                                                  abs=1e-7)


def test_a_loaded_run_says_which_process_had_the_cores() -> None:
    """A pinned host's run: the engines' loops and the API servers by name, and the
    processes' core-seconds add up to the host's."""
    got = tiny_result("push", 32.0, 32, frontend_cores=1, cores=2, pinned=True)["pushkv"]
    by = got["host_busy_s_by_process"]
    assert {"prefill engine", "decode engine"} <= set(by)
    assert any(name.startswith("decode-") for name in by)  # decode's API server
    assert sum(by.values()) == pytest.approx(got["host_busy_s"])
    assert tiny_result("push", 32.0, 4)["pushkv"]["host_busy_s_by_process"] == {}


def test_no_more_jobs_than_cores_run_at_full_speed() -> None:
    jobs = [(0.0, 0.01), (0.002, 0.005), (0.003, 0.001)]
    assert _finish(3, jobs) == pytest.approx([0.01, 0.007, 0.004])


def test_bad_pools_and_work_are_refused() -> None:
    env = simpy.Environment()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="core"):
            SharedCores(env, bad)  # type: ignore[arg-type]
    pool = SharedCores(env, 1)
    for bad_work in (-1.0, math.nan):
        with pytest.raises(ValueError, match="work"):
            pool.run(bad_work)
    assert pool.runnable == 0
    assert pool.run(0.0).triggered


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_host_cores_must_be_a_count(bad: object) -> None:
    with pytest.raises(ProfileError, match=r"host\.cores"):
        profile_from_dict({"host": {"model": "shared-cpu", "cores": bad}})


def _flat(itls: list[list[float]]) -> list[float]:
    return [x for per_request in itls for x in per_request]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_lone_request_takes_as_long_on_two_shared_cores(mode: str) -> None:
    """The profile's times are lone requests' wall times: with the engines and one
    frontend job at a time, two cores are enough, nothing waits for a core."""
    alone = tiny_result(mode, 1.0, 1, frontend_cores=1)
    shared = tiny_result(mode, 1.0, 1, frontend_cores=1, cores=2)
    assert shared["ttfts"] == pytest.approx(alone["ttfts"], rel=1e-9)
    assert _flat(shared["itls"]) == pytest.approx(_flat(alone["itls"]), rel=1e-9)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_enough_cores_change_nothing_and_fewer_slow_a_loaded_run(mode: str) -> None:
    off = tiny_result(mode, 200.0, 24, frontend_cores=1)
    many = tiny_result(mode, 200.0, 24, frontend_cores=1, cores=3)  # >= engines + 1 job
    assert many["ttfts"] == pytest.approx(off["ttfts"], rel=1e-9)
    assert _flat(many["itls"]) == pytest.approx(_flat(off["itls"]), rel=1e-9)
    two = tiny_result(mode, 200.0, 24, frontend_cores=1, cores=2)
    one = tiny_result(mode, 200.0, 24, frontend_cores=1, cores=1)
    assert off["mean_ttft_ms"] < two["mean_ttft_ms"] < one["mean_ttft_ms"]
    assert off["mean_tpot_ms"] < two["mean_tpot_ms"] < one["mean_tpot_ms"]
    assert two["completed"] == one["completed"] == 24


def test_deterministic_on_shared_cores() -> None:
    a = tiny_result("push", 100.0, 16, frontend_cores=1, cores=2)
    b = tiny_result("push", 100.0, 16, frontend_cores=1, cores=2)
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]


def test_the_work_beside_a_step_lengthens_it_only_when_the_cores_are_short() -> None:
    """A lone request's decode steps with cores_busy 1.5: on one core each step lasts
    exactly 1.5 times as long (its companion shares the core until done); on two,
    exactly as long as without it; cores_busy 1 changes nothing."""
    def tpot(host_cores: int, busy: float) -> float:
        prof = on_host(TINY, cores=host_cores, decode={"cores_busy": busy})
        cfg = dataclasses.replace(config("push", qps=1.0, input_len=128, output_len=16,
                                         num_prompts=1), profile=prof)
        return run(cfg).result["mean_tpot_ms"]

    base = tpot(0, 1.0)
    assert tpot(1, 1.0) == pytest.approx(base, rel=1e-9)
    assert tpot(1, 1.5) == pytest.approx(1.5 * base, rel=1e-9)
    assert tpot(2, 1.5) == pytest.approx(base, rel=1e-9)
    assert tpot(0, 1.5) == pytest.approx(base, rel=1e-9)  # no shared cores: nothing beside


@pytest.mark.parametrize("bad", [0.5, math.nan, math.inf, 65.0])
def test_cores_busy_must_be_at_least_one(bad: float) -> None:
    with pytest.raises(ProfileError, match="cores_busy"):
        profile_from_dict({"host": {"model": "shared-cpu", "decode": {"cores_busy": bad}}})


def test_a_tokens_frontend_work_is_its_job_and_the_rest_of_its_way_a_latency() -> None:
    """host.token_work_s: a lone token still arrives return_s after decode emitted it;
    under load less work a token queues less than return_s as the job."""
    def res(qps: float, n: int, work: float) -> dict:  # type: ignore[type-arg]
        prof = tiny_on_host(frontend_cores=1, token_work_s=work)
        prof = dataclasses.replace(  # no prefill answer job: a lone token never queues
            prof, prefill=dataclasses.replace(prof.prefill, return_s=0.0)).validate()
        cfg = dataclasses.replace(config("push", qps=qps, input_len=128, output_len=16,
                                         num_prompts=n), profile=prof)
        return run(cfg).result

    lone, lone_work = res(1.0, 1, 0.0), res(1.0, 1, 0.0001)
    assert lone_work["ttfts"] == pytest.approx(lone["ttfts"], rel=1e-9)
    assert _flat(lone_work["itls"]) == pytest.approx(_flat(lone["itls"]), rel=1e-9)
    busy, light = res(300.0, 24, 0.0), res(300.0, 24, 0.0001)
    assert light["mean_ttft_ms"] < busy["mean_ttft_ms"]
    for bad in ({"host": {"model": "shared-cpu", "token_work_s": -0.001}},
                {"host": {"model": "shared-cpu", "prefill": {"token_work_s": 0.001}}}):
        with pytest.raises(ProfileError, match="token_work_s"):
            profile_from_dict(bad)


# ------------------------------------------------- spinners: a loop that steps empty


def _with_spinner(cores: int, work: float, demand: float, on: float = 0.0,
                  off: float = math.inf) -> tuple[float, float]:
    """When a job of ``work`` started at 0 ends, beside a spinner of ``demand`` from
    ``on`` to ``off``; and the pool's core-seconds served."""
    env = simpy.Environment()
    pool = SharedCores(env, cores)
    end: list[float] = []

    def job():  # type: ignore[no-untyped-def]
        yield pool.run(work)
        end.append(env.now)

    def spinner():  # type: ignore[no-untyped-def]
        yield env.timeout(on)
        k = pool.spin(demand)
        if math.isfinite(off):
            yield env.timeout(off - on)
            pool.unspin(k)

    env.process(job())
    env.process(spinner())
    env.run()
    return end[0], pool.busy_s


@pytest.mark.parametrize(("cores", "demand", "rate"), [
    (1, 1.0, 0.5),     # two single-process pieces on one core
    (1, 0.25, 0.75),   # the spinner wants a quarter: the job gets the rest
    (2, 1.0, 1.0),     # a core each
    (2, 0.5, 1.0),
])
def test_a_spinner_takes_its_fair_share_of_the_cores(cores: int, demand: float,
                                                     rate: float) -> None:
    end, _ = _with_spinner(cores, 0.010, demand)
    assert end == pytest.approx(0.010 / rate, rel=1e-9)


def test_water_filling_with_work_and_spinners_of_several_demands() -> None:
    """Two cores, demands 0.5 (spinner), 1 (spinner), 1 (job): the level x solves
    0.5 + 2x = 2, so x = 0.75 -- the job advances at 0.75."""
    env = simpy.Environment()
    pool = SharedCores(env, 2)
    pool.spin(0.5)
    pool.spin(1.0)
    done = pool.run(0.003)
    assert pool.rate() == pytest.approx(0.75)
    env.run(until=done)
    assert env.now == pytest.approx(0.004, rel=1e-9)


def test_a_spinner_that_stops_gives_the_core_back() -> None:
    """One core: a 1 s job with a spinner until 0.5 s gets 0.25 s done by then, and
    the remaining 0.75 s alone: it ends at 1.25 s; the core served 1.25 s throughout."""
    end, busy = _with_spinner(1, 1.0, 1.0, on=0.0, off=0.5)
    assert end == pytest.approx(1.25, rel=1e-9)
    assert busy == pytest.approx(1.25, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(cores=st.integers(1, 4), work=st.floats(0.001, 1.0),
       demands=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=5))
def test_spinners_slow_work_never_beyond_its_fair_share(cores: int, work: float,
                                                        demands: list[float]) -> None:
    """Spinners never make a job slower than an equal share of the cores among all
    pieces, nor faster than a core; the cores in use never exceed the pool."""
    env = simpy.Environment()
    pool = SharedCores(env, cores)
    for d in demands:
        pool.spin(d)
    assert pool.in_use() <= cores + 1e-9
    done = pool.run(work)
    env.run(until=done)
    n = len(demands) + 1
    assert work - 1e-9 <= env.now <= work * max(1.0, n / cores) + 1e-9


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5, math.nan])
def test_a_spinner_wants_part_of_one_core(bad: float) -> None:
    pool = SharedCores(simpy.Environment(), 2)
    with pytest.raises(ValueError, match="demand"):
        pool.spin(bad)
    assert pool.runnable == 0


def _steps(mode: str, host_cores: int, *, holding: bool, busy: float = 1.0,
           side: str = "decode") -> tuple[float, float]:
    """One lone request: its prefill step ('prefill sees -> prefill finished', s) and
    the host's busy core-seconds, with ``side`` stepping while it holds."""
    from pushkv.sim.marks import Timeline

    prof = on_host(TINY, cores=host_cores,
                   **{side: {"steps_while_holding": holding, "cores_busy": busy}})
    cfg = dataclasses.replace(config(mode, qps=1.0, input_len=128, output_len=4,
                                     num_prompts=1), profile=prof)
    tl = Timeline()
    res = run(cfg, timeline=tl)
    assert res.result["completed"] == 1 and res.leaked_blocks == 0
    (marks,) = tl.requests.values()
    return marks["prefill_finished"] - marks["prefill_seen"], res.result["pushkv"]["host_busy_s"]


def test_a_decode_loop_that_waits_for_its_kv_shares_the_core_with_the_prefill_step() -> None:
    """Push, one core: decode admits the request and steps empty until its KV lands,
    so the prefill step runs beside one spinning process: exactly twice as long. On
    two cores each has its own; with cores_busy 1.5 on two cores the level is 0.75."""
    base, _ = _steps("push", 1, holding=False)
    one, _ = _steps("push", 1, holding=True)
    assert one == pytest.approx(2 * base, rel=1e-9)
    assert _steps("push", 2, holding=True)[0] == pytest.approx(base, rel=1e-9)
    assert _steps("push", 2, holding=True, busy=1.5)[0] == pytest.approx(base / 0.75,
                                                                         rel=1e-9)
    assert _steps("push", 0, holding=True)[0] == pytest.approx(base, rel=1e-9)  # no pool


def test_a_prefill_holding_kv_for_a_read_keeps_a_core_busy_until_it_is_released() -> None:
    """Pull, three cores (never short): the prefill engine holds the prompt's KV from
    its end until decode's read releases it, and steps empty all that while: the host
    serves that much more, exactly cores_busy times the time it spun."""
    def hold_and_busy(holding: bool) -> tuple[float, float]:
        prof = on_host(TINY, cores=3,
                       prefill={"steps_while_holding": holding, "cores_busy": 1.5})
        cfg = dataclasses.replace(config("pull", qps=1.0, input_len=128, output_len=4,
                                         num_prompts=1), profile=prof)
        res = run(cfg, keep_objects=True)
        (p,) = res.prefills  # type: ignore[attr-defined]
        assert res.result["completed"] == 1 and res.leaked_blocks == 0
        return p.spun_s, res.result["pushkv"]["host_busy_s"]

    spun_off, off = hold_and_busy(False)
    spun, on = hold_and_busy(True)
    assert spun_off == 0 and spun > 0
    assert on - off == pytest.approx(1.5 * spun, rel=1e-6)
