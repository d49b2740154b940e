"""Result files speak the language of vllm bench serve."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simpy")

from sim_helpers import config

from pushkv.sim import run
from pushkv.sim.metrics import measure, summary_table, vllm_result
from pushkv.sim.request import Outcome, SimRequest
from pushkv.sim.workload import Request

#: Keys vLLM's serve.py writes for a generation benchmark with --save-detailed
#: (vllm/benchmarks/serve.py: the ``result`` dict, ``result_json`` and
#: ``process_one_metric`` for ttft, tpot, itl, e2el with the default p99).
VLLM_KEYS = [
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts",
    "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests", "rtfx",
    *(f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for s in ("mean", "median", "std", "p99")),
]


def test_result_has_every_vllm_key() -> None:
    res = run(config("push")).result
    assert [k for k in VLLM_KEYS if k not in res] == []
    json.dumps(res)  # serialisable


@pytest.mark.vllm
def test_key_list_matches_the_installed_vllm_source() -> None:
    """Read vLLM's serve.py as text (importing vLLM is not needed) and compare names."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    src = Path(next(iter(spec.submodule_search_locations))) / "benchmarks" / "serve.py"
    if not src.exists():
        pytest.skip("this vLLM has no benchmarks/serve.py")
    text = src.read_text()
    written = set(re.findall(r'result_json\["(\w+)"\]', text))
    # The generation branch: ``result = {...}`` right after the BenchmarkMetrics check.
    m = re.search(r"isinstance\(metrics, BenchmarkMetrics\):\s*result = \{(.*?)\n\s*\}", text, re.S)
    assert m is not None, "vLLM's result dict moved; update this test"
    written |= set(re.findall(r'"(\w+)":', m.group(1)))
    assert len(written) > 25
    assert 'result[f"mean_{metric_attribute_name}_ms"]' in text
    assert 'result[f"p{p_word}_{metric_attribute_name}_ms"]' in text
    missing = sorted(k for k in written if k not in VLLM_KEYS and not k.startswith("ramp_up"))
    assert missing == []


def _req(index: int, arrival: float, tokens: list[float], ok: bool = True) -> SimRequest:
    r = SimRequest(spec=Request(index=index, arrival=arrival, input_len=100,
                                output_len=len(tokens) or 3), transfer_id=f"t{index}")
    r.token_times = tokens
    r.outcome = Outcome.OK if ok else Outcome.FAILED
    r.error = "" if ok else "boom"
    return r


def test_statistics_follow_vllm_definitions() -> None:
    reqs = [_req(0, 0.0, [0.1, 0.2, 0.4]), _req(1, 0.2, [0.5, 0.6, 0.7]),
            _req(2, 2.0, [], ok=False)]
    res = vllm_result(reqs, duration=2.0, model_id="m", request_rate=1.0, burstiness=1.0,
                      label="push", extra={})
    assert res["completed"] == 2 and res["failed"] == 1
    assert res["ttfts"] == [0.1, 0.3, 0.0]
    assert res["itls"][0] == pytest.approx([0.1, 0.2])
    assert res["errors"] == ["", "", "boom"]
    assert res["output_lens"] == [3, 3, 0]
    tpots = [(0.4 - 0.1) / 2, (0.5 - 0.3) / 2]  # (latency - ttft) / (output - 1)
    assert res["mean_tpot_ms"] == pytest.approx(np.mean(tpots) * 1000)
    assert res["mean_ttft_ms"] == pytest.approx(200.0)
    assert res["median_e2el_ms"] == pytest.approx(450.0)
    assert res["p99_itl_ms"] == pytest.approx(np.percentile([0.1, 0.2, 0.1, 0.1], 99) * 1000)
    assert res["request_throughput"] == pytest.approx(1.0)
    assert res["max_concurrent_requests"] == 2


def test_all_failed_gives_zero_statistics_like_vllm() -> None:
    res = vllm_result([_req(0, 0.0, [], ok=False)], duration=1.0, model_id="m",
                      request_rate=1.0, burstiness=1.0, label="pull", extra={})
    assert res["mean_ttft_ms"] == 0.0 and res["p99_tpot_ms"] == 0.0
    assert res["completed"] == 0


def test_return_hop_shifts_tokens_not_gaps() -> None:
    r = _req(0, 0.0, [0.1, 0.2, 0.3])
    a, b = measure(r), measure(r, return_s=0.01)
    assert b.ttft == pytest.approx(a.ttft + 0.01)
    assert b.itl == pytest.approx(a.itl)


def test_summary_table_names_the_headline_numbers() -> None:
    text = summary_table(run(config("pull")).result, "pull")
    for words in ("Mean TTFT (ms)", "Mean TPOT (ms)", "Leaked blocks", "P99 ITL (ms)"):
        assert words in text
