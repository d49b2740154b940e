"""The simulator's timeline: every request's marks, complete and in causal order, in
pushkv.timeline's format; recording them changes no result."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from hypothesis import given, settings
from hypothesis import strategies as st
from sim_helpers import config

from pushkv import timeline
from pushkv.protocol import FailurePolicy
from pushkv.sim.cli import main as sim_main
from pushkv.sim.marks import Timeline
from pushkv.sim.profile import load_profile
from pushkv.sim.request import Outcome
from pushkv.sim.runner import run
from pushkv.sim.scenario import Dispatch, FaultConfig, ProtocolSettings

TINY = load_profile(Path(__file__).resolve().parents[2] / "pushkv/sim/profiles/cpu-tiny.toml")

#: Causal chains each request's marks must follow (each mark no earlier than the one
#: before it).
PUSH_CHAINS = (
    ("received", "legs_sent", "prefill_arrived", "prefill_seen", "prefill_finished",
     "write_handed", "write_posted", "write_completed", "notify_received", "ready",
     "ready_scheduled", "decode_scheduled", "first_token", "last_token"),
    ("legs_sent", "decode_arrived", "decode_seen", "registration_shipped",
     "registration_handed", "registration_sent", "registration_received", "write_posted"),
)
PULL_CHAINS = (
    ("received", "legs_sent", "prefill_arrived", "prefill_seen", "prefill_finished",
     "decode_arrived", "decode_seen", "ready", "ready_scheduled", "decode_scheduled",
     "first_token", "last_token"),
)
CONNECTOR = {"prefill": {"ingest_s": 0.003},
             "decode": {"ingest_s": 0.005, "return_s": 0.004, "order_handoff_s": 0.0015,
                        "event_handoff_s": 0.0017, "admit_lag_s": 0.0012},
             "network": {"notify_wait_s": 0.002}}


def _with(profile, keys):  # type: ignore[no-untyped-def]
    return dataclasses.replace(profile, **{
        side: dataclasses.replace(getattr(profile, side), **fields)
        for side, fields in keys.items()}).validate()


def _check(tl: Timeline, chains: tuple[tuple[str, ...], ...], n: int) -> None:
    assert len(tl.requests) == n
    needed = {e for chain in chains for e in chain}
    for tid, marks in tl.requests.items():
        assert needed <= set(marks), (tid, needed - set(marks))
        assert set(marks) <= set(timeline.EVENTS)
        for chain in chains:
            times = [marks[e] for e in chain]
            assert times == sorted(times), (tid, chain, times)
        assert marks["first_token"] > marks["decode_scheduled"]  # a step in between


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(["push", "pull", "pull-async", "push-seq"]),
       tiny=st.booleans(), connector=st.booleans(), seed=st.integers(0, 1000),
       qps=st.sampled_from([0.5, 4.0, 32.0]), input_len=st.sampled_from([64, 512, 2048]))
def test_every_request_has_its_marks_in_causal_order(
        mode: str, tiny: bool, connector: bool, seed: int, qps: float, input_len: int) -> None:
    seq = mode == "push-seq"
    cfg = config("push" if seq else mode, qps=qps, input_len=input_len, output_len=6,
                 num_prompts=12, seed=seed,
                 dispatch=Dispatch.SEQUENTIAL if seq else Dispatch.CONCURRENT)
    profile = TINY if tiny else cfg.profile
    if connector:
        profile = _with(profile, CONNECTOR)
    cfg = dataclasses.replace(cfg, profile=profile)
    tl = Timeline()
    res = run(cfg, timeline=tl)
    assert res.result["completed"] == 12 and res.leaked_blocks == 0
    _check(tl, PUSH_CHAINS if mode.startswith("push") else PULL_CHAINS, 12)
    if seq:  # the decode leg leaves when prefill has answered
        for marks in tl.requests.values():
            assert marks["decode_seen"] > marks["prefill_finished"]


@pytest.mark.parametrize("mode", ["push", "pull", "pull-async"])
@pytest.mark.parametrize("keys", [{}, CONNECTOR])
def test_recording_changes_no_result(mode: str, keys: dict) -> None:  # type: ignore[type-arg]
    cfg = config(mode, qps=8.0, input_len=1024, num_prompts=30,
                 faults=FaultConfig(drop_register=0.1, drop_notify=0.1))
    cfg = dataclasses.replace(cfg, profile=_with(cfg.profile, keys))
    plain = json.dumps(run(cfg).result)
    assert json.dumps(run(cfg, timeline=Timeline()).result) == plain


def test_first_token_marks_are_the_result_files_ttfts() -> None:
    cfg = dataclasses.replace(config("push", qps=4.0, input_len=256, num_prompts=10),
                              profile=_with(TINY, CONNECTOR))
    tl = Timeline()
    res = run(cfg, timeline=tl)
    by_index = {r.spec.index: r for r in res.requests}
    for i, ttft in enumerate(res.result["ttfts"]):
        marks = tl.requests[by_index[i].transfer_id]
        assert marks["first_token"] - marks["legs_sent"] == pytest.approx(ttft, abs=1e-6)


def test_the_file_is_pushkv_timelines_and_the_cli_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "tl"
    assert sim_main(["sim", "--mode", "push", "--qps", "2", "--input-len", "128",
                     "--output-len", "4", "--num-prompts", "5", "--timeline-dir",
                     str(out)]) == 0
    marks = timeline.read(out)
    assert {m.transfer_id for m in marks} == {f"req-{i}" for i in range(5)}
    assert all(m.process.startswith("sim-") for m in marks)
    stats = timeline.summary({"sim": out})["sim"]
    assert stats["legs out -> first token"]["n"] == 5
    assert stats["write posted -> notification"]["median"] > 0


def test_an_unknown_mark_is_refused() -> None:
    with pytest.raises(ValueError, match="not a simulated timeline mark"):
        Timeline().mark("req-0", "answer_sent", 0.0)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(mode=st.sampled_from(["push", "pull", "pull-async"]), seed=st.integers(0, 1000),
       scale=st.sampled_from([1.0, 30.0]), kill_p=st.one_of(st.none(), st.floats(0.0, 3.0)),
       kill_d=st.one_of(st.none(), st.floats(0.0, 3.0)),
       drop=st.sampled_from([0.0, 0.3]), preemption=st.sampled_from(["recompute", "reissue"]),
       policy=st.sampled_from(list(FailurePolicy)))
def test_the_connector_keys_keep_every_request_ending_once_without_leaks(
        mode: str, seed: int, scale: float, kill_p: float | None, kill_d: float | None,
        drop: float, preemption: str, policy: FailurePolicy) -> None:
    """Hand-offs and ingestion long enough (x30) for deaths and drops to land inside."""
    keys = {side: {k: v * scale for k, v in fields.items()}
            for side, fields in CONNECTOR.items()}
    keys["decode"] = keys["decode"] | {"preemption": preemption}
    cfg = config(mode, qps=16.0, input_len=1024, output_len=4, num_prompts=10, seed=seed,
                 faults=FaultConfig(kill_prefill_at=kill_p, kill_decode_at=kill_d,
                                    drop_register=drop, drop_notify=drop, detect_s=0.2),
                 protocol=ProtocolSettings(policy=policy, window_s=0.5, fence_grace_s=0.5))
    cfg = dataclasses.replace(cfg, profile=_with(cfg.profile, keys))
    tl = Timeline()
    r = run(cfg, timeline=tl)
    assert all(q.outcome is not Outcome.PENDING for q in r.requests)
    assert r.result["completed"] + r.result["failed"] == 10
    assert r.leaked_blocks == 0, r.leaks
    assert r.rejected == 0
