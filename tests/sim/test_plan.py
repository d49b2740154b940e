"""pushkv plan: the rate bisection, the pruning floors, the command line, a real search."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("simpy")

from pushkv.sim import DEFAULT, WorkloadConfig, load_profile
from pushkv.sim.planner import SLO, PlanSpec, Sample, judge, run_plan
from pushkv.sim.planner.cli import main
from pushkv.sim.planner.measure import simulate
from pushkv.sim.planner.search import (
    PRUNE_MARGIN_S,
    Candidate,
    PlanError,
    bounds,
    candidates,
    highest_passing,
    ladder,
    search_candidate,
    sim_config,
)
from pushkv.sim.scenario import SimConfig

TINY = Path(__file__).parents[2] / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"


# ------------------------------------------------------------------ bisection


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 300), data=st.data())
def test_bisection_finds_the_boundary_of_a_monotone_predicate(n: int, data: st.DataObject
                                                              ) -> None:
    boundary = data.draw(st.integers(-1, n - 1))  # highest passing rung; -1: none
    calls: list[int] = []

    def passes(k: int) -> bool:
        calls.append(k)
        return k <= boundary

    best, fail = highest_passing(n, passes)
    assert best == (boundary if boundary >= 0 else None)
    assert fail == (None if boundary == n - 1 else boundary + 1)  # the first failing rung
    assert len(calls) <= 2 + math.ceil(math.log2(n)) if n > 1 else len(calls) == 1
    assert len(set(calls)) == len(calls)  # no rung twice


def _fake(threshold: float, n: int = 10):
    """An evaluator whose requests all meet any SLO at rates up to ``threshold`` and all
    miss the TTFT SLO above it: a monotone attainment with a known boundary."""
    def evaluate(cfg: SimConfig, seeds: int) -> Sample:
        r = cfg.workload.request_rate
        t = 0.01 if r <= threshold else 100.0
        return Sample(rate=r, ttft=(t,) * n * seeds, tpot=(0.001,) * n * seeds,
                      kv_wait=(0.0,) * n * seeds, wall_s=0.0)
    return evaluate


@pytest.mark.parametrize("fraction", [0.001, 0.2, 0.5, 0.77, 1.0, 3.0])
def test_search_matches_the_full_ladder_on_a_monotone_evaluator(fraction: float) -> None:
    spec = PlanSpec(gpus=16, tps=(4, 8), modes=("push",), rate_tol=0.05, rate_range=16)
    cand = Candidate("push", 1, 2, 4)
    rates = ladder(bounds(spec, cand).capacity.rate, spec.rate_tol, spec.rate_range)
    threshold = rates[-1] * fraction
    ev = _fake(threshold)
    out = search_candidate(spec, cand, ev)
    brute = max((r for r in rates if r <= threshold), default=0.0)  # every rung simulated
    assert out.goodput == brute
    assert out.simulations <= 2 + math.ceil(math.log2(len(rates)))
    if 0 < brute < rates[-1]:
        assert out.binding == "ttft" and out.first_fail is not None
        assert out.first_fail.rate == rates[rates.index(brute) + 1]  # the next rung up
    assert out.binding == ("capacity" if brute == rates[-1] else "ttft")


def test_plan_ranks_by_goodput_per_gpu_and_counts_simulations() -> None:
    spec = PlanSpec(gpus=16, tps=(4, 8), modes=("pull", "push"), rate_range=8)
    plan = run_plan(spec, evaluate=_fake(threshold=3.0), progress=None)
    per_gpu = [o.goodput_per_gpu for o in plan.outcomes]
    assert per_gpu == sorted(per_gpu, reverse=True)
    assert plan.simulations == sum(o.simulations for o in plan.outcomes)
    assert plan.simulations < plan.full_grid
    assert len(plan.outcomes) == len(candidates(spec)) == 14


# -------------------------------------------------------------------- pruning


def _grid(profile_spec: PlanSpec) -> list[tuple[Candidate, list[Sample]]]:
    """Every configuration simulated at every rung of its ladder (the brute force)."""
    out = []
    for c in candidates(profile_spec):
        rates = ladder(bounds(profile_spec, c).capacity.rate, profile_spec.rate_tol,
                       profile_spec.rate_range)
        out.append((c, [simulate(sim_config(profile_spec, c, r), 1) for r in rates]))
    return out


SPECS = {
    "cpu-tiny": PlanSpec(profile=load_profile(TINY), gpus=3, modes=("push", "pull"),
                         workload=WorkloadConfig(input_len=512, output_len=8, num_prompts=12),
                         rate_tol=1.0, rate_range=8),
    "h200": PlanSpec(profile=DEFAULT, gpus=16, tps=(2, 8), modes=("push", "pull"),
                     workload=WorkloadConfig(input_len=2048, output_len=8, num_prompts=12),
                     rate_tol=1.0, rate_range=8),
}


@pytest.fixture(scope="module")
def brute() -> dict[str, list[tuple[Candidate, list[Sample]]]]:
    grid = {"cpu-tiny": _grid(SPECS["cpu-tiny"])}
    # h200 at TP2 in a 16-GPU budget is 28 xPyD per mode: keep a dozen 1PyD and xP1D ones
    spec = SPECS["h200"]
    keep = [c for c in candidates(spec) if c.num_prefill == 1 or c.num_decode == 1][:12]
    grid["h200"] = [
        (c, [simulate(sim_config(spec, c, r), 1)
             for r in ladder(bounds(spec, c).capacity.rate, spec.rate_tol, spec.rate_range)])
        for c in keep]
    return grid


@pytest.mark.parametrize("name", sorted(SPECS))
def test_floors_hold_for_every_simulated_request(
        name: str, brute: dict[str, list[tuple[Candidate, list[Sample]]]]) -> None:
    spec = SPECS[name]
    for cand, samples in brute[name]:
        b = bounds(spec, cand)
        for s in samples:
            assert min(s.ttft) >= b.ttft_floor - PRUNE_MARGIN_S, (cand, s.rate)
            assert min(s.tpot) >= b.tpot_floor - PRUNE_MARGIN_S, (cand, s.rate)


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(sorted(SPECS)), ttft_scale=st.floats(0.3, 3.0),
       tpot_scale=st.floats(0.3, 3.0), target=st.sampled_from([0.5, 0.9, 1.0]))
def test_pruning_never_drops_a_configuration_that_meets_the_slo(
        brute: dict[str, list[tuple[Candidate, list[Sample]]]], name: str, ttft_scale: float,
        tpot_scale: float, target: float) -> None:
    spec = SPECS[name]
    grid = brute[name]
    # SLOs around the configurations' floors: some prune, some meet, some neither
    ttft = ttft_scale * min(bounds(spec, c).ttft_floor for c, _ in grid)
    tpot = tpot_scale * min(bounds(spec, c).tpot_floor for c, _ in grid)
    slo = SLO(ttft_s=ttft, tpot_s=tpot, attainment=target)
    for cand, samples in grid:
        meets_somewhere = any(judge(s, slo).meets(slo) for s in samples)
        if meets_somewhere:
            assert bounds(spec, cand).prune_reason(slo) is None, cand


def test_a_tight_slo_prunes_without_simulating() -> None:
    spec = PlanSpec(gpus=16, tps=(4, 8), modes=("push",), slo=SLO(ttft_s=0.01, tpot_s=0.1))
    plan = run_plan(spec, evaluate=_fake(1e9), progress=None)
    assert plan.simulations == 0
    assert all(o.pruned and "TTFT floor" in o.pruned for o in plan.outcomes)
    assert plan.best is None


# --------------------------------------------------------------- command line


def _exit(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return int(info.value.code or 0)


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit(["plan", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for flag, default in [("--ttft-slo", "1.0"), ("--tpot-slo", "0.05"),
                          ("--percentile", "90.0"), ("--input-len", "4096"),
                          ("--num-prompts", "200"), ("--rate-tol", "0.1"),
                          ("--modes", "['pull', 'push']")]:
        assert flag in out
        assert f"(default: {default})" in out, flag
    assert "default 16" in out  # the GPU budget


@pytest.mark.parametrize(("argv", "words"), [
    (["--ttft-slo", "-1"], "TTFT SLO must be a positive number"),
    (["--tpot-slo", "0"], "TPOT SLO must be a positive number"),
    (["--gpus", "1"], "smaller than one 1P1D deployment"),
    (["--nodes", "1", "--tp", "8"], "smaller than one 1P1D deployment"),
    (["--tp", "16"], "outside one node"),
    (["--tp", "3"], "does not fit"),
    (["--modes", "teleport"], "unknown mode"),
    (["--percentile", "100"], "percentile must be in (0, 100)"),
    (["--profile", "/nonexistent/p.toml"], "p.toml"),
    (["--gpus", "-2"], "must be >= 1"),
])
def test_bad_input_exits_2_with_one_line(argv: list[str], words: str,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert words in err[0]


def test_budget_error_is_typed() -> None:
    with pytest.raises(PlanError, match="smaller than one 1P1D"):
        candidates(PlanSpec(gpus=4, tps=(4,)))


def test_tiny_search_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--profile", str(TINY), "--gpus", "3", "--input-len", "512",
            "--output-len", "8", "--num-prompts", "12", "--ttft-slo", "0.03",
            "--tpot-slo", "0.01", "--rate-tol", "0.5", "--rate-range", "8", "--jobs", "1",
            "--json", "--quiet", "--plot", str(tmp_path / "pareto.png")]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["configurations"] == 6  # (1P1D, 1P2D, 2P1D) x (pull, push) at TP1
    assert 0 < first["simulations_run"] < first["full_grid_simulations"]
    rec = first["recommended"]
    assert rec is not None and rec["config"]["label"] == first["ranked"][0]["label"]
    assert rec["goodput_per_gpu"] > 0 and rec["reason"]
    assert (tmp_path / "pareto.png").stat().st_size > 0
    assert main(argv) == 0  # deterministic: the same plan again, but the wall time
    second = json.loads(capsys.readouterr().out)
    for doc in (first, second):
        doc.pop("wall_s")
    assert first == second


def test_worker_processes_give_the_same_plan() -> None:
    spec = PlanSpec(profile=load_profile(TINY), gpus=3, modes=("push", "pull"),
                    workload=WorkloadConfig(input_len=256, output_len=4, num_prompts=8),
                    slo=SLO(ttft_s=0.02, tpot_s=0.01), rate_tol=0.5, rate_range=8)
    one = run_plan(spec, jobs=1, progress=None)
    two = run_plan(spec, jobs=2, progress=None)
    assert two.jobs == 2
    assert [(o.candidate, o.goodput, o.points) for o in one.outcomes] == [
        (o.candidate, o.goodput, o.points) for o in two.outcomes]


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(TINY), "--gpus", "2", "--input-len", "256",
                 "--output-len", "4", "--num-prompts", "8", "--ttft-slo", "0.001",
                 "--jobs", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pruned: TTFT floor" in out
    assert "no configuration meets the SLO" in out


# -------------------------------------------------------------------- packing


def test_packing_is_searched_for_pushes_and_reaches_the_simulator() -> None:
    spec = PlanSpec(gpus=16, tps=(8,), modes=("pull", "push"), packs=("never", "auto"))
    cands = candidates(spec)
    assert {c.pack for c in cands if c.mode == "pull"} == {"never"}
    assert {c.pack for c in cands if c.mode == "push"} == {"never", "auto"}
    packed = next(c for c in cands if c.pack == "auto")
    assert "packed-auto" in packed.label
    assert sim_config(spec, packed, 1.0).packing.mode == "auto"
    plan = run_plan(spec, evaluate=_fake(threshold=3.0), progress=None)
    assert len(plan.outcomes) == len(cands) == 3
    with pytest.raises(PlanError, match="packs"):
        PlanSpec(packs=("sometimes",))
