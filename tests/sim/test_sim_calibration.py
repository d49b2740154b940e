"""The default profile, with one set of parameters, against the published figures, point by point.

Each headline figure is asserted at its own (rate, input length) point; the
post's "TPOT at 4-8 QPS" is two points, 4 QPS and 8 QPS. One of them is out
of tolerance and is marked so (strict: the mark fails the run if the point
ever comes within tolerance, so that docs/sim.md gets updated); docs/sim.md
("Calibration") explains why the model cannot reach it together with the
8 QPS TTFT.
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
    TARGETS,
    TOLERANCE,
    Row,
    evaluate,
    main,
    required_configs,
)

#: The figure the model cannot reach together with the others (see docs/sim.md).
KNOWN_MISS = "TPOT, 4 QPS, 16k input, pull (ms)"


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
    if t.name == KNOWN_MISS else t.name
    for t in TARGETS
])
def test_headline_figure_within_twenty_percent(rows: dict[str, Row], name: str) -> None:
    r = rows[name]
    assert abs(r.error) <= TOLERANCE, (r.name, r.post, r.simulated, f"{r.error:+.0%}")


def test_the_known_miss_is_the_documented_one(rows: dict[str, Row]) -> None:
    """-23% (8.0 ms against 10.4): outside 20%, but no further than docs/sim.md says."""
    r = rows[KNOWN_MISS]
    assert -0.25 < r.error < -TOLERANCE


def test_low_load_short_prompts_about_equal(rows: dict[str, Row]) -> None:
    low = [r for r in rows.values() if r.post == "about equal"]
    assert len(low) == 4
    assert [(r.name, r.error) for r in low if abs(r.error) > LOW_LOAD_GAP] == []


def test_push_wins_where_the_post_says_it_does(rows: dict[str, Row]) -> None:
    pull = float(rows["TTFT, 8 QPS, 16k input, pull (ms)"].simulated.replace(",", ""))
    push = float(rows["TTFT, 8 QPS, 16k input, push (ms)"].simulated.replace(",", ""))
    assert pull / push > 2.5  # the post: about 3x
    tpot_pull = float(rows["TPOT, 8 QPS, 16k input, pull (ms)"].simulated)
    tpot_push = float(rows["TPOT, 8 QPS, 16k input, push (ms)"].simulated)
    assert tpot_push < 0.85 * tpot_pull  # the post: about 30% better


def test_the_command_prints_every_point_and_fails_on_a_miss(
    results: dict[str, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, res in results.items():
        (tmp_path / name).write_text(json.dumps(res))
    assert main(["--results-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"| {KNOWN_MISS} |" in out and "**no** (20%)" in out
    assert out.count("| TPOT, 4 QPS, 16k input,") == 2
    assert out.count("| TPOT, 8 QPS, 16k input,") == 2
