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
    assert [(p.input_len, p.mean, p.count) for p in lines["push", 8.0]] == [
        (1024, 400.5, 2), (4096, 1600.5, 2)]
    first = lines["push", 8.0][0]
    assert (first.lo, first.hi) == (400.0, 401.0)
    assert first.std == pytest.approx(0.5 ** 0.5)  # sample std of 400 and 401


def test_error_bars_and_an_overlay_are_drawn(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    sim, real = tmp_path / "sim", tmp_path / "real"
    sim.mkdir()
    real.mkdir()
    _real_like(sim)
    _write(real, "push_qps1_in1024_out128_iter0.json", mean_ttft_ms=40.0)
    drawn: list[dict[str, object]] = []
    original = plt.Axes.errorbar

    def spy(self, x, y, *args, **kwargs):  # type: ignore[no-untyped-def]
        drawn.append({"x": list(x), "y": list(y), **kwargs})
        return original(self, x, y, *args, **kwargs)

    plt.Axes.errorbar = spy  # type: ignore[method-assign]
    try:
        out = plot(sim, "ttft", tmp_path / "o.png", overlay=real, labels=("sim", "real"))
    finally:
        plt.Axes.errorbar = original  # type: ignore[method-assign]
    assert out.read_bytes()[:4] == b"\x89PNG"
    simulated = [d for d in drawn if str(d["label"]).endswith("(sim)")]
    measured = [d for d in drawn if str(d["label"]).endswith("(real)")]
    assert len(simulated) == 4 and len(measured) == 1
    assert all(d["yerr"] is not None for d in simulated)  # two iterations: bars
    assert measured[0]["yerr"] is None and measured[0]["y"] == [40.0]  # one: none


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
