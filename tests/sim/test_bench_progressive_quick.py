"""benchmarks/bench_progressive.py --sim-only --quick (one profile): the benchmark's own
code, shortened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("simpy")

ROOT = Path(__file__).resolve().parents[2]


def test_quick_simulation_reports_the_loaded_ratio_per_profile():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_progressive.py"), "--sim-only",
         "--quick", "--jobs", "1", "--profiles", "tcp100"],
        capture_output=True, text=True, env=env, timeout=600, check=True).stdout
    *table, last = out.strip().splitlines()
    got = json.loads(last)
    ratios = got["sim_loaded_ttft_ratio_layer_c32_4k"]
    assert set(ratios) == {"tcp100"} and got["sim_loaded_quick"]
    # on a 100 Gbps wire layer-wise push beats whole-request push at every load, and
    # at concurrency 32 it still saves time in absolute terms
    assert 0 < ratios["tcp100"] < 1.0
    assert got["sim_loaded_saved_layer_ms_4k"]["tcp100"]["32"] > 0
    assert any(line.split()[:3] == ["tcp100", "32", "4096"] for line in table)
