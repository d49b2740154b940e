"""The published figures the default profile must reproduce, and the comparison table.

Targets are the figures of the vLLM blog post "Push-Based KV Transfer to
Improve TTFT and TPOT for Disaggregated Inference in vLLM" (2026-10-14). Each
target is one point of one sweep (the default grid) -- the post's "TPOT at 4-8
QPS" is checked at 4 QPS and at 8 QPS separately -- so the table in
``docs/sim.md`` and the calibration test use the same points. A point's figure
is the mean over every iteration (seed) found for it, at least
:data:`MIN_SEEDS`, shown with its spread (sample standard deviation and
range). The command exits with status 1 when any row is outside its tolerance,
and with status 2 when a point has fewer iterations than that::

    python -m pushkv.sim.calibration --results-dir results/sim
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .plot import FILE_RE, Mean, mean_of
from .scenario import SimConfig
from .sweep import SweepSpec, configs

TOLERANCE = 0.20  #: every headline figure within 20%
LOW_LOAD_GAP = 0.10  #: pull and push TTFT within 10% at low load and short prompts
LOW_LOAD = ((1.0, 1024), (1.0, 2048), (2.0, 1024), (2.0, 2048))
MIN_SEEDS = 5  #: a figure is a mean over at least this many iterations (seeds)


@dataclass(frozen=True, slots=True)
class Target:
    """A published number: ``metric`` of ``mode`` at one (rate, input length) point."""

    name: str
    mode: str
    metric: str
    qps: float
    input_len: int
    post: float
    shown: str = ""  #: how the post states it, when not a single number

    def value(self, results: Mapping[str, Mapping[str, Any]]) -> Mean:
        return point(results, self.mode, self.qps, self.input_len, self.metric)


def point(results: Mapping[str, Mapping[str, Any]], mode: str, qps: float, input_len: int,
          metric: str, output_len: int = 128) -> Mean:
    """``metric`` of one point over every iteration present in ``results``."""
    vals = []
    for name, res in results.items():
        m = FILE_RE.match(name)
        if m and (m["mode"], float(m["qps"]), int(m["input"]), int(m["output"])) == (
                mode, qps, input_len, output_len):
            vals.append(float(res[metric]))
    if not vals:
        raise KeyError(_name(mode, qps, input_len, output_len))
    return mean_of(input_len, vals)


def _tpot_under_load(mode: str, post: float) -> tuple[Target, ...]:
    """The post's "TPOT at 4-8 QPS, 16k input": each rate is a point of its own."""
    return tuple(
        Target(f"TPOT, {q:g} QPS, 16k input, {mode} (ms)", mode, "mean_tpot_ms", q, 16384, post,
               f"{post:g} (at 4-8 QPS)")
        for q in (4.0, 8.0))


TARGETS = (
    Target("TTFT, 8 QPS, 16k input, pull (ms)", "pull", "mean_ttft_ms", 8.0, 16384, 1744.0),
    Target("TTFT, 8 QPS, 16k input, push (ms)", "push", "mean_ttft_ms", 8.0, 16384, 540.0),
    Target("TPOT, light load (1 QPS, 1k), pull (ms)", "pull", "mean_tpot_ms", 1.0, 1024, 5.7,
           "5.6-5.8"),
    Target("TPOT, light load (1 QPS, 1k), push (ms)", "push", "mean_tpot_ms", 1.0, 1024, 5.7,
           "5.6-5.8"),
    *_tpot_under_load("pull", 10.4),
    *_tpot_under_load("push", 7.0),
)


def _name(mode: str, qps: float, input_len: int, output_len: int = 128) -> str:
    return f"{mode}_qps{qps:g}_in{input_len}_out{output_len}_iterN.json"


def required_configs(
    base: SimConfig | None = None, iterations: int = MIN_SEEDS
) -> list[SimConfig]:
    """The points the targets read: a subset of the default sweep, ``iterations`` each."""
    wanted = {(t.mode, t.qps, t.input_len) for t in TARGETS}
    wanted |= {(m, q, n) for m in ("pull", "push") for q, n in LOW_LOAD}
    return [c for c in configs(SweepSpec(iterations=iterations), base)
            if (c.mode.value, c.workload.request_rate, c.workload.input_len) in wanted]


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    post: str
    simulated: str  #: the mean over the seeds
    error: float  #: relative error of the mean, or the relative pull-push gap (low load)
    ok: bool
    spread: str = ""  #: sample standard deviation and range over the seeds
    seeds: int = 1
    value: float = 0.0  #: the mean, unformatted


def _fmt(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _spread(m: Mean) -> str:
    return f"±{_fmt(m.std)} ({_fmt(m.lo)}-{_fmt(m.hi)})"


def evaluate(results: Mapping[str, Mapping[str, Any]]) -> list[Row]:
    """Compare result files (by file name) with the published figures, point by point,
    each on the mean over the iterations found."""
    rows = []
    for t in TARGETS:
        v = t.value(results)
        err = v.mean / t.post - 1.0
        rows.append(Row(t.name, t.shown or _fmt(t.post), _fmt(v.mean), err,
                        abs(err) <= TOLERANCE, _spread(v), v.count, v.mean))
    for q, n in LOW_LOAD:
        pull = point(results, "pull", q, n, "mean_ttft_ms")
        push = point(results, "push", q, n, "mean_ttft_ms")
        gap = pull.mean / push.mean - 1.0
        rows.append(Row(f"TTFT, {q:g} QPS, {n // 1024}k input, pull vs push (ms)",
                        "about equal", f"{pull.mean:.1f} vs {push.mean:.1f}", gap,
                        abs(gap) <= LOW_LOAD_GAP, f"±{pull.std:.1f} / ±{push.std:.1f}",
                        min(pull.count, push.count), gap))
    return rows


def load_results(results_dir: str | Path) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in Path(results_dir).glob("*.json")}


def markdown(rows: Sequence[Row]) -> str:
    lines = ["| figure | post | simulated (mean) | spread: std (range) | seeds | difference "
             "| within |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        bound = LOW_LOAD_GAP if r.post == "about equal" else TOLERANCE
        verdict = f"yes ({bound:.0%})" if r.ok else f"**no** ({bound:.0%})"
        lines.append(f"| {r.name} | {r.post} | {r.simulated} | {r.spread} | {r.seeds} "
                     f"| {r.error:+.0%} | {verdict} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pushkv.sim.calibration",
                                description="Compare a default sweep with the post.")
    p.add_argument("--results-dir", required=True, help="output of `pushkv sweep`")
    p.add_argument("--min-seeds", type=int, default=MIN_SEEDS,
                   help="iterations (seeds) every point needs")
    args = p.parse_args(argv)
    try:
        rows = evaluate(load_results(args.results_dir))
    except KeyError as exc:
        p.error(f"missing result file {exc}: run the default `pushkv sweep` first")
    few = [r.name for r in rows if r.seeds < args.min_seeds]
    if few:
        p.error(f"{len(few)} figures have fewer than {args.min_seeds} iterations (first: "
                f"{few[0]}): run `pushkv sweep --iterations {args.min_seeds}`")
    print(markdown(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
