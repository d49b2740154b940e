"""The connector keys (ingest_s, return_s, order_handoff_s, event_handoff_s,
admit_lag_s): validated like every key, off by default, and what each adds; measured
from a real pair's timeline."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from sim_helpers import config, write_timeline

from pushkv.fit.cpu_profile import MeasurementError
from pushkv.fit.measure import main as measure_main
from pushkv.fit.measure_connector import (
    connector_keys,
    connector_steps,
    gauge_keys,
    with_connector_keys,
)
from pushkv.sim.profile import (
    CONNECTOR_KEYS,
    EngineProfile,
    ProfileError,
    load_profile,
    profile_from_dict,
)
from pushkv.sim.runner import run
from pushkv.sim.scenario import Dispatch

ROOT = Path(__file__).resolve().parents[2]
TINY_PATH = ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"
TINY = load_profile(TINY_PATH)


def _with(**sides: dict[str, float]):  # type: ignore[no-untyped-def]
    return dataclasses.replace(TINY, **{
        side: dataclasses.replace(getattr(TINY, side), **fields)
        for side, fields in sides.items()}).validate()


def _run(profile, mode: str = "push", qps: float = 0.5, **kw):  # type: ignore[no-untyped-def]
    cfg = dataclasses.replace(config(mode, qps=qps, input_len=128, output_len=8,
                                     num_prompts=12, **kw), profile=profile)
    return run(cfg).result


def test_the_keys_are_off_by_default() -> None:
    assert TINY.network.notify_wait_s == 0.0
    for key in CONNECTOR_KEYS:
        assert getattr(EngineProfile(), key) == 0.0
        assert getattr(TINY.prefill, key) == 0.0 and getattr(TINY.decode, key) == 0.0


@pytest.mark.parametrize(("doc", "words"), [
    ({"decode": {"ingest_s": math.nan}}, "decode.ingest_s must be a finite number"),
    ({"decode": {"return_s": math.inf}}, "decode.return_s must be a finite number"),
    ({"prefill": {"ingest_s": -0.001}}, "prefill.ingest_s must be >= 0"),
    ({"decode": {"admit_lag_s": -1.0}}, "decode.admit_lag_s must be >= 0"),
    ({"network": {"notify_wait_s": -1.0}}, "network.notify_wait_s must be >= 0"),
    ({"network": {"notify_wait_s": math.nan}}, "network.notify_wait_s must be a finite"),
    ({"decode": {"ingest_ms": 1.0}}, "unknown key decode.ingest_ms"),
    ({"prefill": {"order_handoff_s": 0.001}}, "prefill.order_handoff_s is not used"),
    ({"prefill": {"event_handoff_s": 0.001}}, "prefill.event_handoff_s is not used"),
    ({"decode": {"event_handoff_s": "1ms"}}, "decode.event_handoff_s must be a number"),
])
def test_bad_values_are_refused(doc: dict[str, object], words: str) -> None:
    with pytest.raises(ProfileError, match=words.replace(".", r"\.")):
        profile_from_dict(doc)


def test_nan_in_a_toml_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[decode]\ningest_s = nan\n")
    with pytest.raises(ProfileError, match="finite"):
        load_profile(path)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ingest_zero_is_the_old_result_exactly(mode: str) -> None:
    zero = _with(prefill={"ingest_s": 0.0}, decode={"ingest_s": 0.0, "return_s": 0.0})
    assert json.dumps(_run(zero, mode, qps=4.0)) == json.dumps(_run(TINY, mode, qps=4.0))


@pytest.mark.parametrize("x", [0.002, 0.01])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_ingest_adds_about_itself_to_ttft_at_low_load(mode: str, x: float) -> None:
    base = _run(TINY, mode)["median_ttft_ms"]
    pre = _run(_with(prefill={"ingest_s": x}), mode)["median_ttft_ms"]
    both = _run(_with(prefill={"ingest_s": x}, decode={"ingest_s": x}), mode)["median_ttft_ms"]
    assert pre - base == pytest.approx(x * 1e3, rel=0.15)
    # pull: the decode leg leaves after prefill answered, so its ingestion adds too;
    # push: both legs go at once, the decode leg's ingestion overlaps the prefill.
    extra = 2 * x if mode == "pull" else x
    assert both - base == pytest.approx(extra * 1e3, rel=0.15)


def test_the_api_server_takes_legs_one_at_a_time() -> None:
    """All at once: the n-th leg waits for n - 1 ingestions ahead of it."""
    x = 0.01
    base = _run(TINY, "push", qps=math.inf)
    slow = _run(_with(prefill={"ingest_s": x}), "push", qps=math.inf)
    gain = [b - a for a, b in zip(base["ttfts"], slow["ttfts"], strict=True)]
    assert max(gain) > 5 * x  # queued behind the others, not x for each


def test_return_path_adds_to_every_token_not_to_tpot() -> None:
    x = 0.004
    base, slow = _run(TINY), _run(_with(decode={"return_s": x}))
    assert slow["median_ttft_ms"] - base["median_ttft_ms"] == pytest.approx(x * 1e3)
    assert slow["median_tpot_ms"] == pytest.approx(base["median_tpot_ms"])


def test_the_prefill_answer_path_counts_for_a_sequential_router_only() -> None:
    x = 0.004
    seq, conc = Dispatch.SEQUENTIAL, Dispatch.CONCURRENT
    slow = _with(prefill={"return_s": x})
    assert _run(slow, dispatch=seq)["median_ttft_ms"] - _run(TINY, dispatch=seq)[
        "median_ttft_ms"] == pytest.approx(x * 1e3, rel=0.15)
    assert json.dumps(_run(slow, dispatch=conc)) == json.dumps(_run(TINY, dispatch=conc))


def test_readiness_hand_offs_add_to_a_push_ttft() -> None:
    base = _run(TINY)["median_ttft_ms"]
    late = _run(_with(decode={"event_handoff_s": 0.002, "admit_lag_s": 0.003}))
    assert late["median_ttft_ms"] - base == pytest.approx(5.0, rel=0.15)
    wait = _run(_with(network={"notify_wait_s": 0.003}))
    assert wait["median_ttft_ms"] - base == pytest.approx(3.0, rel=0.15)
    assert _run(_with(network={"notify_wait_s": 0.003}), "pull")["median_ttft_ms"] == \
        _run(TINY, "pull")["median_ttft_ms"]  # pull reads: no write notification
    # a registration late by less than the prefill takes is off the critical path
    order = _run(_with(decode={"order_handoff_s": 0.0005}))["median_ttft_ms"]
    assert base <= order < base + 0.5


# ------------------------------------------------------------ measuring them


def _requests(n: int = 5) -> dict[str, dict[str, float]]:
    """Per request: marks 10 ms apart per segment in a fixed pattern (ms offsets)."""
    offsets = {"legs_sent": 0, "prefill_seen": 6, "decode_seen": 9,
               "registration_shipped": 9.5, "registration_handed": 11, "write_posted": 16,
               "notify_received": 20,
               "ready": 21.5, "ready_scheduled": 22, "decode_scheduled": 23.2,
               "first_token": 31, "last_token": 52}
    return {f"r{i}": {e: 100.0 * i + ms / 1e3 for e, ms in offsets.items()}
            for i in range(n)}


def test_the_keys_are_segment_medians_less_what_the_profile_has() -> None:
    keys = connector_keys(_requests(), TINY)
    hop = TINY.network.router_hop_s
    step = TINY.decode.decode_step_overhead_s + TINY.decode.step_token_s
    assert keys["prefill"]["ingest_s"] == pytest.approx(0.006 - hop)
    assert keys["decode"]["ingest_s"] == pytest.approx(0.009 - hop)
    assert keys["decode"]["return_s"] == pytest.approx(0.0078 - step - hop)
    assert keys["decode"]["order_handoff_s"] == pytest.approx(0.0015)
    assert keys["decode"]["event_handoff_s"] == pytest.approx(0.0015)
    assert keys["decode"]["admit_lag_s"] == pytest.approx(0.0017)
    net = TINY.network
    assert keys["network"]["notify_wait_s"] == pytest.approx(
        0.004 - net.wire_latency_s - net.control_latency_s - net.post_fixed_s)
    half = connector_keys(_requests(), TINY, share=0.5)
    assert half["decode"]["ingest_s"] == pytest.approx(keys["decode"]["ingest_s"] / 2)
    data = with_connector_keys(tomllib.loads(TINY_PATH.read_text()), keys)
    assert profile_from_dict(data).decode.admit_lag_s == pytest.approx(0.0017)


def test_a_missing_segment_or_a_bad_share_is_refused() -> None:
    reqs = _requests()
    for r in reqs.values():
        del r["notify_received"]
    with pytest.raises(MeasurementError, match="notification -> ready"):
        connector_keys(reqs, TINY)
    for share in (math.nan, 0.0, 1.5):
        with pytest.raises(MeasurementError, match="share"):
            connector_keys(_requests(), TINY, share=share)


def test_measure_adds_them_to_a_base_profile(tmp_path: Path) -> None:
    tl = write_timeline(tmp_path / "timeline", _requests())
    out = tmp_path / "conn.toml"
    assert measure_main(["--out", str(out), "--base", str(TINY_PATH),
                         "--connector-timeline", str(tl)]) == 0
    prof = load_profile(out)
    assert prof.decode.order_handoff_s == pytest.approx(0.0015)
    assert prof.decode.decode_step_overhead_s == TINY.decode.decode_step_overhead_s
    assert "Connector keys from the pushkv.timeline marks of 5 requests" in out.read_text()
    assert measure_main(["--out", str(out), "--base", str(TINY_PATH),
                         "--connector-timeline", str(tmp_path / "none")]) == 2
    with pytest.raises(SystemExit):
        measure_main(["--out", str(out), "--base", str(TINY_PATH)])


def test_step_overheads_as_the_connector_servers_ran_them() -> None:
    with pytest.raises(MeasurementError, match="prefill sees -> prefill finished"):
        connector_steps(_requests(), TINY, input_len=100, output_len=8)
    reqs = _requests()
    for r in reqs.values():
        r["prefill_finished"] = r["prefill_seen"] + 0.004
    steps = connector_steps(reqs, TINY, input_len=100, output_len=8)
    assert steps["prefill"]["prefill_step_overhead_s"] == pytest.approx(
        0.004 - 100 * TINY.prefill.step_token_s)
    assert steps["decode"]["decode_step_overhead_s"] == pytest.approx(
        0.021 / 7 - TINY.decode.step_token_s)
    assert steps["decode"]["step_python_s"] == steps["decode"]["decode_step_overhead_s"]
    with pytest.raises(MeasurementError, match="2 output"):
        connector_steps(reqs, TINY, input_len=100, output_len=1)


def test_the_committed_connector_profile_loads_and_extends_cpu_tiny() -> None:
    conn = load_profile(ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny-connector.toml")
    assert conn.decode.ingest_s > 0 and conn.prefill.ingest_s > 0
    assert conn.network.notify_wait_s > 0
    assert conn.network.router_hop_s == TINY.network.router_hop_s
    assert conn.prefill.prefix_hit_fraction == 0.0


def test_a_gauge_gives_a_points_steps_and_keys_from_its_lone_requests() -> None:
    """Push: the steps at the point's lengths, then every connector key against them;
    a request that overlapped another is not taken."""
    reqs = _requests()
    for r in reqs.values():
        r["prefill_finished"] = r["prefill_seen"] + 0.004
    busy = {e: t + 0.001 for e, t in reqs["r0"].items()}  # in flight beside r0
    busy["prefill_seen"] += 0.5  # a stalled leg that must not count
    got = gauge_keys({**reqs, "busy": busy}, TINY, mode="push", input_len=100,
                     output_len=8)
    steps = connector_steps(reqs, TINY, input_len=100, output_len=8)
    stepped = profile_from_dict(steps, base=TINY)  # type: ignore[arg-type]
    assert got["prefill"]["prefill_step_overhead_s"] == pytest.approx(
        steps["prefill"]["prefill_step_overhead_s"])
    assert got["decode"]["decode_step_overhead_s"] == pytest.approx(0.021 / 7
                                                                    - TINY.decode.step_token_s)
    want = connector_keys({k: v for k, v in reqs.items() if k != "r0"}, stepped)
    for side, table in want.items():
        for key, value in table.items():
            assert got[side][key] == pytest.approx(value), (side, key)
    # return_s is taken against the gauge's own decode step, not the base profile's
    assert got["decode"]["return_s"] == pytest.approx(
        0.0078 - 0.021 / 7 - TINY.network.router_hop_s)


def test_a_pull_gauge_gives_what_a_pull_timeline_shows_and_keeps_the_rest() -> None:
    """Pull (a sequential router): the steps, the prefill leg's ingestion, a token's way
    back, the prefill answer's way out against the profile's decode ingestion; the
    push-only keys are not touched."""
    base = _with(decode={"ingest_s": 0.002})
    offsets = {"legs_sent": 0, "prefill_seen": 5, "prefill_finished": 9,
               "decode_seen": 20, "ready_scheduled": 24, "decode_scheduled": 25,
               "first_token": 33, "last_token": 54}
    reqs = {f"r{i}": {e: 100.0 * i + ms / 1e3 for e, ms in offsets.items()}
            for i in range(5)}
    got = gauge_keys(reqs, base, mode="pull", input_len=64, output_len=8)
    hop = base.network.router_hop_s
    dec = 0.021 / 7
    assert got["prefill"]["prefill_step_overhead_s"] == pytest.approx(
        0.004 - 64 * base.prefill.step_token_s)
    assert got["prefill"]["ingest_s"] == pytest.approx(0.005 - hop)
    assert got["decode"]["return_s"] == pytest.approx(0.008 - dec - hop)
    assert got["prefill"]["return_s"] == pytest.approx(0.011 - 2 * hop - 0.002)
    assert not {"ingest_s", "order_handoff_s", "admit_lag_s"} & set(got["decode"])
    assert "network" not in got
    with pytest.raises(MeasurementError, match="mode"):
        gauge_keys(reqs, base, mode="pull-async", input_len=64, output_len=8)
    for r in reqs.values():
        del r["prefill_seen"]
    with pytest.raises(MeasurementError, match="prefill sees -> prefill finished"):
        gauge_keys(reqs, base, mode="pull", input_len=64, output_len=8)
