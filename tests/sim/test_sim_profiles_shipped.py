"""The shipped example profiles load with no warning and run; the step overheads a
profile leaves unset are derived from its layers and TP (and reproduce the built-in
Qwen3-32B TP8 figures); the calibration's posting fragment loads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from sim_helpers import config

from pushkv.sim import run
from pushkv.sim.profile import DEFAULT, load_profile, profile_from_dict
from pushkv.sim.provenance import resolve
from pushkv.sim.sections import ALLREDUCE_S, STEP_FIXED_S

PROFILES = Path(__file__).resolve().parents[2] / "pushkv" / "sim" / "profiles"
SHIPPED = sorted(PROFILES.glob("*.toml"))


def test_the_examples_are_shipped() -> None:
    names = {p.stem for p in SHIPPED}
    assert {"llama-3.1-8b-h100-ib", "llama-3.1-8b-2xh100-ib", "llama-3.3-70b-p5en-tp8",
            "qwen2.5-72b-h20-tp4-ib4x400", "deepseek-v2-lite-mla-h100-ib"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_a_shipped_profile_loads_without_warning_and_runs(path: Path) -> None:
    r = resolve(path)
    assert r.warnings == ()
    assert r.profile == load_profile(path)
    if not path.stem.startswith("cpu-"):  # an example (not measured here): all sourced
        header = ""
        for line in path.read_text().splitlines():
            if line.startswith("["):
                header = line
            elif re.match(r"\w+ = ", line) and not line.startswith(("name ", "wire_model ")):
                assert "#" in line or "#" in header, f"{path.name}: no source for {line!r}"
    cfg = dataclasses.replace(config("push", qps=4.0, input_len=512, output_len=4,
                                     num_prompts=4), profile=r.profile)
    result = run(cfg).result
    assert result["completed"] == 4 and result["failed"] == 0


def test_step_overheads_follow_the_layers_and_tp_unless_set() -> None:
    # the built-in Qwen3-32B TP8 figures, derived from its 64 layers and TP8
    for side in ("prefill", "decode"):
        e = getattr(DEFAULT, side)
        assert e.derived_step_overheads(DEFAULT.model) == {
            "prefill_step_overhead_s": 0.020, "decode_step_overhead_s": 0.0038}
    same = profile_from_dict({"prefill": {"tp": 8}, "decode": {"tp": 8}})
    assert same == DEFAULT
    # TP1: no all-reduce; TP2 of 32 layers: 64 of them
    tp1 = profile_from_dict({"model": {"num_layers": 32}, "decode": {"tp": 1}})
    assert tp1.decode.decode_step_overhead_s == pytest.approx(STEP_FIXED_S)
    tp2 = load_profile(PROFILES / "llama-3.1-8b-2xh100-ib.toml")
    assert tp2.decode.decode_step_overhead_s == pytest.approx(STEP_FIXED_S + 64 * ALLREDUCE_S)
    # a measured all-reduce cost moves them; an explicit overhead is kept as set
    slow = profile_from_dict({"decode": {"allreduce_s": 2 * ALLREDUCE_S}})
    assert slow.decode.decode_step_overhead_s == pytest.approx(
        STEP_FIXED_S + 128 * 2 * ALLREDUCE_S)
    kept = profile_from_dict({"model": {"num_layers": 32},
                              "decode": {"tp": 1, "decode_step_overhead_s": 0.009}})
    assert kept.decode.decode_step_overhead_s == 0.009
    assert kept.decode.prefill_step_overhead_s < DEFAULT.decode.prefill_step_overhead_s
    # the prefill side never reads a decode step's overhead: left as it is
    assert tp1.prefill.decode_step_overhead_s == DEFAULT.prefill.decode_step_overhead_s


def test_the_default_posting_lock_share_is_the_measured_one() -> None:
    n = DEFAULT.network
    assert 0 < n.post_gil_fraction < 0.05
    source = dataclasses.fields(n)[[f.name for f in dataclasses.fields(n)].index(
        "post_gil_fraction")].metadata["source"]
    assert "NIXL 1.5.1" in source
