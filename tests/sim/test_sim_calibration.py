"""The default profile, with one set of parameters, against the published figures, point by point.

Each headline figure is asserted at its own (rate, input length) point, on
the mean over :data:`MIN_SEEDS` seeds; the post's "TPOT at 4-8 QPS" is two
points, 4 QPS and 8 QPS. The figures out of tolerance are marked so
(strict: the mark fails the run if a point ever comes within tolerance, so
that docs/sim.md gets updated); docs/sim.md ("Calibration") explains why
the model cannot reach them together with the others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("simpy")

from pushkv.sim import run
from pushkv.sim.calibration import (
    LOW_LOAD_GAP,
    MIN_SEEDS,
    TARGETS,
    TOLERANCE,
    Row,
    evaluate,
    main,
    required_configs,
)

#: The figures the model cannot reach together with the others, and how far off each
#: is allowed to be (see docs/sim.md).
KNOWN_MISSES = {
    "TPOT, 4 QPS, 16k input, pull (ms)": (-0.30, -TOLERANCE),
}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return {c.file_name(): run(c).result for c in required_configs()}


@pytest.fixture(scope="module")
def rows(results: dict[str, dict[str, Any]]) -> dict[str, Row]:
    return {r.name: r for r in evaluate(results)}


def test_every_rate_is_a_point_of_its_own() -> None:
    names = [t.name for t in TARGETS]
    assert len(set(names)) == len(names)
    under_load = [t for t in TARGETS if t.metric == "mean_tpot_ms" and t.input_len == 16384]
    assert sorted((t.mode, t.qps) for t in under_load) == [
        ("pull", 4.0), ("pull", 8.0), ("push", 4.0), ("push", 8.0)]


@pytest.mark.parametrize("name", [
    pytest.param(t.name, marks=pytest.mark.xfail(
        strict=True, reason="pull's per-admission stall ties 4 QPS TPOT to 8 QPS TTFT"))
    if t.name in KNOWN_MISSES else t.name
    for t in TARGETS
])
def test_headline_figure_within_twenty_percent(rows: dict[str, Row], name: str) -> None:
    r = rows[name]
    assert abs(r.error) <= TOLERANCE, (r.name, r.post, r.simulated, f"{r.error:+.0%}")


@pytest.mark.parametrize("name", sorted(KNOWN_MISSES))
def test_the_known_misses_are_the_documented_ones(rows: dict[str, Row], name: str) -> None:
    """Outside 20%, but no further than docs/sim.md says."""
    lo, hi = KNOWN_MISSES[name]
    r = rows[name]
    assert lo < r.error < hi, (r.simulated, f"{r.error:+.0%}")
    assert r.seeds == MIN_SEEDS


def test_every_figure_is_a_mean_over_seeds_with_its_spread(rows: dict[str, Row]) -> None:
    assert {r.seeds for r in rows.values()} == {MIN_SEEDS}
    pull = rows["TTFT, 8 QPS, 16k input, pull (ms)"]
    assert pull.spread.startswith("±") and "-" in pull.spread


def test_low_load_short_prompts_about_equal(rows: dict[str, Row]) -> None:
    low = [r for r in rows.values() if r.post == "about equal"]
    assert len(low) == 4
    assert [(r.name, r.error) for r in low if abs(r.error) > LOW_LOAD_GAP] == []


def test_push_wins_where_the_post_says_it_does(rows: dict[str, Row]) -> None:
    pull = rows["TTFT, 8 QPS, 16k input, pull (ms)"].value
    push = rows["TTFT, 8 QPS, 16k input, push (ms)"].value
    assert pull / push > 2.5  # the post: about 3x
    tpot_pull = rows["TPOT, 8 QPS, 16k input, pull (ms)"].value
    tpot_push = rows["TPOT, 8 QPS, 16k input, push (ms)"].value
    assert tpot_push < 0.85 * tpot_pull  # the post: about 30% better


def test_the_command_prints_every_point_and_fails_on_a_miss(
    results: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, res in results.items():
        (tmp_path / name).write_text(json.dumps(res))
    assert main(["--results-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for name in KNOWN_MISSES:
        assert f"| {name} |" in out
    assert "**no** (20%)" in out
    assert out.count("| TPOT, 4 QPS, 16k input,") == 2
    assert out.count("| TPOT, 8 QPS, 16k input,") == 2


def test_the_command_refuses_too_few_seeds(
    results: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, res in results.items():
        if name.endswith("_iter0.json"):
            (tmp_path / name).write_text(json.dumps(res))
    with pytest.raises(SystemExit) as info:
        main(["--results-dir", str(tmp_path)])
    assert info.value.code == 2
    assert "fewer than 5 iterations" in capsys.readouterr().err
