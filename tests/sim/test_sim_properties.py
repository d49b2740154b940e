"""Any mode, load and fault: every request ends exactly once and no block leaks."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pushkv.protocol import FailurePolicy
from pushkv.sim import (
    Dispatch,
    FaultConfig,
    ProtocolSettings,
    SimConfig,
    TransferMode,
    WorkloadConfig,
    run,
)
from pushkv.sim.request import Outcome

faults = st.builds(
    FaultConfig,
    drop_register=st.sampled_from([0.0, 0.1, 0.5]),
    drop_notify=st.sampled_from([0.0, 0.1, 0.5]),
    kill_prefill_at=st.one_of(st.none(), st.floats(0.0, 4.0)),
    kill_decode_at=st.one_of(st.none(), st.floats(0.0, 4.0)),
    detect_s=st.sampled_from([0.2, 1.0]),
)

scenarios = st.builds(
    SimConfig,
    mode=st.sampled_from(list(TransferMode)),
    dispatch=st.sampled_from(list(Dispatch)),
    num_prefill=st.integers(1, 2),
    num_decode=st.integers(1, 2),
    workload=st.builds(
        WorkloadConfig,
        request_rate=st.sampled_from([1.0, 4.0, 16.0]),
        burstiness=st.sampled_from([0.3, 1.0]),
        input_len=st.sampled_from([100, 1024, 4096]),
        output_len=st.integers(1, 6),
        num_prompts=st.integers(1, 12),
        seed=st.integers(0, 1000),
    ),
    protocol=st.builds(
        ProtocolSettings,
        window_s=st.sampled_from([0.5, 2.0]),
        fence_grace_s=st.just(0.5),
        heartbeat_s=st.sampled_from([0.2, 5.0]),
        lease_s=st.sampled_from([1.0, 30.0]),
        policy=st.sampled_from(list(FailurePolicy)),
    ),
    faults=faults,
)


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios)
def test_conservation_under_any_fault(cfg: SimConfig) -> None:
    r = run(cfg)
    n = cfg.workload.num_prompts
    assert sorted(q.spec.index for q in r.requests) == list(range(n))
    assert all(q.outcome is not Outcome.PENDING for q in r.requests)
    assert r.result["completed"] + r.result["failed"] == n
    assert r.leaked_blocks == 0, r.leaks
    assert r.rejected == 0
    ok = [q for q in r.requests if q.outcome is Outcome.OK]
    assert all(len(q.token_times) == q.output_len for q in ok)
    if not cfg.faults.any:
        assert r.result["failed"] == 0
