"""``--mode auto``: the simulator chooses the direction by the dispatch with the
rule the vLLM connector applies per request, so a what-if says which direction
wins under which dispatch."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("simpy")

from sim_helpers import config

from pushkv.direction import choose_direction
from pushkv.sim import Dispatch, TransferMode, run
from pushkv.sim.sweep import parse_mode


def _same_run(a: dict, b: dict) -> bool:
    """Every timing equal; only the labels differ."""
    def timings(r: dict) -> str:
        return json.dumps({k: v for k, v in r.items()
                           if k not in ("pushkv", "label", "backend")})
    return timings(a) == timings(b)


def test_the_rule():
    assert choose_direction("sequential") == "pull"
    assert choose_direction("sequential", "push") == "push"
    assert choose_direction("concurrent") == "push"
    assert choose_direction("concurrent", "pull") == "push"
    with pytest.raises(ValueError):
        choose_direction("sideways")


def test_auto_behind_a_sequential_router_is_pull_with_the_background_reader():
    auto = run(config("auto", qps=4.0, num_prompts=30, dispatch=Dispatch.SEQUENTIAL)).result
    pull = run(config("pull-async", qps=4.0, num_prompts=30)).result
    facts = auto["pushkv"]
    assert facts["direction"] == "pull" and facts["dispatch"] == "sequential"
    assert _same_run(auto, pull)


def test_auto_with_concurrent_dispatch_is_push():
    auto = run(config("auto", qps=4.0, num_prompts=30)).result
    push = run(config("push", qps=4.0, num_prompts=30)).result
    facts = auto["pushkv"]
    assert facts["direction"] == "push" and facts["dispatch"] == "concurrent"
    assert _same_run(auto, push)


def test_behind_a_sequential_router_the_choice_beats_push():
    """The what-if's answer: sequential dispatch -> pull (no registration round trip
    nor producer write on the critical path)."""
    seq = dict(qps=4.0, num_prompts=30, dispatch=Dispatch.SEQUENTIAL)
    auto = run(config("auto", **seq)).result
    push = run(config("push", **seq)).result
    assert auto["median_ttft_ms"] < push["median_ttft_ms"]


def test_labels():
    assert parse_mode("auto-seq") == (TransferMode.AUTO, Dispatch.SEQUENTIAL)
    assert config("auto", dispatch=Dispatch.SEQUENTIAL).label() == "auto-seq"
