"""Sim against real segment by segment: per point, and by how a request was served.

Over the points both halves recorded marks of (:func:`compared_points`):
:func:`segment_tables`, each segment's real and simulated median / p90 per point;
the requests pooled per mode and rate and grouped by how many others overlapped them
(:func:`overlap_tables`), by their place in their point (:func:`place_tables`), by
what else they met on their way to the first token (:func:`neighbour_tables`); and
the gauges' lone requests against the points' (:func:`lone_gap`), with the core
probe's wake-ups in each.
"""

from __future__ import annotations

import functools
import json
import re
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ... import timeline
from ...sim.host.profile import RELAY, beside_process, engine_process
from .. import segments
from .keys import gauge_speed
from .runs import GAUGES, MODES, NAME, WAKES


def compared_points(real: Path, timelines: Path, shares: dict[str, dict[str, Any]]
                    ) -> Iterator[tuple[str, re.Match[str], Any, Any]]:
    """Each point both halves recorded, by result file name: the name, its match of
    :data:`~.runs.NAME`, the real requests of its window (its router's and pair's marks) and
    the simulated ones."""

    for fname, got in sorted(shares.items()):
        m, window = NAME.match(fname), got.get("window")
        sim_dir = timelines / Path(fname).stem
        if m is None or m["mode"] not in MODES or not window or not sim_dir.is_dir():
            continue
        name, deployment = MODES[m["mode"]]
        real_dirs = [real / "timeline" / name, real / "timeline" / deployment]
        if not all(d.is_dir() for d in real_dirs):
            continue
        yield (fname, m, segments.load(real_dirs, (window[0], window[1])),
               segments.load([sim_dir]))


def segment_tables(real: Path, timelines: Path, shares: dict[str, dict[str, Any]]
                   ) -> tuple[str, dict[str, dict[str, list[float]]]]:
    """Per point both halves recorded: the segment table (real median / p90 against the
    simulated), and ``{point: {segment: [real median, sim median]}}`` (ms)."""

    texts, out = [], {}
    for fname, _, real_reqs, sim_reqs in compared_points(real, timelines, shares):
        rows = segments.compare(real_reqs, sim_reqs)
        if not rows:
            continue
        texts.append(f"{Path(fname).stem}:\n\n{segments.table(rows)}")
        out[Path(fname).stem] = {r.segment: [r.real_median, r.sim_median] for r in rows}
    return "\n\n".join(texts), out


def pooled_by_rate(real: Path, timelines: Path, shares: dict[str, dict[str, Any]],
                   group: Callable[[str, Any], dict[Any, list[Any]]]
                   ) -> dict[str, tuple[dict[Any, list[Any]], dict[Any, list[Any]]]]:
    """``{"<mode>_qps<rate>": (real, simulated)}``: each side's groups pooled over the
    points both halves recorded at that mode and rate, ``group(name, requests)``
    grouping one point's requests (group -> items)."""
    pooled: dict[str, tuple[dict[Any, list[Any]], dict[Any, list[Any]]]] = {}
    for fname, m, real_reqs, sim_reqs in compared_points(real, timelines, shares):
        both = pooled.setdefault(f"{m['mode']}_qps{float(m['qps']):g}", ({}, {}))
        for side, reqs in zip(both, (real_reqs, sim_reqs), strict=True):
            for g, items in group(fname, reqs).items():
                side.setdefault(g, []).extend(items)
    return pooled


def grouped_tables(real: Path, timelines: Path, shares: dict[str, dict[str, Any]],
                   group: Callable[[Any], dict[int, list[float]]], cap: int,
                   heading: str) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """Per mode and rate, the points' requests pooled over lengths and iterations:
    'legs out -> first token' grouped per point by ``group`` (its requests -> group ->
    times), real against simulated. The text and ``{"<mode>_qps<rate>": [row, ...]}``."""

    pooled = pooled_by_rate(real, timelines, shares, lambda _, reqs: group(reqs))
    texts, out = [], {}
    for key, (r, s) in sorted(pooled.items()):
        rows = segments.overlap_rows(r, s)
        texts.append(f"{key}:\n\n{segments.overlap_table(rows, cap=cap, heading=heading)}")
        out[key] = segments.overlap_json(rows)
    return "\n\n".join(texts), out


def overlap_tables(real: Path, timelines: Path, shares: dict[str, dict[str, Any]],
                   cap: int = 2) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """:func:`grouped_tables` by how many other requests overlapped each
    (:func:`pushkv.fit.segments.by_overlap`) -- whether the two agree on a request
    served alone and part ways on what a neighbour costs it."""

    return grouped_tables(real, timelines, shares,
                          functools.partial(segments.by_overlap, cap=cap), cap, "overlapped")


def place_tables(real: Path, timelines: Path, shares: dict[str, dict[str, Any]],
                 cap: int = 3) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """:func:`grouped_tables` by each request's place in its point (1st, 2nd, 3rd on;
    :func:`pushkv.fit.segments.by_place`) -- a point's first requests meet idle
    engines, so a gap at the first places alone is something at the points' start in
    the real half (the core probe's own start did that, until entering it waited for
    it)."""

    return grouped_tables(real, timelines, shares,
                          functools.partial(segments.by_place, cap=cap), cap, "place")


def neighbour_tables(real: Path, timelines: Path, shares: dict[str, dict[str, Any]]
                     ) -> tuple[str, dict[str, dict[str, Any]]]:
    """Per mode and rate, the points' requests pooled over lengths and iterations,
    grouped per point by what else they met on the way to their first token
    (:func:`pushkv.fit.segments.by_neighbour`: alone, one other decoding, one before its
    first token, one that came later, more): each group's segments, real against
    simulated -- where a neighbour's cost lands, and whether the model puts it there.
    The text and ``{"<mode>_qps<rate>": {group: {"real_n", "sim_n", "segments"}}}``."""

    def group(fname: str, reqs: Any) -> dict[str, list[tuple[str, Any]]]:
        return {g: [(f"{fname}/{k}", r) for k, r in got.items()]  # ids apart per point
                for g, got in segments.by_neighbour(reqs).items()}

    texts, out = [], {}
    for key, (r, s) in sorted(pooled_by_rate(real, timelines, shares, group).items()):
        groups = segments.compare_groups({g: dict(v) for g, v in r.items()},
                                         {g: dict(v) for g, v in s.items()})
        texts.append(f"{key}:\n\n{segments.neighbour_text(groups)}")
        out[key] = segments.neighbour_json(groups)
    return "\n\n".join(texts), out


#: the segments :func:`lone_gap` compares: each leg's way in, the prefill, the hand-off
#: to decode's scheduler, the first token's way out, the whole TTFT
LONE_GAP_SEGMENTS = ("legs out -> prefill sees", "prefill sees -> prefill finished",
                     "legs out -> decode arrives", "decode arrives -> sees",
                     "prefill finished -> scheduler knows", "decode step -> first token",
                     "legs out -> first token")


def wakes_in_flight(path: Path, requests: dict[str, dict[str, float]], where: str
                    ) -> dict[str, list[float]]:
    """The probe's wake-ups in ``path`` (:func:`~.runs.write_wakes`) by how many of
    ``requests`` were in flight (:func:`pushkv.fit.segments.wakes_by_flight`), as
    ``"<where>, 1 in flight"`` and ``"<where>, 2+ in flight"``; idle ones left out, as
    they say nothing of a request's. Empty where the file is missing."""

    if not path.exists():
        return {}
    at = [(t, w) for per in json.loads(path.read_text()).values() for t, w in per]
    out: dict[str, list[float]] = {}
    for n, ws in segments.wakes_by_flight(requests, at).items():
        if n:
            out.setdefault(f"{where}, {'1' if n == 1 else '2+'} in flight", []).extend(ws)
    return out


def lone_gap(real: Path, shares: dict[str, dict[str, Any]]
             ) -> tuple[str, dict[str, dict[str, Any]]]:
    """What the gauges leave out: per mode, the lone requests of every gauge of the run
    (each gauge once) against those of the points at each rate
    (:func:`pushkv.fit.segments.alone`), each segment's mean (:data:`LONE_GAP_SEGMENTS`,
    ms); and the core probe's wake-ups with a request in flight, during the gauges and
    during the points, by how many were (:func:`~.runs.write_wakes`; mean and p99, ms). The
    profile's keys are the gauges' lone requests, so a lone request of a point
    that pays more than a gauge's -- or a woken probe that waits longer beside one
    request in a point than in a gauge -- is a cost the keys do not hold. The text and
    ``{"<mode>": {"requests": {...}, "wakes": {...}}}``."""

    def q(xs: list[float], p: float) -> float:
        got = sorted(xs)
        return got[min(len(got) - 1, int(p * len(got)))]

    texts, out = [], {}
    for mode, (name, deployment) in MODES.items():
        dirs = [real / "timeline" / name, real / "timeline" / deployment]
        points = {f: g for f, g in sorted(shares.items())
                  if (m := NAME.match(f)) and m["mode"] == mode and g.get("window")}
        if not points or not all(d.is_dir() for d in dirs):
            continue
        marks = segments.load(dirs)
        # (gauges?, rate or 0 where unrecorded) -> lone requests; wake-ups by group
        lone: dict[tuple[bool, float], dict[str, dict[str, float]]] = {}
        by_n: dict[str, list[float]] = {}
        windows = {tuple(g["window"]): g for got in points.values()
                   for g in got.get("gauges") or []}  # a gauge two points share once
        for window, g in windows.items():
            reqs = segments.within(marks, window)
            lone.setdefault((True, g.get("qps") or 0.0), {}).update(segments.alone(reqs))
            for k, ws in wakes_in_flight(real / WAKES / f"{GAUGES}/"
                                         f"{Path(g['file']).stem}.json", reqs,
                                         "gauges").items():
                by_n.setdefault(k, []).extend(ws)
        for fname, got in points.items():
            reqs = segments.within(marks, tuple(got["window"]))
            rate = float(NAME.match(fname)["qps"])  # type: ignore[index]
            lone.setdefault((False, rate), {}).update(segments.alone(reqs))
            for k, ws in wakes_in_flight(real / WAKES / f"{Path(fname).stem}.json", reqs,
                                         "points").items():
                by_n.setdefault(k, []).extend(ws)
        if not windows:
            continue
        groups = {("gauges" + (f" qps{r:g}" if r else "") if is_gauge else f"qps{r:g}"): reqs
                  for (is_gauge, r), reqs in sorted(lone.items(),
                                                    key=lambda kv: (not kv[0][0], kv[0][1]))}
        gauge_groups = [g for g in groups if g.startswith("gauges")]
        rows = ["| segment (mean, ms) | " + " | ".join(
                    f"{g} ({len(r)})" for g, r in groups.items()) + " |",
                "|---|" + "---|" * len(groups)]
        means: dict[str, dict[str, float]] = {}
        for g, reqs in groups.items():
            segs = timeline.segments(reqs)
            means[g] = {n: round(statistics.fmean(segs[n]), 2)
                        for n in LONE_GAP_SEGMENTS if segs.get(n)}
        for n in LONE_GAP_SEGMENTS:
            if any(n in means[g] for g in gauge_groups):
                rows.append(f"| {n} | " + " | ".join(
                    f"{means[g][n]:.1f}" if n in means[g] else "-" for g in groups) + " |")
        wakes = {g: {"n": len(ws), "mean_ms": round(statistics.fmean(ws) * 1e3, 3),
                     "p99_ms": round(q(ws, 0.99) * 1e3, 3)} for g, ws in sorted(by_n.items())}
        if wakes:
            rows += ["", "| probe wake-ups | n | mean (ms) | p99 (ms) |", "|---|---|---|---|"]
            rows += [f"| {g} | {w['n']} | {w['mean_ms']:.2f} | {w['p99_ms']:.2f} |"
                     for g, w in wakes.items()]
        texts.append(f"{mode}:\n\n" + "\n".join(rows))
        out[mode] = {"requests": {g: {"n": len(groups[g]), "mean_ms": means[g]}
                                  for g in groups}, "wakes": wakes}
    return "\n\n".join(texts), out


#: the frontend parts whose garbage-collector pauses :func:`iteration_rows` shows
FRONTEND_PARTS = ("decode_api", "router", "client")


def iteration_rows(real: Path, sim: Path, shares: dict[str, dict[str, Any]], *,
                   input_len: int, rate: float) -> tuple[str, list[dict[str, Any]]]:
    """One point's iterations side by side, per mode (the points of ``input_len``
    tokens at ``rate``): the real and simulated mean TTFT (ms), and what the run
    recorded of the machine meanwhile (``shares``, ``cpu_probe.json``) -- decode's
    engine time per output token (the servers' metrics, ms), how much of a core the
    prefill and decode engines' pinned threads got (:func:`.deployment.sched_parts`),
    the longest garbage-collector pause of a frontend process (:data:`FRONTEND_PARTS`,
    ms, and whose) and the cores' speed against the point's gauges
    (:func:`.keys.gauge_speed`). Where a real mean TTFT is far from its simulated
    one, the columns beside it show whether the engines, a stopped frontend or the
    machine's cores carried it. A field the run did not record: None ('-'). The table
    and its rows."""
    rows: list[dict[str, Any]] = []
    for path in sorted(real.iterdir()):
        m = NAME.match(path.name)
        if (m is None or m["mode"] not in MODES or int(m["input"]) != input_len
                or float(m["qps"]) != rate or not (sim / path.name).exists()):
            continue
        got = shares.get(path.name, {})
        threads = got.get("threads") or {}
        pinned = {side: threads.get(side, {}).get("pinned", {}).get("cores")
                  for side in ("prefill", "decode")}
        gc = {part: got.get("gc", {}).get(part, {}).get("max_ms") for part in FRONTEND_PARTS}
        gc = {k: v for k, v in gc.items() if v is not None}
        worst = max(gc, key=lambda k: gc[k]) if gc else None
        tok = got.get("engine", {}).get("decode_token_s")
        speed = gauge_speed(got)
        rows.append({
            "mode": m["mode"], "iter": int(m["iter"]),
            "real_ttft_ms": round(json.loads(path.read_text())["mean_ttft_ms"], 1),
            "sim_ttft_ms": round(json.loads((sim / path.name).read_text())["mean_ttft_ms"], 1),
            "decode_ms_a_token": None if tok is None else round(tok * 1e3, 2),
            "prefill_pinned_cores": pinned["prefill"], "decode_pinned_cores": pinned["decode"],
            "frontend_gc_max_ms": None if worst is None else gc[worst], "gc_part": worst,
            "speed": {k: round(v, 2) for k, v in speed.items()} or None})
    rows.sort(key=lambda r: (r["mode"], r["iter"]))

    def f(v: Any, spec: str = ".1f") -> str:
        return "-" if v is None else format(v, spec)

    lines = ["| mode | iteration | real mean TTFT | sim | decode ms a token | pinned cores, "
             "prefill / decode | longest frontend GC pause (ms) | cores' speed, prefill / "
             "decode |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sp = r["speed"] or {}
        lines.append(
            f"| {r['mode']} | {r['iter']} | {r['real_ttft_ms']:.1f} | {r['sim_ttft_ms']:.1f} | "
            f"{f(r['decode_ms_a_token'], '.2f')} | {f(r['prefill_pinned_cores'], '.2f')} / "
            f"{f(r['decode_pinned_cores'], '.2f')} | {f(r['frontend_gc_max_ms'])}"
            f"{' (' + r['gc_part'] + ')' if r['gc_part'] else ''} | "
            f"{f(sp.get('prefill'), '.2f')} / {f(sp.get('decode'), '.2f')} |")
    return ("\n".join(lines) if rows else ""), rows


#: the deployment's parts whose CPU the run records (:func:`.deployment.parts`), and
#: the simulated processes each holds (:attr:`pushkv.sim.host.model.HostModel.busy_by_process`:
#: an engine's loop and the work beside its steps by side, an API server by its engine's
#: id, the relay of the router and the client)
CPU_PARTS = {"prefill": (engine_process("prefill"), beside_process("prefill"), "prefill-"),
             "decode": (engine_process("decode"), beside_process("decode")),
             "decode_api": ("decode-",), "router": (RELAY,)}


def _sim_part(by_process: dict[str, float], names: tuple[str, ...]) -> float:
    return sum(s for p, s in by_process.items()
               if any(p == n or (n.endswith("-") and p.startswith(n)) for n in names))


def cpu_rows(real: Path, sim: Path, shares: dict[str, dict[str, Any]]
             ) -> list[dict[str, Any]]:
    """Per mode and rate (iterations averaged), the cores each part of the deployment
    kept busy while the point loaded it (``threads`` in ``shares``, pinned and floating
    threads together) against the simulated processes' (:data:`CPU_PARTS`; their
    core-seconds over the simulated run's duration). The simulated relay holds the
    client's work too, the real router does not. Points either half lacks: left out."""
    acc: dict[tuple[str, float], dict[str, list[float]]] = {}
    for path in sorted(real.iterdir()):
        m = NAME.match(path.name)
        threads = shares.get(path.name, {}).get("threads") or {}
        if m is None or not threads or not (sim / path.name).exists():
            continue
        res = json.loads((sim / path.name).read_text())
        by, dur = res.get("pushkv", {}).get("host_busy_s_by_process"), res.get("duration")
        if not by or not dur:
            continue
        row = acc.setdefault((m["mode"], float(m["qps"])), {})
        for part, names in CPU_PARTS.items():
            got = threads.get(part)
            if got is None:
                continue
            row.setdefault(f"{part}_real", []).append(
                sum((got.get(cls) or {}).get("cores") or 0.0 for cls in ("pinned", "floating")))
            row.setdefault(f"{part}_sim", []).append(_sim_part(by, names) / dur)
    return [{"mode": mode, "qps": qps,
             **{k: round(statistics.fmean(v), 3) for k, v in sorted(cols.items())}}
            for (mode, qps), cols in sorted(acc.items())]


def cpu_table(rows: list[dict[str, Any]]) -> str:
    """:func:`cpu_rows` as a table: each part's cores busy, real / simulated."""
    if not rows:
        return ""
    lines = ["| mode | QPS | " + " | ".join(f"{p} real / sim" for p in CPU_PARTS)
             + " | all real / sim |", "|---|---|" + "---|" * (len(CPU_PARTS) + 1)]
    for r in rows:
        cells, tot = [], [0.0, 0.0]
        for p in CPU_PARTS:
            a, b = r.get(f"{p}_real"), r.get(f"{p}_sim")
            cells.append("-" if a is None else f"{a:.2f} / {b:.2f}")
            tot[0] += a or 0.0
            tot[1] += b or 0.0
        lines.append(f"| {r['mode']} | {r['qps']:g} | " + " | ".join(cells)
                     + f" | {tot[0]:.2f} / {tot[1]:.2f} |")
    return "\n".join(lines)
