"""The simulator against real vLLM CPU engines on this machine, point by point.

**Real half**: pushkv push (``PushKVConnector`` behind ``pushkv proxy``) and vLLM
pull (vLLM's ``NixlConnector`` behind ``pushkv.fit.e2e.vllm_proxy``'s relay), each
a prefill server on core 0 and a decode server on core 1 (:mod:`pushkv.fit.e2e`'s
deployments); ``vllm bench serve`` runs every (input length, rate) point against each,
the deployments alternating each iteration, with a core probe on each core, the
servers' metrics, the parts' run-queue waits, threads and garbage-collector pauses
recorded per point (``OUT/real/cpu_probe.json``), and *gauges* (``--gauge N``: N lone
requests through the same router at the point's lengths and rate, just before and
just after it). Points already in ``OUT/real`` are not run again.

**Simulated half** (all ``--sim-only`` runs, on a recorded ``OUT/real``):
:func:`pushkv.fit.sim_vs_real.sim_half.sim_half` simulates the same points at the
very send times ``vllm bench serve`` used, several ways (a core per engine, the
cores the probe met, each point with the profile its gauges measured, the servers'
steps), and prints the sim/real ratio tables, the segment tables, how far the run
can tell, and last one JSON object (also ``OUT/summary.json``).

What each part measures and how the simulated half uses it: :mod:`pushkv.fit.sim_vs_real`
(the library this command line drives) and ``docs/sim.md`` ("Against real engines").

    PYTHONPATH=. python benchmarks/bench_sim_vs_real.py --out /tmp/simreal
    PYTHONPATH=. python benchmarks/bench_sim_vs_real.py --sim-only --out /tmp/simreal
    # longer: --rates 1,2,4,8 --inputs 32,64,128,256 --num-prompts 64 --iterations 5
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pushkv.fit import segments  # noqa: E402
from pushkv.fit.cores import CoreProbe  # noqa: E402
from pushkv.fit.sim_vs_real.cross import (  # noqa: E402
    TRAIN_INPUTS,
    TRAIN_RATES,
    cross_validate,
)
from pushkv.fit.sim_vs_real.deployment import (  # noqa: E402
    SchedSamples,
    active_s,
    engine_spans,
    engine_steps,
    gc_line,
    gc_pauses,
    intake,
    intake_line,
    load_span,
    part_pids,
    parts,
    per_request,
    runq_waits,
    sched_parts,
    server_metrics,
    spans_line,
    threads_line,
)
from pushkv.fit.sim_vs_real.keys import gauge_rate  # noqa: E402
from pushkv.fit.sim_vs_real.runs import (  # noqa: E402
    API_LOOPS,
    CLIENT,
    GAUGES,
    MODES,
    PINNED_ENGINES,
    PROFILE,
    file_name,
    point_prompts,
    probe_speed,
    rate_name,
    record_shares,
    steal_record,
    timeline_dirs,
    write_wakes,
)
from pushkv.fit.sim_vs_real.sim_half import sim_half  # noqa: E402
from pushkv.hostprobe import (  # noqa: E402
    autogroup,
    cpu_times,
    group_cpu_s,
    process_cpu_s,
    steal,
)

# ------------------------------------------------------------------- real


def run_real(args: argparse.Namespace, real: Path) -> dict[str, str]:
    """``vllm bench serve`` at every point against both deployments; failures by name."""
    from pushkv.fit.e2e.bench_client import BenchClient
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
    run with ``client`` (:class:`pushkv.fit.e2e.bench_client.BenchClient`), stopped;
    failures added by name."""
    from pushkv.fit.e2e.bench_client import bench_serve
    from pushkv.fit.e2e.deployment import Deployment, Endpoint
    from pushkv.fit.e2e.modes import MODES as E2E_MODES

    for mode in args.modes:
        name, kind = MODES[mode]
        todo = [(i, q) for i, q in grid(args)
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
                prompts = point_prompts(q, args.num_prompts, args.point_seconds)
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
                                     num_prompts=prompts, seed=args.seed + it,
                                     log=real / "logs" / f"{mode}-bench.log",
                                     extra=("--save-detailed",),  # each request's TTFT
                                     client=client)
                got = {side: {"cpu_share": round(probe.share(core), 4),
                              "wake_s": round(probe.wake_s(core), 6)}
                       for side, core in (("prefill", 0), ("decode", 1))}
                got["runq_wait_ms"] = per_request(waited, runq_waits(dep, ep),
                                                  prompts)
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
                pids = part_pids(dep, ep, client.pid)
                got["gc"] = gc_pauses(timeline_dirs(real, mode),
                                      got.get("load_span") or got["window"], pids)
                # each leg's way into its engine loop, and the loops' steps
                got["intake"] = intake(timeline_dirs(real, mode), got["window"])
                got["spans"] = engine_spans(timeline_dirs(real, mode),
                                            got.get("load_span") or got["window"], pids)
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
                for line in ((intake_line(got["intake"]) if got["intake"] else ""),
                             (spans_line(got["spans"]) if got["spans"] else "")):
                    if line:
                        print(f"[{mode} iter {it}] in {input_len} qps {rate_name(q)} "
                              f"{line}", flush=True)
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
    from pushkv.fit.e2e.bench_client import bench_serve

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


def cores_busy(dep: Any, ep: Any, real: Path, model: str, args: argparse.Namespace,
               input_len: int, *, n: int = 24, idle_s: float = 3.0,
               together: int = 8, rounds: int = 3) -> dict[str, float]:
    """Where the CPU of a lone request goes, as the profile's keys: ``prefill`` and
    ``decode``, the cores each engine keeps busy while it is active (``cores_busy``,
    with ``steps_while_holding``: ``holding`` is true): the CPU time (/proc, all
    threads) of the instance's processes -- decode's without its API server -- over
    ``n`` lone requests through the router, less what the same processes use idle
    (measured over ``idle_s`` just before), over the time the engine's loop had the
    request in hand in the timeline
    (:data:`pushkv.fit.sim_vs_real.deployment.ACTIVE`: stepping it, or holding it for
    its transfer), at least 1; ``token_work_s``, the frontend work per output token:
    decode's API server, the router and this client (which pass every token on) the
    same way, per output token; ``token_item_s``, what of it a token still costs when it
    shares its processes' wake-ups with others (``token_api_s``, ``token_api_item_s``:
    decode's API server's part of each): ``rounds`` rounds of ``together``
    requests sent at once, whose tokens leave decode in the same steps, cost ``F`` a
    token where lone ones cost ``L = w + c`` (``w`` the wake-up a token pays alone, now
    shared by ``together``): ``c = (together x F - L) / (together - 1)``.

    Over the stepping time alone, vLLM pull's prefill measured 3.6-9.5 cores at ten
    starts on this machine, pushkv's 2.0-3.1: what its processes burn while it holds a
    prompt's KV until decode has read it (21-38 ms a request) was charged to its 7-9 ms
    of steps. Over the active time both are 1.0-1.6 (decode 1.0-1.4): a loop that has a
    request in hand keeps about one core busy, stepping or not."""
    from pushkv.fit.e2e.client import Client

    def cpu() -> dict[str, float]:
        p = parts(dep, ep, process_cpu_s, group_cpu_s)
        front = {"decode_api": p["decode_api"], "router": p.get("router", 0.0),
                 "client": time.process_time()}
        return {"prefill": p["prefill"], "decode": p["decode"], **front,
                "front": sum(front.values())}

    c0, t0 = cpu(), time.monotonic()
    time.sleep(idle_s)
    c1, t1 = cpu(), time.monotonic()

    async def lone() -> None:
        rng = random.Random(len(str(real)) + input_len)
        async with Client(model) as client:
            for _ in range(n):
                await client.request(ep.target, [rng.randrange(5, 995)
                                                 for _ in range(input_len)], args.output_len)
                await asyncio.sleep(0.05)  # so the next finds the engines idle

    async def batched() -> None:
        rng = random.Random(len(str(real)) + input_len + 1)
        async with Client(model) as client:
            for _ in range(rounds):
                await asyncio.gather(*(client.request(
                    ep.target, [rng.randrange(5, 995) for _ in range(input_len)],
                    args.output_len) for _ in range(together)))
                await asyncio.sleep(0.05)

    c2, t2 = cpu(), time.monotonic()
    asyncio.run(lone())
    c3, t3 = cpu(), time.monotonic()
    asyncio.run(batched())
    c4, t4 = cpu(), time.monotonic()
    reqs = segments.alone(segments.load([real / "timeline" / ep.mode.name,
                                         real / "timeline" / dep.kind], (t2, t3)))
    per = {side: active_s(reqs, side, ep.mode.name) for side in ("prefill", "decode")}
    per["front"] = n * args.output_len  # what each part's CPU is taken over
    used = {part: c3[part] - c2[part] - (c1[part] - c0[part]) / (t1 - t0) * (t3 - t2)
            for part in per}
    out: dict[str, Any] = {side: round(max(1.0, used[side] / per[side]), 3)
                           if per[side] > 0 else 1.0 for side in ("prefill", "decode")}
    out["token_work_s"] = round(max(0.0, used["front"] / per["front"]), 6)
    idle = {part: (c1[part] - c0[part]) / (t1 - t0) for part in FRONT}
    lone_s = {part: (c3[part] - c2[part] - idle[part] * (t3 - t2)) / per["front"]
              for part in FRONT}
    shared_s = {part: (c4[part] - c3[part] - idle[part] * (t4 - t3))
                / (rounds * together * args.output_len) for part in FRONT}
    item = {part: (together * shared_s[part] - lone_s[part]) / (together - 1)
            for part in FRONT}
    print("a token's frontend work, lone / sharing its wake-ups with "
          f"{together - 1} others / its item part (ms): " + ", ".join(
              f"{part} {lone_s[part] * 1e3:.3f} / {shared_s[part] * 1e3:.3f} / "
              f"{item[part] * 1e3:.3f}" for part in FRONT), flush=True)
    out["token_item_s"] = round(min(out["token_work_s"], max(0.0, sum(item.values()))), 6)
    # decode's API server's part of each: the rest is the relay (router and client)
    out["token_api_s"] = round(min(out["token_work_s"], max(0.0, lone_s["decode_api"])), 6)
    out["token_api_item_s"] = round(min(out["token_item_s"], out["token_api_s"],
                                        max(0.0, item["decode_api"])), 6)
    out["holding"] = True  # over the active time: the profile steps while holding
    return out


#: the processes a token passes on its way out: decode's API server, the router, the client
FRONT = ("decode_api", "router", "client")


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


def grid(args: argparse.Namespace) -> list[tuple[int, float]]:
    """The (input length, rate) points of a run: ``--points`` where given, else every
    ``--inputs`` length at every ``--rates`` rate."""
    if args.points:
        return list(args.points)
    return [(i, q) for i in args.inputs for q in args.rates]


def points_arg(text: str) -> list[tuple[int, float]]:
    """``--points``: ``LEN:RATE,RATE/LEN:RATE,...`` (e.g. ``64:2,8,16/192:2,8``)."""
    out = []
    try:
        for part in text.split("/"):
            length, rates = part.split(":")
            out += [(int(length), float(q)) for q in rates.split(",")]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--points {text!r}: expected LEN:RATE,RATE/LEN:RATE,... ({exc})") from exc
    if not out or any(i <= 0 or q <= 0 for i, q in out):
        raise argparse.ArgumentTypeError(f"--points {text!r}: lengths and rates must be > 0")
    return out


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
    p.add_argument("--points", type=points_arg, default=None,
                   help="the run's (length, rate) points instead of every --inputs length "
                   "at every --rates rate: LEN:RATE,RATE/LEN:RATE,... (e.g. "
                   "64:2,4,8,16/192:2,8)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--point-seconds", type=float, default=None,
                   help="send each point's requests for about this long: at rate q, "
                        "max(--num-prompts, ceil(q x S)) requests, so points past the knee "
                        "run long enough to leave their start (default: --num-prompts at "
                        "every rate)")
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
    from pushkv.fit.e2e.modes import SPIN_S

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
                   help="replace the profile's host.frontend_cores: the API servers', "
                   "router's and client's times as one queue on this many cores "
                   "(pushkv.sim.host.frontend); 0: as delays")
    p.add_argument("--host-cores", type=int, default=None,
                   help="replace the profile's host.cores: the engines' steps and "
                   "the frontends' jobs as work on this many shared cores (pushkv.sim.host.cores; "
                   "a profile --measure writes has the machine's, and the gauge way takes "
                   "the real run's); 0: a core each")
    p.add_argument("--real-keys", action="store_true",
                   help="measure network.client_hop_s and prefill.return_s from the real "
                   "half's own marks (requests that ran alone) and simulate with them")
    p.add_argument("--cross-validate", action="store_true",
                   help="instead of the usual ways, cross-validate: key the simulator from "
                   "the gauges of the training points (--train-rates x --train-inputs) "
                   "alone, simulate every point, judge the training points (in sample) "
                   "apart from the others (out of sample), and find the knee of the "
                   "rate sweep at --sweep-input, real and simulated "
                   "(pushkv.fit.sim_vs_real.cross)")
    p.add_argument("--train-rates", type=floats, default=list(TRAIN_RATES),
                   help="the training rates of --cross-validate (default 2,8: the grid the "
                   "profile was fitted on)")
    p.add_argument("--train-inputs", type=ints, default=list(TRAIN_INPUTS),
                   help="the training lengths of --cross-validate (default 64,192)")
    p.add_argument("--sweep-input", type=int, default=None,
                   help="the length whose rates make the knee's sweep (default: the one "
                   "run at the most rates)")
    p.add_argument("--api-loops", action=argparse.BooleanOptionalAction,
                   default=API_LOOPS,
                   help="simulate each API server as a loop of its own and a token's way "
                   "out as two jobs where the run measured host.token_api_s (docs/sim.md, "
                   "'A wake-up shared'; the default); --no-api-loops: the frontends as "
                   "one queue")
    p.add_argument("--pinned-engines", action=argparse.BooleanOptionalAction,
                   default=PINNED_ENGINES,
                   help="simulate each engine's loop on a core of its own and the other "
                   "pieces floating between the cores (host.pinned, where the host has two "
                   "cores or more), as the real deployment pins its engines (the "
                   "default); --no-pinned-engines: one pool of the cores")
    p.add_argument("--measured-speed", action="store_true",
                   help="with --cross-validate: each point's cores as fast as the core "
                   "probe measured them during it, against the probe's rate over the "
                   "gauges its keys came from (host.prefill/decode.cpu_speed; "
                   "pushkv.fit.sim_vs_real.cross.key_speeds): the machine's speed a "
                   "condition of the point, as its send times are; default: as fast as "
                   "when its keys were gauged")
    p.add_argument("--no-merge-tokens", dest="merge_tokens", action="store_false",
                   help="every output token a frontend job of its own (host.merge_tokens "
                   "0); by default all of a request's tokens waiting together on the "
                   "frontend queue leave as one chunk (host.merge_tokens the output "
                   "length), as vLLM's API server merges them")
    p.add_argument("--engine-spans", action="store_true",
                   help="the real servers also record each engine step and each model "
                   "run of its worker (a timeline line a step in two processes; "
                   "PUSHKV_BENCH_SPANS) and the run prints their count, mean, p90 and "
                   "busy share per point; default off")
    args = p.parse_args()
    if args.engine_spans:  # every server started from now on (ServerSpec.environ)
        from pushkv.vllm.testing import SPANS_ENV

        os.environ[SPANS_ENV] = "1"
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (choose from {', '.join(MODES)})")
    if args.point_seconds is not None and not args.point_seconds > 0:
        p.error(f"--point-seconds must be > 0, got {args.point_seconds}")
    if args.measured_speed and not args.cross_validate:
        p.error("--measured-speed needs --cross-validate")
    if args.points:  # the lengths the deployments must hold
        args.inputs = sorted({i for i, _ in args.points})
    real = args.out / "real"
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
    if args.cross_validate:
        return cross_main(args, failures, t0, real_s, load)
    got = sim_half(args.out, args.profile, seed=args.seed, arrivals=args.arrivals,
                   frontend_cores=args.frontend_cores, host_cores=args.host_cores,
                   use_real_keys=args.real_keys, cpu_share=args.cpu_share,
                   figures_dir=args.figures, failures=failures,
                   merge_tokens=args.output_len if args.merge_tokens else 0,
                   api_loops=args.api_loops, pinned_engines=args.pinned_engines)
    summary = got.summary | {
        "real_s": round(real_s, 1), "total_s": round(time.monotonic() - t0, 1),
        "load_at_start": [round(x, 2) for x in load],
        "load_at_end": [round(x, 2) for x in os.getloadavg()],
        "sched_autogroup": autogroup(),
        "profile": str(args.profile), "arrivals": args.arrivals,
        "frontend_cores": args.frontend_cores, "host_cores": args.host_cores,
        "api_loops": args.api_loops, "pinned_engines": args.pinned_engines,
        "engine_spans": args.engine_spans, "real_keys": got.keys, "way": got.way,
        "failures": failures}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 1 if failures else 0


def cross_main(args: argparse.Namespace, failures: dict[str, str], t0: float,
               real_s: float, load: tuple[float, float, float]) -> int:
    """``--cross-validate``: :func:`pushkv.fit.sim_vs_real.cross.cross_validate` on the
    run in ``--out``, its summary written (``OUT/cross.json``) and printed last as one
    JSON line: the in-sample and out-of-sample ratio ranges, the out-of-sample figures
    in band, decided and counted, and ``knee_ratio`` per mode with its 95% interval
    and verdict (``knee_interval``: low, high -- None past the sweep -- verdict)."""
    try:
        got = cross_validate(args.out, args.profile, rates=args.train_rates,
                             inputs=args.train_inputs, sweep_input=args.sweep_input,
                             seed=args.seed, arrivals=args.arrivals,
                             frontend_cores=args.frontend_cores, host_cores=args.host_cores,
                             merge_tokens=args.merge_tokens, api_loops=args.api_loops,
                             pinned_engines=args.pinned_engines,
                             measured_speed=args.measured_speed,
                             figures_dir=args.figures)
    except ValueError as exc:  # a split that cannot cross-validate
        print(f"cannot cross-validate: {exc}", file=sys.stderr)
        return 2
    ins, outs = got.get("in_sample", {}), got.get("out_of_sample", {})
    summary = {
        "in_sample": [ins.get("ratio_min"), ins.get("ratio_max")],
        "out_of_sample": [outs.get("ratio_min"), outs.get("ratio_max")],
        "out_of_sample_in_band": outs.get("in_band"),
        "out_of_sample_points": outs.get("figures"),
        "out_of_sample_decided": outs.get("decided"),
        "out_of_sample_narrow_not_in": outs.get("narrow_not_in"),
        "in_sample_in_band": ins.get("in_band"), "in_sample_points": ins.get("figures"),
        "knee_ratio": got.get("knee_ratio"),
        "knee_ratio_median": got.get("knee_ratio_median"),
        **{name: {m: [v["low"], v["high"], v["verdict"]]
                  for m, v in (got.get(name) or {}).items()}
           for name in ("knee_interval", "knee_interval_median")},
        "merge_tokens": args.merge_tokens, "api_loops": args.api_loops,
        "pinned_engines": args.pinned_engines, "measured_speed": args.measured_speed,
        **{other: {"out_of_sample": [got[other].get("out_of_sample", {}).get(k)
                                     for k in ("ratio_min", "ratio_max")],
                   "out_of_sample_in_band": got[other].get("out_of_sample", {}).get("in_band"),
                   "knee_ratio": got[other].get("knee_ratio")}
           for other in ("merge", "no_merge") if other in got},
        "cross": got, "real_s": round(real_s, 1),
        "total_s": round(time.monotonic() - t0, 1),
        "load_at_start": [round(x, 2) for x in load],
        "load_at_end": [round(x, 2) for x in os.getloadavg()],
        "sched_autogroup": autogroup(),
        "profile": str(args.profile), "frontend_cores": args.frontend_cores,
        "host_cores": args.host_cores, "failures": failures}
    (args.out / "cross.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "cross"}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
