"""Replay one trace under several transfer modes and compare them.

:func:`compare` runs a :class:`~pushkv.sim.trace.Trace` once per mode (in parallel
processes, one per mode up to ``jobs``) on one profile and returns, per mode, the
TTFT and TPOT percentiles, the prefix-cache hit rate the trace's hashes gave and the
run's wall time. ``benchmarks/bench_trace.py`` is its command line.

Progressive push is not among the default modes; ``modes`` may name
``push-chunk`` and ``push-layer`` like any other (docs/sim-progressive.md).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from .plot import percentile_ms
from .profile import DEFAULT, Profile
from .scenario import SimConfig
from .sweep import parse_mode
from .trace import Trace, trace_workload

NOT_MODELLED = {
    "progressive": "not in the default comparison: modes push-chunk and push-layer run "
                   "progressive push (each prefill step's or layer's KV written as it is "
                   "computed)",
}


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """TTFT / TPOT p50 and p90 (ms), completions and the prefix hit rate of a result."""
    extra = result.get("pushkv", {})
    out: dict[str, Any] = {"completed": result["completed"], "failed": result["failed"]}
    for metric in ("ttft", "tpot"):
        for q in (50, 90):
            value = percentile_ms(result, metric, float(q))
            out[f"{metric}_p{q}_ms"] = round(value, 3) if value is not None else None
    out["prefix_hit_rate"] = round(extra.get("prefix_hit_rate", 0.0), 6)
    out["duration_s"] = round(result["duration"], 3)
    return out


def _one(cfg: SimConfig, label: str, progress_every_s: float) -> tuple[dict[str, Any], float]:
    from .runner import run

    def report(now: float, ended: int, total: int) -> None:
        print(f"[{label}] simulated {now:8.0f} s, {ended}/{total} requests ended",
              file=sys.stderr, flush=True)

    r = run(cfg, progress=report if progress_every_s > 0 else None,
            progress_every_s=progress_every_s or 60.0)
    return r.result, r.wall_s


def compare(trace: Trace, modes: tuple[str, ...] = ("pull", "push"), *,
            profile: Profile = DEFAULT, num_prefill: int = 1, num_decode: int = 1,
            jobs: int = 2, progress_every_s: float = 300.0) -> dict[str, Any]:
    """Replay ``trace`` under each of ``modes``; return per-mode summaries and walls."""
    cfgs = {}
    for label in modes:
        mode, dispatch = parse_mode(label)
        cfgs[label] = SimConfig(mode=mode, dispatch=dispatch, profile=profile, trace=trace,
                                workload=trace_workload(trace), num_prefill=num_prefill,
                                num_decode=num_decode)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(modes)))) as pool:
        futures = {label: pool.submit(_one, cfg, label, progress_every_s)
                   for label, cfg in cfgs.items()}
        done = {label: f.result() for label, f in futures.items()}
    wall = time.perf_counter() - t0
    return {
        "trace": trace.name,
        "requests": len(trace.requests),
        "span_s": round(trace.span_s, 3),
        "speed": trace.speed,
        "window_s": list(trace.window) if trace.window else None,
        "profile": profile.name,
        "num_prefill": num_prefill,
        "num_decode": num_decode,
        "modes": {label: {**summarise(res), "wall_s": round(w, 2)}
                  for label, (res, w) in done.items()},
        "not_modelled": NOT_MODELLED,
        "wall_s": round(wall, 2),
    }


__all__ = ["NOT_MODELLED", "compare", "summarise"]
