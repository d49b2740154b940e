"""Sustained overload: pools full on both sides, every request still ends, nothing leaks.

A scaled-down copy of ``pushkv sim --mode pull --qps 8 --input-len 16384
--num-prompts 1200``: the prefill pool holds six prompts, decode runs two at a
time, and requests arrive far faster than either can serve them, so prefill
waits for source blocks that only a finished transfer frees.
"""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from sim_helpers import config, with_profile

from pushkv.sim import run
from pushkv.sim.profile import DEFAULT
from pushkv.sim.request import Outcome

INPUT = 4096


def _small_prefill_pool(prompts: int) -> float:
    """An activation reserve that leaves room for ``prompts`` prompts on prefill."""
    m, g = DEFAULT.model, DEFAULT.gpu
    free = g.memory_bytes * DEFAULT.prefill.gpu_memory_utilization - m.weight_bytes_per_gpu(
        DEFAULT.prefill.tp)
    return free - prompts * INPUT * m.kv_bytes_per_token(DEFAULT.prefill.tp)


@pytest.mark.parametrize("mode", ["pull", "push", "pull-async"])
def test_every_request_ends_under_sustained_overload(mode: str) -> None:
    prof = with_profile(prefill={"activation_reserve_bytes": _small_prefill_pool(6)},
                        decode={"max_num_seqs": 2})
    r = run(config(mode, qps=50.0, input_len=INPUT, output_len=32, num_prompts=80,
                   profile=prof), keep_objects=True)
    assert r.prefills[0].pool.num_blocks < 7 * INPUT // DEFAULT.prefill.block_size
    assert all(q.outcome is not Outcome.PENDING for q in r.requests)
    assert r.result["completed"] == 80, r.result["errors"]
    assert r.leaked_blocks == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_queued_requests_keep_their_prefill_lease_as_in_vllm(mode: str) -> None:
    """Requests queue on decode longer than the lease. vLLM's decode scheduler renews
    the lease of every queued request, so none loses its KV; renewing only transfers
    that started (the consumer endpoint's own heartbeats) lets queued ones expire."""
    from pushkv.sim import ProtocolSettings

    def go(queued: bool) -> dict:
        prof = with_profile(decode={"max_num_seqs": 1, "heartbeat_queued": queued})
        return run(config(mode, qps=20.0, input_len=INPUT, output_len=64, num_prompts=40,
                          profile=prof,
                          protocol=ProtocolSettings(lease_s=1.2, heartbeat_s=0.2))).result

    renewed, not_renewed = go(True), go(False)
    assert renewed["completed"] == 40 and renewed["pushkv"]["leaked_blocks"] == 0
    assert not_renewed["failed"] > 0 and not_renewed["pushkv"]["leaked_blocks"] == 0
    # The source went away under the waiting request: a read of released blocks
    # (pull) or the producer's SOURCE_RELEASED (push).
    assert {e.split(":")[0] for e in not_renewed["errors"] if e} == {"KV transfer failed"}
