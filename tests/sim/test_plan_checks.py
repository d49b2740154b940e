"""pushkv plan against the brute force and against itself: the search returns the
full grid's answer on a small real case; a looser SLO never lowers goodput and more
GPUs never lower the best total goodput; on the post's deployment push beats pull,
and on short prompts the two are equal."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("simpy")

from pushkv.sim import DEFAULT, WorkloadConfig, load_profile
from pushkv.sim.planner import SLO, PlanSpec, Sample, judge, run_plan
from pushkv.sim.planner.measure import simulate
from pushkv.sim.planner.report import recommendation
from pushkv.sim.planner.search import bounds, candidates, grid_best, ladder, sim_config
from pushkv.sim.scenario import SimConfig

TINY = Path(__file__).parents[2] / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"

# cpu-tiny, TP1: budgets of 2-4 GPUs are 1, 3 and 6 topologies, in two modes
SMALL = PlanSpec(profile=load_profile(TINY), gpus=4, modes=("push", "pull"),
                 workload=WorkloadConfig(input_len=512, output_len=8, num_prompts=24),
                 slo=SLO(ttft_s=0.018, tpot_s=0.01), rate_tol=0.5, rate_range=8)

_MEMO: dict[tuple[str, int, int, int, float], Sample] = {}


def _memo(cfg: SimConfig, seeds: int) -> Sample:
    """The simulator, each point run once for the whole module (it is deterministic)."""
    key = (cfg.mode.name + str(cfg.dispatch), cfg.num_prefill, cfg.num_decode,
           cfg.profile.prefill.tp, cfg.workload.request_rate)
    if key not in _MEMO:
        _MEMO[key] = simulate(cfg, seeds)
    return _MEMO[key]


def _spec(**kw: object) -> PlanSpec:
    import dataclasses

    return dataclasses.replace(SMALL, **kw)  # type: ignore[arg-type]


def test_search_returns_the_full_grids_answer() -> None:
    slo = SMALL.slo
    brute: dict[str, float] = {}
    for c in candidates(SMALL):  # every configuration at every rung of its ladder
        rates = ladder(bounds(SMALL, c).capacity.rate, SMALL.rate_tol, SMALL.rate_range)
        ok = [r for r in rates if judge(_memo(sim_config(SMALL, c, r), 1), slo).meets(slo)]
        brute[c.label] = max(ok, default=0.0)
    plan = run_plan(SMALL, evaluate=_memo, progress=None)
    assert {o.candidate.label: o.goodput for o in plan.outcomes} == brute
    best = max(plan.outcomes, key=lambda o: brute[o.candidate.label] / o.candidate.gpus)
    assert plan.best is not None and plan.best.goodput_per_gpu == pytest.approx(
        best.goodput_per_gpu)
    # the benchmark's shortcut to the grid's best (only rungs that could beat it) agrees
    assert grid_best(plan, _memo)[0] == plan.best.candidate
    # a case with something to find: several answers, some below capacity; fewer simulations
    assert len({g for g in brute.values() if g > 0}) > 1 and plan.simulations < plan.full_grid
    assert any(0 < o.goodput < o.bounds.capacity.rate for o in plan.outcomes)


@settings(max_examples=25, deadline=None)
@given(ttft=st.floats(0.01, 0.08), tpot=st.floats(0.0008, 0.003),
       target=st.sampled_from([0.5, 0.8, 0.9, 1.0]), looser=st.floats(1.0, 3.0),
       give=st.sampled_from([0.0, 0.1, 0.3]), which=st.sampled_from(["ttft", "tpot", "both"]))
def test_a_looser_slo_never_lowers_goodput(ttft: float, tpot: float, target: float,
                                           looser: float, give: float, which: str) -> None:
    tight = SLO(ttft_s=ttft, tpot_s=tpot, attainment=target)
    loose = SLO(ttft_s=ttft * (looser if which != "tpot" else 1.0),
                tpot_s=tpot * (looser if which != "ttft" else 1.0),
                attainment=max(0.05, target - give))
    a = run_plan(_spec(slo=tight), evaluate=_memo, progress=None)
    b = run_plan(_spec(slo=loose), evaluate=_memo, progress=None)
    tight_g = {o.candidate: o.goodput for o in a.outcomes}
    for o in b.outcomes:
        assert o.goodput >= tight_g[o.candidate], o.candidate
    best = (a.best.goodput_per_gpu if a.best else 0.0, b.best.goodput_per_gpu if b.best else 0.0)
    assert best[1] >= best[0]


@settings(max_examples=12, deadline=None)
@given(gpus=st.integers(2, 3), more=st.integers(1, 2), ttft=st.floats(0.01, 0.08),
       tpot=st.floats(0.0008, 0.003))
def test_more_gpus_never_lower_the_best_total_goodput(gpus: int, more: int, ttft: float,
                                                      tpot: float) -> None:
    slo = SLO(ttft_s=ttft, tpot_s=tpot)
    small = run_plan(_spec(gpus=gpus, slo=slo), evaluate=_memo, progress=None)
    large = run_plan(_spec(gpus=gpus + more, slo=slo), evaluate=_memo, progress=None)
    total = [max((o.goodput for o in p.outcomes), default=0.0) for p in (small, large)]
    assert total[1] >= total[0]


# -------------------------------------------------------- the published setting

#: the post's deployment: Qwen3-32B, TP8 prefill and decode on H200s (16 GPUs: 1P1D),
#: 128 output tokens; the post states no SLO: p90 TTFT <= 1 s (pull's 8 QPS TTFT is
#: above it, push's below) and TPOT <= 50 ms
POST = PlanSpec(profile=DEFAULT, gpus=16, tps=(8,), modes=("pull", "push"),
                workload=WorkloadConfig(input_len=16384, output_len=128, num_prompts=100),
                slo=SLO(ttft_s=1.0, tpot_s=0.05))


def test_on_the_posts_deployment_push_wins_and_its_ratio_is_reported() -> None:
    plan = run_plan(POST, progress=None)
    g = {o.candidate.mode: o.goodput for o in plan.outcomes}
    assert plan.best is not None and plan.best.candidate.mode == "push"
    ratio = g["push"] / g["pull"]
    assert ratio > 1 + POST.rate_tol  # more than one rung of the ladder apart
    rec = recommendation(plan)
    assert rec is not None
    shown = re.search(r"(\d+\.\d\d)x the runner-up, pull 1P1D TP8", rec["reason"])
    assert shown is not None and float(shown.group(1)) == pytest.approx(ratio, abs=0.005)


def test_on_short_prompts_push_and_pull_are_equal_within_a_rung() -> None:
    import dataclasses

    # 200 requests: enough to build a queue below the capacity bound (100 pass there)
    spec = dataclasses.replace(POST, workload=dataclasses.replace(
        POST.workload, input_len=256, num_prompts=200))
    plan = run_plan(spec, progress=None)
    g = {o.candidate.mode: o.goodput for o in plan.outcomes}
    assert g["pull"] > 0 and g["push"] > 0
    assert all(o.binding != "capacity" for o in plan.outcomes)  # found, not capped
    # the ladder resolves rates 1 + rate_tol apart: within one rung is equal
    assert abs(math.log(g["push"] / g["pull"])) <= math.log1p(spec.rate_tol) + 1e-9


def test_a_tp_the_planner_tries_gets_the_step_overheads_its_shape_implies():
    """Overheads derived from the model's shape follow the TP the search tries (TP 1
    has no all-reduce); overheads a profile sets otherwise are kept."""
    import dataclasses

    from pushkv.sim.planner.search import profile_at
    from pushkv.sim.profile import DEFAULT

    one = profile_at(DEFAULT, 1)
    assert one.decode.decode_step_overhead_s < DEFAULT.decode.decode_step_overhead_s
    assert one.decode.decode_step_overhead_s == pytest.approx(
        one.decode.derived_step_overheads(DEFAULT.model)["decode_step_overhead_s"])
    assert profile_at(DEFAULT, 8) == DEFAULT.validate()
    custom = dataclasses.replace(DEFAULT, decode=dataclasses.replace(
        DEFAULT.decode, decode_step_overhead_s=0.01))
    assert profile_at(custom, 1).decode.decode_step_overhead_s == 0.01
