"""The default profile, with one set of parameters, reproduces the published figures."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from pushkv.sim import run
from pushkv.sim.calibration import LOW_LOAD_GAP, TOLERANCE, evaluate, required_configs


@pytest.fixture(scope="module")
def rows():
    results = {c.file_name(): run(c).result for c in required_configs()}
    return evaluate(results)


def test_headline_figures_within_twenty_percent(rows) -> None:
    bad = [(r.name, r.post, r.simulated, f"{r.error:+.0%}") for r in rows
           if "about equal" not in r.post and abs(r.error) > TOLERANCE]
    assert bad == []


def test_low_load_short_prompts_about_equal(rows) -> None:
    low = [r for r in rows if r.post == "about equal"]
    assert len(low) == 4
    assert [(r.name, r.error) for r in low if abs(r.error) > LOW_LOAD_GAP] == []


def test_push_wins_where_the_post_says_it_does(rows) -> None:
    by_name = {r.name: r for r in rows}
    pull = float(by_name["TTFT, 8 QPS, 16k input, pull (ms)"].simulated.replace(",", ""))
    push = float(by_name["TTFT, 8 QPS, 16k input, push (ms)"].simulated.replace(",", ""))
    assert pull / push > 2.5  # the post: about 3x
