"""``python -m pushkv.transports.calibrate`` on a tiny size, real NIXL between two
processes: its settings are well-formed, positive, and load where they are meant to."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")

from pushkv.protocol.errors import ConfigError
from pushkv.protocol.packing import PackingConfig
from pushkv.sim.profile import profile_from_dict
from pushkv.transports.calibrate import CalibrationError, main, settings

pytestmark = pytest.mark.nixl

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_prints_positive_settings_that_load(tmp_path: Path) -> None:
    out = tmp_path / "packing.toml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NIXL_LOG_LEVEL": "WARN"}
    run = subprocess.run(
        [sys.executable, "-m", "pushkv.transports.calibrate", "--descriptors", "256",
         "--mib", "1", "--reps", "3", "--chunk-mib", "0.0625", "--device", "cpu",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.strip().splitlines()
    figures = json.loads(lines[-1])
    snippet = tomllib.loads(out.read_text())
    assert snippet == tomllib.loads("\n".join(lines[:-1]))  # printed == written
    assert set(snippet) == {"packing", "network"}
    # Times and rates are positive; the interpreter-lock shares are clamped to
    # [0, 1] (a lock share too small to measure reads 0 on a quiet or loaded
    # machine alike); the raw lock readings are differences and may be negative.
    for table in snippet.values():
        assert table and all(isinstance(v, float) and math.isfinite(v) for v in table.values())
        assert all(0 <= v <= 1 if k.endswith("gil_fraction") else v > 0
                   for k, v in table.items())
    assert snippet["packing"]["gather_bytes_per_s"] == pytest.approx(
        figures["figures"]["device_gather_bytes_per_s"], rel=1e-3)  # --device wins
    for k, v in figures["figures"].items():
        assert math.isfinite(v), k
        if k.endswith("_fraction"):
            assert 0 <= v <= 1, (k, v)
        elif k == "gil_held_per_descriptor_s":
            assert v >= 0, (k, v)
        elif not k.endswith("_raw"):
            assert v > 0, (k, v)
    config = PackingConfig(**snippet["packing"])  # the transport's settings take it
    assert config.post_per_descriptor_s == snippet["packing"]["post_per_descriptor_s"]
    profile = profile_from_dict({"network": snippet["network"]}).validate()
    assert profile.network.post_per_descriptor_s == snippet["network"]["post_per_descriptor_s"]


def test_non_positive_figures_and_bad_arguments_are_refused() -> None:
    figures = {"post_per_descriptor_s": -1e-7, "post_fixed_s": 1e-5,
               "gather_bytes_per_s": 1e9, "scatter_bytes_per_s": 1e9}
    with pytest.raises(CalibrationError, match="post_per_descriptor_s"):
        settings(figures, None)
    with pytest.raises(ConfigError):
        main(["--descriptors", "1"])
