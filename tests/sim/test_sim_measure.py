"""The profile writer: measured figures become a valid profile the simulator runs; bad
measurements are refused; the per-token step cost has its closed form."""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from sim_helpers import config, on_host

from pushkv.fit.cpu_profile import (
    Measured,
    MeasurementError,
    fit_line,
    profile_data,
    to_toml,
    write_profile,
)
from pushkv.sim.costs import step_s
from pushkv.sim.host.shared_cpu import SharedCpu, on_shared_cores
from pushkv.sim.profile import (
    DEFAULT,
    Profile,
    ProfileError,
    load_profile,
    profile_from_dict,
)
from pushkv.sim.runner import run

PROFILES = Path(__file__).resolve().parents[2] / "pushkv" / "sim" / "profiles"

#: Plausible figures: prefill 2 ms + 3 us per token, decode 1 ms + 20 us per sequence.
GOOD = Measured(
    machine="a test", when="2026-12-01 00:00 UTC", load=(1.0, 1.0, 1.0),
    prefill_lengths=(16, 64, 256), prefill_step_s=tuple(2e-3 + 3e-6 * n for n in (16, 64, 256)),
    decode_batches=(1, 2, 4, 8), decode_step_s=tuple(1e-3 + 2e-5 * b for b in (1, 2, 4, 8)),
    decode_input_len=128, request_overhead_s=4e-3, relay_s=1e-3,
    post_descriptors=(1, 16, 256), post_s=(12e-6, 40e-6, 470e-6),
    wire_descriptors=(1, 1, 16, 256), wire_bytes=(8192, 1 << 22, 131072, 1 << 21),
    wire_s=(10e-6, 110e-6, 35e-6, 430e-6),
    message_send_s=3e-6, message_recv_s=3e-6, message_latency_s=18e-6,
)


def test_measurements_become_the_fitted_profile(tmp_path: Path) -> None:
    prof = write_profile(GOOD, tmp_path / "cpu.toml")
    assert prof.name == "cpu-tiny"
    assert prof.prefill.prefill_step_overhead_s == pytest.approx(2e-3)
    assert prof.prefill.step_token_s == pytest.approx(3e-6)
    assert prof.decode.decode_step_overhead_s == pytest.approx(1e-3)
    assert prof.decode.step_token_s == pytest.approx(2e-5)
    assert prof.network.router_hop_s == pytest.approx((4e-3 + 1e-3) / 2)
    assert prof.network.gpus_per_node == 1 and prof.prefill.tp == 1
    text = (tmp_path / "cpu.toml").read_text()
    assert text.startswith("# cpu-tiny") and "load average at the start 1.00" in text
    # A one-token request at 64 tokens costs what was measured; a decode step at 4 too.
    assert step_s(prof, prof.prefill, prefill_chunks=((64, 0),)) == pytest.approx(
        2e-3 + 3e-6 * 64, rel=1e-4)  # the roofline: ~50 ns
    assert step_s(prof, prof.decode, num_decodes=4, decode_contexts=4 * 128) == pytest.approx(
        1e-3 + 2e-5 * 4, rel=1e-4)


def test_the_written_profile_runs_in_the_simulator(tmp_path: Path) -> None:
    prof = write_profile(GOOD, tmp_path / "cpu.toml")
    for mode in ("push", "pull"):
        res = run(config(mode, qps=8.0, input_len=64, output_len=8, num_prompts=8,
                         profile=prof))
        assert res.result["completed"] == 8 and res.leaked_blocks == 0
        # At this light load a request's TPOT is one decode step of a small batch.
        assert 1e3 <= res.result["mean_tpot_ms"] * 1e3 <= 1.2e3 + 1


@pytest.mark.parametrize(("change", "words"), [
    ({"prefill_step_s": (2e-3, float("nan"), 3e-3)}, "positive finite"),
    ({"decode_step_s": (1e-3, -1e-3, 1e-3, 1e-3)}, "positive finite"),
    ({"post_s": (12e-6, float("inf"), 470e-6)}, "positive finite"),
    ({"message_latency_s": 0.0}, "positive finite"),
    ({"prefill_lengths": (64, 64, 64)}, "two different sizes"),
    ({"decode_batches": (1, 2), "decode_step_s": (1e-3,)}, "two different sizes"),
    ({"prefill_step_s": (1e-4, 1e-3, 5e-3)}, "negative fixed cost"),
    ({"wire_s": (10e-6, 110e-6, 35e-6)}, "one descriptor count"),
])
def test_bad_measurements_are_refused(tmp_path: Path, change: dict[str, object],
                                      words: str) -> None:
    bad = dataclasses.replace(GOOD, **change)  # type: ignore[arg-type]
    out = tmp_path / "bad.toml"
    with pytest.raises(MeasurementError, match=words):
        write_profile(bad, out)
    assert not out.exists()


def test_a_flat_or_falling_per_size_cost_is_no_cost() -> None:
    assert fit_line([1, 2, 4], [3e-3, 3e-3, 2.9e-3], "x") == (pytest.approx(2.9667e-3,
                                                                           rel=1e-3), 0.0)


def test_toml_round_trips_through_the_profile_reader() -> None:
    data = profile_data(GOOD)
    parsed = tomllib.loads(to_toml(data, ["a comment"]))
    assert parsed == data
    assert profile_from_dict(parsed).decode.step_token_s == data["decode"]["step_token_s"]


@pytest.mark.parametrize("value", [-1e-6, float("nan"), float("inf")])
def test_step_token_s_must_be_finite_and_not_negative(value: float) -> None:
    with pytest.raises(ProfileError, match="step_token_s"):
        profile_from_dict({"prefill": {"step_token_s": value}})


def test_step_token_s_limiting_cases() -> None:
    """0 (the default) leaves every step as it was; otherwise a step costs exactly its
    overhead and roofline plus step_token_s per computed token."""
    assert DEFAULT.prefill.step_token_s == 0 and DEFAULT.decode.step_token_s == 0
    tok = 5e-5
    dec = dataclasses.replace(DEFAULT.decode, step_token_s=tok)
    base = step_s(DEFAULT, DEFAULT.decode, num_decodes=6, decode_contexts=6000)
    assert step_s(DEFAULT, dec, num_decodes=6, decode_contexts=6000) == pytest.approx(
        base + 6 * tok, rel=1e-12)
    chunks = ((100, 0), (28, 40))
    base = step_s(DEFAULT, DEFAULT.prefill, num_decodes=2, decode_contexts=300,
                  prefill_chunks=chunks)
    pre = dataclasses.replace(DEFAULT.prefill, step_token_s=tok)
    assert step_s(DEFAULT, pre, num_decodes=2, decode_contexts=300,
                  prefill_chunks=chunks) == pytest.approx(base + (2 + 128) * tok, rel=1e-12)
    assert step_s(DEFAULT, pre) == 0.0  # nothing to compute: no step


def test_the_committed_cpu_tiny_profile_loads() -> None:
    prof = load_profile(PROFILES / "cpu-tiny.toml")
    assert prof.name == "cpu-tiny"
    assert prof.model.num_layers == 2 and prof.model.dtype_bytes == 4
    for side in (prof.prefill, prof.decode):
        assert side.step_token_s >= 0 and math.isfinite(side.step_token_s)
    text = (PROFILES / "cpu-tiny.toml").read_text()
    assert "measured" in text.splitlines()[2] and "load average" in text


# ------------------------------------------------------------------ cpu_share


def test_a_core_of_its_own_changes_nothing() -> None:
    assert on_shared_cores(DEFAULT) is DEFAULT
    prof = on_host(profile_from_dict(profile_data(GOOD)))
    assert on_shared_cores(prof) is prof


def test_cpu_share_stretches_every_host_time_by_its_inverse() -> None:
    prof = profile_from_dict(profile_data(GOOD))
    half = on_host(prof, prefill={"cpu_share": 0.5}, decode={"cpu_share": 0.25})
    s = on_shared_cores(half)
    assert s.host.prefill.cpu_share == 1 and s.host.decode.cpu_share == 1
    assert s.prefill.prefill_step_overhead_s == 2 * prof.prefill.prefill_step_overhead_s
    assert s.prefill.step_token_s == 2 * prof.prefill.step_token_s
    assert s.decode.decode_step_overhead_s == 4 * prof.decode.decode_step_overhead_s
    assert s.decode.step_python_s == 4 * prof.decode.step_python_s
    both = (0.5 + 0.25) / 2  # posting, messages and hops run on both sides' cores
    assert s.network.router_hop_s == pytest.approx(prof.network.router_hop_s / both)
    assert s.network.post_per_descriptor_s == pytest.approx(
        prof.network.post_per_descriptor_s / both)
    assert s.control.message_recv_s == pytest.approx(prof.control.message_recv_s / both)
    assert s.network.wire_latency_s == prof.network.wire_latency_s  # the wire is not host


@pytest.mark.parametrize("share", [0.5, 0.2])
def test_one_request_decodes_at_the_stretched_step(share: float) -> None:
    """Limiting case: one request alone, its TPOT is exactly one decode step of batch 1,
    (overhead + step_token_s) / cpu_share (the roofline adds nanoseconds here)."""
    prof = profile_from_dict(profile_data(GOOD))
    slow = on_host(prof, decode={"cpu_share": share})
    res = run(config("push", qps=1.0, input_len=64, output_len=9, num_prompts=1,
                     profile=slow))
    step = (prof.decode.decode_step_overhead_s + prof.decode.step_token_s) / share
    assert res.result["mean_tpot_ms"] == pytest.approx(step * 1e3, rel=1e-5)


@pytest.mark.parametrize("value", [0.0, 1.5, float("nan")])
def test_cpu_share_must_be_a_share(value: float) -> None:
    with pytest.raises(ProfileError, match="cpu_share"):
        profile_from_dict({"host": {"model": "shared-cpu", "decode": {"cpu_share": value}}})


# ------------------------------------------------------------------- cpu_speed


def test_a_slower_machine_is_a_smaller_share_of_the_measured_one() -> None:
    """cpu_speed s stretches what cpu_share s would, exactly: a core half as fast is half
    a core of the machine the profile was measured on."""
    prof = profile_from_dict(profile_data(GOOD))

    def sides(**kw: float) -> Profile:
        return on_host(prof, prefill=kw, decode=kw)

    same = sides(cpu_speed=1.0)
    assert on_shared_cores(same) is same
    assert on_shared_cores(sides(cpu_speed=0.5)) == on_shared_cores(sides(cpu_share=0.5))
    fast = on_shared_cores(sides(cpu_speed=2.0, cpu_share=0.5))  # the two cancel
    assert fast.decode.decode_step_overhead_s == prof.decode.decode_step_overhead_s
    assert fast.network.router_hop_s == prof.network.router_hop_s
    cfg = dict(qps=4.0, input_len=64, output_len=9, num_prompts=12)
    slow = run(config("push", profile=sides(cpu_speed=0.4), **cfg)).result
    assert slow == run(config("push", profile=sides(cpu_share=0.4), **cfg)).result
    step = (prof.decode.decode_step_overhead_s + prof.decode.step_token_s) / 0.4
    alone = run(config("push", qps=1.0, input_len=64, output_len=9, num_prompts=1,
                       profile=on_host(prof, decode={"cpu_speed": 0.4}))).result
    assert alone["mean_tpot_ms"] == pytest.approx(step * 1e3, rel=1e-5)


@pytest.mark.parametrize("value", [0.0, -1.0, 101.0, float("nan"), float("inf")])
def test_cpu_speed_must_be_a_positive_finite_rate(value: float) -> None:
    with pytest.raises(ProfileError, match="cpu_speed"):
        profile_from_dict({"host": {"model": "shared-cpu", "prefill": {"cpu_speed": value}}})
    with pytest.raises(ProfileError, match="probe_speed"):
        profile_from_dict({"host": {"model": "shared-cpu",
                                    "probe_speed": -1.0 if value >= 0 else value}})


def test_the_profile_keeps_the_probe_speed_it_was_measured_at(tmp_path: Path) -> None:
    assert "host" not in profile_data(GOOD)  # not probed: no reference, dedicated
    prof = write_profile(dataclasses.replace(GOOD, engine_speed=123456.0), tmp_path / "p.toml")
    assert prof.host.probe_speed == 123456.0 and prof.host.model == "shared-cpu"


def test_the_probe_measures_the_cores_speed() -> None:
    """The probe's loop, run here for five bursts: each burst's rate of fixed work per CPU
    second is positive and about what this process gets running the same work."""
    import os
    import time

    from pushkv.fit.cores import _probe, _unit

    class Stop:  # set after five bursts
        calls = 0

        def is_set(self) -> bool:
            self.calls += 1
            return self.calls > 5

    class Out:
        got: tuple[list[float], list[float], list[float], list[float]] | None = None

        def send(self, got: tuple[list[float], list[float], list[float], list[float]]
                 ) -> None:
            self.got = got

    out = Out()
    cores = os.sched_getaffinity(0)
    try:
        _probe(min(cores), 0.0, 0.002, Stop(), out)
    finally:
        os.sched_setaffinity(0, cores)  # the probe pins the process it runs in
    assert out.got is not None
    wakes, shares, speeds, due = out.got
    assert len(wakes) == len(shares) == len(speeds) == len(due) == 5 and min(speeds) > 0
    assert due == sorted(due)  # when each wake-up was due, in order
    c0, units = time.thread_time(), 0
    while time.thread_time() - c0 < 0.01:
        _unit()
        units += 1
    mine = units / (time.thread_time() - c0)
    assert 0.1 < sorted(speeds)[2] / mine < 10


def test_a_core_probe_is_running_before_what_it_measures_starts() -> None:
    """Entering a CoreProbe returns only once each probe process is in its loop: a fresh
    interpreter's start-up (about half a second of both cores here) never overlaps the
    measurement that follows. Each probe's start lies between the call and its return,
    and each probe reports once the measurement ends."""
    import time

    from pushkv.fit.cores import CoreProbe

    called = time.monotonic()
    with CoreProbe(cores=(0, 1)) as probe:
        entered = time.monotonic()
        assert sorted(probe.started) == [0, 1]
        assert all(called <= t <= entered for t in probe.started.values())
        assert all(p.is_alive() for p in probe._procs)
    assert sorted(probe.wakes) == sorted(probe.shares) == sorted(probe.wake_times) == [0, 1]
    for core, due in probe.wake_times.items():  # when each wake-up was due, in order
        assert len(due) == len(probe.wakes[core])
        assert due == sorted(due) and all(entered - 1 <= t <= time.monotonic() for t in due)
    assert not any(p.is_alive() for p in probe._procs)


def _dies_at_once(core: int, period_s: float, burst_s: float, stop: object,
                  out: object) -> None:
    """A probe process that exits before it starts its loop."""
    raise SystemExit(3)


def test_a_core_probe_that_dies_before_it_starts_is_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe whose process dies before its loop: ProbeError on entering, naming the
    core, and no probe process left behind; bad probe settings are refused."""
    from pushkv.fit import cores

    monkeypatch.setattr(cores, "_probe", _dies_at_once)
    probe = cores.CoreProbe(cores=(0,), ready_s=60)
    with pytest.raises(cores.ProbeError, match="core 0 died before it started"):
        probe.__enter__()
    assert not any(p.is_alive() for p in probe._procs)
    with pytest.raises(ValueError, match="shorter than its period"):
        cores.CoreProbe(period_s=0.001, burst_s=0.002)
    with pytest.raises(ValueError, match="ready_s must be positive"):
        cores.CoreProbe(ready_s=0)


# ---------------------------------------------------------------------- wake_s


def _with_wake(w: float) -> Profile:
    prof = profile_from_dict(profile_data(GOOD))
    return on_host(prof, prefill={"wake_s": w}, decode={"wake_s": w})


@pytest.mark.parametrize(("mode", "wakes"), [
    # push: the prefill leg's hop (2), the prefill engine (2), its writer thread (1), the
    # notification's receiver (1), the idle decode engine (2), the way back (3)
    ("push", 11),
    # pull: hop to prefill (2), prefill engine (2), its answer's hop (2), hop to decode
    # (2), decode engine (2); the read is posted inline; decode engine again when the
    # read is done (2), the way back (3)
    ("pull", 15),
])
def test_one_request_pays_each_wake_up_on_its_path(mode: str, wakes: int) -> None:
    """Limiting case: one request alone on idle engines; every process woken on its
    critical path adds exactly wake_s to its TTFT."""
    w = 5e-4
    base = run(config(mode, qps=1.0, input_len=64, output_len=4, num_prompts=1,
                      profile=_with_wake(0.0))).result["mean_ttft_ms"]
    slow = run(config(mode, qps=1.0, input_len=64, output_len=4, num_prompts=1,
                      profile=_with_wake(w))).result["mean_ttft_ms"]
    assert slow - base == pytest.approx(wakes * w * 1e3, abs=0.01)


def test_wake_s_zero_keeps_the_default_profile_as_it_was() -> None:
    assert DEFAULT.host.prefill.wake_s == 0 and DEFAULT.host.decode.wake_s == 0
    assert DEFAULT.host.model == "dedicated"
    import numpy as np
    import simpy

    shared = SharedCpu(simpy.Environment(), on_host(DEFAULT), np.random.SeedSequence(0))
    assert shared.hop_wake_s == 0 and shared.return_wake_s == 0


@pytest.mark.parametrize("value", [-1e-3, float("inf")])
def test_wake_s_must_be_finite_and_not_negative(value: float) -> None:
    with pytest.raises(ProfileError, match="wake_s"):
        profile_from_dict({"host": {"model": "shared-cpu", "decode": {"wake_s": value}}})


def test_the_cpu_profile_has_no_prefix_hits() -> None:
    """The real servers run with prefix caching off: the committed profile and a
    measured one must not inherit the default profile's 0.9 hits on prefill."""
    root = Path(__file__).resolve().parents[2]
    assert load_profile(root / "pushkv/sim/profiles/cpu-tiny.toml").prefill \
        .prefix_hit_fraction == 0.0
    assert profile_from_dict(profile_data(GOOD)).prefill.prefix_hit_fraction == 0.0
