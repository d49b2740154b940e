"""A point's profile keys from the real half: from its gauges, or from its own marks.

*Gauges* are lone requests through a point's own router just before and after it;
:func:`gauge_keys` gives each point the profile they measure
(:func:`pushkv.fit.measure_connector.gauge_keys` of their lone requests), over the
run's keys from all its push gauges, each key shrunk toward its group's mean by how
far the run's gauges one at a time tell points apart (:func:`gauge_noise`,
:func:`noise_table`), with the run's ``host.wake_beside_s`` from the core probe's
wake-ups against the points' timelines (:func:`wake_beside_of`). :func:`real_keys`
takes ``network.client_hop_s`` and ``prefill.return_s`` from the points' own marks
instead (``--real-keys``). :func:`gauge_rate` and :func:`gauge_speed`: the rate a
gauge runs at, and how fast a point's cores ran against its gauges' (or, with
:func:`speed_over`, against any probe rate its keys were measured at).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...sim.host import SHARED_CPU
from ...sim.profile import load_profile, profile_from_dict
from .. import segments
from ..cpu_profile import MeasurementError
from ..measure_connector import (
    KeyNoise,
    client_first,
    client_hop,
    host_spread,
    key_noise,
    pull_keys,
    shrink_keys,
    wake_beside,
)
from ..measure_connector import gauge_keys as keys_of
from .runs import MODES, NAME, WAKES

#: at how many quantiles ``host.wake_beside_s`` is taken (:func:`wake_beside_of`)
WAKE_QUANTILES = 100
#: the frontend keys ``cores_busy`` measures for the host, not for an engine's side
TOKEN_KEYS = ("token_work_s", "token_item_s", "token_api_s", "token_api_item_s")


def gauge_rate(args: argparse.Namespace, qps: float) -> float:
    """The rate of a point's gauges: ``--gauge-qps`` where given, else the point's own
    (``qps``). On this VM a lone request costs more the lower the rate of the stream it
    is in -- not its own idle gap, the rate over seconds (vLLM pull's at 64 tokens in,
    one at a time: 52.0 ms mean TTFT at 5 requests a second, 57.7 at 2, and a 2-QPS
    point's lone ones 59.7, on the development machine) -- so a gauge spaces its
    requests as its point does, to measure what the point's lone requests pay."""
    return float(args.gauge_qps) if args.gauge_qps else float(qps)


def gauges_speed(got: dict[str, Any]) -> dict[str, float]:
    """Each side's probe rate over a point's gauges (the mean of theirs,
    :meth:`pushkv.fit.cores.CoreProbe.speed`): the speed of the cores its gauged keys
    were measured at. Empty where it has no gauge, or one without a speed (runs before
    the gauges were probed)."""
    gauges = got.get("gauges") or []
    out = {}
    for side in ("prefill", "decode"):
        ref = [g.get("speed", {}).get(side, 0.0) for g in gauges]
        if ref and all(r > 0 for r in ref):
            out[side] = statistics.fmean(ref)
    return out if len(out) == 2 else {}


def speed_over(got: dict[str, Any], ref: dict[str, float]) -> dict[str, float]:
    """How fast each side's core ran during a point (``got``: its record in
    ``cpu_probe.json``) against ``ref`` (per side, the probe rate its keys were measured
    at) -- the profile's ``cpu_speed`` for the point simulated with those keys. Empty
    where the point or ``ref`` lacks a side."""
    point = got.get("speed") or {}
    out = {side: point[side] / ref[side] for side in ("prefill", "decode")
           if point.get(side, 0.0) > 0 and ref.get(side, 0.0) > 0}
    return out if len(out) == 2 else {}


def gauge_speed(got: dict[str, Any]) -> dict[str, float]:
    """How fast each side's core ran during a point against during its gauges: the
    probe's rate over the point, over the mean of the gauges' (:func:`speed_over`
    :func:`gauges_speed`) -- the profile's ``cpu_speed`` for a point simulated with its
    gauges' profile. Empty where the point or a gauge has no speed."""
    return speed_over(got, gauges_speed(got))


def real_keys(real: Path, shares: dict[str, dict[str, Any]], profile_path: Path
              ) -> dict[str, dict[str, float]]:
    """The keys the real half's own marks measure (requests that ran alone, each point's
    figures scaled by the share of a core its probe met): ``network.client_hop_s`` from
    every point (the client's latencies against the router's marks,
    :func:`pushkv.fit.measure_connector.client_hop`) and ``prefill.return_s`` from the
    pull points (:func:`pushkv.fit.measure_connector.pull_keys`, against the profile's
    hops and ``decode.ingest_s``). A key whose marks the run lacks is left out."""

    points, pull, pull_shares = [], {}, []
    for fname, got in sorted(shares.items()):
        m, window = NAME.match(fname), got.get("window")
        if m is None or m["mode"] not in MODES or not window or not (real / fname).exists():
            continue
        name, deployment = MODES[m["mode"]]
        share = (got["prefill"]["cpu_share"] + got["decode"]["cpu_share"]) / 2
        router = segments.load([real / "timeline" / name], (window[0], window[1]))
        latencies = json.loads((real / fname).read_text()).get("latencies") or []
        if router and latencies:
            points.append((router, latencies, share))
        if m["mode"] == "pull":
            both = segments.load([real / "timeline" / name, real / "timeline" / deployment],
                                 (window[0], window[1]))
            pull |= segments.alone(both)
            pull_shares.append(share)
    out: dict[str, dict[str, float]] = {}
    if points:
        out["network"] = {"client_hop_s": client_hop(points)}
    if pull:
        out |= pull_keys(pull, load_profile(profile_path),
                         share=statistics.mean(pull_shares))
    return out


def gauge_keys(real: Path, shares: dict[str, dict[str, Any]], profile_path: Path,
               output_len: int, *, quantiles: int = 100,
               noise_out: dict[str, dict[str, dict[str, float]]] | None = None,
               shrink: bool = True
               ) -> tuple[dict[str, dict[str, dict[str, float]]], dict[str, dict[str, Any]]]:
    """Each point's profile from the gauges around it, and the run's.

    The run's (the second value): the pushkv gauges of the whole run pooled, per input
    length (:func:`pushkv.fit.measure_connector.gauge_keys`, mode push), each key the
    mean over the lengths -- what a pull pair's timeline does not show (the push-only
    keys, ``decode.ingest_s``) -- and ``host.spread`` at up to ``quantiles``
    quantiles of their lone requests (:func:`~pushkv.fit.measure_connector.host_spread`);
    then the pull gauges' ``prefill.return_s`` likewise, which no push mark shows.
    A point's (the first, by result file name): the lone requests of its two gauges,
    its own pair's, just before and after it, at its lengths -- the step overheads and
    the keys its mode's timeline shows, against the profile with the run's keys, and
    ``network.client_hop_s`` and ``network.client_first_s`` from the gauges' own client
    results (:func:`~pushkv.fit.measure_connector.client_hop`,
    :func:`~pushkv.fit.measure_connector.client_first`), and each engine's
    ``cores_busy`` and decode's ``token_work_s`` as ``bench_sim_vs_real.cores_busy`` measured its
    deployment, the mean over the run's starts of it. Nothing comes from the
    points themselves.

    A point's keys from its gauges are a median or two of a handful of lone requests
    each, and most of what they differ by from point to point is that sampling noise
    (a pull's ``prefill.return_s`` 0-31 ms over one run's points, its gauges one after
    another differing as much as any two); so each is shrunk toward the run's mean of
    its gauges' group (mode, length and, where recorded, rate: :func:`gauge_group`) by
    how far the group's gauges, taken one at a time, tell points apart
    (:func:`gauge_noise`, :func:`pushkv.fit.measure_connector.shrink_keys`), what
    ``noise_out`` receives per group (:func:`noise_label`; ``shrink`` false: each
    point's own gauges' keys as measured). MeasurementError when a gauge lacks a segment."""

    base = load_profile(profile_path)
    gauged = {f: g for f, g in sorted(shares.items())
              if (m := NAME.match(f)) and m["mode"] in MODES and g.get("gauges")
              and (real / f).exists()}
    if not gauged:
        raise MeasurementError(f"no point of {real} has gauges (run with --gauge N)")

    loaded: dict[tuple[Path, ...], dict[str, dict[str, float]]] = {}

    def marks(fname: str, router_only: bool, window: list[float]
              ) -> dict[str, dict[str, float]]:
        """The requests of ``fname``'s router (and pair) in ``window``; each timeline
        read once."""
        name, deployment = MODES[NAME.match(fname)["mode"]]  # type: ignore[index]
        dirs = (real / "timeline" / name,) + (() if router_only else
                                               (real / "timeline" / deployment,))
        if dirs not in loaded:
            loaded[dirs] = segments.load(dirs)
        return segments.within(loaded[dirs], (window[0], window[1]))

    def requests(fname: str) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for g in gauged[fname]["gauges"]:
            out |= marks(fname, False, g["window"])
        return out

    by_mode: dict[str, dict[int, dict[str, dict[str, float]]]] = {"push": {}, "pull": {}}
    for fname in gauged:
        m = NAME.match(fname)
        assert m is not None
        by_mode[m["mode"]].setdefault(int(m["input"]), {}).update(requests(fname))
    push = by_mode["push"]
    run: dict[str, dict[str, Any]] = {}
    if push:
        per_len = [keys_of(r, base, mode="push", input_len=i, output_len=output_len)
                   for i, r in sorted(push.items())]
        run = {side: {k: statistics.fmean(p[side][k] for p in per_len) for k in t}
               for side, t in per_len[0].items()}
        pooled = {k: r for reqs in push.values() for k, r in reqs.items()}
        lone = segments.alone(pooled)
        with_run = profile_from_dict(run, base=base)  # type: ignore[arg-type]
        run["host"] = {"model": SHARED_CPU, "spread": list(host_spread(
            lone, with_run, quantiles=max(1, min(quantiles, len(lone)))))}
    beside = wake_beside_of(real, gauged, marks)
    if beside:  # the machine's, the same for every point
        run.setdefault("host", {"model": SHARED_CPU})["wake_beside_s"] = list(beside)
    profile = profile_from_dict(run, base=base) if run else base  # type: ignore[arg-type]
    if by_mode["pull"]:  # the prefill answer's way out, which no push mark shows
        run.setdefault("prefill", {})["return_s"] = statistics.fmean(
            keys_of(r, profile, mode="pull", input_len=i, output_len=output_len)
            ["prefill"]["return_s"] for i, r in sorted(by_mode["pull"].items()))
        profile = profile_from_dict(run, base=base)  # type: ignore[arg-type]
    # cores_busy and token_work_s: measured at each start of a deployment over 24 lone
    # requests, and noisy (vLLM pull's prefill 3.6-6.7 over one run's four starts); what
    # the deployment's processes burn while an engine steps is its software's, not the
    # minute's, so each point gets the mean over the run's starts of its deployment
    starts: dict[str, dict[str, dict[str, float]]] = {}
    for fname, got in gauged.items():
        m = NAME.match(fname)
        assert m is not None
        if got.get("cores_busy"):
            starts.setdefault(m["mode"], {})[m["iter"]] = got["cores_busy"]
    busy_of = {mode: {k: statistics.fmean(float(b[k]) for b in per.values() if k in b)
                      for k in sorted({k for b in per.values() for k in b})}
               for mode, per in starts.items()}
    noise = gauge_noise(gauged, marks, profile, output_len) if shrink else {}
    if noise_out is not None:
        noise_out.update({noise_label(group): {f"{t}.{k}": n.as_dict() for (t, k), n
                                               in sorted(by_key.items())}
                          for group, by_key in sorted(noise.items(), key=noise_order)})
    points: dict[str, dict[str, dict[str, float]]] = {}
    for fname, got in gauged.items():
        m = NAME.match(fname)
        assert m is not None
        keys = shrink_keys(keys_of(requests(fname), profile, mode=m["mode"],
                                   input_len=int(m["input"]), output_len=output_len),
                           noise.get(gauge_group(m, got["gauges"][0]), {}),
                           gauges=len(got["gauges"]))
        busy = dict(busy_of.get(m["mode"], {}))  # its deployment's, over the run's starts
        host: dict[str, Any] = {}
        for key in TOKEN_KEYS:  # the frontends', not a side's
            if key in busy:
                host[key] = float(busy.pop(key))
        holding = bool(busy.pop("holding", 0))  # measured over the active time
        for side, cores in busy.items():
            host[side] = {"cores_busy": max(1.0, float(cores)),
                          "steps_while_holding": holding}
        if got.get("host_cores"):  # the machine the point and its gauges ran on
            host["cores"] = int(got["host_cores"])
        if host:  # the shared CPU the point ran on
            keys["host"] = {"model": SHARED_CPU, **host}  # type: ignore[dict-item]
        hops, firsts = [], []
        for g in got["gauges"]:
            router = marks(fname, True, g["window"])
            result = json.loads((real / g["file"]).read_text())
            hops.append((router, result.get("latencies") or [], 1.0))
            firsts.append((router, result))
        keys["network"] = {"client_hop_s": client_hop(hops),
                           "client_first_s": client_first(firsts)}
        points[fname] = {side: {**run.get(side, {}), **keys.get(side, {})}
                         for side in {*run, *keys}}  # the point's over the run's
    return points, run


#: a gauge's group (:func:`gauge_group`): mode, input length, the gauge's rate (None in
#: runs whose gauges all ran at one rate and did not record it)
GaugeGroup = tuple[str, int, "float | None"]


def gauge_group(m: re.Match[str], g: dict[str, Any]) -> GaugeGroup:
    """The group of gauge ``g`` of the point ``m`` matched (:data:`~.runs.NAME`): gauges of one
    group measure the same keys, and differ only by drift and noise."""
    return m["mode"], int(m["input"]), g.get("qps")


def noise_label(group: GaugeGroup) -> str:
    """``<mode>_in<length>``, and ``_qps<rate>`` where the gauges recorded theirs."""
    mode, length, qps = group
    return f"{mode}_in{length}" + (f"_qps{qps:g}" if qps is not None else "")


def noise_order(item: tuple[GaugeGroup, Any]) -> tuple[str, int, float]:
    mode, length, qps = item[0]
    return mode, length, -1.0 if qps is None else qps


def gauge_noise(gauged: dict[str, dict[str, Any]],
                marks: Callable[[str, bool, list[float]], dict[str, dict[str, float]]],
                profile: Any, output_len: int) -> dict[GaugeGroup, dict[Any, Any]]:
    """Per group of gauges (:func:`gauge_group`: mode, input length, rate), each key's
    :class:`~pushkv.fit.measure_connector.KeyNoise` over the run's gauges of it one at a
    time, in the order they ran (a gauge two points share counted once):
    :func:`pushkv.fit.measure_connector.gauge_keys` of each gauge's lone requests
    (``marks(point, False, window)``) against ``profile``; a gauge too thin for a key on
    its own is left out of that group's noise."""

    windows: dict[GaugeGroup, dict[tuple[float, ...], str]] = {}
    for fname, got in sorted(gauged.items()):
        m = NAME.match(fname)
        assert m is not None
        for g in got["gauges"]:
            windows.setdefault(gauge_group(m, g), {}).setdefault(tuple(g["window"]), fname)
    out: dict[GaugeGroup, dict[Any, Any]] = {}
    for (mode, length, qps), by_window in sorted(windows.items(), key=noise_order):
        keys = []
        for window, fname in sorted(by_window.items()):
            try:
                keys.append(keys_of(marks(fname, False, list(window)), profile, mode=mode,
                                    input_len=length, output_len=output_len))
            except MeasurementError:
                continue
        out[(mode, length, qps)] = key_noise(keys)
    return out


def noise_table(noise: dict[str, dict[str, dict[str, float]]]) -> str:
    """:func:`gauge_noise`'s estimates as a table: per mode and length and key, the
    gauges' mean, their noise's and drift's standard deviations and the share a point
    of two gauges keeps of its own deviation."""

    rows = ["| mode, input | key | mean (ms) | noise sd (ms) | drift sd (ms) | kept |",
            "|---|---|---|---|---|---|"]
    for group, by_key in noise.items():
        for key, n in by_key.items():
            if key.endswith(".step_python_s"):  # the step overhead's twin
                continue
            est = KeyNoise.of(n)
            rows.append(f"| {group} | {key} | {n['mean'] * 1e3:.2f} | "
                        f"{math.sqrt(n['noise_var']) * 1e3:.2f} | "
                        f"{math.sqrt(n['drift_var']) * 1e3:.2f} | {est.weight(2):.2f} |")
    return "\n".join(rows)


def wake_beside_of(real: Path, points: dict[str, dict[str, Any]],
                   marks: Callable[[str, bool, list[float]], dict[str, dict[str, float]]]
                   ) -> tuple[float, ...]:
    """``host.wake_beside_s`` of the run: every point's probe wake-ups
    (:func:`~.runs.write_wakes`; points without are skipped), both cores, by how many of the
    point's requests (``marks(point, False, window)``) were in flight when each was due
    (:func:`pushkv.fit.segments.wakes_by_flight`), pooled over the points, then
    :func:`pushkv.fit.measure_connector.wake_beside`. Empty without wake-ups."""

    pooled: dict[int, list[float]] = {}
    for fname, got in sorted(points.items()):
        path = real / WAKES / f"{Path(fname).stem}.json"
        if not path.exists() or not got.get("window"):
            continue
        wakes = [(t, w) for per_core in json.loads(path.read_text()).values()
                 for t, w in per_core]
        for n, delays in segments.wakes_by_flight(
                marks(fname, False, got["window"]), wakes).items():
            pooled.setdefault(n, []).extend(delays)
    return wake_beside(pooled, quantiles=WAKE_QUANTILES) if pooled else ()


def without_wake(points: dict[str, dict[str, dict[str, Any]]]
                 ) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`gauge_keys`' point profiles without ``host.wake_beside_s`` (a copy)."""
    return {f: {t: {k: v for k, v in kv.items() if (t, k) != ("host", "wake_beside_s")}
                for t, kv in pt.items()} for f, pt in points.items()}
