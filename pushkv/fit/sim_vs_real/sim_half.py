"""The simulated half of a sim-vs-real run, and its comparison with the real half.

:func:`sim_half` is everything ``benchmarks/bench_sim_vs_real.py --sim-only`` does
once a run's real half is on disk (``OUT/real``, :mod:`.runs`): it simulates every
point of it at its send times, several ways (:func:`~.simulate.run_sim`), each into
``OUT/sim-<way>``, and compares each with the real half (:mod:`.report`,
:mod:`.tables`):

* ``own_cores`` (``OUT/sim-own-cores``): the profile as measured, a core per engine;
* ``probe`` (``OUT/sim``): on the cores the core probe met during each point
  (``cpu_share``, ``wake_s``, ``cpu_speed``);
* ``gauge`` (``OUT/sim-gauge``), the headline where the run has gauges: each point
  with the profile its gauges measured (:func:`~.keys.gauge_keys`), on the machine's
  shared cores; again with one part changed at a time beside it
  (``OUT/sim-gauge-<part>``: ``speed``, ``no-wake``, ``unshrunk``, ``wall-steps``);
* ``server_steps`` (``OUT/sim-server-steps``), a diagnosis: the engines' steps as
  the real servers' metrics gave them.

It prints the tables as it goes (``say``, a line at a time) and returns the summary
the command line writes to ``OUT/summary.json``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..cpu_profile import MeasurementError
from .keys import gauge_keys, gauge_speed, noise_table, real_keys, without_wake
from .report import BAND, compare, figures, in_band, precision
from .runs import API_LOOPS, PINNED_ENGINES, SHARES, real_points
from .simulate import run_sim
from .tables import lone_gap, neighbour_tables, overlap_tables, place_tables, segment_tables


def _say(line: str) -> None:
    print(line, flush=True)


@dataclass
class SimHalf:
    """What :func:`sim_half` found: the summary (the headline way's ratios, the other
    ways', the precision, the segments ...), the headline ``way`` (``gauge``, else
    ``probe``, else ``own_cores``), the keys ``--real-keys`` took from the real half's
    marks (None without), and where the headline way's results are."""

    summary: dict[str, Any]
    way: str
    keys: dict[str, dict[str, float]] | None
    sim: Path


def sim_half(out: Path, profile: Path, *, seed: int = 0, arrivals: str = "vllm",
             frontend_cores: int | None = None, host_cores: int | None = None,
             use_real_keys: bool = False, cpu_share: bool = True,
             figures_dir: Path | None = None, failures: dict[str, str] | None = None,
             merge_tokens: int | None = None, api_loops: bool = API_LOOPS,
             pinned_engines: bool = PINNED_ENGINES,
             say: Callable[[str], None] = _say) -> SimHalf:
    """Simulate the points of ``out/real`` every way, compare, print (``say``); see the
    module. ``profile``: the profile every way starts from; ``seed``, ``arrivals``: the
    send times (``"vllm"``: the very ones ``vllm bench serve --seed seed+iteration``
    used); ``frontend_cores``, ``host_cores``: replace the profile's; ``use_real_keys``:
    take ``network.client_hop_s`` and ``prefill.return_s`` from the real half's marks
    (:func:`~.keys.real_keys`); ``cpu_share`` false: no ``probe`` way; ``figures_dir``:
    also draw the headline way's TTFT and TPOT against the real half there. What
    fails without stopping the rest (the real keys, the gauges' profile) is added to
    ``failures`` by name. ``merge_tokens``: every way's ``host.merge_tokens`` on the
    shared-CPU host (None: the profile's; see :func:`~.simulate.run_sim`);
    ``api_loops``: each API server a loop of its own where the run measured
    ``token_api_s`` (:func:`~.simulate.run_sim`)."""
    failures = {} if failures is None else failures
    real, sim = out / "real", out / "sim"
    points, output_len, num_prompts = real_points(real)
    shares = json.loads((real / SHARES).read_text()) if (real / SHARES).exists() else {}
    knobs: dict[str, Any] = {"arrivals": arrivals, "frontend_cores": frontend_cores,
                             "host_cores": host_cores, "keys": None,
                             "merge_tokens": merge_tokens, "api_loops": api_loops,
                             "pinned_engines": pinned_engines}
    if use_real_keys:
        try:
            knobs["keys"] = real_keys(real, shares, profile)
        except MeasurementError as exc:  # the profile's own keys stand in
            failures["real_keys"] = str(exc)
            say(f"measuring the real half's keys failed ({exc}); simulating with "
                f"{profile}'s")
    if knobs["keys"]:
        say("keys from the real half's marks: " + ", ".join(
            f"{t}.{k} {v * 1e3:.3f} ms" for t, kv in knobs["keys"].items()
            for k, v in kv.items()))
    own = out / "sim-own-cores"  # the mechanism off
    timelines = out / "sim-timeline"
    run_sim(profile, own, points, output_len, num_prompts, seed=seed, **knobs,
            timelines=timelines / "own-cores")
    own_table, own_summary = compare(real, own)
    say("\nSimulated with a core per engine (cpu_share 1):\n")
    say(own_table)
    segs: dict[str, Any] = {}
    text, segs["own_cores"] = segment_tables(real, timelines / "own-cores", shares)
    if text:
        say("\nSegment by segment, a core per engine (real / simulated, ms):\n")
        say(text)
    if cpu_share and shares:
        run_sim(profile, sim, points, output_len, num_prompts, seed=seed, **knobs,
                shares=shares, timelines=timelines / "probe")
        table, summary = compare(real, sim)
        say("\nSimulated on the cores the probe met (cpu_share, wake_s):\n")
        say(table)
        text, segs["probe"] = segment_tables(real, timelines / "probe", shares)
        if text:
            say("\nSegment by segment, on the cores the probe met (real / simulated, "
                "ms):\n")
            say(text)
    else:
        sim = own
        summary = dict(own_summary)
    keys = ("ttft_ratio_min", "ttft_ratio_max", "tpot_ratio_min", "tpot_ratio_max")
    way = "probe" if cpu_share and shares else "own_cores"
    if any(v.get("gauges") for v in shares.values()):
        noise: dict[str, dict[str, dict[str, float]]] = {}
        try:
            per_point, run_keys = gauge_keys(real, shares, profile, output_len,
                                             noise_out=noise)
        except MeasurementError as exc:
            failures["gauge"] = str(exc)
            say(f"the gauges gave no profile ({exc})")
        else:
            say("\nthe run's keys from its pushkv gauges: " + ", ".join(
                f"{t}.{k} {v * 1e3:.3f} ms" for t, kv in run_keys.items() for k, v in
                kv.items() if t != "host") + f"; host_spread mean "
                f"{statistics.fmean(run_keys.get('host', {}).get('spread', [1])):.2f}"
                + (f"; wake_beside_s mean {statistics.fmean(beside) * 1e3:.2f} ms" if (
                    beside := run_keys.get("host", {}).get("wake_beside_s")) else ""))
            if noise:
                say("\nEach point's keys from its two gauges, shrunk toward the run's mean "
                    "by how far the gauges one at a time tell points apart (sd in ms; "
                    "kept: the share of a point's own deviation it keeps):\n")
                say(noise_table(noise))
            gauged = out / "sim-gauge"
            run_sim(profile, gauged, points, output_len, num_prompts, seed=seed,
                    arrivals=arrivals, frontend_cores=frontend_cores,
                    host_cores=host_cores, gauges=per_point, merge_tokens=merge_tokens,
                    api_loops=api_loops, pinned_engines=pinned_engines,
                    timelines=timelines / "gauge")
            gauge_table, gauge_summary = compare(real, gauged)
            say("\nSimulated with each point's profile from the gauges just before and "
                "after it (its own pair's lone requests at its lengths):\n")
            say(gauge_table)
            text, segs["gauge"] = segment_tables(real, timelines / "gauge", shares)
            if text:
                say("\nSegment by segment, the gauges' profiles (real / simulated, ms):\n")
                say(text)
            text, by_overlap = overlap_tables(real, timelines / "gauge", shares)
            if text:
                say("\n'legs out -> first token' by how many requests overlapped it, the "
                    "gauges' profiles (the points' requests pooled per mode and rate; "
                    "real: the router's first token, simulated: the client's):\n")
                say(text)
            text, by_place = place_tables(real, timelines / "gauge", shares)
            if text:
                say("\n'legs out -> first token' by each request's place in its point, "
                    "the gauges' profiles (pooled per mode and rate):\n")
                say(text)
            text, lone = lone_gap(real, shares)
            if text:
                say("\nLone requests of the gauges (what the keys hold) against those of "
                    "the points, and the probe's wake-ups in each:\n")
                say(text)
            text, by_neighbour = neighbour_tables(real, timelines / "gauge", shares)
            if text:
                say("\nSegment by segment, by what else each request met on its way to "
                    "its first token, the gauges' profiles (pooled per mode and rate):\n")
                say(text)

            def beside(name: str, title: str, **kw: Any) -> None:
                """The gauge way again with one part changed (``kw`` to :func:`~.simulate.run_sim`),
                into ``OUT/sim-gauge-<name>``, printed and kept as ``gauge_<name>``."""
                there = out / f"sim-gauge-{name}"
                kw.setdefault("gauges", per_point)
                run_sim(profile, there, points, output_len, num_prompts, seed=seed,
                        arrivals=arrivals, frontend_cores=frontend_cores,
                        host_cores=host_cores, merge_tokens=merge_tokens,
                        api_loops=api_loops, pinned_engines=pinned_engines, **kw)
                table, got = compare(real, there)
                say(f"\nThe same {title}:\n")
                say(table)
                gauge_summary[f"gauge_{name.replace('-', '_')}"] = {
                    k: got[k] for k in keys} | {"in_band": in_band(got)}

            if any(gauge_speed(v) for v in shares.values()):
                beside("speed", "with each side's cores as fast against the gauges' as the "
                       "probe on them saw (cpu_speed: the point's rate of fixed work over its "
                       "gauges')", shares=shares, speeds=True)
            if run_keys.get("host", {}).get("wake_beside_s"):  # the mechanism's part
                beside("no-wake", "without a woken frontend's wait beside another request "
                       "(host.wake_beside_s off)", gauges=without_wake(per_point))
            if noise:  # the estimator's part: each point's own gauges' keys as measured
                raw, _ = gauge_keys(real, shares, profile, output_len, shrink=False)
                beside("unshrunk", "with each point's keys as its own two gauges measured "
                       "them (not shrunk)", gauges=raw)
            # the steps' part: the gauged steps as the model's, the work beside them twice
            beside("wall-steps", "with each point's steps as its gauges timed them (lone "
                   "wall times, to which the shared cores add the request's own work again)",
                   wall_steps=True)
            summary[way] = {k: summary[k] for k in keys}  # kept beside the headline
            summary = gauge_summary | {way: summary[way]}
            summary["gauge_keys"] = {"run": run_keys, "points": per_point, "noise": noise}
            summary["by_overlap"] = by_overlap
            summary["by_place"] = by_place
            summary["by_neighbour"] = by_neighbour
            summary["lone_gap"] = lone
            sim, way = gauged, "gauge"
    if shares and any("engine" in v for v in shares.values()):
        steps = out / "sim-server-steps"
        run_sim(profile, steps, points, output_len, num_prompts, seed=seed, **knobs,
                shares=shares, server_steps=True)
        steps_table, steps_summary = compare(real, steps)
        say("\nDiagnosis: the same, engine steps as the real P/D servers' metrics gave "
            "them (not a prediction of the steps):\n")
        say(steps_table)
        summary["server_steps"] = {k: steps_summary[k] for k in keys}
    text, summary["precision"] = precision(real, sim)
    say(f"\nHow far this run can tell, the {way} way: each point's iterations' sim/real "
        f"ratios, their mean and its 95% interval; in / out: the whole interval in / "
        f"outside {BAND[0]}-{BAND[1]} (out: a miss the iterations agree on), unsure: "
        f"it straddles a side:\n")
    say(text)
    v = summary["precision"]["verdicts"]
    say(f"\nverdicts: {v['in']} in, {v['out']} out, {v['unsure']} unsure; a 95% interval "
        f"as narrow as the band needs up to {summary['precision']['iterations_needed_max']} "
        f"iterations a point at this run's spread")
    say("")
    summary["own_cores"] = {k: own_summary[k] for k in keys}
    summary["segments"] = segs
    if figures_dir:
        for path in figures(real, sim, figures_dir, way):
            say(f"wrote {path}")
    return SimHalf(summary, way, knobs["keys"], sim)
