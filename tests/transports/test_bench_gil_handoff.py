"""benchmarks/bench_gil_handoff.py: it measures both ways, reports them in one JSON
line, and refuses bad input (the price it measures is for the benchmark to print,
never asserted here)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gil_handoff.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gil_handoff", PATH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_summary_is_the_median_and_the_p90_in_ms() -> None:
    got = _bench().summary([0.001 * i for i in range(1, 11)])
    assert got == {"median_ms": 5.5, "p90_ms": 9.0}


def test_every_handoff_is_timed_each_way() -> None:
    bench = _bench()
    for busy in (False, True):
        got = bench.handoffs(5, 0.001, busy)
        assert len(got) == 5 and all(x >= 0 for x in got)


def test_it_prints_both_ways_and_a_json_line(capsys: pytest.CaptureFixture[str]) -> None:
    before = sys.getswitchinterval()
    try:
        assert _bench().main(["--n", "3", "--gap-s", "0.001", "--switch-s", "0.002"]) == 0
    finally:
        sys.setswitchinterval(before)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("feeder sleeps") and lines[1].startswith("feeder runs Python")
    out = json.loads(lines[-1])
    assert out["switch_interval_s"] == pytest.approx(0.002)
    assert set(out["idle"]) == set(out["busy"]) == {"median_ms", "p90_ms"}
    assert out["busy_over_idle"] > 0


@pytest.mark.parametrize("args", [["--n", "0"], ["--gap-s", "0"], ["--switch-s", "-1"]])
def test_bad_input_is_refused_with_a_usage_error(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _bench().main(args)
    assert exc.value.code == 2
