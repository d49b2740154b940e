"""Faults as what-ifs: the protocol's timeouts and failure policy, visible in the results."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from sim_helpers import config

from pushkv.protocol import FailurePolicy
from pushkv.sim import FaultConfig, ProtocolSettings, run
from pushkv.sim.request import Outcome

SHORT = {"window_s": 2.0, "fence_grace_s": 1.0}


def _run(mode: str, policy: FailurePolicy, faults: FaultConfig, **kw):
    cfg = config(mode, qps=4.0, input_len=4096, num_prompts=60,
                 protocol=ProtocolSettings(policy=policy, **SHORT), faults=faults, **kw)
    return run(cfg, keep_objects=True)


def _check_clean(r) -> None:
    assert r.leaked_blocks == 0
    assert r.rejected == 0
    assert len(r.requests) == 60
    assert all(q.outcome is not Outcome.PENDING for q in r.requests)
    assert r.result["completed"] + r.result["failed"] == 60


@pytest.mark.parametrize("fault", ["drop_register", "drop_notify"])
def test_lost_messages_hit_the_window_then_the_policy(fault: str) -> None:
    faults = FaultConfig(**{fault: 0.2})
    failed = _run("push", FailurePolicy.FAIL, faults)
    _check_clean(failed)
    e = failed.result["pushkv"]
    lost = e["lost_registrations"] + e["lost_notifications"]
    assert lost > 0
    assert failed.result["failed"] == lost == e["transfer_failures"]
    errors = [m for m in failed.result["errors"] if m]
    assert all("no write within the registration window" in m for m in errors)
    # The decode side waited out its window before giving up.
    slow = [q for q in failed.requests if q.outcome is Outcome.FAILED]
    assert all(q.error for q in slow)

    again = _run("push", FailurePolicy.RECOMPUTE, faults)
    _check_clean(again)
    assert again.result["failed"] == 0
    assert again.result["pushkv"]["recomputed"] == lost
    ttfts = sorted(again.result["ttfts"])
    assert ttfts[-1] > SHORT["window_s"]  # recomputed after the window passed


def test_pull_does_not_use_registrations_or_notifications() -> None:
    r = _run("pull", FailurePolicy.FAIL, FaultConfig(drop_register=1.0, drop_notify=1.0))
    _check_clean(r)
    assert r.result["failed"] == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_death_with_recompute_loses_no_request(mode: str) -> None:
    r = _run(mode, FailurePolicy.RECOMPUTE, FaultConfig(kill_prefill_at=5.0, detect_s=0.5))
    _check_clean(r)
    assert r.result["failed"] == 0
    assert r.result["pushkv"]["recomputed"] > 0
    # Decode computed the prompts itself: requests after the death are slower.
    late = [q for q in r.requests if q.arrival > 6.0]
    assert late and all(q.recomputed for q in late)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_death_with_fail_policy_fails_what_it_cannot_serve(mode: str) -> None:
    r = _run(mode, FailurePolicy.FAIL, FaultConfig(kill_prefill_at=5.0, detect_s=0.5))
    _check_clean(r)
    assert r.result["failed"] > 0
    assert r.result["pushkv"]["recomputed"] == 0
    assert all(q.arrival > 4.0 for q in r.requests if q.outcome is Outcome.FAILED)


def test_a_second_prefill_instance_absorbs_a_death() -> None:
    r = _run("pull", FailurePolicy.FAIL, FaultConfig(kill_prefill_at=5.0, detect_s=0.5),
             num_prefill=2)
    _check_clean(r)
    assert r.result["failed"] == 0
    assert r.result["pushkv"]["rerouted"] > 0  # its lost prefill legs went to the other


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_death_fails_its_requests_and_the_other_decode_carries_on(mode: str) -> None:
    r = _run(mode, FailurePolicy.RECOMPUTE, FaultConfig(kill_decode_at=5.0, detect_s=0.5),
             num_decode=2)
    _check_clean(r)
    failed = [q for q in r.requests if q.outcome is Outcome.FAILED]
    assert failed and all(q.decode == "decode-0" for q in failed)
    assert all("decode" in q.error for q in failed)
    assert all(q.outcome is Outcome.OK for q in r.requests if q.arrival > 6.0)
