"""Decode failover in the cluster simulator: a decode instance dies; the router
fails its requests, retries them from scratch, or re-targets their held KV
(protocol rule 12) to the other decode instance."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from sim_helpers import config

from pushkv.protocol import FailurePolicy
from pushkv.sim import FaultConfig, ProtocolSettings, run
from pushkv.sim.request import Outcome

N = 60


def _run(policy: str, hold: float = 5.0, mode: str = "push"):
    cfg = config(mode, qps=12.0, input_len=8192, output_len=32, num_prompts=N, num_decode=2,
                 protocol=ProtocolSettings(policy=FailurePolicy.RECOMPUTE,
                                           retarget_hold_s=hold),
                 faults=FaultConfig(kill_decode_at=4.0, detect_s=0.5, decode_failover=policy))
    return run(cfg, keep_objects=True)


def _moved(r):
    return [q for q in r.requests if q.failovers]


@pytest.fixture(scope="module")
def runs():
    return {p: _run(p) for p in ("fail", "retry", "retarget")}


def test_every_policy_ends_every_request_and_leaks_nothing(runs):
    for r in runs.values():
        assert r.leaked_blocks == 0 and r.rejected == 0
        assert all(q.outcome is not Outcome.PENDING for q in r.requests)
        assert r.result["completed"] + r.result["failed"] == N


def test_failover_saves_the_requests_that_had_no_token_yet(runs):
    failed = {p: r.result["failed"] for p, r in runs.items()}
    assert failed["fail"] > failed["retry"] and failed["fail"] > failed["retarget"]
    for p in ("retry", "retarget"):
        r = runs[p]
        moved = _moved(r)
        assert moved and r.result["pushkv"]["failovers"] == len(moved)
        assert all(q.outcome is Outcome.OK and q.decode == "decode-1" for q in moved)
        # what still fails was streaming when its instance died (not resumed here)
        assert all(q.token_times for q in r.requests if q.outcome is Outcome.FAILED)


def test_retarget_computes_no_prompt_again_and_retry_computes_each(runs):
    retry, retarget = runs["retry"], runs["retarget"]
    assert retry.result["pushkv"]["prompt_tokens_recomputed"] == 8192 * len(_moved(retry))
    assert retarget.result["pushkv"]["prompt_tokens_recomputed"] == 0
    assert not any(q.recomputed for q in _moved(retarget))
    # ... and its moved requests see their first token sooner
    def ttft(r):
        qs = _moved(r)
        return sum(q.token_times[0] - q.arrival for q in qs) / len(qs)
    assert ttft(retarget) < ttft(retry)


def test_without_a_hold_a_retarget_after_the_death_is_known_recomputes():
    # The router re-targets at once (the connection reset); with detection in 0.5 s
    # and no hold, a re-target that reaches prefill later finds the KV released:
    # the new decode instance recomputes (policy recompute). Whatever the timing,
    # nothing is lost or leaked and the counts agree.
    r = _run("retarget", hold=0.0)
    assert r.leaked_blocks == 0
    moved = _moved(r)
    assert all(q.outcome is Outcome.OK for q in moved)
    assert r.result["pushkv"]["prompt_tokens_recomputed"] == 8192 * sum(q.recomputed for q in moved)


def test_the_default_policy_adds_nothing_to_the_result(runs):
    assert "failovers" not in runs["fail"].result["pushkv"]


def test_a_bad_policy_is_refused():
    with pytest.raises(ValueError, match="decode_failover"):
        FaultConfig(decode_failover="resume")


def test_a_hold_keeps_each_source_until_its_first_decode_step_and_no_hold_sends_nothing(runs):
    # Protocol rule 12's linger: every decode instance reports its first step from a
    # pushed transfer (Consumed), which releases the source a re-target might want.
    t = runs["retarget"].transport
    assert t.stats["sent_Consumed"] > 0
    lingered = sum(p.stats["lingered"] for p in t.producers.values())
    told = sum(p.stats["consumed"] for p in t.producers.values())
    assert lingered >= told > 0
    assert _run("retarget", hold=0.0).transport.stats["sent_Consumed"] == 0
