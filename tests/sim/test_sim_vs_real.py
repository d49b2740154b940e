"""bench_sim_vs_real's simulator half on a committed sample of real results.

``data/sim_vs_real/real`` holds two ``vllm bench serve`` result files of one real run
(pushkv push and vLLM pull, 24 prompts, 2 QPS, 64 tokens in, 24 out) and what the
core probe and the servers' metrics said meanwhile. The simulator half must find
the points, simulate them with the committed profile, three ways, and compare."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from sim_helpers import bench_sim_vs_real

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data" / "sim_vs_real" / "real"


def test_the_simulator_half_runs_on_real_results(tmp_path: Path) -> None:
    bench = bench_sim_vs_real()
    points, output_len, num_prompts = bench.real_points(DATA)
    assert sorted(p[0] for p in points) == ["pull", "push"]
    assert (output_len, num_prompts) == (24, 24)
    probe = json.loads((DATA / bench.SHARES).read_text())
    runs = {"own": {}, "probe": {"shares": probe},
            "steps": {"shares": probe, "server_steps": True}}
    summaries = {}
    for name, kw in runs.items():
        out = tmp_path / name
        bench.run_sim(bench.PROFILE, out, points, output_len, num_prompts, **kw)
        assert len(list(out.glob("*_iter0.json"))) == 2
        table, summaries[name] = bench.compare(DATA, out)
        assert "| push | 64 | 2 |" in table and "| pull | 64 | 2 |" in table
        s = summaries[name]
        assert s["points"] == 2
        for k in ("ttft_ratio_min", "ttft_ratio_max", "tpot_ratio_min", "tpot_ratio_max"):
            assert math.isfinite(s[k]) and s[k] > 0
    # The probe's wake-ups and the servers' slower steps only lengthen simulated TTFT.
    assert summaries["probe"]["ttft_ratio_min"] > summaries["own"]["ttft_ratio_min"]
    assert summaries["steps"]["ttft_ratio_max"] > summaries["own"]["ttft_ratio_max"]
