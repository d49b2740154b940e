"""Percentiles in ``pushkv plot`` (p50/p90 from the per-request lists), its CDF view of
trace runs, and the trace comparison ``benchmarks/bench_trace.py`` prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")
pytest.importorskip("matplotlib")

from pushkv.sim.cli import main
from pushkv.sim.plot import PlotError, load_cdfs, percentile_ms
from pushkv.sim.replay import NOT_MODELLED, compare
from pushkv.sim.trace import read_trace, shipped_slice

POINT = ["--profile", str(Path(__file__).resolve().parents[2] / "pushkv" / "sim" / "profiles"
                          / "cpu-tiny.toml"), "--qps", "4", "--input-len", "64",
         "--output-len", "6", "--num-prompts", "12"]


def test_percentiles_from_the_lists_match_the_files_own(tmp_path: Path) -> None:
    assert main(["sim", *POINT, "--mode", "pull", "--result-dir", str(tmp_path)]) == 0
    [f] = tmp_path.glob("*.json")
    data = json.loads(f.read_text())
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert percentile_ms(data, metric, 99) == pytest.approx(data[f"p99_{metric}_ms"],
                                                                abs=1e-3)  # lists: 0.1 us
        assert percentile_ms(data, metric, 50) == pytest.approx(
            data[f"median_{metric}_ms"], abs=1e-3)  # lists: 0.1 us
    for stat in ("p50", "p90", "p99"):
        assert main(["plot", "--results-dir", str(tmp_path), "--metric", "ttft",
                     "--stat", stat, "--out", str(tmp_path / f"{stat}.png")]) == 0
        assert (tmp_path / f"{stat}.png").stat().st_size > 0


def test_the_cdf_view_of_trace_runs(tmp_path: Path) -> None:
    for mode in ("pull", "push"):
        assert main(["sim", "--trace", str(shipped_slice()), "--trace-window", "0", "10",
                     "--mode", mode, "--result-dir", str(tmp_path)]) == 0
    cdfs = load_cdfs(tmp_path, "ttft")
    assert len(cdfs) == 2
    for vals, profile in cdfs.values():
        assert vals == sorted(vals) and profile == "qwen3-32b-h200-tp8-efa"
    assert main(["plot", "--results-dir", str(tmp_path), "--metric", "ttft", "--cdf"]) == 0
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        main(["plot", "--results-dir", str(tmp_path), "--metric", "ttft", "--cdf",
              "--overlay", str(tmp_path)])
    (tmp_path / "none").mkdir()
    with pytest.raises(PlotError, match="no trace result files"):
        load_cdfs(tmp_path / "none", "ttft")


def test_compare_replays_each_mode_and_says_what_it_leaves_out() -> None:
    trace = read_trace(shipped_slice(), window=(0.0, 10.0))
    out = compare(trace, ("pull", "push"), jobs=1, progress_every_s=0)
    assert set(out["modes"]) == {"pull", "push"}
    for m in out["modes"].values():
        assert m["completed"] == len(trace.requests)
        assert m["ttft_p50_ms"] <= m["ttft_p90_ms"] and m["tpot_p50_ms"] <= m["tpot_p90_ms"]
    rates = {m["prefix_hit_rate"] for m in out["modes"].values()}
    assert len(rates) == 1  # one prefill instance: the same hits whatever the mode
    assert out["not_modelled"] == NOT_MODELLED and "progressive" in NOT_MODELLED
