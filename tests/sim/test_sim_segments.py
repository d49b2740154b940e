"""The segment-by-segment comparison of a real and a simulated timeline, on small
synthetic directories, and the sim-vs-real tables' use of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.fit import segments
from pushkv.fit.sim_vs_real.runs import PROFILE, real_points
from pushkv.fit.sim_vs_real.simulate import run_sim
from pushkv.fit.sim_vs_real.tables import (
    neighbour_tables,
    overlap_tables,
    place_tables,
    segment_tables,
)

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


def _simulated_push_point(tmp_path: Path) -> tuple[str, str, int]:
    """The committed push point's name, its simulated timeline (the file's text, under
    ``tmp_path / "tl"``) and its number of prompts."""
    points, output_len, prompts = real_points(DATA)
    push = [p for p in points if p[0] == "push"]
    run_sim(PROFILE, tmp_path / "sim", push, output_len, prompts,
            timelines=tmp_path / "tl")
    fname = "push_qps2_in64_out24_iter0.json"
    lines = (tmp_path / "tl" / Path(fname).stem / "timeline-sim.jsonl").read_text()
    return fname, lines, prompts[fname]


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
    fname, lines, _ = _simulated_push_point(tmp_path)
    lines = lines.splitlines()
    real = tmp_path / "real"
    for sub, keep in (("push", True), ("pushkv", False)):
        d = real / "timeline" / sub
        d.mkdir(parents=True)
        (d / "timeline-1.jsonl").write_text("".join(
            line + "\n" for line in lines
            if (json.loads(line)["p"] == "sim-router") == keep))
    shares = {fname: {"window": [0.0, 1e9]}, "pull_qps2_in64_out24_iter0.json": {}}
    text, got = segment_tables(real, tmp_path / "tl", shares)
    assert "push_qps2_in64_out24_iter0:" in text
    assert got["push_qps2_in64_out24_iter0"]["write posted -> notification"][1] > 0
    for real_ms, sim_ms in got["push_qps2_in64_out24_iter0"].values():
        assert real_ms == sim_ms
    assert segment_tables(real, tmp_path / "tl", {fname: {}}) == ("", {})


def test_alone_keeps_the_requests_nothing_overlapped() -> None:
    reqs = {"a": {"legs_sent": 0.0, "last_token": 1.0},
            "b": {"legs_sent": 2.0, "last_token": 5.0},  # c starts inside it
            "c": {"legs_sent": 3.0, "last_token": 4.0},
            "d": {"legs_sent": 6.0, "last_token": 7.0},
            "e": {"legs_sent": 8.0, "last_token": 9.0}, "f": {}}
    assert set(segments.alone(reqs)) == {"a", "d", "e"}


def test_overlaps_count_the_requests_in_flight_before_the_first_token() -> None:
    reqs = {"a": {"legs_sent": 0.0, "first_token": 1.0, "last_token": 4.0},
            "b": {"legs_sent": 2.0, "first_token": 3.0, "last_token": 5.0},  # a in flight
            "c": {"legs_sent": 4.5, "first_token": 6.0, "last_token": 7.0},  # b in flight
            "d": {"legs_sent": 8.0, "first_token": 9.0, "last_token": 10.0},  # alone
            "e": {"legs_sent": 8.5, "last_token": 9.5}}  # no first token: not counted
    # a: b started before a's first token? no (2.0 > 1.0); b: a; c: b (ends 5.0 > 4.5)
    assert segments.overlaps(reqs) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert segments.overlaps(reqs, end="first_token") == {"a": 0, "b": 0, "c": 0, "d": 0}
    groups = segments.by_overlap(reqs)
    assert sorted(groups) == [0, 1]
    assert sorted(groups[0]) == pytest.approx([1000.0, 1000.0])
    assert sorted(groups[1]) == pytest.approx([1000.0, 1500.0])


def test_by_overlap_caps_the_count() -> None:
    """Four requests in flight together: each overlapped three, all in the capped group."""
    reqs = {k: {"legs_sent": i * 0.1, "first_token": 1.0 + i * 0.1, "last_token": 2.0}
            for i, k in enumerate("abcd")}
    assert set(segments.overlaps(reqs).values()) == {3}
    assert list(segments.by_overlap(reqs, cap=2)) == [2]
    assert list(segments.by_overlap(reqs, cap=0)) == [0]
    with pytest.raises(ValueError, match="cap"):
        segments.by_overlap(reqs, cap=-1)


def test_by_place_groups_the_requests_by_the_order_their_legs_went_out() -> None:
    """The first request is place 1 whatever its id; places from the cap on are one
    group; a request without its first token has no place."""
    reqs = {"z": {"legs_sent": 0.0, "first_token": 0.5},
            "a": {"legs_sent": 1.0, "first_token": 1.1},
            "m": {"legs_sent": 2.0, "first_token": 2.2},
            "b": {"legs_sent": 3.0, "first_token": 3.4},
            "x": {"legs_sent": 2.5}}  # never got its first token
    groups = segments.by_place(reqs)
    assert sorted(groups) == [1, 2, 3]
    assert groups[1] == pytest.approx([500.0])
    assert groups[2] == pytest.approx([100.0])
    assert sorted(groups[3]) == pytest.approx([200.0, 400.0])
    assert segments.by_place(reqs, cap=1) == {1: pytest.approx([500.0, 100.0, 200.0, 400.0])}
    assert segments.by_place({}) == {}
    with pytest.raises(ValueError, match="cap"):
        segments.by_place(reqs, cap=0)
    text = segments.overlap_table(segments.overlap_rows(groups, groups), cap=3,
                                  heading="place")
    assert text.startswith("| place |") and "| 3+ | 2 / 2 |" in text


def test_neighbour_tells_apart_what_a_request_met() -> None:
    """Each kind of lone neighbour from its marks: one past its first token when the
    request's legs went out is decoding, one still before it is on its way, one whose
    legs went out later came later; two at once are 2+, none alone; a neighbour that
    ended before the legs went out, or started after the first token, is no
    neighbour, and a request without its marks has no group."""
    reqs = {
        "dec": {"legs_sent": 0.0, "first_token": 0.05, "last_token": 0.5},
        "a": {"legs_sent": 0.1, "first_token": 0.2, "last_token": 0.3},  # dec decoding
        "way": {"legs_sent": 1.0, "first_token": 1.3, "last_token": 1.4},
        "b": {"legs_sent": 1.1, "first_token": 1.5, "last_token": 1.6},  # way on its way
        "lone": {"legs_sent": 2.0, "first_token": 2.1, "last_token": 2.15},
        "late": {"legs_sent": 2.05, "first_token": 2.3, "last_token": 2.4},
        "x": {"legs_sent": 3.0, "first_token": 3.5, "last_token": 3.6},
        "y": {"legs_sent": 3.1, "first_token": 3.2, "last_token": 3.3},
        "z": {"legs_sent": 3.15, "first_token": 3.4, "last_token": 3.45},
        "cut": {"legs_sent": 4.0},
    }
    got = segments.neighbour(reqs)
    assert got["a"] == "decoding" and got["b"] == "before its first token"
    assert got["lone"] == "came later"  # late's legs left before lone's first token
    assert got["late"] == "before its first token"
    assert got["x"] == "2+"
    assert "cut" not in got
    # a's legs went out after dec's first token: dec had the way to it to itself
    assert got["dec"] == "alone"
    assert set(got.values()) <= set(segments.NEIGHBOURS)
    assert segments.neighbour({"solo": reqs["dec"]}) == {"solo": "alone"}
    groups = segments.by_neighbour(reqs)
    assert sorted(groups["decoding"]) == ["a"]
    assert groups["2+"].keys() == {"x", "y", "z"}
    assert sum(map(len, groups.values())) == len(reqs) - 1


def test_neighbour_rows_compare_each_group_both_sides_have() -> None:
    real = {"s": {"legs_sent": 0.0, "first_token": 0.05, "last_token": 0.5},
            "t": {"legs_sent": 0.1, "prefill_arrived": 0.102, "first_token": 0.2,
                  "last_token": 0.3}}
    sim = {"s": dict(real["s"]), "t": dict(real["t"], first_token=0.15)}
    groups = segments.neighbour_rows(real, sim)
    assert list(groups) == ["alone", "decoding"]  # s had its first token before t came
    rn, sn, rows = groups["decoding"]
    assert (rn, sn) == (1, 1)
    ttft = {r.segment: r for r in rows}["legs out -> first token"]
    assert ttft.real_median == pytest.approx(100.0) and ttft.ratio_median == 0.5
    text = segments.neighbour_text(groups)
    assert "\n\ndecoding (requests real / sim: 1 / 1):" in text
    assert json.loads(json.dumps(segments.neighbour_json(groups)))["decoding"]["real_n"] == 1


def test_overlap_rows_compare_the_groups_either_side_has() -> None:
    rows = segments.overlap_rows({0: [10.0, 20.0, 30.0], 1: [40.0]}, {0: [10.0, 30.0], 2: [5.0]})
    assert [r.group for r in rows] == [0, 1, 2]
    zero, one, two = rows
    assert (zero.real_n, zero.real_median, zero.real_mean) == (3, 20.0, 20.0)
    assert (zero.sim_n, zero.sim_median, zero.sim_mean) == (2, 20.0, 20.0)
    assert zero.ratio_median == zero.ratio_mean == 1.0
    assert one.sim_n == 0 and one.ratio_median is None and one.ratio_mean is None
    assert two.real_n == 0 and two.ratio_mean is None
    text = segments.overlap_table(rows, cap=2)
    assert "| 0 | 3 / 2 | 20.0 / 20.0 | 20.0 / 20.0 | 1.00 / 1.00 |" in text
    assert "| 1 | 1 / 0 | 40.0 / 40.0 | - / - | - / - |" in text
    assert "| 2+ | 0 / 1 |" in text
    assert segments.overlap_json(rows)[1]["sim_median"] is None
    assert json.loads(json.dumps(segments.overlap_json(rows)))[0]["real_n"] == 3


def test_the_cli_by_overlap(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    router, _ = _real(tmp_path)
    assert segments.main(["--real", str(router), "--sim", str(router), "--by-overlap",
                          "--json"]) == 0
    # a, b and c have no last token: no request to group, on either side
    assert json.loads(capsys.readouterr().out) == []
    _write(router, "4", [(r, "last_token", t) for r, t in (("a", 10.1), ("b", 20.1),
                                                            ("c", 30.1))])
    assert segments.main(["--real", str(router), "--sim", str(router), "--by-overlap"]) == 0
    assert "| 0 | 3 / 3 |" in capsys.readouterr().out


def test_the_cli_by_place(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    router, _ = _real(tmp_path)
    assert segments.main(["--real", str(router), "--sim", str(router), "--by-place"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| place |") and "| 1 | 1 / 1 |" in out


def test_the_cli_by_neighbour(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    router, _ = _real(tmp_path)
    _write(router, "4", [(r, "last_token", t) for r, t in (("a", 10.1), ("b", 20.1),
                                                            ("c", 30.1))])
    assert segments.main(["--real", str(router), "--sim", str(router), "--by-neighbour"]) == 0
    assert capsys.readouterr().out.startswith("alone (requests real / sim: 3 / 3):")
    assert segments.main(["--real", str(router), "--sim", str(router), "--by-neighbour",
                          "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["alone"]["sim_n"] == 3


def _point_as_its_own_real_half(tmp_path: Path) -> tuple[str, Path, int]:
    """The simulated push point, its timeline also written as a real run's router's and
    pair's (``tmp_path/real``): the point's file name, the real directory and the
    point's request count."""
    fname, lines, num_prompts = _simulated_push_point(tmp_path)
    real = tmp_path / "real"
    for sub in ("push", "pushkv"):
        (real / "timeline" / sub).mkdir(parents=True)
        (real / "timeline" / sub / "timeline-1.jsonl").write_text(lines)
    return fname, real, num_prompts


def test_bench_pools_overlap_groups_per_mode_and_rate(tmp_path: Path) -> None:
    """The simulated timeline of the committed push point as its own real half: every
    group agrees, and the text names the point's mode and rate."""
    fname, real, num_prompts = _point_as_its_own_real_half(tmp_path)
    text, got = overlap_tables(real, tmp_path / "tl", {fname: {"window": [0.0, 1e9]}})
    assert text.startswith("push_qps2:")
    rows = got["push_qps2"]
    assert sum(r["real_n"] for r in rows) == num_prompts
    assert all(r["real_n"] == r["sim_n"] and r["ratio_median"] == 1.0 for r in rows)
    assert overlap_tables(real, tmp_path / "tl", {fname: {}}) == ("", {})


def test_bench_pools_place_groups_per_mode_and_rate(tmp_path: Path) -> None:
    """The same point as its own real half, by place: three groups (1st, 2nd, 3rd on)
    holding every request, each agreeing."""
    fname, real, num_prompts = _point_as_its_own_real_half(tmp_path)
    text, got = place_tables(real, tmp_path / "tl", {fname: {"window": [0.0, 1e9]}})
    assert text.startswith("push_qps2:") and "| place |" in text and "| 3+ |" in text
    rows = got["push_qps2"]
    assert [r["group"] for r in rows] == [1, 2, 3]
    assert [r["real_n"] for r in rows] == [1, 1, num_prompts - 2]
    assert all(r["real_n"] == r["sim_n"] and r["ratio_mean"] == 1.0 for r in rows)
    assert place_tables(real, tmp_path / "tl", {fname: {}}) == ("", {})


def test_bench_pools_neighbour_groups_per_mode_and_rate(tmp_path: Path) -> None:
    """The same point as its own real half, by what each request met: every request in
    one group, the groups agreeing segment by segment, ids of different points kept
    apart."""
    fname, real, num_prompts = _point_as_its_own_real_half(tmp_path)
    text, got = neighbour_tables(real, tmp_path / "tl", {fname: {"window": [0.0, 1e9]}})
    assert text.startswith("push_qps2:") and "| segment |" in text
    groups = got["push_qps2"]
    assert set(groups) <= set(segments.NEIGHBOURS)
    assert sum(g["real_n"] for g in groups.values()) == num_prompts
    for g in groups.values():
        assert g["real_n"] == g["sim_n"]
        assert all(row["ratio_median"] in (1.0, None) for row in g["segments"].values())
    assert neighbour_tables(real, tmp_path / "tl", {fname: {}}) == ("", {})
