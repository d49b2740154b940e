"""The figures read simulated and real result files alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")
pytest.importorskip("matplotlib")

from pushkv.sim.plot import FILE_RE, PlotError, load_points, plot, series


def _write(d: Path, name: str, **fields: float) -> None:
    (d / name).write_text(json.dumps({"backend": "vllm", **fields}))


def _real_like(d: Path) -> None:
    """Files shaped like `vllm bench serve --save-result` output, two iterations."""
    for mode, base in (("pull", 100.0), ("push", 50.0)):
        for qps in (1, 8):
            for n in (1024, 4096):
                for it in (0, 1):
                    v = base * qps * n / 1024 + it
                    _write(d, f"{mode}_qps{qps}_in{n}_out128_iter{it}.json",
                           mean_ttft_ms=v, median_ttft_ms=v, p99_ttft_ms=2 * v,
                           mean_tpot_ms=v / 100)


def test_file_names_parse() -> None:
    m = FILE_RE.match("pull-async_qps0.5_in16384_out128_iter3.json")
    assert m is not None
    assert (m["mode"], m["qps"], m["input"], m["output"], m["iter"]) == (
        "pull-async", "0.5", "16384", "128", "3")
    assert FILE_RE.match("notes.json") is None


def test_iterations_are_averaged_per_mode_and_rate(tmp_path: Path) -> None:
    _real_like(tmp_path)
    (tmp_path / "README.txt").write_text("ignored")
    lines = series(load_points(tmp_path, "ttft"))
    assert set(lines) == {("pull", 1.0), ("pull", 8.0), ("push", 1.0), ("push", 8.0)}
    assert lines["push", 8.0] == [(1024, 400.5), (4096, 1600.5)]


@pytest.mark.parametrize("metric", ["ttft", "tpot"])
def test_png_is_written(tmp_path: Path, metric: str) -> None:
    _real_like(tmp_path)
    out = plot(tmp_path, metric, tmp_path / "fig" / f"{metric}.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_errors_are_explained(tmp_path: Path) -> None:
    with pytest.raises(PlotError, match="not found"):
        load_points(tmp_path / "missing", "ttft")
    with pytest.raises(PlotError, match="no result files"):
        load_points(tmp_path, "ttft")
    with pytest.raises(PlotError, match="unknown metric"):
        load_points(tmp_path, "speed")
    _write(tmp_path, "push_qps1_in1024_out128_iter0.json", mean_ttft_ms=1.0)
    _write(tmp_path, "push_qps1_in1024_out256_iter0.json", mean_ttft_ms=1.0)
    with pytest.raises(PlotError, match="output lengths"):
        series(load_points(tmp_path, "ttft"))
    assert series(load_points(tmp_path, "ttft"), output_len=256)
    with pytest.raises(PlotError, match="mean_tpot_ms"):
        load_points(tmp_path, "tpot")
    (tmp_path / "pull_qps1_in1024_out128_iter0.json").write_text("{not json")
    with pytest.raises(PlotError, match="cannot read"):
        load_points(tmp_path, "ttft")
