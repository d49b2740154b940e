"""The segment-by-segment comparison of a real and a simulated timeline, on small
synthetic directories, and bench_sim_vs_real's use of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from sim_helpers import bench_sim_vs_real

from pushkv.sim import segments

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data" / "sim_vs_real" / "real"


def _write(directory: Path, name: str, marks: list[tuple[str, str, float]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / f"timeline-{name}.jsonl").open("w") as f:
        for tid, ev, t in marks:
            f.write(json.dumps({"id": tid, "ev": ev, "t": t, "p": name}) + "\n")


def _real(tmp: Path) -> tuple[Path, Path]:
    """A router directory (requests a, b, c) and a server directory that also holds a
    request of another mode (x), which must not count."""
    router, server = tmp / "real" / "push", tmp / "real" / "pushkv"
    _write(router, "1", [(r, "legs_sent", t0) for r, t0 in (("a", 10.0), ("b", 20.0),
                                                              ("c", 30.0))]
           + [("a", "first_token", 10.050), ("b", "first_token", 20.070),
              ("c", "first_token", 30.060)])
    _write(server, "2", [("a", "prefill_seen", 10.004), ("b", "prefill_seen", 20.006),
                         ("c", "prefill_seen", 30.008), ("x", "legs_sent", 40.0),
                         ("x", "prefill_seen", 40.9)])
    _write(server, "3", [("a", "prefill_seen", 10.100)])  # a later repeat: the first counts
    return router, server


def test_real_requests_are_those_of_the_first_directory(tmp_path: Path) -> None:
    router, server = _real(tmp_path)
    reqs = segments.load([router, server])
    assert set(reqs) == {"a", "b", "c"}
    assert reqs["a"]["prefill_seen"] == pytest.approx(10.004)
    assert set(segments.load([router, server], window=(15.0, 35.0))) == {"b", "c"}


def test_rows_give_both_sides_medians_p90s_and_ratios(tmp_path: Path) -> None:
    router, server = _real(tmp_path)
    sim = tmp_path / "sim"
    _write(sim, "sim", [("req-0", "legs_sent", 0.0), ("req-0", "prefill_seen", 0.012),
                        ("req-0", "first_token", 0.030), ("req-1", "legs_sent", 1.0),
                        ("req-1", "prefill_seen", 1.012), ("req-1", "first_token", 1.030)])
    rows = {r.segment: r for r in segments.compare(segments.load([router, server]),
                                                   segments.load([sim]))}
    assert set(rows) == {"legs out -> prefill sees", "legs out -> first token"}
    seen = rows["legs out -> prefill sees"]
    assert (seen.real_median, seen.real_n, seen.sim_median, seen.sim_n) == (
        pytest.approx(6.0), 3, pytest.approx(12.0), 2)
    assert seen.real_p90 == pytest.approx(7.6)  # 4, 6, 8 ms: 6 + 0.8 * 2
    assert seen.ratio_median == pytest.approx(2.0)
    first = rows["legs out -> first token"]
    assert first.real_median == pytest.approx(60.0)
    assert first.ratio_median == pytest.approx(0.5)
    text = segments.table(list(rows.values()))
    assert "| legs out -> prefill sees | 6.0 / 7.6 | 12.0 / 12.0 | 2.00 / 1.58 |" in text


def test_a_zero_real_segment_has_no_ratio(tmp_path: Path) -> None:
    real, sim = tmp_path / "r", tmp_path / "s"
    _write(real, "1", [("a", "legs_sent", 1.0), ("a", "prefill_seen", 1.0)])
    _write(sim, "1", [("b", "legs_sent", 1.0), ("b", "prefill_seen", 1.001)])
    (row,) = segments.compare(segments.load([real]), segments.load([sim]))
    assert row.ratio_median is None and "| - / - |" in segments.table([row])


def test_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    router, server = _real(tmp_path)
    sim = tmp_path / "sim"
    _write(sim, "sim", [("s", "legs_sent", 0.0), ("s", "prefill_seen", 0.003)])
    assert segments.main(["--real", str(router), str(server), "--sim", str(sim),
                          "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["legs out -> prefill sees"]["ratio_median"] == pytest.approx(0.5)
    with pytest.raises(SystemExit):
        segments.main(["--real", str(tmp_path / "empty"), "--sim", str(sim)])


def test_bench_compares_each_points_timelines(tmp_path: Path) -> None:
    """The simulated timeline of the committed push point stands in for a real one (its
    router's marks in the mode's directory, the rest in the deployment's): every
    segment's ratio is 1."""
    bench = bench_sim_vs_real()
    points, output_len, num_prompts = bench.real_points(DATA)
    push = [p for p in points if p[0] == "push"]
    bench.run_sim(bench.PROFILE, tmp_path / "sim", push, output_len, num_prompts,
                  timelines=tmp_path / "tl")
    fname = "push_qps2_in64_out24_iter0.json"
    sim_dir = tmp_path / "tl" / Path(fname).stem
    lines = (sim_dir / "timeline-sim.jsonl").read_text().splitlines()
    real = tmp_path / "real"
    for sub, keep in (("push", True), ("pushkv", False)):
        d = real / "timeline" / sub
        d.mkdir(parents=True)
        (d / "timeline-1.jsonl").write_text("".join(
            line + "\n" for line in lines
            if (json.loads(line)["p"] == "sim-router") == keep))
    shares = {fname: {"window": [0.0, 1e9]}, "pull_qps2_in64_out24_iter0.json": {}}
    text, got = bench.segment_tables(real, tmp_path / "tl", shares)
    assert "push_qps2_in64_out24_iter0:" in text
    assert got["push_qps2_in64_out24_iter0"]["write posted -> notification"][1] > 0
    for real_ms, sim_ms in got["push_qps2_in64_out24_iter0"].values():
        assert real_ms == sim_ms
    assert bench.segment_tables(real, tmp_path / "tl", {fname: {}}) == ("", {})


def test_alone_keeps_the_requests_nothing_overlapped() -> None:
    reqs = {"a": {"legs_sent": 0.0, "last_token": 1.0},
            "b": {"legs_sent": 2.0, "last_token": 5.0},  # c starts inside it
            "c": {"legs_sent": 3.0, "last_token": 4.0},
            "d": {"legs_sent": 6.0, "last_token": 7.0},
            "e": {"legs_sent": 8.0, "last_token": 9.0}, "f": {}}
    assert set(segments.alone(reqs)) == {"a", "d", "e"}
