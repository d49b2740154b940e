"""A simulated run against a real one, segment by segment of their timelines.

Both sides record :mod:`pushkv.timeline` marks: the real connector, proxy and
benchmark client into directories of ``timeline-<pid>.jsonl`` files, the simulator
into ``timeline-sim.jsonl`` (:mod:`pushkv.sim.marks`). :func:`compare` takes each
segment of :data:`pushkv.timeline.SEGMENTS` that both sides recorded and gives real
median / p90, simulated median / p90 and their ratios (sim / real)::

    python -m pushkv.fit.segments --real /tmp/run/timeline/push /tmp/run/timeline/pushkv \\
        --sim /tmp/sim-timeline [--json]

A real run's first directory is the router's or client's (it names the requests of
the run); marks of later directories -- the servers', shared by every mode and run
against them -- count only for those requests. ``--window T0 T1`` (``time.monotonic``
seconds) keeps the requests whose legs left in that interval (one point of a run);
``--alone`` the requests that had the deployment to themselves (:func:`alone`).
``--by-place`` groups the requests by their place in the run (:func:`by_place`): the
first ones meet idle engines, and where only they part ways with the model the cause
is at the run's start.

:func:`by_overlap` groups the requests by how many others were in flight on their
way to the first token (:func:`overlaps`), so a comparison can tell whether the
two sides agree on a request served alone and part ways on how much a neighbour
costs it (:func:`overlap_rows`)::

    python -m pushkv.fit.segments --real ... --sim ... --by-overlap

:func:`by_neighbour` goes one step further for the requests that met exactly one
other: it tells apart a neighbour that was decoding when their legs went out, one
still on its way to its first token, and one that came later, and ``--by-neighbour``
compares the segments of each group (:func:`neighbour_rows`) -- where a neighbour's
cost lands, and whether the model puts it there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import timeline

Requests = dict[str, dict[str, float]]


def load(dirs: Sequence[str | os.PathLike[str]],
         window: tuple[float, float] | None = None) -> Requests:
    """Per request id, each event's first time: the requests of ``dirs[0]``, joined with
    the marks later directories hold for them; with ``window``, only the requests whose
    ``legs_sent`` (else ``received``) lies in it."""
    if not dirs:
        raise ValueError("no timeline directory given")
    own = timeline.read(dirs[0])
    ids = {m.transfer_id for m in own}
    others = [m for d in dirs[1:] for m in timeline.read(d) if m.transfer_id in ids]
    reqs = timeline.by_request(own + others)
    return reqs if window is None else within(reqs, window)


def within(requests: Mapping[str, dict[str, float]], window: tuple[float, float]) -> Requests:
    """The requests whose ``legs_sent`` (else ``received``) lies in ``window``."""
    t0, t1 = window
    return {k: r for k, r in requests.items()
            if (s := r.get("legs_sent", r.get("received"))) is not None and t0 <= s <= t1}


def alone(requests: Mapping[str, Mapping[str, float]]) -> Requests:
    """The requests that ran alone: nothing else between their legs leaving and their
    last mark (a low-load sample from any run)."""
    spans = sorted((min(r.values()), max(r.values()), k) for k, r in requests.items() if r)
    out: Requests = {}
    ended = -math.inf  # the latest end of the requests that started before
    for i, (t0, t1, k) in enumerate(spans):
        after = spans[i + 1][0] if i + 1 < len(spans) else math.inf
        if ended < t0 and t1 < after:
            out[k] = dict(requests[k])
        ended = max(ended, t1)
    return out


def in_flight(requests: Mapping[str, Mapping[str, float]], *,
              end: str = "last_token") -> dict[str, list[str]]:
    """Per request with ``legs_sent``, ``first_token`` and ``end`` marks: the others
    (with those marks) in flight -- from their ``legs_sent`` to their ``end`` -- at some
    time between its legs going out and its first token."""
    spans = [(k, r["legs_sent"], r["first_token"], r[end]) for k, r in requests.items()
             if "legs_sent" in r and "first_token" in r and end in r]
    return {k: [k2 for k2, s2, _, e2 in spans if k2 != k and s2 < first and e2 > sent]
            for k, sent, first, _ in spans}


def wakes_by_flight(requests: Mapping[str, Mapping[str, float]],
                    wakes: Sequence[tuple[float, float]], *, start: str = "legs_sent",
                    end: str = "last_token") -> dict[int, list[float]]:
    """The ``wakes`` ((when due, delay) each, on the timeline's clock) by how many of
    ``requests`` were in flight then -- from their ``start`` to their ``end`` mark
    (requests without both left out)."""
    spans = [(r[start], r[end]) for r in requests.values() if start in r and end in r]
    out: dict[int, list[float]] = {}
    for t, delay in wakes:
        out.setdefault(sum(s <= t < e for s, e in spans), []).append(delay)
    return out


def overlaps(requests: Mapping[str, Mapping[str, float]], *,
             end: str = "last_token") -> dict[str, int]:
    """Per request of :func:`in_flight`: how many others were in flight on its way to
    its first token."""
    return {k: len(others) for k, others in in_flight(requests, end=end).items()}


def by_overlap(requests: Mapping[str, Mapping[str, float]], *, cap: int = 2,
               end: str = "last_token") -> dict[int, list[float]]:
    """'legs out -> first token' (ms) of each request of :func:`overlaps`, grouped by its
    overlap count, counts above ``cap`` in the group ``cap``."""
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    out: dict[int, list[float]] = {}
    for k, n in overlaps(requests, end=end).items():
        r = requests[k]
        out.setdefault(min(n, cap), []).append((r["first_token"] - r["legs_sent"]) * 1e3)
    return out


def by_place(requests: Mapping[str, Mapping[str, float]], *, cap: int = 3
             ) -> dict[int, list[float]]:
    """'legs out -> first token' (ms) of each request with both marks, grouped by its
    place in the run (1: the first whose legs went out), places from ``cap`` on in the
    group ``cap``. A run's first requests meet idle engines, so where they part ways
    with the model and the later ones do not, something at the run's start (not the
    load) is in the real half."""
    if cap < 1:
        raise ValueError(f"cap must be >= 1, got {cap}")
    timed = sorted((r["legs_sent"], k) for k, r in requests.items()
                   if "legs_sent" in r and "first_token" in r)
    out: dict[int, list[float]] = {}
    for place, (sent, k) in enumerate(timed, start=1):
        out.setdefault(min(place, cap), []).append((requests[k]["first_token"] - sent) * 1e3)
    return out


#: what else a request met on its way to its first token (:func:`neighbour`)
NEIGHBOURS = ("alone", "decoding", "before its first token", "came later", "2+")


def neighbour(requests: Mapping[str, Mapping[str, float]], *,
              end: str = "last_token") -> dict[str, str]:
    """Per request of :func:`in_flight`: what else was in flight between its legs going
    out and its first token (:data:`NEIGHBOURS`) -- ``"alone"``; with exactly one other,
    where that one was when its legs went out: ``"decoding"`` (past its own first
    token: its engines step and its tokens stream), ``"before its first token"``, or
    ``"came later"`` (its legs went out after); ``"2+"`` with more. Where a
    neighbour's cost lands depends on which of these it is."""
    out: dict[str, str] = {}
    for k, others in in_flight(requests, end=end).items():
        if len(others) != 1:
            out[k] = "2+" if others else "alone"
            continue
        sent, other = requests[k]["legs_sent"], requests[others[0]]
        out[k] = ("came later" if other["legs_sent"] >= sent else
                  "decoding" if other["first_token"] <= sent else "before its first token")
    return out


def by_neighbour(requests: Mapping[str, Mapping[str, float]], *,
                 end: str = "last_token") -> dict[str, Requests]:
    """The requests of :func:`neighbour`, by group (only groups that have one)."""
    out: dict[str, Requests] = {}
    for k, g in neighbour(requests, end=end).items():
        out.setdefault(g, {})[k] = dict(requests[k])
    return out


@dataclass(frozen=True, slots=True)
class OverlapRow:
    """'legs out -> first token' of a group of requests, both sides (ms): those that
    overlapped ``group`` others (:func:`by_overlap`) or had place ``group`` in their run
    (:func:`by_place`), the last group that many or more; a ratio is None without both."""

    group: int
    real_n: int
    real_median: float
    real_mean: float
    sim_n: int
    sim_median: float
    sim_mean: float
    ratio_median: float | None
    ratio_mean: float | None


def overlap_rows(real: Mapping[int, Sequence[float]],
                 sim: Mapping[int, Sequence[float]]) -> list[OverlapRow]:
    """A row per group either side has (:func:`by_overlap`, :func:`by_place`), in
    order."""
    def stats(xs: Sequence[float]) -> tuple[int, float, float]:
        return ((len(xs), statistics.median(xs), statistics.fmean(xs)) if xs
                else (0, math.nan, math.nan))

    rows = []
    for g in sorted(set(real) | set(sim)):
        rn, rm, ra = stats(real.get(g, ()))
        sn, sm, sa = stats(sim.get(g, ()))
        rows.append(OverlapRow(g, rn, round(rm, 3), round(ra, 3), sn, round(sm, 3),
                               round(sa, 3), _ratio(sm, rm), _ratio(sa, ra)))
    return rows


def overlap_json(rows: Sequence[OverlapRow]) -> list[dict[str, float | int | None]]:
    """The rows as JSON-ready dicts, a group one side lacks as None (not NaN)."""
    return [{k: None if isinstance(v, float) and math.isnan(v) else v
             for k, v in asdict(r).items()} for r in rows]


def overlap_table(rows: Sequence[OverlapRow], cap: int | None = None,
                  heading: str = "overlapped") -> str:
    """Markdown: the group (``heading``: overlap, or place with :func:`by_place`),
    requests, real median / mean, sim median / mean, ratios; the group ``cap`` reads
    "cap+"."""
    def num(x: float) -> str:
        return "-" if math.isnan(x) else f"{x:.1f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [f"| {heading} | requests real / sim | real median / mean (ms) | "
             "sim median / mean (ms) | sim/real median / mean |", "|---|---|---|---|---|"]
    for r in rows:
        g = f"{r.group}+" if cap is not None and r.group == cap else str(r.group)
        lines.append(f"| {g} | {r.real_n} / {r.sim_n} | {num(r.real_median)} / "
                     f"{num(r.real_mean)} | {num(r.sim_median)} / {num(r.sim_mean)} | "
                     f"{ratio(r.ratio_median)} / {ratio(r.ratio_mean)} |")
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Row:
    """One segment, both sides (ms); a ratio is None where the real figure is 0."""

    segment: str
    real_median: float
    real_p90: float
    real_n: int
    sim_median: float
    sim_p90: float
    sim_n: int
    ratio_median: float | None
    ratio_p90: float | None


def _ratio(sim: float, real: float) -> float | None:
    return round(sim / real, 3) if real > 0 and math.isfinite(sim / real) else None


def compare(real: Mapping[str, Mapping[str, float]],
            sim: Mapping[str, Mapping[str, float]]) -> list[Row]:
    """A row per segment of :data:`pushkv.timeline.SEGMENTS` both sides recorded, in its
    order."""
    r, s = timeline.segments(real), timeline.segments(sim)
    rows = []
    for name, _, _ in timeline.SEGMENTS:
        if name not in r or name not in s:
            continue
        rm, rp = statistics.median(r[name]), timeline.percentile(r[name], 0.9)
        sm, sp = statistics.median(s[name]), timeline.percentile(s[name], 0.9)
        rows.append(Row(name, round(rm, 3), round(rp, 3), len(r[name]), round(sm, 3),
                        round(sp, 3), len(s[name]), _ratio(sm, rm), _ratio(sp, rp)))
    return rows


def neighbour_rows(real: Mapping[str, Mapping[str, float]],
                   sim: Mapping[str, Mapping[str, float]]
                   ) -> dict[str, tuple[int, int, list[Row]]]:
    """Per group of :func:`neighbour` both sides have, in :data:`NEIGHBOURS` order: the
    requests real and simulated and their :func:`compare` rows -- which segment a
    neighbour of each kind lengthens, on each side."""
    return compare_groups(by_neighbour(real), by_neighbour(sim))


def compare_groups(real: Mapping[str, Mapping[str, Mapping[str, float]]],
                   sim: Mapping[str, Mapping[str, Mapping[str, float]]]
                   ) -> dict[str, tuple[int, int, list[Row]]]:
    """:func:`neighbour_rows` of requests already grouped (:func:`by_neighbour`, say
    pooled over several runs' points)."""
    return {g: (len(real[g]), len(sim[g]), compare(real[g], sim[g]))
            for g in NEIGHBOURS if g in real and g in sim}


def neighbour_text(groups: Mapping[str, tuple[int, int, Sequence[Row]]]) -> str:
    """Markdown: a :func:`table` per group of :func:`neighbour_rows`, headed by the
    group and its requests."""
    return "\n\n".join(f"{g} (requests real / sim: {rn} / {sn}):\n\n{table(rows)}"
                        for g, (rn, sn, rows) in groups.items())


def neighbour_json(groups: Mapping[str, tuple[int, int, Sequence[Row]]]
                   ) -> dict[str, dict[str, Any]]:
    """The groups of :func:`neighbour_rows` as JSON-ready dicts."""
    return {g: {"real_n": rn, "sim_n": sn, "segments": as_json(rows)}
            for g, (rn, sn, rows) in groups.items()}


def table(rows: Sequence[Row]) -> str:
    """Markdown: segment, real median / p90, sim median / p90, ratio median / p90."""
    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = ["| segment | real median / p90 (ms) | sim median / p90 (ms) | "
             "sim/real median / p90 |", "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.segment} | {row.real_median:.1f} / {row.real_p90:.1f} | "
                     f"{row.sim_median:.1f} / {row.sim_p90:.1f} | "
                     f"{ratio(row.ratio_median)} / {ratio(row.ratio_p90)} |")
    return "\n".join(lines)


def as_json(rows: Sequence[Row]) -> dict[str, dict[str, float | int | None]]:
    return {row.segment: {k: v for k, v in asdict(row).items() if k != "segment"}
            for row in rows}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pushkv.fit.segments", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--real", nargs="+", required=True, metavar="DIR",
                   help="the real run's timeline directories, the router's or client's first")
    p.add_argument("--sim", nargs="+", required=True, metavar="DIR",
                   help="the simulated run's timeline directory")
    p.add_argument("--window", nargs=2, type=float, metavar=("T0", "T1"),
                   help="only real requests whose legs left between T0 and T1")
    p.add_argument("--alone", action="store_true",
                   help="only the requests that ran alone, on both sides (low load)")
    p.add_argument("--by-overlap", action="store_true",
                   help="'legs out -> first token' by how many requests each overlapped")
    p.add_argument("--by-place", action="store_true",
                   help="'legs out -> first token' by each request's place in the run "
                        "(1st, 2nd, 3rd on)")
    p.add_argument("--by-neighbour", action="store_true",
                   help="the segments per kind of neighbour each request met: alone, "
                        "one decoding, one before its first token, one that came "
                        "later, or more")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = p.parse_args(argv)
    window = (args.window[0], args.window[1]) if args.window else None
    real, sim = load(args.real, window), load(args.sim)
    if args.alone:
        real, sim = alone(real), alone(sim)
    for side, reqs in (("--real", real), ("--sim", sim)):
        if not reqs:
            p.error(f"{side}: no timeline marks found")
    if args.by_overlap:
        orows = overlap_rows(by_overlap(real), by_overlap(sim))
        print(json.dumps(overlap_json(orows)) if args.json
              else overlap_table(orows, cap=2))
        return 0
    if args.by_place:
        prows = overlap_rows(by_place(real), by_place(sim))
        print(json.dumps(overlap_json(prows)) if args.json
              else overlap_table(prows, cap=3, heading="place"))
        return 0
    if args.by_neighbour:
        groups = neighbour_rows(real, sim)
        print(json.dumps(neighbour_json(groups)) if args.json else neighbour_text(groups))
        return 0
    rows = compare(real, sim)
    print(json.dumps(as_json(rows)) if args.json else table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
