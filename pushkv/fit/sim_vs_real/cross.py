"""Cross-validation: profile keys fitted on some points of a run, judged on the others.

The gauge way (:func:`.keys.gauge_keys`) simulates every point with keys measured
around that very point, so it checks the model's mechanisms, never a prediction. Here
the run's points are split (:func:`split`): the *training* points' gauges alone are
turned into keys (:func:`cross_keys`: :func:`.keys.gauge_keys` over the training
points only, so the run's shared keys -- ``host.spread``, ``host.wake_beside_s``, the
push-only keys, ``cores_busy`` -- come from them too), each training point simulated
with its own (*in-sample*), and each *held-out* point -- a rate above the training
rates, a length beyond the training lengths -- with the keys of the training group
nearest it (:func:`nearest_group`: same mode, nearest length, then nearest rate; the
mean over that group's points), its own gauges unused (*out-of-sample*).

:func:`judge` gives every (point, statistic) figure its interval over the iterations
(:func:`.report.interval`) and counts, in and out of sample, the figures *decided*
(the whole 95% interval inside or outside the band) and those in band.
:func:`knees` finds, per mode, the rate at which mean TTFT doubles from its
light-load value, real and simulated, on one length's rate sweep, and how far the
iterations can tell their ratio (:func:`knee_interval`: the iterations resampled).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from .report import BAND, by_iteration, interval, verdict
from .runs import API_LOOPS, NAME, PINNED_ENGINES, file_name, point_name, rate_name

#: the points the committed profile was fitted and checked on (docs/sim.md): the
#: default training grid of a cross-validation
TRAIN_RATES = (2.0, 8.0)
TRAIN_INPUTS = (64, 192)
#: the statistics a figure is judged on, and the one the knee is taken on
JUDGED = ("median_ttft_ms", "mean_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
KNEE_STAT = "mean_ttft_ms"
#: how far mean TTFT grows from its light-load value at the knee
KNEE_FACTOR = 2.0
#: the band a simulated knee over the real one is judged against: within 15%
KNEE_BAND = (0.85, 1.15)
#: resamples of the iterations behind a knee ratio's interval (:func:`knee_interval`)
KNEE_DRAWS = 2000

Point = tuple[str, int, float, int]  # mode, input length, rate, iteration


def point_key(fname: str) -> tuple[str, int, float] | None:
    """A result file's (mode, input length, rate), None for another file."""
    m = NAME.match(fname)
    return None if m is None else (m["mode"], int(m["input"]), float(m["qps"]))


def split(points: Iterable[Point], rates: Sequence[float] = TRAIN_RATES,
          inputs: Sequence[int] = TRAIN_INPUTS) -> tuple[list[Point], list[Point]]:
    """The run's points as (training, held out): training where both the rate and the
    length are training ones. ValueError when either side is empty, or a mode has no
    training point (its held-out points would have nothing to be predicted from)."""
    train: list[Point] = []
    held: list[Point] = []
    for p in points:
        (train if p[2] in rates and p[1] in inputs else held).append(p)
    if not train or not held:
        raise ValueError(f"cross-validation needs points both in and out of the training "
                         f"grid (rates {list(rates)}, lengths {list(inputs)}): "
                         f"{len(train)} in, {len(held)} out")
    if missing := sorted({p[0] for p in held} - {p[0] for p in train}):
        raise ValueError(f"no training point of mode(s) {', '.join(missing)}")
    return train, held


def nearest_group(mode: str, input_len: int, rate: float,
                  groups: Iterable[tuple[str, int, float]]) -> tuple[str, int, float]:
    """The training group (mode, length, rate) a held-out point takes its keys from:
    its mode's, the nearest length (the longer on a tie), then the nearest rate (the
    higher on a tie). The keys of a length or rate the run has not trained on are those
    of the nearest it has: no key is extrapolated."""
    mine = [g for g in groups if g[0] == mode]
    if not mine:
        raise ValueError(f"no training group of mode {mode}")
    length = min({g[1] for g in mine}, key=lambda n: (abs(n - input_len), -n))
    q = min({g[2] for g in mine if g[1] == length}, key=lambda r: (abs(r - rate), -r))
    return mode, length, q


def _mean_keys(keys: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per table and key, the mean of numbers over ``keys``; anything else (a list, a
    name, a flag) the first's."""
    out: dict[str, dict[str, Any]] = {}
    for table in keys[0]:
        out[table] = {}
        for k, v in keys[0][table].items():
            vals = [p.get(table, {}).get(k) for p in keys]
            if isinstance(v, float) and all(isinstance(x, (int, float)) and
                                             not isinstance(x, bool) for x in vals):
                out[table][k] = statistics.fmean(vals)  # type: ignore[arg-type]
            else:
                out[table][k] = v
    return out


def predict(train_keys: dict[str, dict[str, dict[str, Any]]], held: Iterable[str]
            ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, str]]:
    """Each held-out result file's keys from the training points' (by file name): the
    mean over the nearest training group's points (:func:`nearest_group`). Returns the
    keys and, per held-out file, the group it took them from."""
    groups: dict[tuple[str, int, float], list[dict[str, dict[str, Any]]]] = {}
    for fname, keys in train_keys.items():
        g = point_key(fname)
        if g is not None:
            groups.setdefault(g, []).append(keys)
    means = {g: _mean_keys(ks) for g, ks in groups.items()}
    out, source = {}, {}
    for fname in held:
        p = point_key(fname)
        if p is None:
            continue
        g = nearest_group(*p, groups=means)
        out[fname] = means[g]
        source[fname] = point_name(*g)
    return out, source


def key_speeds(shares: dict[str, dict[str, Any]], train: set[str],
               source: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per result file, the probe rate (per side) its keys were measured at: a training
    point's, its own gauges' (:func:`.keys.gauges_speed`); a held-out one's, the mean
    of those over the training group it took its keys from (``source``, as
    :func:`predict` gives). A file whose rate is unknown (no probed gauge) is left
    out: its cores then run as the profile's."""
    from .keys import gauges_speed

    own = {f: got for f in train if (got := gauges_speed(shares.get(f, {})))}
    groups: dict[str, list[dict[str, float]]] = {}
    for f, got in own.items():
        if (k := point_key(f)) is not None:
            groups.setdefault(point_name(*k), []).append(got)
    out = dict(own)
    for f, g in source.items():
        if groups.get(g):
            out[f] = {side: statistics.fmean(r[side] for r in groups[g])
                      for side in ("prefill", "decode")}
    return out


def cross_keys(real: Path, shares: dict[str, dict[str, Any]], profile: Path,
               output_len: int, train: set[str], held: set[str]
               ) -> tuple[dict[str, dict[str, dict[str, Any]]], dict[str, Any], dict[str, str]]:
    """Every point's keys with the training points' gauges alone: the training points'
    own (:func:`.keys.gauge_keys` over ``shares`` cut to ``train``), the held-out ones
    predicted from them (:func:`predict`). Returns the keys by file name, the run's
    keys (from the training points), and each held-out file's training group."""
    from .keys import gauge_keys

    trained, run = gauge_keys(real, {f: v for f, v in shares.items() if f in train},
                              profile, output_len)
    predicted, source = predict(trained, held)
    return trained | predicted, run, source


def judge(real: Path, sim: Path, train: set[str], stats: Sequence[str] = JUDGED,
          band: tuple[float, float] = BAND) -> dict[str, Any]:
    """Each (point, statistic) figure's iterations' sim/real ratios as an interval
    (:func:`.report.interval`), split in and out of sample (``train``: the training
    points' (mode, length, rate) names, ``push_in64_qps2``): per side the ratio range
    (the iterations' mean ratios), the figures, those decided (the whole interval in
    or outside the band), those in band (decided in), those whose interval is narrower
    than the band yet not inside it (``narrow_not_in``: the target is none), and per
    statistic the same counts and the median and most iterations an interval as
    narrow as the band's nearer side would need at the spread seen
    (:func:`.report.interval`'s ``iterations_needed``)."""
    r, s = by_iteration(real), by_iteration(sim)
    width = band[1] - band[0]
    sides: dict[str, dict[str, Any]] = {}
    for key in sorted(set(r) & set(s), key=lambda k: (k[0], k[1], k[2])):
        mode, length, q = key
        name = point_name(mode, length, q)
        side = sides.setdefault("in_sample" if name in train else "out_of_sample",
                                {"points": {}, "by_stat": {}})
        its = sorted(set(r[key]) & set(s[key]))
        got = {}
        for k in stats:
            ratios = [s[key][i][k] / r[key][i][k] for i in its if r[key][i][k] > 0]
            if not ratios:
                continue
            iv = interval(ratios, band)
            narrow = iv["low"] is not None and iv["high"] - iv["low"] < width
            got[k] = {x: (round(v, 3) if isinstance(v, float) else v)
                      for x, v in iv.items()} | {"iterations": len(ratios),
                                                 "narrow": narrow}
            c = side["by_stat"].setdefault(k, {"figures": 0, "decided": 0, "in_band": 0,
                                               "narrow_not_in": 0, "iterations_needed": []})
            if iv["iterations_needed"] is not None and iv["low"] is not None:
                c["iterations_needed"].append(iv["iterations_needed"])
            c["figures"] += 1
            c["decided"] += iv["verdict"] != "unsure"
            c["in_band"] += iv["verdict"] == "in"
            c["narrow_not_in"] += narrow and iv["verdict"] != "in"
        side["points"][name] = got
    out: dict[str, Any] = {}
    for side in sides.values():  # the iterations a band-narrow interval needs, typical
        for c in side["by_stat"].values():
            need = c.pop("iterations_needed")
            c["iterations_needed_median"] = statistics.median(need) if need else None
            c["iterations_needed_max"] = max(need, default=None)
    for name, side in sides.items():
        figs = [v for p in side["points"].values() for v in p.values()]
        means = [v["mean"] for v in figs]
        out[name] = {
            "ratio_min": min(means, default=None), "ratio_max": max(means, default=None),
            "figures": len(figs),
            "decided": sum(v["verdict"] != "unsure" for v in figs),
            "in_band": sum(v["verdict"] == "in" for v in figs),
            "narrow_not_in": sum(v["narrow"] and v["verdict"] != "in" for v in figs),
            "by_stat": side["by_stat"], "points": side["points"]}
    return out


def judge_table(judged: dict[str, Any]) -> str:
    """:func:`judge`'s figures as a table: side, point, each statistic's mean ratio,
    its interval and verdict."""
    head = ["sample", "point", *(k[:-3].replace("_", " ") for k in JUDGED)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for side in ("in_sample", "out_of_sample"):
        for name, got in judged.get(side, {}).get("points", {}).items():
            cells = []
            for k in JUDGED:
                v = got.get(k)
                cells.append("-" if v is None else f"{v['mean']:.2f}" + (
                    f" [{v['low']:.2f}, {v['high']:.2f}] {v['verdict']}"
                    if v["low"] is not None else " (one iteration)"))
            lines.append(f"| {side.replace('_', ' ')} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def knee(rates: Sequence[float], values: Sequence[float],
         factor: float = KNEE_FACTOR) -> float | None:
    """The rate at which ``values`` (a statistic at ascending ``rates``) first reaches
    ``factor`` times its value at the lowest rate, linearly interpolated between the two
    rates around it; None when it never does (the knee lies beyond the sweep)."""
    if len(rates) != len(values) or len(rates) < 2:
        raise ValueError("a knee needs two or more rates, one value each")
    if list(rates) != sorted(rates):
        raise ValueError("rates must ascend")
    target = factor * values[0]
    for (q0, v0), (q1, v1) in zip(zip(rates, values, strict=True),
                                  zip(rates[1:], values[1:], strict=True), strict=False):
        if v1 >= target:
            return q1 if v1 == v0 else q0 + (q1 - q0) * (target - v0) / (v1 - v0)
    return None


def _sweep_knee(its: dict[float, dict[int, dict[str, float]]], rates: Sequence[float],
                draw: Sequence[int], stat: str, factor: float) -> float | None:
    """The knee (:func:`knee`) of ``stat`` averaged, at each rate, over the iterations
    ``draw`` names (each ran at every rate; one may be named more than once)."""
    return knee(rates, [statistics.fmean(its[q][i][stat] for i in draw) for q in rates],
                factor)


def knee_interval(real: dict[float, dict[int, dict[str, float]]],
                  sim: dict[float, dict[int, dict[str, float]]], rates: Sequence[float],
                  stat: str = KNEE_STAT, factor: float = KNEE_FACTOR,
                  band: tuple[float, float] = KNEE_BAND, draws: int = KNEE_DRAWS,
                  seed: int = 0) -> dict[str, Any]:
    """How far a sweep's iterations can tell its knee ratio (simulated knee over real).
    ``real`` and ``sim``: per rate, per iteration, the statistics of its result file.
    The iterations are resampled with replacement ``draws`` times, the same iterations
    at every rate (an iteration's points ran in the same minutes of the machine) and
    each simulated iteration beside its real one (it has its send times and keys); each
    draw's knees are taken as :func:`knees` takes them. The 2.5% and 97.5% points of
    the draws' ratios are the interval: ``"in"`` when it lies inside ``band``,
    ``"out"`` when outside, else ``"unsure"``. A knee beyond the sweep makes a ratio
    of infinity (the simulated one) or 0 (the real one); a draw with both beyond has
    no ratio and is counted in ``undefined``; with more than 2.5% such draws there is
    no interval. Only the iterations both halves ran at every rate are drawn.
    ValueError for fewer than two rates or no such iteration."""
    if len(rates) < 2:
        raise ValueError("a knee needs two or more rates")
    names = sorted(set.intersection(*({*real[q]} & {*sim[q]} for q in rates)))
    if not names:
        raise ValueError("no iteration both halves ran at every rate")
    import random

    rng = random.Random(seed)
    ratios: list[float] = []
    undefined = 0
    for _ in range(draws):
        draw = [rng.choice(names) for _ in names]
        kr = _sweep_knee(real, rates, draw, stat, factor)
        ks = _sweep_knee(sim, rates, draw, stat, factor)
        if kr is None and ks is None:
            undefined += 1
        else:
            ratios.append(0.0 if kr is None else math.inf if ks is None else ks / kr)
    ratios.sort()
    if undefined > 0.025 * draws:
        return {"low": None, "high": None, "verdict": "unsure", "undefined": undefined,
                "draws": draws}
    low = ratios[int(0.025 * len(ratios))]
    high = ratios[min(len(ratios) - 1, math.ceil(0.975 * len(ratios)) - 1)]
    return {"low": None if math.isinf(low) else round(low, 3),
            "high": None if math.isinf(high) else round(high, 3),
            "verdict": verdict(low, high, band), "undefined": undefined, "draws": draws}


def interval_text(got: dict[str, Any]) -> str:
    """A :func:`knee_interval` as the knee lines print it: `` [low, high] verdict``
    (``beyond``: that end of the interval is a simulated knee past the sweep)."""
    if got["low"] is None and got["high"] is None and got["undefined"]:
        return f" (both knees beyond the sweep in {got['undefined']} of {got['draws']} draws)"
    ends = ["beyond" if x is None else f"{x:.2f}" for x in (got["low"], got["high"])]
    return f" [{ends[0]}, {ends[1]}] {got['verdict']}"


def knees(real: Path, sim: Path, input_len: int, stat: str = KNEE_STAT,
          factor: float = KNEE_FACTOR, draws: int = KNEE_DRAWS) -> dict[str, Any]:
    """Per mode, the rate sweep at ``input_len`` (every rate both halves ran there, the
    iterations averaged): the rates, real and simulated ``stat``, each side's knee
    (:func:`knee`), ``knee_ratio`` (simulated over real; None where either knee lies
    beyond the sweep) and how far the iterations can tell it (``interval``:
    :func:`knee_interval`, ``draws`` resamples; 0: none)."""
    r, s = by_iteration(real), by_iteration(sim)
    out: dict[str, Any] = {}
    for mode in sorted({k[0] for k in r}):
        keys = sorted((k for k in set(r) & set(s) if k[0] == mode and k[1] == input_len),
                      key=lambda k: k[2])
        if len(keys) < 2:
            continue
        rates = [k[2] for k in keys]
        rv = [statistics.fmean(v[stat] for v in r[k].values()) for k in keys]
        sv = [statistics.fmean(v[stat] for v in s[k].values()) for k in keys]
        kr, ks = knee(rates, rv, factor), knee(rates, sv, factor)
        out[mode] = {"rates": rates, "real": [round(v, 2) for v in rv],
                     "sim": [round(v, 2) for v in sv],
                     "real_knee": None if kr is None else round(kr, 2),
                     "sim_knee": None if ks is None else round(ks, 2),
                     "knee_ratio": None if kr is None or ks is None else round(ks / kr, 3)}
        if draws:
            out[mode]["interval"] = knee_interval(
                {k[2]: r[k] for k in keys}, {k[2]: s[k] for k in keys}, rates, stat,
                factor, draws=draws)
    return out


def knee_figure(sweep: dict[str, Any], out: Path, *, input_len: int,
                stat: str = KNEE_STAT, factor: float = KNEE_FACTOR) -> Path:
    """The sweep (:func:`knees`) drawn: per mode, real and simulated ``stat`` against
    the rate, the ``factor`` x light-load line and each knee."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, max(1, len(sweep)), figsize=(5.5 * max(1, len(sweep)), 4),
                             squeeze=False)
    for ax, (mode, got) in zip(axes[0], sorted(sweep.items()), strict=False):
        for side, style in (("real", "o-"), ("sim", "s--")):
            ax.plot(got["rates"], got[side], style, label=side)
            ax.axhline(factor * got[side][0], ls=":", lw=0.8,
                       color="C0" if side == "real" else "C1")
            k = got[f"{side}_knee"]
            if k is not None:
                ax.axvline(k, lw=0.8, color="C0" if side == "real" else "C1")
        ax.set_title(f"{mode}, {input_len} tokens in: knee ratio {got['knee_ratio']}"
                     + (interval_text(got["interval"]) if "interval" in got else ""),
                     fontsize=9)
        ax.set_xlabel("request rate (QPS)")
        ax.set_ylabel(stat.replace("_", " ").replace(" ms", " (ms)"))
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def chunks(directory: Path) -> dict[tuple[str, int, float], float]:
    """Per (mode, length, rate), the mean over its requests and iterations of the
    chunks a request's answer reached the client in: its first output and every later
    one that brought tokens after a gap (``itls`` of a result file saved with
    ``--save-detailed``: ``vllm bench serve`` times each chunk, however many tokens it
    carries; a simulated result's merged tokens share a time, a gap of 0). Fewer chunks
    than output tokens: tokens that piled up somewhere on the way out left together.
    Points whose files hold no ``itls`` are left out."""
    import json

    got: dict[tuple[str, int, float], list[float]] = {}
    for path in sorted(directory.iterdir()):
        key = point_key(path.name)
        if key is None:
            continue
        itls = json.loads(path.read_text()).get("itls") or []
        got.setdefault(key, []).extend(1 + sum(1 for x in r if x > 0) for r in itls)
    return {k: statistics.fmean(v) for k, v in got.items() if v}


def chunk_table(real: Path, sims: dict[str, Path]) -> tuple[str, dict[str, Any]]:
    """:func:`chunks` of the real half against each simulated way's (``sims``: by name),
    per point: the table and the summary's rows."""
    r = chunks(real)
    s = {name: chunks(d) for name, d in sims.items()}
    head = ["point", "real", *sims]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows: dict[str, Any] = {}
    for key in sorted(r, key=lambda k: (k[0], k[1], k[2])):
        name = point_name(*key)
        rows[name] = {"real": round(r[key], 2)} | {
            n: round(v[key], 2) for n, v in s.items() if key in v}
        lines.append(f"| {name} | {r[key]:.1f} | " + " | ".join(
            f"{s[n][key]:.1f}" if key in s[n] else "-" for n in sims) + " |")
    return "\n".join(lines), rows


def segment_rows(main: dict[str, dict[str, list[float]]],
                 other: dict[str, dict[str, list[float]]], stems: set[str]
                 ) -> tuple[str, dict[str, dict[str, list[float]]]]:
    """The segment medians (:func:`.tables.segment_tables`: per point stem, per segment,
    [real, simulated]) of the points ``stems`` names, their iterations averaged per
    (mode, length, rate): [real, simulated, simulated the other way] in ms. The table
    and the rows."""
    pooled: dict[str, dict[str, list[list[float]]]] = {}
    for stem, rows in main.items():
        if stem not in stems:
            continue
        name = stem.rsplit("_iter", 1)[0]
        for seg, (r, s) in rows.items():
            o = other.get(stem, {}).get(seg, [None, None])[1]
            pooled.setdefault(name, {}).setdefault(seg, []).append(
                [r, s, math.nan if o is None else o])
    out = {name: {seg: [round(statistics.fmean(v[i] for v in vals), 2) for i in range(3)]
                  for seg, vals in by_seg.items()} for name, by_seg in sorted(pooled.items())}
    lines = ["| point | segment | real | sim | sim, other way |", "|---|---|---|---|---|"]
    for name, by_seg in out.items():
        lines += [f"| {name} | {seg} | {r:.1f} | {s:.1f} | {o:.1f} |"
                  for seg, (r, s, o) in by_seg.items()]
    return ("\n".join(lines) if out else ""), out


def cross_validate(out: Path, profile: Path, *, rates: Sequence[float] = TRAIN_RATES,
                   inputs: Sequence[int] = TRAIN_INPUTS, sweep_input: int | None = None,
                   seed: int = 0, arrivals: str = "vllm", frontend_cores: int | None = None,
                   host_cores: int | None = None, merge_tokens: bool = True,
                   api_loops: bool = API_LOOPS,
                   pinned_engines: bool = PINNED_ENGINES, measured_speed: bool = False,
                   figures_dir: Path | None = None,
                   say: Callable[[str], None] = print) -> dict[str, Any]:
    """The cross-validation of a recorded run (``out/real``): split its points
    (:func:`split` on ``rates`` x ``inputs``), key them from the training points alone
    (:func:`cross_keys`), simulate every point into ``out/sim-cross`` with
    ``host.merge_tokens`` the output length (every token of a request waiting
    together leaves as one chunk, as vLLM's) if ``merge_tokens``, else 0 (with
    ``api_loops``, each API server a loop of its own where the run measured
    ``token_api_s``: :func:`~.simulate.run_sim`), and again with
    the other
    (``out/sim-cross-no-merge`` or ``-merge``: the mechanism's part), judge both
    (:func:`judge`), find the knees of the rate sweep at ``sweep_input`` (default: the
    length with the most rates; :func:`knees`) and draw it into ``figures_dir``.
    Prints the tables (``say``) and returns the summary: ``in_sample`` and
    ``out_of_sample`` ratio ranges, figures decided and in band, ``knee_ratio`` per
    mode, the same the other way under ``no_merge`` (or ``merge``), and the sweep's
    top rate iteration by iteration (``top_rate``: :func:`.tables.iteration_rows`).
    ``measured_speed``: each point's cores run as fast as the probe measured them during
    it, against the rate its keys were measured at (:func:`key_speeds`; ``cpu_speed``):
    the machine's speed then a condition of the point, as its send times are."""
    import json

    from .runs import SHARES, real_points
    from .simulate import run_sim
    from .tables import cpu_rows, cpu_table, iteration_rows, segment_tables

    real = out / "real"
    points, output_len, num_prompts = real_points(real)
    shares = json.loads((real / SHARES).read_text()) if (real / SHARES).exists() else {}
    train, held = split(points, rates, inputs)

    def fname(p: Point) -> str:
        return file_name(p[0], p[2], p[1], output_len, p[3])

    keys, run, source = cross_keys(real, shares, profile, output_len,
                                   {fname(p) for p in train}, {fname(p) for p in held})
    names = {point_name(*p[:3]) for p in train}
    refs = key_speeds(shares, {fname(p) for p in train}, source)
    said = sorted({f"{point_name(*k)} <- {g}"
                   for f, g in source.items() if (k := point_key(f)) is not None})
    say(f"cross-validation: {len(train)} training points ({len(names)} groups: "
        f"rates {sorted(set(rates))} x lengths {sorted(set(inputs))}), {len(held)} held "
        f"out, each keyed from its nearest training group: " + ", ".join(said))
    if sweep_input is None:  # the length swept over the most rates
        per_len: dict[int, set[float]] = {}
        for p in points:
            per_len.setdefault(p[1], set()).add(p[2])
        sweep_input = max(per_len, key=lambda n: (len(per_len[n]), -n))
    summary: dict[str, Any] = {"train": {"rates": sorted(set(rates)),
                                         "inputs": sorted(set(inputs)),
                                         "points": len(train)},
                               "held_out": len(held), "keyed_from": source,
                               "sweep_input": sweep_input, "measured_speed": measured_speed}
    if measured_speed:
        from .keys import speed_over

        got_speeds = [v for p in points
                      if (v := speed_over(shares.get(fname(p), {}), refs.get(fname(p), {})))]
        ends = [min(v[s] for v in got_speeds for s in v),
                max(v[s] for v in got_speeds for s in v)] if got_speeds else None
        summary["cpu_speed"] = None if ends is None else [round(x, 3) for x in ends]
        say(f"each point's cores as fast as the probe measured them against its keys' "
            f"gauges: {len(got_speeds)} of {len(points)} points, cpu_speed "
            f"{summary['cpu_speed']}")
    segs: dict[str, dict[str, dict[str, list[float]]]] = {}
    other = "merge" if not merge_tokens else "no_merge"
    beside = out / f"sim-cross-{other.replace('_', '-')}"
    for way, merge in (("main", output_len if merge_tokens else 0),
                       (other, 0 if merge_tokens else output_len)):
        sim = out / "sim-cross" if way == "main" else beside
        run_sim(profile, sim, points, output_len, num_prompts, seed=seed,
                arrivals=arrivals, frontend_cores=frontend_cores, host_cores=host_cores,
                gauges=keys, merge_tokens=merge, api_loops=api_loops,
                pinned_engines=pinned_engines, shares=shares, speeds=measured_speed,
                speed_refs=refs,
                timelines=out / "sim-timeline" / way)
        _, segs[way] = segment_tables(real, out / "sim-timeline" / way, shares)
        judged = judge(real, sim, names)
        sweep = knees(real, sim, sweep_input)
        sweep_median = knees(real, sim, sweep_input, stat="median_ttft_ms")
        title = (f", host.merge_tokens {merge}" +
                 ("" if merge else " (every token a frontend job of its own)"))
        say(f"\nCross-validated{title}: each figure's iterations' sim/real ratios, their "
            f"mean and 95% interval, verdict against {BAND[0]}-{BAND[1]}:\n")
        say(judge_table(judged))
        say(f"\nKnee (mean TTFT {KNEE_FACTOR:g}x its value at the lowest rate), "
            f"{sweep_input} tokens in{title}:")
        for mode, got in sweep.items():
            say(f"  {mode}: rates {got['rates']}, real {got['real']}, sim {got['sim']}; "
                f"knee real {got['real_knee']} sim {got['sim_knee']}, ratio "
                f"{got['knee_ratio']}{interval_text(got['interval'])}")
        got = {side: {k: v for k, v in judged[side].items() if k != "points"}
               for side in judged}
        for mode, g in sweep_median.items():
            say(f"  {mode}, on median TTFT: real {g['real']}, sim {g['sim']}; knee real "
                f"{g['real_knee']} sim {g['sim_knee']}, ratio {g['knee_ratio']}"
                f"{interval_text(g['interval'])}")
        got["knee"] = sweep
        got["knee_ratio"] = {m: v["knee_ratio"] for m, v in sweep.items()}
        got["knee_interval"] = {m: v["interval"] for m, v in sweep.items()}
        got["knee_median"] = sweep_median
        got["knee_ratio_median"] = {m: v["knee_ratio"] for m, v in sweep_median.items()}
        got["knee_interval_median"] = {m: v["interval"] for m, v in sweep_median.items()}
        got["points"] = {side: judged[side]["points"] for side in judged}
        if way == "main":
            summary |= got | {"merge_tokens": merge}
            if figures_dir is not None and sweep:
                path = knee_figure(sweep, figures_dir / "sim_saturation_knee.png",
                                   input_len=sweep_input)
                say(f"wrote {path}")
        else:
            summary[other] = {k: v for k, v in got.items() if k != "points"}
    text, summary["chunks"] = chunk_table(real, {"sim": out / "sim-cross",
                                                 f"sim, {other.replace('_', ' ')}": beside})
    if summary["chunks"]:
        say(f"\nChunks a request's {output_len} tokens reached the client in, mean a "
            "request (real: vllm bench serve's own count; fewer than the tokens: some "
            "left together):\n")
        say(text)
    above = {fname(p).removesuffix(".json") for p in held if p[2] > max(rates)}
    text, summary["segments"] = segment_rows(segs.get("main", {}), segs.get(other, {}),
                                             above)
    if text:
        say(f"\nAbove the training rates, each segment's median over the points' "
            f"iterations (ms; real / simulated / simulated {other.replace('_', ' ')}):\n")
        say(text)
    summary["cpu"] = cpu_rows(real, out / "sim-cross", shares)
    if summary["cpu"]:
        say("\nThe cores each part kept busy while a point loaded it, mean over its "
            "iterations (real: its threads' CPU time; simulated: its processes' work "
            "over the run; the simulated router is the relay, the client's work "
            "with it):\n")
        say(cpu_table(summary["cpu"]))
    swept = [p[2] for p in points if p[1] == sweep_input]
    top = max(swept, default=None)  # none: a --sweep-input the run has no point of
    text, rows = ("", []) if top is None else iteration_rows(
        real, out / "sim-cross", shares, input_len=sweep_input, rate=top)
    summary["top_rate"] = {"qps": top, "input_len": sweep_input, "iterations": rows}
    if text:
        say(f"\nThe sweep's top rate ({rate_name(top)} QPS, {sweep_input} tokens in), "
            "iteration by iteration: mean TTFT real and simulated, and what the machine "
            "did meanwhile:\n")
        say(text)
    o = summary.get("out_of_sample", {})
    say(f"\nout of sample: {o.get('in_band')} of {o.get('figures')} figures in band, "
        f"{o.get('decided')} decided, {o.get('narrow_not_in')} narrower than the band "
        f"yet not inside it; knee ratio {summary.get('knee_ratio')}")
    summary["run_keys"] = run
    return summary
