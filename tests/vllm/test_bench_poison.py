"""``benchmarks/bench_poison.py``, shortened: 40 requests through a 1P2D fleet of real
vLLM CPU servers, one poison request of each kind among them.

Each poison request gets its expected clear error (the proxy's 400 for a token id
past the vocabulary; the engine's 400 for a text past the model's length and a
chat role the template refuses; 502 naming the prefill instance for a request
that fails inside the engine, or the decode instance's 500 when its leg failed
first), no request is sent twice, every good request's
tokens equal a plain server's, no instance leaves rotation, and the decode
servers received their prompts over the connector.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

ROOT = Path(__file__).resolve().parents[2]


def test_poison_requests_cost_no_good_request_and_no_instance(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_poison.py"), "--requests", "40",
         "--poison", "0.1", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["requests"] == 40 and summary["poison_requests"] == 4, summary
    assert summary["good_requests_failed"] == 0, run.stdout[-3000:]
    assert summary["instances_lost"] == 0, run.stdout[-3000:]
    kinds = summary["poison_by_kind"]
    # An engine failure is passed on from whichever leg failed first: 502 naming the
    # prefill instance, or the decode instance's own 500.
    assert list(kinds.pop("grammar_fails_in_engine").values()) == [1], summary
    assert kinds == {"token_id_past_vocab": {"400": 1}, "text_past_context": {"400": 1},
                     "chat_unknown_role": {"400": 1}}, summary
    assert summary["poison_answered_4xx"] == 3 and summary["poison_answered_5xx"] == 1
    assert summary["poison_unclear"] == 0 and summary["poison_unexpected_status"] == 0
    assert summary["retries"] == 0, summary
    assert summary["decode_prompt_tokens_transferred"] > 0, summary
    assert summary["decode_prompt_tokens_computed"] == 0, summary
