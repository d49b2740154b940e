"""pushkv plan --trace: a trace as the workload, scaled to each rate; its floors hold
for every replayed request, prefix hits included."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simpy")

from pushkv.sim import load_profile
from pushkv.sim.planner import SLO, PlanError, PlanSpec
from pushkv.sim.planner.cli import main
from pushkv.sim.planner.measure import simulate
from pushkv.sim.planner.search import bounds, candidates, ladder, sim_config
from pushkv.sim.trace import read_trace

TINY = Path(__file__).parents[2] / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"


def _write_trace(path: Path, n: int = 30) -> Path:
    """A conversation-like trace: prompts of 1-3 hashed blocks of 512 tokens, every
    other one extending the previous prompt (same leading hashes: prefix hits)."""
    rng = np.random.default_rng(7)
    t, lines, prev = 0.0, [], [1]
    for i in range(n):
        t += float(rng.exponential(0.05))
        blocks = [*prev, 100 + i] if i % 2 and len(prev) < 3 else [1000 + i]
        prev = blocks
        tokens = 512 * (len(blocks) - 1) + int(rng.integers(1, 512))
        lines.append(json.dumps({"arrival_s": round(t, 4), "input_len": tokens,
                                 "output_len": int(rng.integers(2, 9)),
                                 "block_hashes": blocks}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_trace_is_scaled_to_each_rate_and_its_floors_hold(tmp_path: Path) -> None:
    trace = read_trace(_write_trace(tmp_path / "conv.jsonl"))
    spec = PlanSpec(profile=load_profile(TINY), gpus=2, modes=("push", "pull"), trace=trace,
                    slo=SLO(ttft_s=0.05, tpot_s=0.01), rate_tol=1.0, rate_range=8)
    for cand in candidates(spec):
        b = bounds(spec, cand)
        for rate in ladder(b.capacity.rate, spec.rate_tol, spec.rate_range)[::3]:
            cfg = sim_config(spec, cand, rate)
            assert cfg.trace is not None and math.isclose(cfg.trace.mean_rate, rate)
            assert [r.input_len for r in cfg.trace.requests] == [
                r.input_len for r in trace.requests]
            s = simulate(cfg, 1)
            assert len(s.ttft) == len(trace.requests)
            assert min(s.ttft) >= b.ttft_floor - 1e-6, (cand, rate)
            assert min(s.tpot) >= b.tpot_floor - 1e-6, (cand, rate)


def test_plan_trace_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write_trace(tmp_path / "conv.jsonl")
    assert main(["plan", "--profile", str(TINY), "--gpus", "2", "--trace", str(path),
                 "--ttft-slo", "0.05", "--tpot-slo", "0.01", "--rate-tol", "0.5",
                 "--rate-range", "8", "--jobs", "1", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["trace"]["name"] == "conv"
    assert doc["workload"]["trace"]["requests"] == 30
    ranked = [r for r in doc["ranked"] if r["at_goodput"] is not None]
    assert ranked, "no configuration met the SLO at any rate"
    assert all(r["at_goodput"]["requests"] == 30 for r in ranked)  # the trace's requests


def test_trace_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in [(["--trace-window", "0", "1"], "needs --trace"),
                        (["--trace", str(tmp_path / "none.jsonl")], "not found")]:
        with pytest.raises(SystemExit) as info:
            main(["plan", "--profile", str(TINY), "--gpus", "2", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    one = tmp_path / "one.jsonl"
    one.write_text('{"arrival_s": 0, "input_len": 16, "output_len": 2}\n')
    with pytest.raises(PlanError, match="no rate to scale"):
        PlanSpec(profile=load_profile(TINY), gpus=2, trace=read_trace(one))
