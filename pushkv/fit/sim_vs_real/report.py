"""Sim against real: the ratio table, and how far one run can tell.

:func:`compare` averages each point's iterations on both sides and gives the sim/real
ratio of each statistic (:data:`~.runs.STATS`); :func:`precision` takes the
iterations' ratios one by one as an :func:`interval` (mean, Student's 95% interval,
a verdict against :data:`BAND`). :func:`figures` draws the two sides on one plot.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .runs import MODES, NAME, STATS, point_name, rate_name

#: the band every sim/real ratio is to fall in
BAND = (0.75, 1.33)


#: Student's t, its 0.975 quantile, by degrees of freedom 1-30 (above 30: 30's, a
#: little wide)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def by_iteration(directory: Path) -> dict[tuple[str, int, float], dict[int, dict[str, float]]]:
    """Per (mode, input, rate), per iteration, the statistics of its result file."""
    out: dict[tuple[str, int, float], dict[int, dict[str, float]]] = defaultdict(dict)
    for path in sorted(directory.iterdir()):
        m = NAME.match(path.name)
        if m is None or m["mode"] not in MODES:
            continue
        data = json.loads(path.read_text())
        if not data.get("failed"):
            out[m["mode"], int(m["input"]), float(m["qps"])][int(m["iter"])] = {
                k: float(data[k]) for k in STATS}
    return out


def averages(directory: Path) -> dict[tuple[str, int, float], dict[str, float]]:
    """Per (mode, input, rate): each statistic averaged over the iterations."""
    return {p: {k: statistics.fmean(v[k] for v in its.values()) for k in STATS}
            for p, its in by_iteration(directory).items()}


def compare(real: Path, sim: Path) -> tuple[str, dict[str, Any]]:
    """The ratio table (markdown) and the summary object."""
    r, s = averages(real), averages(sim)
    head = ["mode", "input", "QPS", "real TTFT mean / median (ms)",
            "sim TTFT mean / median (ms)", "TTFT ratio mean / median",
            "real TPOT mean / median (ms)", "sim TPOT mean / median (ms)",
            "TPOT ratio mean / median"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ratios: dict[str, dict[str, float]] = {}
    for key in sorted(set(r) & set(s), key=lambda k: (k[0] != "push", k[1], k[2])):
        mode, input_len, q = key
        a, b = r[key], s[key]
        rat = {k: b[k] / a[k] for k in STATS if a[k] > 0}
        ratios[point_name(mode, input_len, q)] = {k: round(v, 3)
                                                            for k, v in rat.items()}
        lines.append(
            f"| {mode} | {input_len} | {rate_name(q)} | "
            f"{a['mean_ttft_ms']:.1f} / {a['median_ttft_ms']:.1f} | "
            f"{b['mean_ttft_ms']:.1f} / {b['median_ttft_ms']:.1f} | "
            f"{rat['mean_ttft_ms']:.2f} / {rat['median_ttft_ms']:.2f} | "
            f"{a['mean_tpot_ms']:.2f} / {a['median_tpot_ms']:.2f} | "
            f"{b['mean_tpot_ms']:.2f} / {b['median_tpot_ms']:.2f} | "
            f"{rat['mean_tpot_ms']:.2f} / {rat['median_tpot_ms']:.2f} |")
    ttft = [v[k] for v in ratios.values() for k in ("mean_ttft_ms", "median_ttft_ms")]
    tpot = [v[k] for v in ratios.values() for k in ("mean_tpot_ms", "median_tpot_ms")]
    summary = {
        "ttft_ratio_min": min(ttft, default=None), "ttft_ratio_max": max(ttft, default=None),
        "tpot_ratio_min": min(tpot, default=None), "tpot_ratio_max": max(tpot, default=None),
        "points": len(ratios),
        "within_0.75_1.33": all(BAND[0] <= x <= BAND[1] for x in ttft + tpot)
        if ratios else False,
        "ratios": ratios,
    }
    return "\n".join(lines), summary


def verdict(low: float, high: float, band: tuple[float, float] = BAND) -> str:
    """An interval against ``band``: ``"in"`` when it lies wholly inside, ``"out"`` when
    wholly outside, else ``"unsure"``."""
    return ("in" if band[0] <= low and high <= band[1] else
            "out" if high < band[0] or low > band[1] else "unsure")


def interval(ratios: Sequence[float], band: tuple[float, float] = BAND) -> dict[str, Any]:
    """The iterations' sim/real ratios of one point and statistic: their mean, its 95%
    interval (Student's t over the iterations), the verdict -- ``"in"`` when the whole
    interval lies in ``band``, ``"out"`` when none of it does (a miss the iterations
    agree on: the model's), else ``"unsure"`` (the iterations disagree more than the
    band is wide: the run cannot tell a miss there from the machine's moods) -- and how
    many iterations would make the interval no wider than the band's nearer side
    (the normal approximation, ``(1.96 cv / h)^2``; ``h = 1 - 1 / band[1]``)."""
    n = len(ratios)
    if n == 0:
        raise ValueError("no ratios")
    mean = statistics.fmean(ratios)
    if n == 1:  # no spread to be had from one iteration
        return {"mean": mean, "low": None, "high": None, "verdict": "unsure",
                "iterations_needed": None}
    sd = statistics.stdev(ratios)
    half = T975[min(n - 1, len(T975)) - 1] * sd / math.sqrt(n)
    low, high = mean - half, mean + half
    hi = band[1]
    need = math.ceil((1.96 * (sd / mean) / (1 - 1 / hi)) ** 2) if mean > 0 else None
    return {"mean": mean, "low": low, "high": high, "verdict": verdict(low, high, band),
            "iterations_needed": max(n if need is None else need, 2)}


def precision(real: Path, sim: Path, band: tuple[float, float] = BAND
              ) -> tuple[str, dict[str, Any]]:
    """How far one run can tell: per point and statistic, the iterations' sim/real
    ratios as an :func:`interval`. On a shared machine one iteration's real mean can
    be twice the next one's at the same point and send times, so a point ratio
    outside the band with an ``"unsure"`` verdict is not evidence against the model,
    and one with ``"out"`` is. The table (markdown) and the summary: per point the
    intervals, the verdicts counted, and the most iterations any ratio needs."""
    r, s = by_iteration(real), by_iteration(sim)
    head = ["mode", "input", "QPS", "iterations", *(f"{k[:-3].replace('_', ' ')} ratio, "
                                                    "95% interval" for k in STATS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    points: dict[str, dict[str, Any]] = {}
    verdicts = {"in": 0, "out": 0, "unsure": 0}
    needed = 0
    for key in sorted(set(r) & set(s), key=lambda k: (k[0] != "push", k[1], k[2])):
        its = sorted(set(r[key]) & set(s[key]))
        if not its:
            continue
        mode, input_len, q = key
        cells, got = [], {}
        for k in STATS:
            ratios = [s[key][i][k] / r[key][i][k] for i in its if r[key][i][k] > 0]
            if not ratios:  # every real value 0 (a median TPOT of one-chunk answers)
                cells.append("-")
                continue
            iv = interval(ratios, band)
            got[k] = {x: (round(v, 3) if isinstance(v, float) else v) for x, v in iv.items()}
            verdicts[iv["verdict"]] += 1
            needed = max(needed, iv["iterations_needed"] or 0)
            cells.append(f"{iv['mean']:.2f}" + (
                f" [{iv['low']:.2f}, {iv['high']:.2f}] {iv['verdict']}"
                if iv["low"] is not None else " (one iteration)"))
        points[point_name(mode, input_len, q)] = got
        lines.append(f"| {mode} | {input_len} | {rate_name(q)} | {len(its)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines), {"band": list(band), "verdicts": verdicts,
                              "iterations_needed_max": needed, "points": points}


def in_band(summary: dict[str, Any], band: tuple[float, float] = BAND) -> int:
    """How many of a :func:`compare` summary's ratios lie in ``band``."""
    return sum(band[0] <= x <= band[1] for v in summary["ratios"].values() for x in v.values())


#: how each way's simulation is named on its figures
WAY_TITLES = {"gauge": "from its gauges", "probe": "cpu-tiny, probe",
              "own_cores": "cpu-tiny, a core each"}


def figures(real: Path, sim: Path, out: Path, way: str = "gauge") -> list[Path]:
    from ...sim.plot import plot

    return [plot(real, metric, out / f"sim_vs_real_{metric}.png", overlay=sim,
                 labels=("real", "sim"), title=f"Mean {metric.upper()}: real vLLM CPU "
                 f"engines (thick), each point simulated {WAY_TITLES.get(way, way)} (thin)")
            for metric in ("ttft", "tpot")]
