"""Per-request metrics and the result file of ``vllm bench serve --save-result``.

Field names, units and statistics follow vLLM's ``vllm/benchmarks/serve.py``:
latencies in the lists are seconds, summary fields are milliseconds with
``mean_``, ``median_``, ``std_`` and ``p99_`` prefixes for ``ttft``, ``tpot``,
``itl`` and ``e2el``; TPOT of a request is ``(latency - ttft) / (output - 1)``
and only requests with more than one output token count; statistics cover
successful requests only, and an empty list counts as 0. Simulator-only
facts (mode, stalls, failures, leaks) go under the extra key ``"pushkv"``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .request import Outcome, SimRequest

PERCENTILES = (99.0,)
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """What a benchmark client measures for one request (seconds)."""

    success: bool
    ttft: float
    itl: tuple[float, ...]
    latency: float
    output_tokens: int
    prompt_len: int
    start_time: float
    error: str

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def client_times(req: SimRequest, return_s: float = 0.0, first_s: float = 0.0
                 ) -> list[float]:
    """When the client got each token: as the frontend queue delivered them, else
    ``return_s`` after decode emitted them; the first ``first_s`` later
    (``network.client_first_s``), and no later token before it."""
    times = list(req.client_times) if req.client_times else [
        t + return_s for t in req.token_times]
    if first_s > 0 and times:
        times[0] += first_s
        for i in range(1, len(times)):  # in order already: only a prefix can trail it
            if times[i] >= times[i - 1]:
                break
            times[i] = times[i - 1]
    return times


def measure(req: SimRequest, return_s: float = 0.0, first_s: float = 0.0
            ) -> RequestMetrics:
    """The client's view: tokens reach it ``return_s`` after decode emits them (with a
    frontend queue, when it delivered them), the first ``first_s`` later still."""
    ok = req.outcome is Outcome.OK
    times = client_times(req, return_s, first_s) if ok else []
    ttft = times[0] - req.arrival if times else 0.0
    return RequestMetrics(
        success=ok,
        ttft=ttft,
        itl=tuple(b - a for a, b in itertools.pairwise(times)),
        latency=times[-1] - req.arrival if times else 0.0,
        output_tokens=len(times),
        prompt_len=req.input_len,
        start_time=req.arrival,
        error=req.error,
    )


def _stats(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values if len(values) else [0.0], dtype=float)
    out = {
        "mean": float(np.mean(arr)) * 1000,
        "median": float(np.median(arr)) * 1000,
        "std": float(np.std(arr)) * 1000,
    }
    for p in PERCENTILES:
        word = str(int(p)) if int(p) == p else str(p)
        out[f"p{word}"] = float(np.percentile(arr, p)) * 1000
    return out


def _peaks(ok: Sequence[RequestMetrics]) -> tuple[float, int]:
    """Peak output tokens in a one-second bucket and requests live in it (as vLLM)."""
    if not ok:
        return 0.0, 0
    t0 = min(m.start_time for m in ok)
    t1 = max(m.start_time + m.latency for m in ok)
    n = math.ceil(t1 - t0) + 1
    tokens = np.zeros(n)
    live = np.zeros(n)
    for m in ok:
        t = m.start_time + m.ttft
        stamps = [t]
        for gap in m.itl:
            t += gap
            stamps.append(t)
        idx = np.asarray([int(s - t0) for s in stamps])
        idx = idx[(idx >= 0) & (idx < n)]
        np.add.at(tokens, idx, 1)
        live[int(m.start_time - t0): int(m.start_time + m.latency - t0) + 1] += 1
    return float(tokens.max()), int(live.max())


def _r(x: float) -> float:
    return round(x, 7)


def vllm_result(
    requests: Sequence[SimRequest],
    *,
    duration: float,
    model_id: str,
    request_rate: float,
    burstiness: float,
    max_concurrency: int | None = None,
    label: str,
    extra: dict[str, Any],
    return_s: float = 0.0,
    first_s: float = 0.0,
) -> dict[str, Any]:
    """The JSON object ``vllm bench serve --save-result --save-detailed`` writes."""
    ordered = sorted(requests, key=lambda r: r.spec.index)
    ms = [measure(r, return_s, first_s) for r in ordered]
    ok = [m for m in ms if m.success]
    total_input = sum(m.prompt_len for m in ok)
    output_lens = [m.output_tokens if m.success else 0 for m in ms]
    total_output = sum(output_lens)
    dur = duration if duration > 0 else 1.0
    peak_tokens, peak_live = _peaks(ok)
    result: dict[str, Any] = {
        "date": "simulated",
        "endpoint_type": "pushkv-sim",
        "backend": "pushkv-sim",
        "label": label,
        "model_id": model_id,
        "tokenizer_id": model_id,
        "num_prompts": len(ms),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "duration": duration,
        "completed": len(ok),
        "failed": len(ms) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "request_goodput": None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "input_lens": [m.prompt_len for m in ms],
        "output_lens": output_lens,
        "ttfts": [_r(m.ttft) for m in ms],
        "itls": [[_r(x) for x in m.itl] for m in ms],
        "latencies": [_r(m.latency) for m in ms],
        "start_times": [_r(m.start_time) for m in ms],
        "queue_times": [0.0 for _ in ms],
        "generated_texts": ["" for _ in ms],
        "errors": [m.error for m in ms],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_live,
        "rtfx": 0.0,
    }
    series = {
        "ttft": [m.ttft for m in ok],
        "tpot": [t for m in ok if (t := m.tpot) is not None],
        "itl": [x for m in ok for x in m.itl],
        "e2el": [m.latency for m in ok],
    }
    for name in METRICS:
        for stat, value in _stats(series[name]).items():
            result[f"{stat}_{name}_ms"] = value
    result["pushkv"] = extra
    return result


SUMMARY_ROWS = (
    ("completed", "Successful requests", "{:d}"),
    ("failed", "Failed requests", "{:d}"),
    ("duration", "Benchmark duration (s)", "{:.2f}"),
    ("request_throughput", "Request throughput (req/s)", "{:.2f}"),
    ("output_throughput", "Output token throughput (tok/s)", "{:.2f}"),
    ("mean_ttft_ms", "Mean TTFT (ms)", "{:.2f}"),
    ("median_ttft_ms", "Median TTFT (ms)", "{:.2f}"),
    ("p99_ttft_ms", "P99 TTFT (ms)", "{:.2f}"),
    ("mean_tpot_ms", "Mean TPOT (ms)", "{:.2f}"),
    ("median_tpot_ms", "Median TPOT (ms)", "{:.2f}"),
    ("p99_tpot_ms", "P99 TPOT (ms)", "{:.2f}"),
    ("mean_itl_ms", "Mean ITL (ms)", "{:.2f}"),
    ("p99_itl_ms", "P99 ITL (ms)", "{:.2f}"),
    ("mean_e2el_ms", "Mean E2EL (ms)", "{:.2f}"),
)


def summary_table(result: dict[str, Any], title: str) -> str:
    """A text table in the style of ``vllm bench serve``'s printout."""
    lines = [f"{' ' + title + ' ':=^52}"]
    profile = result.get("pushkv", {}).get("profile")
    if profile is not None:
        lines.append(f"{'Profile:':<40} {profile}")
    for key, name, fmt in SUMMARY_ROWS:
        lines.append(f"{name + ':':<40} {fmt.format(result[key])}")
    extra = result.get("pushkv", {})
    rows = (
        ("recomputed", "Recomputed on decode"),
        ("transfer_failures", "Failed transfers"),
        ("leaked_blocks", "Leaked blocks"),
        ("descriptors_mean", "Descriptors per transfer (mean)"),
        ("decode_stall_ms_total", "Decode loop stalled (ms, total)"),
    )
    if extra:
        lines.append(f"{' pushkv ':-^52}")
        for key, name in rows:
            if key in extra:
                v = extra[key]
                lines.append(f"{name + ':':<40} {v:.1f}" if isinstance(v, float)
                             else f"{name + ':':<40} {v}")
    lines.append("=" * 52)
    return "\n".join(lines)
