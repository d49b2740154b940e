"""The simulator against real vLLM CPU engines on this machine, point by point.

**Real half**: pushkv push (``PushKVConnector`` behind ``pushkv proxy``, mode
``push``) and vLLM pull (vLLM's ``NixlConnector`` behind the pull relay of
``benchmarks/e2e/vllm_proxy.py``, mode ``pull``), each a prefill server on core 0
and a decode server on core 1 (the deployments of ``benchmarks/e2e/run.py``:
tiny model, prefix caching off, every NIXL progress thread sleeping
``--delay-us`` between polls, every transport thread on its server's core).
``vllm bench serve`` (random dataset, ``--ignore-eos``) runs every (input
length, rate) point against each router; the deployments alternate each
iteration (push, pull, push, ...), so slow drift of the shared machine's load
reaches both modes. During each point a probe process on each core
(:class:`pushkv.fit.cores.CoreProbe`) records its wake-up delay and share (each
wake-up, with when it was due, in ``OUT/real/wakes/<point>.json``), and the
two servers' vLLM metrics are read before and after (``OUT/real/cpu_probe.json``).
Around each point, *gauges* (``--gauge N``): N lone requests through the same router
at the point's lengths and rate just before and just after it (:func:`gauge`,
:func:`gauge_rate`), the core probe's wake-ups during each kept too; and once per
deployment, where a lone request's CPU goes (:func:`cores_busy`, from ``/proc``).
For the point and for its gauge just after it, how long each part of the deployment
waited on a run queue, a request (:func:`runq_waits`, ``runq_wait_ms`` and
``gauge_runq_wait_ms`` in ``cpu_probe.json``): where the cores were short. And
while the point loaded the deployment (:func:`load_span`: its requests' first mark to
their last), each part's threads pinned to one core and floating apart: the cores
they kept busy, how many waited on a run queue, and how long a wake-up waited
(:class:`SchedSamples`, every 0.25 s; ``threads`` in ``cpu_probe.json``). Over each
point and each gauge, the share of each core its host took (a VM's steal time,
:func:`pushkv.hostprobe.steal`; ``steal`` in ``cpu_probe.json`` and in each gauge's record).
While the point loaded the deployment, each part's garbage-collector pauses and the
client's (:func:`gc_pauses`; ``gc`` in ``cpu_probe.json``): every process that records
a timeline writes them down (:func:`pushkv.timeline.record_gc`).
Result files: ``OUT/real/{mode}_qps{q}_in{i}_out{o}_iter{n}.json``. Points already
in ``OUT/real`` are not run again (an interrupted run resumes; so does one whose
deployment failed to start, run again with the same ``--out`` and ``--profile``).
Eight iterations by default: on this machine a few requests of a point stall for
tens to hundreds of milliseconds, so one iteration's real mean TTFT can be several
times the next one's at the same point. One ``vllm bench serve`` process
(:class:`run.BenchClient`) runs every point and gauge, so a point's window is its
load, not the client's import (10-12 s each, which took most of the real half's time
before), and eight iterations take about as long as four did.

**Simulated half**: ``pushkv.sim`` with the measured profile
(``pushkv/sim/profiles/cpu-tiny.toml``) at the same points -- same modes, number
of prompts, rates, lengths, output length and iterations, and the very send times
``vllm bench serve`` used (``--arrivals vllm``, the default: its seed, its
generator) -- four ways: a core per
engine (``OUT/sim-own-cores``), on the cores the probe met (``cpu_share``,
``wake_s``; ``OUT/sim``), each point with the profile its gauges measured, on the
machine's shared cores (``OUT/sim-gauge``, the headline when the run has gauges:
:func:`gauge_keys`), and, as a diagnosis, with the engines' steps as the real
servers' metrics gave them (``OUT/sim-server-steps``). ``--frontend-cores N``
replaces the profile's ``control.frontend_cores`` (the API servers', router's and
client's times as one queue, :mod:`pushkv.sim.frontend`; a profile ``--measure``
writes has it from the machine's cores).

**Segment by segment**: the real half's router, client and servers record
:mod:`pushkv.timeline` marks (``OUT/real/timeline/<mode>/``, ``<deployment>/``;
each point's interval in ``time.monotonic()`` is kept in ``cpu_probe.json``), the
simulated half records the same marks per point (``OUT/sim-timeline/<way>/<point>/``,
:mod:`pushkv.sim.marks`); for every point both recorded, a table of each segment's
real and simulated median / p90 (:mod:`pushkv.fit.segments`). Then, per mode and
rate, the points' requests grouped by how many others overlapped them on the way to
their first token, real against the gauge way (:func:`overlap_tables`): where
the two agree on requests served alone, a gap that grows with the overlap is the
load's cost the model leaves out; and by each request's place in its point
(:func:`place_tables`): a gap at the first places alone is something at the points'
start, not the load; and by what else a request met on its way to its first token
(:func:`neighbour_tables`: alone, one other decoding, one before its first token, one
that came later, more), each group's segments: which hand-off a neighbour lengthens.
And the lone requests of the gauges against those of the points, with the probe's
wake-ups in each (:func:`lone_gap`): what a point's lone requests pay that the keys,
measured on the gauges', do not hold.

The gauges run with the core probe too, so a second gauge way (``OUT/sim-gauge-speed``)
can simulate each point with its cores as fast against its gauges' as the probe saw
(each side's ``cpu_speed``, :func:`gauge_speed`), printed beside the headline.
The gauge way's ``control.wake_beside_s`` is the run's: the probe's wake-ups against
the points' timelines (:func:`wake_beside_of`); the gauge way is simulated again
without it (``OUT/sim-gauge-no-wake``, ``gauge_no_wake`` in the summary) and printed
beside the headline, so every run shows the mechanism's part. A point's keys from its
two gauges are mostly sampling noise (a median of some 20 lone requests of a broad
segment), so each is shrunk toward the mean over the run of its gauges' group (mode,
length, rate) by how far the group's gauges one at a time tell points apart (:func:`gauge_noise`,
:func:`pushkv.fit.measure_connector.shrink_keys`; the table is printed, ``noise`` in
the summary's ``gauge_keys``); the gauge way is simulated again with the keys as
measured (``OUT/sim-gauge-unshrunk``, ``gauge_unshrunk`` in the summary). A gauge's
step times are lone requests' wall times, which hold the work each request brought
beside its steps (the loop holding it, its tokens' way out); on the shared cores the
model adds that work again, so each point's steps are first made to give those wall
times to a lone request simulated there
(:func:`pushkv.fit.measure_connector.lone_steps`); the gauge way is simulated again
with the steps as timed (``OUT/sim-gauge-wall-steps``, ``gauge_wall_steps``).

**How far one run can tell** (:func:`precision`): per point and statistic, the
iterations' sim/real ratios, their mean and its 95% interval (Student's t), with a
verdict: ``in`` or ``out`` when the whole interval lies in or outside 0.75-1.33
(:data:`BAND`; out: a miss the iterations agree on, the model's), ``unsure`` when it
straddles a side (the iterations disagree more than the band is wide), and how many
iterations an interval as narrow as the band would need at the run's spread.

Prints a table of sim/real ratios per way (mean and median TTFT and TPOT, per
point and mode, iterations averaged), the segment tables, the precision table, and,
last, one JSON object for the headline way (``"way"``: gauge, else probe):
``ttft_ratio_min``, ``ttft_ratio_max``, ``tpot_ratio_min``, ``tpot_ratio_max``,
``points`` (the per-point ratios, and the other ways' ranges under ``own_cores``,
``server_steps`` and ``gauge_speed``), ``precision`` (the intervals, the verdicts
counted, ``iterations_needed_max``), ``segments``
(per way and point, each segment's real and simulated median in ms), ``by_overlap``
``by_place`` and ``by_neighbour`` (the groups' rows), ``lone_gap``. Figures (``--figures DIR``, or
``pushkv plot --results-dir OUT/real --overlay OUT/sim --labels real sim --metric ttft``).

    PYTHONPATH=. python benchmarks/bench_sim_vs_real.py --out /tmp/simreal
    PYTHONPATH=. python benchmarks/bench_sim_vs_real.py --sim-only --out /tmp/simreal
    # longer: --rates 1,2,4,8 --inputs 32,64,128,256 --num-prompts 64 --iterations 5
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))

PROFILE = ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"
#: sim mode -> (real mode of benchmarks/e2e/modes.py, its deployment)
MODES = {"push": ("push", "pushkv"), "pull": ("pull", "nixl-pull")}
NAME = re.compile(r"^(?P<mode>[a-z-]+)_qps(?P<qps>[\d.]+)_in(?P<input>\d+)_out(?P<output>\d+)"
                  r"_iter(?P<iter>\d+)\.json$")
#: per result file: what a probe on each core met meanwhile (core 0: prefill, 1: decode)
SHARES = "cpu_probe.json"
STATS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
#: the band every sim/real ratio is to fall in
BAND = (0.75, 1.33)
#: at how many quantiles ``control.wake_beside_s`` is taken (:func:`wake_beside_of`)
WAKE_QUANTILES = 100
#: Student's t, its 0.975 quantile, by degrees of freedom 1-30 (above 30: 30's, a
#: little wide)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
        2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
        2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def rate_name(q: float) -> str:
    return str(int(q)) if q == int(q) else str(q)


def file_name(mode: str, rate: float, input_len: int, output_len: int, it: int) -> str:
    return f"{mode}_qps{rate_name(rate)}_in{input_len}_out{output_len}_iter{it}.json"


# ------------------------------------------------------------------- real


def run_real(args: argparse.Namespace, real: Path) -> dict[str, str]:
    """``vllm bench serve`` at every point against both deployments; failures by name."""
    from run import BenchClient

    from pushkv.vllm.testing import write_tiny_llama, write_word_tokenizer

    (real / "logs").mkdir(parents=True, exist_ok=True)
    model = real / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    max_len = -(-(max(args.inputs) + args.output_len + 64) // 256) * 256
    failures: dict[str, str] = {}
    seeds = itertools.count(args.seed + 1000)  # every gauge its own prompts
    # vLLM's client, imported once for every run
    with BenchClient(timeline_dir=real / "timeline" / CLIENT) as client:
        for it in range(args.iterations):
            real_iteration(args, real, model, max_len, it, client, seeds, failures)
    return failures


def real_iteration(args: argparse.Namespace, real: Path, model: Path, max_len: int, it: int,
                   client: Any, seeds: Iterator[int], failures: dict[str, str]) -> None:
    """Iteration ``it`` of :func:`run_real`: each mode's deployment started, its points
    run with ``client`` (:class:`run.BenchClient`), stopped; failures added by name."""
    from modes import MODES as E2E_MODES  # benchmarks/e2e
    from run import Deployment, Endpoint, bench_serve

    from pushkv.fit.cores import CoreProbe
    from pushkv.hostprobe import cpu_times, steal

    for mode in args.modes:
        name, kind = MODES[mode]
        todo = [(i, q) for i in args.inputs for q in args.rates
                if not (real / file_name(mode, q, i, args.output_len, it)).exists()]
        if not todo:
            continue
        dep = Deployment(kind, str(model), real, max_model_len=max_len,
                         delay_us=args.delay_us, spin_s=args.spin_s)
        t0 = time.monotonic()
        ep = None
        try:
            dep.start()
            print(f"[{mode} iter {it}] {kind} up in {time.monotonic() - t0:.0f} s, "
                  f"load {os.getloadavg()[0]:.2f}", flush=True)
            ep = Endpoint(E2E_MODES[name], dep, real)
            warm_up(ep.target.url, str(model), args.warmup, max(args.inputs))
            busy = (cores_busy(dep, ep, real, str(model), args, max(args.inputs))
                    if args.gauge else None)
            if busy:
                print(f"[{mode} iter {it}] cores an active engine keeps busy: {busy}",
                      flush=True)
            last: dict[str, Any] | None = None  # the gauge just taken, and its length
            for input_len, q in todo:
                fname = file_name(mode, q, input_len, args.output_len, it)
                stem = Path(fname).stem
                rate = gauge_rate(args, q)
                if args.gauge:  # lone requests at the point's lengths, just before it
                    if last is None or (last["input_len"], last["qps"]) != (input_len, rate):
                        last = gauge(ep.target.url, str(model), real, f"{stem}_before",
                                     input_len, args, seed=next(seeds), client=client,
                                     qps=rate)
                    before_gauge = last
                before = server_metrics(dep)
                waited = runq_waits(dep, ep)
                t_start = time.monotonic()  # the point's interval, for its timeline
                ticks = cpu_times()
                with (CoreProbe() as probe,  # core 0: prefill, core 1: decode
                      SchedSamples(functools.partial(sched_parts, dep, ep)) as sched):
                    ok = bench_serve(ep.target.url, str(model), real, fname, qps=str(q),
                                     input_len=input_len, output_len=args.output_len,
                                     num_prompts=args.num_prompts, seed=args.seed + it,
                                     log=real / "logs" / f"{mode}-bench.log",
                                     client=client)
                got = {side: {"cpu_share": round(probe.share(core), 4),
                              "wake_s": round(probe.wake_s(core), 6)}
                       for side, core in (("prefill", 0), ("decode", 1))}
                got["runq_wait_ms"] = per_request(waited, runq_waits(dep, ep),
                                                  args.num_prompts)
                got["engine"] = engine_steps(before, server_metrics(dep))
                # the wake-ups' tail, kept for diagnosis (the simulation takes medians)
                got["wake_tail"] = {side: {k: round(v, 6) for k, v in
                                           probe.wake_tail(core).items()}
                                    for side, core in (("prefill", 0), ("decode", 1))}
                write_wakes(real, stem, probe)  # and each one, with when it was due
                got["window"] = [t_start, time.monotonic()]
                # the host's share of each core meanwhile (a VM's steal time)
                got["steal"] = steal_record(steal(ticks, cpu_times()))
                span = load_span(real, mode, got["window"])
                if span is not None:  # where the threads ran while the point loaded
                    got["load_span"] = list(span)
                    got["threads"] = sched.over(*span)
                got["speed"] = probe_speed(probe)
                # each part's garbage-collector pauses while the point loaded it
                got["gc"] = gc_pauses(timeline_dirs(real, mode),
                                      got.get("load_span") or got["window"],
                                      part_pids(dep, ep, client.pid))
                if args.gauge:  # and just after it (the next point's, if as long)
                    waited = runq_waits(dep, ep)
                    last = gauge(ep.target.url, str(model), real, f"{stem}_after",
                                 input_len, args, seed=next(seeds), client=client,
                                 qps=rate)
                    got["gauge_runq_wait_ms"] = per_request(
                        waited, runq_waits(dep, ep), args.gauge)
                    got["gauges"] = [before_gauge, last]
                    got["cores_busy"] = busy
                    got["host_cores"] = os.cpu_count() or 0  # what the gauges ran on
                record_shares(real, fname, got)
                print(f"[{mode} iter {it}] in {input_len} qps {rate_name(q)}: "
                      f"{'ok' if ok else 'FAILED'}; CPU share "
                      f"{ {k: got[k] for k in ('prefill', 'decode', 'engine', 'speed')} }, "
                      f"run-queue wait a request (ms) {got['runq_wait_ms']}, its lone "
                      f"gauge's {got.get('gauge_runq_wait_ms')}, steal (of the work) "
                      f"{ {c: v['of_work'] for c, v in got['steal'].items()} }, "
                      f"load {os.getloadavg()[0]:.2f}", flush=True)
                if got.get("threads"):
                    print(f"[{mode} iter {it}] in {input_len} qps {rate_name(q)} loaded, "
                          f"{threads_line(got['threads'])}", flush=True)
                print(f"[{mode} iter {it}] in {input_len} qps {rate_name(q)} "
                      f"{gc_line(got['gc'])}", flush=True)
                if not ok:
                    failures[fname] = "vllm bench serve failed"
                    (real / fname).unlink(missing_ok=True)
        except Exception as exc:  # reported; the other mode still runs
            failures[f"{mode} iter {it}"] = f"{exc!r:.300}"
            print(f"[{mode} iter {it}] FAILED: {exc!r:.300}", flush=True)
        finally:
            if ep is not None:
                ep.stop()
            dep.stop()


def parts(dep: Any, ep: Any, of_process: Callable[[int], Any],
          of_groups: Callable[[list[int]], Any]) -> dict[str, Any]:
    """A per-process measure of the deployment's parts (``of_process(pid)``, summed
    over process groups by ``of_groups(pgids)``; anything with ``-``: seconds, thread
    schedules, sets of pids): ``prefill``, its instance; ``decode``, decode's instance
    without its API server; ``decode_api``; and ``router``, where the mode has one."""
    api = dep.decode.proc.pid  # decode's API server: the group's leader
    out = {"prefill": of_groups([dep.prefill.proc.pid]),
           "decode": of_groups([api]) - of_process(api), "decode_api": of_process(api)}
    if ep.router is not None:
        out["router"] = of_process(ep.router.pid)
    return out


def part_pids(dep: Any, ep: Any, client_pid: int | None) -> dict[str, list[int]]:
    """The processes of each of the deployment's :func:`parts` now, and the client's."""
    from pushkv.hostprobe import group_pids

    out = {part: sorted(pids) for part, pids in parts(
        dep, ep, lambda pid: frozenset({pid}), lambda pgids: frozenset(group_pids(pgids))
    ).items()}
    if client_pid:
        out["client"] = [client_pid]
    return out


def timeline_dirs(real: Path, mode: str) -> list[Path]:
    """Where ``mode``'s router, servers and the client record (:mod:`pushkv.timeline`)."""
    name, deployment = MODES[mode]
    return [real / "timeline" / d for d in (name, deployment, CLIENT)]


def gc_pauses(dirs: Sequence[Path], span: Sequence[float],
              pids: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per part (``pids``: part -> its processes), the garbage-collector pauses its
    processes recorded under ``dirs`` (:func:`pushkv.timeline.read_pauses`) within
    ``span`` (``time.monotonic()``): their time (``ms``, clipped to the span), how many
    (``n``) and the longest (``max_ms``). A pause stops every thread of its process."""
    from pushkv import timeline

    part_of = {pid: part for part, ps in pids.items() for pid in ps}
    out = {part: {"ms": 0.0, "n": 0, "max_ms": 0.0} for part in pids}
    for d in dirs:
        if not d.is_dir():
            continue
        for p in timeline.read_pauses(d):
            part = part_of.get(p.pid)
            if part is None or p.t1 <= span[0] or p.t0 >= span[1]:
                continue
            ms = (min(p.t1, span[1]) - max(p.t0, span[0])) * 1e3
            got = out[part]
            got["ms"] = round(got["ms"] + ms, 3)
            got["n"] += 1
            got["max_ms"] = round(max(got["max_ms"], ms), 3)
    return out


def gc_line(gc: dict[str, dict[str, float]]) -> str:
    """:func:`gc_pauses` in one line."""
    return "garbage-collector pauses (ms / count / longest ms): " + ", ".join(
        f"{part} {x['ms']:.1f}/{x['n']}/{x['max_ms']:.1f}" for part, x in gc.items())


def runq_waits(dep: Any, ep: Any) -> dict[str, float]:
    """Seconds the deployment's :func:`parts` have waited on a run queue so far,
    runnable but not running (:func:`pushkv.hostprobe.runq_wait_s`)."""
    from pushkv.hostprobe import group_runq_wait_s, runq_wait_s

    return parts(dep, ep, runq_wait_s, group_runq_wait_s)


def sched_parts(dep: Any, ep: Any) -> dict[str, Any]:
    """How the threads of each of the deployment's :func:`parts` have been scheduled so
    far, pinned and floating apart (:class:`pushkv.hostprobe.ThreadSched`)."""
    from pushkv.hostprobe import ThreadSched, group_thread_sched, thread_sched

    return parts(dep, ep, lambda pid: thread_sched(pid) or ThreadSched(), group_thread_sched)


class SchedSamples:
    """While open, a background thread takes ``sample()`` (:func:`sched_parts`) every
    ``period_s``; :meth:`over` tells what the threads did between two instants. The
    first sample is taken on entering, before what it brackets starts, the last on
    closing."""

    def __init__(self, sample: Callable[[], dict[str, Any]], period_s: float = 0.25) -> None:
        self.sample, self.period_s = sample, period_s
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sched-samples", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.monotonic(), self.sample()))
        self.samples.append((time.monotonic(), self.sample()))

    def __enter__(self) -> SchedSamples:
        self.samples.append((time.monotonic(), self.sample()))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def over(self, t0: float, t1: float) -> dict[str, dict[str, dict[str, float]]]:
        """Each part's pinned and floating threads from the last sample at or before
        ``t0`` to the first at or after ``t1`` (the nearest ones where none is): the
        cores they kept busy (``cores``, CPU seconds a second), how many waited on a run
        queue (``waiting``, seconds a second) and each wake-up's wait
        (``wait_per_wakeup_ms``). Empty without two samples."""
        if len(self.samples) < 2:
            return {}
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t1] or self.samples[-1:]
        (a, first), (b, last) = before[-1], after[0]
        if b <= a:
            return {}
        out: dict[str, dict[str, dict[str, float]]] = {}
        for part, got in last.items():
            if part not in first:
                continue
            d = got - first[part]
            out[part] = {cls: {"cores": round(x.run_s / (b - a), 3),
                               "waiting": round(x.wait_s / (b - a), 3),
                               "wait_per_wakeup_ms": round(x.wait_s * 1e3 / x.slices, 3)
                               if x.slices > 0 else 0.0}
                         for cls, x in (("pinned", d.pinned), ("floating", d.floating))}
        return out


def threads_line(threads: dict[str, dict[str, dict[str, float]]]) -> str:
    """:meth:`SchedSamples.over` in one line: per part, pinned and floating threads'
    cores busy / threads waiting / wait a wake-up (ms)."""
    return "threads (cores busy / waiting / ms a wake-up): " + ", ".join(
        f"{part} " + " ".join(
            f"{cls} {x['cores']:.2f}/{x['waiting']:.2f}/{x['wait_per_wakeup_ms']:.2f}"
            for cls, x in by.items() if x["cores"] or x["waiting"])
        for part, by in threads.items())


def load_span(real: Path, mode: str, window: Sequence[float]) -> tuple[float, float] | None:
    """From the first to the last timeline mark of the requests of ``mode``'s point
    recorded within ``window`` (``time.monotonic()``): when the point loaded the
    deployment (its window also holds the client's start). None without marks."""
    from pushkv.fit import segments

    name, deployment = MODES[mode]
    dirs = [real / "timeline" / name, real / "timeline" / deployment]
    if not all(d.is_dir() for d in dirs):
        return None
    marks = [t for req in segments.load(dirs, (window[0], window[1])).values()
             for t in req.values()]
    return (min(marks), max(marks)) if marks else None


def per_request(before: dict[str, float], after: dict[str, float],
                requests: int) -> dict[str, float]:
    """Each part's wait between two :func:`runq_waits`, in ms a request."""
    return {k: round((after[k] - before[k]) * 1e3 / max(1, requests), 3)
            for k in before if k in after}


#: where the gauges' ``vllm bench serve`` result files go, under ``OUT/real``
GAUGES = "gauge"
#: where the client records its garbage-collector pauses, under ``OUT/real/timeline``
CLIENT = "client"


def gauge_rate(args: argparse.Namespace, qps: float) -> float:
    """The rate of a point's gauges: ``--gauge-qps`` where given, else the point's own
    (``qps``). On this VM a lone request costs more the lower the rate of the stream it
    is in -- not its own idle gap, the rate over seconds (vLLM pull's at 64 tokens in,
    one at a time: 52.0 ms mean TTFT at 5 requests a second, 57.7 at 2, and a 2-QPS
    point's lone ones 59.7, on the development machine) -- so a gauge spaces its
    requests as its point does, to measure what the point's lone requests pay."""
    return float(args.gauge_qps) if args.gauge_qps else float(qps)


def gauge(url: str, model: str, real: Path, tag: str, input_len: int,
          args: argparse.Namespace, *, seed: int, qps: float, client: Any = None
          ) -> dict[str, Any]:
    """``args.gauge`` lone requests of ``input_len`` tokens in, ``args.output_len`` out,
    through the router at ``url`` -- ``vllm bench serve``, the points' own client, one
    request at a time (``--max-concurrency 1``) at ``qps`` (:func:`gauge_rate`) --
    recorded like a point (the router's and servers' marks, a result file in
    ``OUT/real/gauge/``, the core probe's wake-ups in ``OUT/real/wakes/gauge/``). The
    simulator takes the point's profile from the gauges just before and after it
    (:func:`pushkv.fit.measure_connector.gauge_keys`): on this machine the engines'
    speed moves 2-3x between minutes, so a profile measured at another time cannot
    hold. Returns the gauge's record for ``cpu_probe.json``."""
    from run import bench_serve

    from pushkv.fit.cores import CoreProbe
    from pushkv.hostprobe import cpu_times, steal

    t0, ticks = time.monotonic(), cpu_times()
    name = f"{tag}.json"
    with CoreProbe() as probe:  # the cores' speed meanwhile, as during a point
        ok = bench_serve(url, model, real / GAUGES, name, qps=f"{qps:g}",
                         input_len=input_len, output_len=args.output_len,
                         num_prompts=args.gauge, seed=seed, log=real / "logs" / "gauge.log",
                         extra=("--max-concurrency", "1", "--ready-check-timeout-sec", "0"),
                         client=client)
    if not ok:
        raise RuntimeError(f"gauge {tag}: vllm bench serve failed (see logs/gauge.log)")
    write_wakes(real, f"{GAUGES}/{tag}", probe)  # what a lone request's cores met
    return {"window": [t0, time.monotonic()], "file": f"{GAUGES}/{name}",
            "input_len": input_len, "qps": qps, "steal": steal_record(steal(ticks, cpu_times())),
            "speed": probe_speed(probe)}


def probe_speed(probe: Any) -> dict[str, float]:
    """The probe's rate of fixed work per CPU second on each side's core (core 0:
    prefill, 1: decode), rounded: the cores' speed over a point or a gauge."""
    return {side: round(probe.speed(core), 1) for side, core in (("prefill", 0), ("decode", 1))}


def gauge_speed(got: dict[str, Any]) -> dict[str, float]:
    """How fast each side's core ran during a point against during its gauges: the
    probe's rate of fixed work per CPU second (:meth:`pushkv.fit.cores.CoreProbe.speed`)
    over the point, over the mean of the gauges' -- the profile's ``cpu_speed`` for a
    point simulated with its gauges' profile. Empty where the point or a gauge has no
    speed (runs before the gauges were probed)."""
    point, gauges = got.get("speed") or {}, got.get("gauges") or []
    out = {}
    for side in ("prefill", "decode"):
        ref = [g.get("speed", {}).get(side, 0.0) for g in gauges]
        if point.get(side, 0.0) > 0 and ref and all(r > 0 for r in ref):
            out[side] = point[side] / statistics.fmean(ref)
    return out if len(out) == 2 else {}


def steal_record(got: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """:func:`pushkv.hostprobe.steal` for ``cpu_probe.json``: per core (its number as a
    string), the host's share of the wall and of the work, rounded."""
    return {str(c): {k: round(v, 4) for k, v in share.items()} for c, share in got.items()}


def cores_busy(dep: Any, ep: Any, real: Path, model: str, args: argparse.Namespace,
               input_len: int, *, n: int = 24, idle_s: float = 3.0) -> dict[str, float]:
    """Where the CPU of a lone request goes, as the profile's keys: ``prefill`` and
    ``decode``, the cores each engine keeps busy while it is active (``cores_busy``,
    with ``steps_while_holding``: ``holding`` is true): the CPU time (/proc, all
    threads) of the instance's processes -- decode's without its API server -- over
    ``n`` lone requests through the router, less what the same processes use idle
    (measured over ``idle_s`` just before), over the time the engine's loop had the
    request in hand in the timeline (:data:`ACTIVE`: stepping it, or holding it for
    its transfer), at least 1; ``token_work_s``, the frontend work per output token:
    decode's API server, the router and this client (which pass every token on) the
    same way, per output token.

    Over the stepping time alone, vLLM pull's prefill measured 3.6-9.5 cores at ten
    starts on this machine, pushkv's 2.0-3.1: what its processes burn while it holds a
    prompt's KV until decode has read it (21-38 ms a request) was charged to its 7-9 ms
    of steps. Over the active time both are 1.0-1.6 (decode 1.0-1.4): a loop that has a
    request in hand keeps about one core busy, stepping or not."""
    import asyncio

    from client import Client

    from pushkv.fit import segments
    from pushkv.hostprobe import group_cpu_s, process_cpu_s

    def cpu() -> dict[str, float]:
        p = parts(dep, ep, process_cpu_s, group_cpu_s)
        return {"prefill": p["prefill"], "decode": p["decode"],
                "front": p["decode_api"] + p.get("router", 0.0) + time.process_time()}

    c0, t0 = cpu(), time.monotonic()
    time.sleep(idle_s)
    c1, t1 = cpu(), time.monotonic()

    async def lone() -> None:
        import random

        rng = random.Random(len(str(real)) + input_len)
        async with Client(model) as client:
            for _ in range(n):
                await client.request(ep.target, [rng.randrange(5, 995)
                                                 for _ in range(input_len)], args.output_len)
                await asyncio.sleep(0.05)  # so the next finds the engines idle

    c2, t2 = cpu(), time.monotonic()
    asyncio.run(lone())
    c3, t3 = cpu(), time.monotonic()
    reqs = segments.alone(segments.load([real / "timeline" / ep.mode.name,
                                         real / "timeline" / dep.kind], (t2, t3)))
    per = {side: active_s(reqs, side, ep.mode.name) for side in ("prefill", "decode")}
    per["front"] = n * args.output_len  # what each part's CPU is taken over
    used = {part: c3[part] - c2[part] - (c1[part] - c0[part]) / (t1 - t0) * (t3 - t2)
            for part in per}
    out: dict[str, Any] = {side: round(max(1.0, used[side] / per[side]), 3)
                           if per[side] > 0 else 1.0 for side in ("prefill", "decode")}
    out["token_work_s"] = round(max(0.0, used["front"] / per["front"]), 6)
    out["holding"] = True  # over the active time: the profile steps while holding
    return out


#: The span of a lone request an engine's loop has it in hand, by side and mode: from
#: the scheduler's first look at it until it stops stepping for it -- prefill when its
#: KV has left (push: the write completed; pull: decode's scheduler knows the read
#: done, when the producer's notification lands too), decode at its last token.
ACTIVE = {("prefill", "push"): ("prefill_seen", "write_completed"),
          ("prefill", "pull"): ("prefill_seen", "ready_scheduled"),
          ("decode", "push"): ("decode_seen", "last_token"),
          ("decode", "pull"): ("decode_seen", "last_token")}


def active_s(requests: dict[str, dict[str, float]], side: str, mode: str) -> float:
    """Seconds the ``side`` engine's loop had ``requests`` in hand (:data:`ACTIVE`)."""
    start, end = ACTIVE[side, mode]
    return sum(r[end] - r[start] for r in requests.values() if start in r and end in r)


def warm_up(url: str, model: str, n: int, input_len: int) -> None:
    """``n`` requests one at a time through the router before any point: the pair's
    first transfer pays one-off costs (on this machine the decode worker's first
    registration once took 26 s, and every request of the point queued behind it) that
    the profile's ``handshake_before_run`` keeps out of the simulated runs."""
    from pushkv.vllm.testing import post_json

    for i in range(n):
        status, body = post_json(url + "/v1/completions", {
            "model": model, "prompt": [5 + (i + j) % 900 for j in range(input_len)],
            "max_tokens": 2, "temperature": 0, "ignore_eos": True}, timeout=600)
        if status != 200:
            raise RuntimeError(f"warm-up request {i}: HTTP {status}: {body!r:.200}")


def server_metrics(dep: Any) -> dict[str, dict[str, float]]:
    """The vLLM metrics' sums and counts of the deployment's two servers."""
    from pushkv.fit.timings import metric_sums
    from pushkv.vllm.testing import get_text

    return {side: metric_sums(get_text(srv.url + "/metrics"))
            for side, srv in (("prefill", dep.prefill), ("decode", dep.decode))}


def engine_steps(before: dict[str, dict[str, float]],
                 after: dict[str, dict[str, float]]) -> dict[str, float]:
    """What the real servers' own metrics say of one point: the prefill server's mean
    prefill time per request, the decode server's mean time per output token."""
    def delta(side: str, key: str) -> float:
        return after[side][f"vllm:{key}"] - before[side][f"vllm:{key}"]

    n = delta("prefill", "request_prefill_time_seconds_count")
    tokens = (delta("decode", "request_generation_tokens_sum")
              - delta("decode", "request_generation_tokens_count"))
    return {"prefill_step_s": delta("prefill", "request_prefill_time_seconds_sum") / n
            if n else 0.0,
            "decode_token_s": delta("decode", "request_decode_time_seconds_sum") / tokens
            if tokens else 0.0}


#: where each point's probe wake-ups go, one file a point (:func:`write_wakes`)
WAKES = "wakes"


def write_wakes(real: Path, stem: str, probe: Any) -> Path:
    """The core probe's wake-ups of point ``stem``, each as [when it was due
    (``time.monotonic()``, the timelines' clock), its delay (s)], by core, into
    ``real/wakes/<stem>.json``: what the profile's ``control.wake_beside_s`` is taken
    from, against the point's timeline (:func:`pushkv.fit.segments.wakes_by_flight`)."""
    out = real / WAKES / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(core): [[round(t, 6), round(w, 6)] for t, w in zip(
        probe.wake_times.get(core, ()), probe.wakes.get(core, ()), strict=True)]
        for core in sorted(probe.wakes)}))
    return out


def record_shares(real: Path, fname: str, shares: dict[str, Any]) -> None:
    """The cores' share and wake-up delay during one point, in ``real/cpu_probe.json``."""
    path = real / SHARES
    got = json.loads(path.read_text()) if path.exists() else {}
    got[fname] = shares
    path.write_text(json.dumps(got, indent=1, sort_keys=True))


# -------------------------------------------------------------------- sim


def run_sim(profile_path: Path, sim: Path, points: Sequence[tuple[str, int, float, int]],
            output_len: int, num_prompts: int, *, seed: int = 0,
            shares: dict[str, dict[str, Any]] | None = None,
            server_steps: bool = False, timelines: Path | None = None,
            arrivals: str = "vllm", frontend_cores: int | None = None,
            host_cores: int | None = None,
            keys: dict[str, dict[str, float]] | None = None,
            gauges: dict[str, dict[str, dict[str, float]]] | None = None,
            speeds: bool = False, wall_steps: bool = False) -> None:
    """The simulator at ``(mode, input, rate, iteration)`` points, into ``sim``; with
    ``shares`` (by result file name), each point's engines get the share of a core and
    the wake-up delay the probe met on their cores (``cpu_share``, ``wake_s``), else a
    core each. With ``server_steps`` the engines' step overheads are instead what the
    real P/D servers' metrics gave at that point (wall times under the load, share 1),
    per-token costs as profiled. With ``timelines``, each point's timeline marks go into
    ``timelines/<point>/`` (:mod:`pushkv.sim.marks`). ``arrivals``: the send times'
    generator (``"vllm"``: the very ones ``vllm bench serve --seed seed+iteration`` used
    in the real half); ``frontend_cores`` replaces the profile's
    ``control.frontend_cores`` (the frontends as a queue; 0 off), ``host_cores``
    ``control.host_cores`` (engines and frontends on shared cores; 0 off); ``keys`` (per table,
    key: value) replace the profile's (:func:`real_keys`); ``gauges`` (by result file name,
    per table, key: value) replace them again for that point alone (:func:`gauge_keys`),
    on a core each; with ``speeds`` too, each side's ``cpu_speed`` the point's against
    its gauges' (:func:`gauge_speed`, from ``shares``). A point's gauged step times are
    its lone requests' wall times, the work they brought beside their steps in them, so
    on shared cores its steps are first made to give those wall times to a lone request
    simulated there (:func:`pushkv.fit.measure_connector.lone_steps`; ``wall_steps``: the
    gauged steps as they are, that work counted twice)."""
    from pushkv.fit.measure_connector import lone_steps
    from pushkv.sim.marks import Timeline
    from pushkv.sim.profile import MAX_SPEED, load_profile, profile_from_dict
    from pushkv.sim.runner import run
    from pushkv.sim.scenario import SimConfig, TransferMode
    from pushkv.sim.workload import WorkloadConfig

    base = load_profile(profile_path)
    for name, cores in (("frontend_cores", frontend_cores), ("host_cores", host_cores)):
        if cores is not None:
            base = dataclasses.replace(base, control=dataclasses.replace(
                base.control, **{name: cores})).validate()
    for table, values in (keys or {}).items():
        base = dataclasses.replace(base, **{table: dataclasses.replace(
            getattr(base, table), **values)}).validate()
    sim.mkdir(parents=True, exist_ok=True)
    for old in sim.glob("*_iter*.json"):
        old.unlink()
    for mode, input_len, rate, it in points:
        profile = base
        fname = file_name(mode, rate, input_len, output_len, it)
        got = (shares or {}).get(fname)
        if gauges is not None:
            if fname not in gauges:
                raise RuntimeError(f"{fname}: no gauge to simulate it with")
            point = {t: dict(v) for t, v in gauges[fname].items()}
            if host_cores is not None:  # the command line's cores, over the real run's
                point.get("control", {}).pop("host_cores", None)
            profile = profile_from_dict(point, base=base)
            if not wall_steps:  # the gauges' lone wall times, the request's own work out
                profile = lone_steps(profile, mode=mode, input_len=input_len,
                                     output_len=output_len)
            if speeds:
                profile = profile_from_dict({side: {"cpu_speed": min(MAX_SPEED, speed)}
                                             for side, speed in gauge_speed(got or {}).items()},
                                            base=profile)
        elif got:
            pre, dec = dict(got["prefill"]), dict(got["decode"])  # cpu_share, wake_s
            speed, ref = got.get("speed", {}), base.control.probe_speed
            if ref > 0 and speed.get("prefill", 0) > 0 and speed.get("decode", 0) > 0:
                # the cores' speed now against when the profile was measured
                pre["cpu_speed"] = speed["prefill"] / ref
                dec["cpu_speed"] = speed["decode"] / ref
            eng = got.get("engine", {})
            if server_steps and eng.get("prefill_step_s") and eng.get("decode_token_s"):
                tok_p, tok_d = base.prefill.step_token_s, base.decode.step_token_s
                pre |= {"cpu_share": 1.0, "cpu_speed": 1.0, "prefill_step_overhead_s": max(
                    0.0, eng["prefill_step_s"] - tok_p * input_len)}
                dec |= {"cpu_share": 1.0, "cpu_speed": 1.0, "decode_step_overhead_s": max(
                    0.0, eng["decode_token_s"] - tok_d)}
            profile = dataclasses.replace(
                base, prefill=dataclasses.replace(base.prefill, **pre),
                decode=dataclasses.replace(base.decode, **dec)).validate()
        cfg = SimConfig(mode=TransferMode(mode), profile=profile, iteration=it,
                        workload=WorkloadConfig(request_rate=rate, input_len=input_len,
                                                output_len=output_len,
                                                num_prompts=num_prompts, seed=seed,
                                                arrivals=arrivals))
        tl = Timeline() if timelines is not None else None
        res = run(cfg, timeline=tl)
        if tl is not None and timelines is not None:
            tl.write(timelines / Path(cfg.file_name()).stem)
        if res.result["completed"] != num_prompts or res.leaked_blocks:
            raise RuntimeError(f"simulated {cfg.file_name()}: {res.result['completed']} of "
                               f"{num_prompts} completed, {res.leaked_blocks} blocks leaked")
        res.write(sim)


def real_points(real: Path) -> tuple[list[tuple[str, int, float, int]], int, int]:
    """The points of the result files in ``real``, their output length and prompt count."""
    points, outs, prompts = [], set(), set()
    for path in sorted(real.iterdir()):
        m = NAME.match(path.name)
        if m is None or m["mode"] not in MODES:
            continue
        data = json.loads(path.read_text())
        points.append((m["mode"], int(m["input"]), float(m["qps"]), int(m["iter"])))
        outs.add(int(m["output"]))
        prompts.add(int(data["num_prompts"]) if "num_prompts" in data
                    else int(data["completed"]) + int(data.get("failed", 0)))
    if not points:
        raise SystemExit(f"no real result files in {real}")
    if len(outs) != 1 or len(prompts) != 1:
        raise SystemExit(f"{real}: mixed output lengths {sorted(outs)} or prompt counts "
                         f"{sorted(prompts)}")
    return points, outs.pop(), prompts.pop()


# ----------------------------------------------------------------- report


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
        ratios[f"{mode}_in{input_len}_qps{rate_name(q)}"] = {k: round(v, 3)
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
    lo, hi = band
    verdict = ("in" if lo <= low and high <= hi else
               "out" if high < lo or low > hi else "unsure")
    need = math.ceil((1.96 * (sd / mean) / (1 - 1 / hi)) ** 2) if mean > 0 else None
    return {"mean": mean, "low": low, "high": high, "verdict": verdict,
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
        points[f"{mode}_in{input_len}_qps{rate_name(q)}"] = got
        lines.append(f"| {mode} | {input_len} | {rate_name(q)} | {len(its)} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines), {"band": list(band), "verdicts": verdicts,
                              "iterations_needed_max": needed, "points": points}


def in_band(summary: dict[str, Any], band: tuple[float, float] = BAND) -> int:
    """How many of a :func:`compare` summary's ratios lie in ``band``."""
    return sum(band[0] <= x <= band[1] for v in summary["ratios"].values() for x in v.values())


def compared_points(real: Path, timelines: Path, shares: dict[str, dict[str, Any]]
                    ) -> Iterator[tuple[str, re.Match[str], Any, Any]]:
    """Each point both halves recorded, by result file name: the name, its match of
    :data:`NAME`, the real requests of its window (its router's and pair's marks) and
    the simulated ones."""
    from pushkv.fit import segments

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
    from pushkv.fit import segments

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
    from pushkv.fit import segments

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
    from pushkv.fit import segments

    return grouped_tables(real, timelines, shares,
                          functools.partial(segments.by_overlap, cap=cap), cap, "overlapped")


def place_tables(real: Path, timelines: Path, shares: dict[str, dict[str, Any]],
                 cap: int = 3) -> tuple[str, dict[str, list[dict[str, Any]]]]:
    """:func:`grouped_tables` by each request's place in its point (1st, 2nd, 3rd on;
    :func:`pushkv.fit.segments.by_place`) -- a point's first requests meet idle
    engines, so a gap at the first places alone is something at the points' start in
    the real half (the core probe's own start did that, until entering it waited for
    it)."""
    from pushkv.fit import segments

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
    from pushkv.fit import segments

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
    """The probe's wake-ups in ``path`` (:func:`write_wakes`) by how many of
    ``requests`` were in flight (:func:`pushkv.fit.segments.wakes_by_flight`), as
    ``"<where>, 1 in flight"`` and ``"<where>, 2+ in flight"``; idle ones left out, as
    they say nothing of a request's. Empty where the file is missing."""
    from pushkv.fit import segments

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
    during the points, by how many were (:func:`write_wakes`; mean and p99, ms). The
    profile's keys are the gauges' lone requests, so a lone request of a point
    that pays more than a gauge's -- or a woken probe that waits longer beside one
    request in a point than in a gauge -- is a cost the keys do not hold. The text and
    ``{"<mode>": {"requests": {...}, "wakes": {...}}}``."""
    from pushkv import timeline
    from pushkv.fit import segments

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


def real_keys(real: Path, shares: dict[str, dict[str, Any]], profile_path: Path
              ) -> dict[str, dict[str, float]]:
    """The keys the real half's own marks measure (requests that ran alone, each point's
    figures scaled by the share of a core its probe met): ``network.client_hop_s`` from
    every point (the client's latencies against the router's marks,
    :func:`pushkv.fit.measure_connector.client_hop`) and ``prefill.return_s`` from the
    pull points (:func:`pushkv.fit.measure_connector.pull_keys`, against the profile's
    hops and ``decode.ingest_s``). A key whose marks the run lacks is left out."""
    from pushkv.fit import segments
    from pushkv.fit.measure_connector import client_hop, pull_keys
    from pushkv.sim.profile import load_profile

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
    keys, ``decode.ingest_s``) -- and ``control.host_spread`` at up to ``quantiles``
    quantiles of their lone requests (:func:`~pushkv.fit.measure_connector.host_spread`);
    then the pull gauges' ``prefill.return_s`` likewise, which no push mark shows.
    A point's (the first, by result file name): the lone requests of its two gauges,
    its own pair's, just before and after it, at its lengths -- the step overheads and
    the keys its mode's timeline shows, against the profile with the run's keys, and
    ``network.client_hop_s`` and ``network.client_first_s`` from the gauges' own client
    results (:func:`~pushkv.fit.measure_connector.client_hop`,
    :func:`~pushkv.fit.measure_connector.client_first`), and each engine's
    ``cores_busy`` and decode's ``token_work_s`` as :func:`cores_busy` measured its
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
    from pushkv.fit import segments
    from pushkv.fit.cpu_profile import MeasurementError
    from pushkv.fit.measure_connector import client_first, client_hop, host_spread, shrink_keys
    from pushkv.fit.measure_connector import gauge_keys as keys_of
    from pushkv.sim.profile import load_profile, profile_from_dict

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
        run["control"] = {"host_spread": list(host_spread(
            lone, with_run, quantiles=max(1, min(quantiles, len(lone)))))}
    beside = wake_beside_of(real, gauged, marks)
    if beside:  # the machine's, the same for every point
        run.setdefault("control", {})["wake_beside_s"] = list(beside)
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
        if "token_work_s" in busy:
            keys.setdefault("decode", {})["token_work_s"] = float(busy.pop("token_work_s"))
        holding = bool(busy.pop("holding", 0))  # measured over the active time
        for side, cores in busy.items():
            keys.setdefault(side, {}).update(cores_busy=max(1.0, float(cores)),
                                             steps_while_holding=holding)
        if got.get("host_cores"):  # the machine the point and its gauges ran on
            keys.setdefault("control", {})["host_cores"] = int(got["host_cores"])
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
    """The group of gauge ``g`` of the point ``m`` matched (:data:`NAME`): gauges of one
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
    from pushkv.fit.cpu_profile import MeasurementError
    from pushkv.fit.measure_connector import gauge_keys as keys_of
    from pushkv.fit.measure_connector import key_noise

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
    from pushkv.fit.measure_connector import KeyNoise

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
    """``control.wake_beside_s`` of the run: every point's probe wake-ups
    (:func:`write_wakes`; points without are skipped), both cores, by how many of the
    point's requests (``marks(point, False, window)``) were in flight when each was due
    (:func:`pushkv.fit.segments.wakes_by_flight`), pooled over the points, then
    :func:`pushkv.fit.measure_connector.wake_beside`. Empty without wake-ups."""
    from pushkv.fit import segments
    from pushkv.fit.measure_connector import wake_beside

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
    """:func:`gauge_keys`' point profiles without ``control.wake_beside_s`` (a copy)."""
    return {f: {t: {k: v for k, v in kv.items() if (t, k) != ("control", "wake_beside_s")}
                for t, kv in pt.items()} for f, pt in points.items()}


#: how each way's simulation is named on its figures
WAY_TITLES = {"gauge": "from its gauges", "probe": "cpu-tiny, probe",
              "own_cores": "cpu-tiny, a core each"}


def figures(real: Path, sim: Path, out: Path, way: str = "gauge") -> list[Path]:
    from pushkv.sim.plot import plot

    return [plot(real, metric, out / f"sim_vs_real_{metric}.png", overlay=sim,
                 labels=("real", "sim"), title=f"Mean {metric.upper()}: real vLLM CPU "
                 f"engines (thick), each point simulated {WAY_TITLES.get(way, way)} (thin)")
            for metric in ("ttft", "tpot")]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sim_vs_real")
    p.add_argument("--rates", type=floats, default=[2.0, 8.0], help="QPS, comma separated")
    p.add_argument("--inputs", type=ints, default=[64, 192], help="input lengths")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--iterations", type=int, default=8,
                   help="iterations per point (default 8: a 24-prompt point's real mean TTFT "
                        "moves with the machine's stalls, one iteration's by up to 7x; eight "
                        "take about 28 minutes here with the client kept up)")
    p.add_argument("--modes", type=lambda t: t.split(","), default=["push", "pull"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3,
                   help="requests sent one at a time through each router before its points")
    p.add_argument("--gauge", type=int, default=10,
                   help="lone requests through the router at each point's lengths just "
                   "before and after it (gauges; the 'gauge' way simulates each point "
                   "with the profile they measure); 0: none")
    p.add_argument("--gauge-qps", type=float, default=None,
                   help="the gauges' rate, one request at a time (default: each point's "
                   "own, so its gauges' lone requests meet engines as idle as its own do)")
    p.add_argument("--delay-us", type=int, default=100,
                   help="NIXL progress-thread sleep between polls, every connector alike")
    from modes import SPIN_S  # benchmarks/e2e

    p.add_argument("--spin-s", default=SPIN_S,
                   help="cap of vLLM's busy loop after each queue message in every server "
                   "(as bench_e2e.sh --spin-s; empty: vLLM's 1 s)")
    p.add_argument("--profile", type=Path, default=PROFILE)
    p.add_argument("--measure", action="store_true",
                   help="first measure the profile on this machine (python -m "
                   "pushkv.fit.measure) into OUT/cpu-tiny.toml and simulate with it, so "
                   "the profile and the real runs see the same load")
    p.add_argument("--sim-only", action="store_true",
                   help="skip the real runs: simulate the points of OUT/real's files")
    p.add_argument("--no-cpu-share", dest="cpu_share", action="store_false",
                   help="simulate with a core per engine only (cpu_share, wake_s off)")
    p.add_argument("--figures", type=Path, help="also draw the TTFT and TPOT overlays here")
    p.add_argument("--arrivals", choices=("vllm", "pushkv"), default="vllm",
                   help="the simulated send times: 'vllm' (default), the very ones vllm "
                   "bench serve sent in the real half (its seed, its generator); "
                   "'pushkv', the simulator's own stream (same rate, other draws)")
    p.add_argument("--frontend-cores", type=int, default=None,
                   help="replace the profile's control.frontend_cores: the API servers', "
                   "router's and client's times as one queue on this many cores "
                   "(pushkv.sim.frontend); 0: as delays")
    p.add_argument("--host-cores", type=int, default=None,
                   help="replace the profile's control.host_cores: the engines' steps and "
                   "the frontends' jobs as work on this many shared cores (pushkv.sim.cpu; "
                   "a profile --measure writes has the machine's, and the gauge way takes "
                   "the real run's); 0: a core each")
    p.add_argument("--real-keys", action="store_true",
                   help="measure network.client_hop_s and prefill.return_s from the real "
                   "half's own marks (requests that ran alone) and simulate with them")
    args = p.parse_args()
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    real, sim = args.out / "real", args.out / "sim"
    failures: dict[str, str] = {}
    t0 = time.monotonic()
    load = os.getloadavg()
    if args.measure:
        from pushkv.fit.cpu_profile import MeasurementError, write_profile
        from pushkv.fit.measure import measure

        try:
            write_profile(measure(args.out / "measure", reps=20, delay_us=args.delay_us),
                          args.out / "cpu-tiny.toml")
            args.profile = args.out / "cpu-tiny.toml"
            print(f"measured {args.profile}", flush=True)
        except MeasurementError as exc:  # the committed profile stands in
            failures["measure"] = str(exc)
            print(f"measuring failed ({exc}); simulating with {args.profile}", flush=True)
    if not args.sim_only:
        failures |= run_real(args, real)
    real_s = time.monotonic() - t0
    points, output_len, num_prompts = real_points(real)
    shares = json.loads((real / SHARES).read_text()) if (real / SHARES).exists() else {}
    knobs: dict[str, Any] = {"arrivals": args.arrivals, "frontend_cores": args.frontend_cores,
                             "host_cores": args.host_cores, "keys": None}
    if args.real_keys:
        from pushkv.fit.cpu_profile import MeasurementError

        try:
            knobs["keys"] = real_keys(real, shares, args.profile)
        except MeasurementError as exc:  # the profile's own keys stand in
            failures["real_keys"] = str(exc)
            print(f"measuring the real half's keys failed ({exc}); simulating with "
                  f"{args.profile}'s", flush=True)
    if knobs["keys"]:
        print("keys from the real half's marks: " + ", ".join(
            f"{t}.{k} {v * 1e3:.3f} ms" for t, kv in knobs["keys"].items()
            for k, v in kv.items()), flush=True)
    own = args.out / "sim-own-cores"  # the mechanism off
    timelines = args.out / "sim-timeline"
    run_sim(args.profile, own, points, output_len, num_prompts, seed=args.seed, **knobs,
            timelines=timelines / "own-cores")
    own_table, own_summary = compare(real, own)
    print("\nSimulated with a core per engine (cpu_share 1):\n")
    print(own_table)
    segs: dict[str, Any] = {}
    text, segs["own_cores"] = segment_tables(real, timelines / "own-cores", shares)
    if text:
        print("\nSegment by segment, a core per engine (real / simulated, ms):\n")
        print(text)
    if args.cpu_share and shares:
        run_sim(args.profile, sim, points, output_len, num_prompts, seed=args.seed, **knobs,
                shares=shares, timelines=timelines / "probe")
        table, summary = compare(real, sim)
        print("\nSimulated on the cores the probe met (cpu_share, wake_s):\n")
        print(table)
        text, segs["probe"] = segment_tables(real, timelines / "probe", shares)
        if text:
            print("\nSegment by segment, on the cores the probe met (real / simulated, "
                  "ms):\n")
            print(text)
    else:
        sim = own
        summary = dict(own_summary)
    keys = ("ttft_ratio_min", "ttft_ratio_max", "tpot_ratio_min", "tpot_ratio_max")
    way = "probe" if args.cpu_share and shares else "own_cores"
    if any(v.get("gauges") for v in shares.values()):
        from pushkv.fit.cpu_profile import MeasurementError

        noise: dict[str, dict[str, dict[str, float]]] = {}
        try:
            per_point, run_keys = gauge_keys(real, shares, args.profile, output_len,
                                             noise_out=noise)
        except MeasurementError as exc:
            failures["gauge"] = str(exc)
            print(f"the gauges gave no profile ({exc})", flush=True)
        else:
            print("\nthe run's keys from its pushkv gauges: " + ", ".join(
                f"{t}.{k} {v * 1e3:.3f} ms" for t, kv in run_keys.items() for k, v in
                kv.items() if t != "control") + f"; host_spread mean "
                f"{statistics.fmean(run_keys.get('control', {}).get('host_spread', [1])):.2f}"
                + (f"; wake_beside_s mean {statistics.fmean(beside) * 1e3:.2f} ms" if (
                    beside := run_keys.get("control", {}).get("wake_beside_s")) else ""),
                flush=True)
            if noise:
                print("\nEach point's keys from its two gauges, shrunk toward the run's mean "
                      "by how far the gauges one at a time tell points apart (sd in ms; "
                      "kept: the share of a point's own deviation it keeps):\n")
                print(noise_table(noise))
            gauged = args.out / "sim-gauge"
            run_sim(args.profile, gauged, points, output_len, num_prompts, seed=args.seed,
                    arrivals=args.arrivals, frontend_cores=args.frontend_cores,
                    host_cores=args.host_cores, gauges=per_point,
                    timelines=timelines / "gauge")
            gauge_table, gauge_summary = compare(real, gauged)
            print("\nSimulated with each point's profile from the gauges just before and "
                  "after it (its own pair's lone requests at its lengths):\n")
            print(gauge_table)
            text, segs["gauge"] = segment_tables(real, timelines / "gauge", shares)
            if text:
                print("\nSegment by segment, the gauges' profiles (real / simulated, ms):\n")
                print(text)
            text, by_overlap = overlap_tables(real, timelines / "gauge", shares)
            if text:
                print("\n'legs out -> first token' by how many requests overlapped it, the "
                      "gauges' profiles (the points' requests pooled per mode and rate; "
                      "real: the router's first token, simulated: the client's):\n")
                print(text)
            text, by_place = place_tables(real, timelines / "gauge", shares)
            if text:
                print("\n'legs out -> first token' by each request's place in its point, "
                      "the gauges' profiles (pooled per mode and rate):\n")
                print(text)
            text, lone = lone_gap(real, shares)
            if text:
                print("\nLone requests of the gauges (what the keys hold) against those of "
                      "the points, and the probe's wake-ups in each:\n")
                print(text)
            text, by_neighbour = neighbour_tables(real, timelines / "gauge", shares)
            if text:
                print("\nSegment by segment, by what else each request met on its way to "
                      "its first token, the gauges' profiles (pooled per mode and rate):\n")
                print(text)
            def beside(name: str, title: str, **kw: Any) -> None:
                """The gauge way again with one part changed (``kw`` to :func:`run_sim`),
                into ``OUT/sim-gauge-<name>``, printed and kept as ``gauge_<name>``."""
                out = args.out / f"sim-gauge-{name}"
                kw.setdefault("gauges", per_point)
                run_sim(args.profile, out, points, output_len, num_prompts, seed=args.seed,
                        arrivals=args.arrivals, frontend_cores=args.frontend_cores,
                        host_cores=args.host_cores, **kw)
                table, got = compare(real, out)
                print(f"\nThe same {title}:\n")
                print(table)
                gauge_summary[f"gauge_{name.replace('-', '_')}"] = {
                    k: got[k] for k in keys} | {"in_band": in_band(got)}

            if any(gauge_speed(v) for v in shares.values()):
                beside("speed", "with each side's cores as fast against the gauges' as the "
                       "probe on them saw (cpu_speed: the point's rate of fixed work over its "
                       "gauges')", shares=shares, speeds=True)
            if run_keys.get("control", {}).get("wake_beside_s"):  # the mechanism's part
                beside("no-wake", "without a woken frontend's wait beside another request "
                       "(control.wake_beside_s off)", gauges=without_wake(per_point))
            if noise:  # the estimator's part: each point's own gauges' keys as measured
                raw, _ = gauge_keys(real, shares, args.profile, output_len, shrink=False)
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
        steps = args.out / "sim-server-steps"
        run_sim(args.profile, steps, points, output_len, num_prompts, seed=args.seed, **knobs,
                shares=shares, server_steps=True)
        steps_table, steps_summary = compare(real, steps)
        print("\nDiagnosis: the same, engine steps as the real P/D servers' metrics gave "
              "them (not a prediction of the steps):\n")
        print(steps_table)
        summary["server_steps"] = {k: steps_summary[k] for k in keys}
    text, summary["precision"] = precision(real, sim)
    print(f"\nHow far this run can tell, the {way} way: each point's iterations' sim/real "
          f"ratios, their mean and its 95% interval; in / out: the whole interval in / "
          f"outside {BAND[0]}-{BAND[1]} (out: a miss the iterations agree on), unsure: "
          f"it straddles a side:\n")
    print(text)
    v = summary["precision"]["verdicts"]
    print(f"\nverdicts: {v['in']} in, {v['out']} out, {v['unsure']} unsure; a 95% interval "
          f"as narrow as the band needs up to {summary['precision']['iterations_needed_max']} "
          f"iterations a point at this run's spread")
    print()
    summary["own_cores"] = {k: own_summary[k] for k in keys}
    summary["segments"] = segs
    if args.figures:
        for path in figures(real, sim, args.figures, way):
            print(f"wrote {path}")
    summary |= {"real_s": round(real_s, 1), "total_s": round(time.monotonic() - t0, 1),
                "load_at_start": [round(x, 2) for x in load],
                "load_at_end": [round(x, 2) for x in os.getloadavg()],
                "profile": str(args.profile), "arrivals": args.arrivals,
                "frontend_cores": args.frontend_cores, "host_cores": args.host_cores,
                "real_keys": knobs["keys"],
                "way": way, "failures": failures}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
