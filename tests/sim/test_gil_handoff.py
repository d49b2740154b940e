"""The GIL hand-off measurement (:mod:`pushkv.fit.gil_handoff`) and its command line,
``benchmarks/bench_gil_handoff.py``: it measures both ways, reports them in one JSON
line, and refuses bad input (the price it measures is for the benchmark to print,
never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pushkv.fit.gil_handoff import handoffs, summary, verdict

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gil_handoff.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True,
                          text=True, timeout=120)


def test_summary_is_the_median_and_the_p90_in_ms() -> None:
    got = summary([0.001 * i for i in range(1, 11)])
    assert got == {"median_ms": 5.5, "p90_ms": 9.0}


def test_every_handoff_is_timed_each_way() -> None:
    for busy in (False, True):
        got = handoffs(5, 0.001, busy)
        assert len(got) == 5 and all(x >= 0 for x in got)


def test_the_verdict_is_both_ways_and_the_ratio_of_their_medians() -> None:
    ways = {"idle": {"median_ms": 0.1, "p90_ms": 0.2}, "busy": {"median_ms": 5.0, "p90_ms": 6.0}}
    got = verdict(ways)
    assert got == {"switch_interval_s": sys.getswitchinterval(), **ways, "busy_over_idle": 50.0}
    assert list(got) == ["switch_interval_s", "idle", "busy", "busy_over_idle"]


def test_it_prints_both_ways_and_a_json_line() -> None:
    got = _run("--n", "3", "--gap-s", "0.001", "--switch-s", "0.002")
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert lines[0].startswith("feeder sleeps") and lines[1].startswith("feeder runs Python")
    out = json.loads(lines[-1])
    assert out["switch_interval_s"] == pytest.approx(0.002)
    assert set(out["idle"]) == set(out["busy"]) == {"median_ms", "p90_ms"}
    assert out["busy_over_idle"] > 0


@pytest.mark.parametrize("args", [["--n", "0"], ["--gap-s", "0"], ["--switch-s", "-1"]])
def test_bad_input_is_refused_with_a_usage_error(args: list[str]) -> None:
    got = _run(*args)
    assert got.returncode == 2 and "usage:" in got.stderr
