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
