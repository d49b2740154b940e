"""The post's two figures: TTFT and TPOT against input length, one line per mode and rate.

Reads every ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json`` in a directory --
files written by ``pushkv sweep`` or by ``vllm bench serve --save-result``
under the same names -- averages iterations (seeds), and draws the chosen
statistic with an error bar of one standard deviation over the iterations
where a point has several. Colour is the request rate; line style is the
mode. A second directory (``overlay``, e.g. measured runs next to simulated
ones) is drawn on the same axes with hollow markers and thin lines.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FILE_RE = re.compile(
    r"^(?P<mode>[A-Za-z0-9][A-Za-z0-9-]*)_qps(?P<qps>inf|\d+(?:\.\d+)?)"
    r"(?:_c(?P<conc>\d+))?_in(?P<input>\d+)_out(?P<output>\d+)_iter(?P<iter>\d+)\.json$"
)
METRICS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}
STATS = ("mean", "median", "p50", "p90", "p99")
#: per-request lists of a result file (seconds) behind each metric, for percentiles
#: the file's summary fields do not hold (p50 is the median, p90)
_LISTS = {"ttft": "ttfts", "e2el": "latencies"}
_STYLES: dict[str, Any] = {"pull": "--", "push": "-", "pull-async": ":", "push-seq": "-.",
                           "push-chunk": (0, (6, 2, 1, 2, 1, 2)), "push-layer": (0, (1, 1))}
_MARKERS = {"pull": "s", "push": "o", "pull-async": "^", "push-seq": "D", "push-chunk": "v",
            "push-layer": "P"}


def _base(mode: str) -> str:
    """A series' mode label without its closed-loop concurrency (``push-layer c8``)."""
    return mode.split(" ")[0]


class PlotError(ValueError):
    """The results cannot be plotted as asked."""


@dataclass(frozen=True, slots=True)
class Point:
    mode: str
    qps: float
    input_len: int
    output_len: int
    iteration: int
    value: float
    profile: str | None = None  #: the simulator's profile name (None: a real run)


def request_values_ms(data: dict[str, Any], metric: str) -> list[float] | None:
    """One value per successful request (ms) from a result file's per-request lists,
    as vLLM's statistics count them; None when the file lacks the lists."""
    errors = data.get("errors")
    if metric in _LISTS:
        vals = data.get(_LISTS[metric])
        if not isinstance(vals, list):
            return None
        ok = [v for i, v in enumerate(vals) if not (errors and errors[i])]
        return [v * 1000 for v in ok]
    ttfts, lats, outs = data.get("ttfts"), data.get("latencies"), data.get("output_lens")
    if metric == "tpot" and all(isinstance(x, list) for x in (ttfts, lats, outs)):
        return [(lat - t) / (o - 1) * 1000 for i, (t, lat, o) in enumerate(
            zip(ttfts, lats, outs, strict=True)) if o > 1 and not (errors and errors[i])]
    itls = data.get("itls")
    if metric == "itl" and isinstance(itls, list):
        return [x * 1000 for i, r in enumerate(itls) if not (errors and errors[i]) for x in r]
    return None


def percentile_ms(data: dict[str, Any], metric: str, q: float) -> float | None:
    """The ``q``-th percentile of ``metric`` (ms) over the file's requests (numpy's
    linear interpolation, as vLLM's p99); 0 for no request, None without the lists."""
    import numpy as np

    vals = request_values_ms(data, metric)
    if vals is None:
        return None
    return float(np.percentile(vals, q)) if vals else 0.0


def load_points(results_dir: str | Path, metric: str, stat: str = "mean") -> list[Point]:
    """One point per result file; files not named like results are ignored."""
    if metric not in METRICS:
        raise PlotError(f"unknown metric {metric!r} (choose from {', '.join(METRICS)})")
    if stat not in STATS:
        raise PlotError(f"unknown statistic {stat!r} (choose from {', '.join(STATS)})")
    d = Path(results_dir)
    if not d.is_dir():
        raise PlotError(f"results directory not found: {d}")
    key = f"{'median' if stat == 'p50' else stat}_{metric}_ms"
    points = []
    for path in sorted(d.iterdir()):
        m = FILE_RE.match(path.name)
        if m is None:
            continue
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlotError(f"cannot read {path.name}: {exc}") from exc
        if not isinstance(data, dict):
            raise PlotError(f"{path.name} is not a result object")
        value = data.get(key) if stat != "p90" else percentile_ms(data, metric, 90.0)
        if value is None:
            raise PlotError(f"{path.name} has no {key!r} field")
        profile = data.get("pushkv", {}).get("profile") if isinstance(
            data.get("pushkv"), dict) else None
        points.append(Point(  # closed loop: the concurrency joins the mode's label
            mode=m["mode"] + (f" c{m['conc']}" if m["conc"] else ""), qps=float(m["qps"]),
            input_len=int(m["input"]),
            output_len=int(m["output"]), iteration=int(m["iter"]), value=float(value),
            profile=profile,
        ))
    if not points:
        raise PlotError(f"no result files named like mode_qpsQ_inI_outO_iterN.json in {d}")
    return points


@dataclass(frozen=True, slots=True)
class Mean:
    """One point of a line: the mean over its iterations and their spread."""

    input_len: int
    mean: float
    std: float  #: sample standard deviation over the iterations (0 for one)
    lo: float
    hi: float
    count: int


def mean_of(input_len: int, vals: list[float]) -> Mean:
    n = len(vals)
    m = sum(vals) / n
    std = math.sqrt(sum((v - m) ** 2 for v in vals) / (n - 1)) if n > 1 else 0.0
    return Mean(input_len, m, std, min(vals), max(vals), n)


def series(
    points: list[Point], output_len: int | None = None, modes: list[str] | None = None
) -> dict[tuple[str, float], list[Mean]]:
    """(mode, qps) -> one :class:`Mean` over the iterations per input length, by length."""
    outs = sorted({p.output_len for p in points})
    if output_len is None:
        if len(outs) > 1:
            raise PlotError(f"results mix output lengths {outs}: choose one with --output-len")
        output_len = outs[0]
    chosen = [p for p in points if p.output_len == output_len
              and (modes is None or p.mode in modes or _base(p.mode) in modes)]
    if not chosen:
        raise PlotError(f"no results for output length {output_len} and modes {modes}")
    acc: dict[tuple[str, float, int], list[float]] = defaultdict(list)
    for p in chosen:
        acc[p.mode, p.qps, p.input_len].append(p.value)
    out: dict[tuple[str, float], list[Mean]] = defaultdict(list)
    for (mode, qps, n), vals in sorted(acc.items()):
        out[mode, qps].append(mean_of(n, vals))
    return dict(out)


def _qps_label(q: float) -> str:
    return "inf" if math.isinf(q) else (f"{q:g}")


def plot(
    results_dir: str | Path,
    metric: str,
    out: str | Path | None = None,
    *,
    stat: str = "mean",
    output_len: int | None = None,
    modes: list[str] | None = None,
    title: str | None = None,
    overlay: str | Path | None = None,
    labels: tuple[str, str] = ("simulated", "measured"),
) -> Path:
    """Draw ``stat`` of ``metric`` against input length; return the PNG path.

    With ``overlay``, the result files of that directory are drawn on the same
    axes (``labels`` name the two sets in the legend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts_all = load_points(results_dir, metric, stat)
    sets = [(series(pts_all, output_len, modes), labels[0])]
    if overlay is not None:
        more = load_points(overlay, metric, stat)
        pts_all = pts_all + more
        sets.append((series(more, output_len, modes), labels[1]))
    rates = sorted({q for lines, _ in sets for _, q in lines})
    mode_names = sorted({m for lines, _ in sets for m, _ in lines},
                        key=lambda m: (_base(m) not in _STYLES, m))
    cmap = plt.get_cmap("viridis")
    colours = {q: cmap(0.1 + 0.8 * i / max(1, len(rates) - 1)) for i, q in enumerate(rates)}
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=120)
    lengths: set[int] = set()
    for k, (lines, name) in enumerate(sets):
        second = k == 1
        for mode in mode_names:
            for q in rates:
                pts = lines.get((mode, q))
                if not pts:
                    continue
                xs = [p.input_len for p in pts]
                ys = [p.mean for p in pts]
                lengths.update(xs)
                label = f"{mode}, {_qps_label(q)} QPS"
                if overlay is not None:
                    label += f" ({name})"
                yerr = [p.std for p in pts] if any(p.count > 1 for p in pts) else None
                ax.errorbar(
                    xs, ys, yerr=yerr, capsize=3 if yerr else 0,
                    linestyle=_STYLES.get(_base(mode), "-"),
                    marker=_MARKERS.get(_base(mode), "x"),
                    color=colours[q], linewidth=0.9 if second else 1.8,
                    markersize=6 if second else 5,
                    markerfacecolor="none" if second else colours[q],
                    alpha=0.8 if second else 1.0, label=label)
    ax.set_xscale("log", base=2)
    ticks = sorted(lengths)
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{t // 1024}k" if t % 1024 == 0 else str(t) for t in ticks])
    ax.set_xlabel("input length (tokens)")
    ax.set_ylabel(f"{stat} {METRICS[metric]} (ms)")
    if metric == "ttft":
        ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    iters = max(p.count for lines, _ in sets for pts in lines.values() for p in pts)
    bars = f"; bars: 1 std over {iters} iterations" if iters > 1 else ""
    profiles = sorted({p.profile for p in pts_all if p.profile})
    named = f" ({', '.join(profiles)})" if profiles else ""
    ax.set_title(title or f"{stat.capitalize()} {METRICS[metric]} vs input length{named}{bars}",
                 fontsize=10)
    ax.legend(fontsize=7 if overlay is not None else 8, ncol=2, frameon=False)
    fig.tight_layout()
    path = Path(out) if out is not None else Path(results_dir) / f"{metric}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


TRACE_RE = re.compile(r"^(?P<mode>[A-Za-z0-9][A-Za-z0-9-]*)_trace-(?P<trace>[A-Za-z0-9._-]+)"
                      r"_iter(?P<iter>\d+)\.json$")


def load_cdfs(results_dir: str | Path, metric: str) -> dict[str, tuple[list[float], Any]]:
    """Label -> (sorted per-request values in ms, the file's profile name) of every
    trace result file (``{mode}_trace-{name}_iter{n}.json``) in a directory."""
    if metric not in METRICS:
        raise PlotError(f"unknown metric {metric!r} (choose from {', '.join(METRICS)})")
    d = Path(results_dir)
    if not d.is_dir():
        raise PlotError(f"results directory not found: {d}")
    out = {}
    for path in sorted(d.iterdir()):
        m = TRACE_RE.match(path.name)
        if m is None:
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlotError(f"cannot read {path.name}: {exc}") from exc
        vals = request_values_ms(data, metric) if isinstance(data, dict) else None
        if vals is None:
            raise PlotError(f"{path.name} has no per-request lists for {metric}")
        extra = data.get("pushkv") if isinstance(data.get("pushkv"), dict) else {}
        label = f"{m['mode']} ({m['trace']}, iter {m['iter']})"
        out[label] = (sorted(vals), extra.get("profile"))
    if not out:
        raise PlotError(f"no trace result files named like mode_trace-NAME_iterN.json in {d}")
    return out


def plot_cdf(results_dir: str | Path, metric: str, out: str | Path | None = None, *,
             title: str | None = None) -> Path:
    """The distribution of ``metric`` over a trace run's requests, one line per result
    file (mode), p50 / p90 / p99 marked; return the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cdfs = load_cdfs(results_dir, metric)
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=120)
    for label, (vals, _profile) in cdfs.items():
        if not vals:
            continue
        ys = np.arange(1, len(vals) + 1) / len(vals)
        style = _STYLES.get(label.split(" ")[0], "-")
        qs = {q: float(np.percentile(vals, q)) for q in (50, 90, 99)}
        fmt = "{:.0f}" if qs[50] >= 10 else "{:.2f}"
        label += ": " + ", ".join(f"p{q} {fmt.format(x)}" for q, x in qs.items()) + " ms"
        (line,) = ax.plot(vals, ys, linestyle=style, linewidth=1.6, label=label)
        ax.plot(list(qs.values()), [q / 100 for q in qs], linestyle="none", marker="o",
                color=line.get_color(), markersize=4)
    ax.set_xscale("log")
    ax.set_xlabel(f"{METRICS[metric]} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.grid(True, which="both", alpha=0.3)
    profiles = sorted({p for _, p in cdfs.values() if p})
    named = f" ({', '.join(profiles)})" if profiles else ""
    ax.set_title(title or f"{METRICS[metric]} distribution over the trace's requests{named}",
                 fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    path = Path(out) if out is not None else Path(results_dir) / f"{metric}_cdf.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
