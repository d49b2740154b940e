"""``pushkv sim``, ``pushkv sweep`` and ``pushkv plot``.

:func:`register` adds the three subcommands to an existing ``argparse``
subparsers object; :func:`main` runs them on their own
(``python -m pushkv.sim.cli sim --mode push ...``). Bad input -- a negative
rate, an unknown mode, a missing or malformed profile -- ends with a
one-line message and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ..protocol import FailurePolicy
from .packing import SIM_PACKING
from .profile import DEFAULT, Profile, ProfileError
from .provenance import Resolved, resolve, to_toml
from .scenario import (
    DECODE_FAILOVERS,
    ConfigError,
    Dispatch,
    FaultConfig,
    ProtocolSettings,
    RouterPolicy,
    SimConfig,
    TransferMode,
)
from .sweep import MODE_LABELS, SweepSpec, default_jobs, parse_mode
from .trace import Trace, TraceError, read_trace, trace_workload
from .workload import ARRIVALS, WorkloadConfig, WorkloadError

_ERRORS = (ConfigError, ProfileError, WorkloadError)


# ------------------------------------------------------------ value parsers


def _number(text: str, *, integer: bool, low: float, inclusive: bool, allow_inf: bool) -> Any:
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        kind = "an integer" if integer else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    if isinstance(value, float) and math.isnan(value):
        raise argparse.ArgumentTypeError("NaN is not allowed")
    if math.isinf(value) and not allow_inf:
        raise argparse.ArgumentTypeError("infinity is not allowed here")
    ok = value >= low if inclusive else value > low
    if not ok:
        raise argparse.ArgumentTypeError(f"{text} must be {'>=' if inclusive else '>'} {low:g}")
    return value


def _pos_float(text: str) -> float:
    return float(_number(text, integer=False, low=0, inclusive=False, allow_inf=False))


def _rate(text: str) -> float:
    return float(_number(text, integer=False, low=0, inclusive=False, allow_inf=True))


def _nonneg_float(text: str) -> float:
    return float(_number(text, integer=False, low=0, inclusive=True, allow_inf=False))


def _pos_int(text: str) -> int:
    return int(_number(text, integer=True, low=1, inclusive=True, allow_inf=False))


def _nonneg_int(text: str) -> int:
    return int(_number(text, integer=True, low=0, inclusive=True, allow_inf=False))


def _fraction(text: str) -> float:
    v = _nonneg_float(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"{text} must be in [0, 1]")
    return v


# ----------------------------------------------------------- shared options


def _add_deployment(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("deployment")
    g.add_argument("--profile", metavar="FILE", help="TOML profile overriding the built-in "
                   f"default ({DEFAULT.name}); see docs/sim.md for its keys")
    g.add_argument("--dispatch", choices=[d.value for d in Dispatch], default="concurrent",
                   help="push only: the router sends the decode leg at arrival (concurrent, "
                   "default) or after prefill answers (sequential); pull is always sequential")
    g.add_argument("--num-prefill", type=_pos_int, default=1, metavar="X",
                   help="prefill instances (xPyD; default 1)")
    g.add_argument("--num-decode", type=_pos_int, default=1, metavar="Y",
                   help="decode instances (xPyD; default 1)")
    g.add_argument("--router-policy", choices=[r.value for r in RouterPolicy],
                   default="least-loaded", help="how the router picks among instances")
    g.add_argument("--prefix-hit", type=_fraction, metavar="F",
                   help="prefill prefix-cache hit fraction, overriding the profile "
                   f"(default {DEFAULT.prefill.prefix_hit_fraction})")
    g.add_argument("--fragmentation", type=_fraction, metavar="F",
                   help="probability a KV block is not next to the previous one, both sides, "
                   f"overriding the profile (default {DEFAULT.decode.fragmentation})")
    g.add_argument("--post-per-descriptor-us", type=_nonneg_float, metavar="US",
                   help="descriptor posting cost in microseconds, overriding the profile "
                   f"(default {DEFAULT.network.post_per_descriptor_s * 1e6:g})")
    g.add_argument("--pack", choices=["auto", "never", "always"], default="never",
                   help="packed writes, chosen per write by the transports' cost model "
                   "(default never)")
    w = p.add_argument_group("workload (like vllm bench serve --dataset-name random)")
    w.add_argument("--burstiness", type=_pos_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier")
    w.add_argument("--seed", type=_nonneg_int, default=0, help="workload seed (default 0)")
    w.add_argument("--max-concurrency", type=_pos_int, metavar="N",
                   help="closed loop, as vllm bench serve: at most N requests in flight; "
                   "a request due while N are in flight is sent when one ends, its TTFT "
                   "counted from then (default: open loop, every request at its arrival "
                   "time)")
    w.add_argument("--arrivals", choices=ARRIVALS, default="pushkv",
                   help="gap generator: 'pushkv' (the run's own stream) or 'vllm' (the very "
                   "send times of vllm bench serve --seed SEED+ITERATION)")
    pr = p.add_argument_group("protocol timeouts and failure policy (vLLM defaults)")
    pr.add_argument("--policy", choices=[f.value for f in FailurePolicy],
                    default=ProtocolSettings().policy.value,
                    help="a failed transfer fails the request, or decode recomputes the prompt")
    d = ProtocolSettings()
    pr.add_argument("--lease-s", type=_pos_float, default=d.lease_s,
                    help="prefill holds unclaimed KV this long")
    pr.add_argument("--heartbeat-s", type=_pos_float, default=d.heartbeat_s,
                    help="decode renews prefill leases this often")
    pr.add_argument("--window-s", type=_pos_float, default=d.window_s,
                    help="decode gives up waiting for KV after this long")
    pr.add_argument("--fence-grace-s", type=_pos_float, default=d.fence_grace_s,
                    help="after the window, blocks are released without a fence")
    pr.add_argument("--retarget-hold-s", type=_nonneg_float, default=d.retarget_hold_s,
                    help="prefill holds the KV of a dead decode instance this long for a "
                         "re-target (rule 12; default 0: released at once)")
    f = p.add_argument_group("faults (what-if)")
    f.add_argument("--drop-register", type=_fraction, default=0.0, metavar="P",
                   help="probability that a registration message is lost")
    f.add_argument("--drop-notify", type=_fraction, default=0.0, metavar="P",
                   help="probability that a write notification is lost")
    f.add_argument("--kill-prefill-at", type=_nonneg_float, metavar="T",
                   help="prefill instance 0 dies at T seconds")
    f.add_argument("--kill-decode-at", type=_nonneg_float, metavar="T",
                   help="decode instance 0 dies at T seconds")
    f.add_argument("--detect-s", type=_pos_float, default=1.0,
                   help="seconds until peers and router learn of a death (default 1)")
    f.add_argument("--decode-failover", choices=DECODE_FAILOVERS, default="fail",
                   help="a request whose decode instance dies before its first token: "
                        "fail it, retry it from scratch (prefill again), or retarget its "
                        "held KV to another decode instance (default fail)")


def _resolved(args: argparse.Namespace) -> Resolved:
    """The profile in effect and where each value came from: the built-in default,
    ``--profile``'s file, then the flags that override it."""
    flags: dict[str, tuple[Any, str]] = {}
    if args.prefix_hit is not None:
        flags["prefill.prefix_hit_fraction"] = (args.prefix_hit, "--prefix-hit")
    if args.fragmentation is not None:
        for side in ("prefill", "decode"):
            flags[f"{side}.fragmentation"] = (args.fragmentation, "--fragmentation")
    if args.post_per_descriptor_us is not None:
        flags["network.post_per_descriptor_s"] = (
            args.post_per_descriptor_us * 1e-6, "--post-per-descriptor-us")
    return resolve(args.profile, flags)


def _profile(args: argparse.Namespace) -> Profile:
    resolved = _resolved(args)
    for line in resolved.warnings:
        print(f"pushkv: warning: {line}", file=sys.stderr)
    return resolved.profile


def _trace(args: argparse.Namespace) -> Trace | None:
    """The trace of ``--trace``, cut and scaled; None without one."""
    if args.trace is None:
        for flag, value in (("--trace-speed", args.trace_speed),
                            ("--trace-window", args.trace_window)):
            if value is not None:
                raise TraceError(f"{flag} needs --trace FILE")
        return None
    if args.prefix_hit is not None:
        raise TraceError("--prefix-hit and --trace exclude each other: with a trace the "
                         "prompts' block hashes set the prefix hits")
    window = tuple(args.trace_window) if args.trace_window is not None else None
    return read_trace(args.trace, speed=args.trace_speed or 1.0, window=window)


def _base_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        dispatch=Dispatch(args.dispatch),
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        router_policy=RouterPolicy(args.router_policy),
        protocol=ProtocolSettings(
            lease_s=args.lease_s, heartbeat_s=args.heartbeat_s, window_s=args.window_s,
            fence_grace_s=args.fence_grace_s, policy=FailurePolicy(args.policy),
            retarget_hold_s=args.retarget_hold_s,
        ),
        faults=FaultConfig(
            drop_register=args.drop_register, drop_notify=args.drop_notify,
            kill_prefill_at=args.kill_prefill_at, kill_decode_at=args.kill_decode_at,
            detect_s=args.detect_s, decode_failover=args.decode_failover,
        ),
        profile=_profile(args),
        packing=dataclasses.replace(SIM_PACKING, mode=args.pack),
    )


# ---------------------------------------------------------------- commands


def _cmd_sim(args: argparse.Namespace) -> int:
    from .metrics import summary_table
    from .runner import run

    if args.print_profile:
        resolved = _resolved(args)
        for line in resolved.warnings:
            print(f"pushkv: warning: {line}", file=sys.stderr)
        sys.stdout.write(to_toml(resolved))
        return 0
    mode, default_dispatch = parse_mode(args.mode)
    trace = _trace(args)
    base = _base_config(args)
    seq = args.mode.endswith("-seq")
    dispatch = Dispatch.SEQUENTIAL if seq else base.dispatch
    # the dispatch is a choice for every push
    free = mode in (TransferMode.PUSH, TransferMode.AUTO) or mode.granularity != "request"
    workload = WorkloadConfig(
        request_rate=args.qps, burstiness=args.burstiness, input_len=args.input_len,
        output_len=args.output_len, num_prompts=args.num_prompts, seed=args.seed,
        arrivals=args.arrivals, max_concurrency=args.max_concurrency,
    ) if trace is None else dataclasses.replace(trace_workload(trace, seed=args.seed),
                                                max_concurrency=args.max_concurrency)
    cfg = dataclasses.replace(
        base, mode=mode, dispatch=dispatch if free else default_dispatch,
        iteration=args.iteration, workload=workload, trace=trace,
    )
    tl = None
    if args.timeline_dir:
        from .marks import Timeline

        tl = Timeline()
    result = run(cfg, timeline=tl)
    w = cfg.workload
    if trace is not None:
        title = f"{cfg.label()} trace {trace.name} ({len(trace.requests)} requests)"
    else:
        title = f"{cfg.label()} {w.request_rate:g} QPS in={w.input_len} out={w.output_len}"
    print(summary_table(result.result, title))
    if args.result_dir:
        print(f"wrote {result.write(args.result_dir)}")
    if tl is not None:
        print(f"wrote {tl.write(args.timeline_dir)}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from .sweep import configs, run_sweep

    spec = SweepSpec(
        modes=tuple(args.modes), input_lens=tuple(args.input_lens), rates=tuple(args.rates),
        output_len=args.output_len, num_prompts=args.num_prompts,
        iterations=args.iterations, seed=args.seed, burstiness=args.burstiness,
        arrivals=args.arrivals, max_concurrency=args.max_concurrency,
    )
    cfgs = configs(spec, _base_config(args))
    paths, wall = run_sweep(cfgs, args.out, jobs=args.jobs, progress=not args.no_progress)
    requests = sum(c.workload.num_prompts for c in cfgs)
    print(f"{len(paths)} points, {requests} simulated requests in {wall:.1f} s "
          f"({requests / wall:.0f} requests per second) -> {args.out}")
    return 0


def _cmd_plot(args: argparse.Namespace) -> int:
    from .plot import PlotError, plot, plot_cdf

    if args.cdf:
        if args.overlay or args.stat != "mean":
            raise PlotError("--cdf draws every request of each trace run: no --overlay "
                            "or --stat")
        print(f"wrote {plot_cdf(args.results_dir, args.metric, args.out, title=args.title)}")
        return 0
    path = plot(args.results_dir, args.metric, args.out, stat=args.stat,
                output_len=args.output_len, modes=args.modes, title=args.title,
                overlay=args.overlay, labels=tuple(args.labels))
    print(f"wrote {path}")
    return 0


def _mode(text: str) -> str:
    if text not in MODE_LABELS:
        raise argparse.ArgumentTypeError(
            f"unknown mode {text!r} (choose from {', '.join(MODE_LABELS)})")
    return text


def register(subparsers: Any) -> None:
    """Add ``sim``, ``sweep`` and ``plot`` to an ``argparse`` subparsers object.

    Each sets ``func``: after ``parse_args``, ``args.func(args)`` runs the command
    and returns its exit status.
    """
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = subparsers.add_parser(
        "sim", formatter_class=fmt,
        help="simulate one benchmark point and print a summary",
        description="Simulate one `vllm bench serve` point (random dataset) against a "
        "prefill/decode deployment whose KV moves by pull, push or pull-async; the real "
        "pushkv protocol endpoints run inside. Prints a summary table.",
    )
    p.add_argument("--mode", type=_mode, default="push", help="pull: decode reads, posting "
                   "inline in its engine loop; push: prefill writes from a background thread; "
                   "pull-async: pull posted by a decode background thread; push-seq: push "
                   "with a sequential router; push-chunk / push-layer: progressive push, "
                   "each prefill step's (layer's) KV written as it is computed")
    p.add_argument("--qps", type=_rate, default=1.0, help="request rate (inf: all at once)")
    p.add_argument("--input-len", type=_pos_int, default=1024, help="prompt tokens")
    p.add_argument("--output-len", type=_pos_int, default=128, help="generated tokens")
    p.add_argument("--num-prompts", type=_pos_int, default=100, help="requests")
    p.add_argument("--iteration", type=_nonneg_int, default=0,
                   help="iteration number (file name and random streams)")
    p.add_argument("--result-dir", metavar="DIR",
                   help="also write the vLLM-style result JSON into DIR")
    p.add_argument("--timeline-dir", metavar="DIR",
                   help="also write every request's timeline marks into DIR "
                   "(pushkv.timeline's JSON lines; python -m pushkv.timeline sim=DIR)")
    t = p.add_argument_group("trace replay (instead of the random workload)")
    t.add_argument("--trace", metavar="FILE",
                   help="replay the requests of a JSON-lines trace (Mooncake's FAST'25 "
                   "format, or arrival_s / input_len / output_len / block_hashes): arrival "
                   "times and lengths from the file, prefix hits from its block hashes "
                   "through an LRU prefix cache on each prefill instance (instead of "
                   "--prefix-hit); --qps, --input-len, --output-len, --num-prompts and "
                   "--burstiness are not used")
    t.add_argument("--trace-speed", type=_pos_float, metavar="X",
                   help="divide the trace's arrival times by X (2: twice the rate; "
                   "default 1)")
    t.add_argument("--trace-window", type=_nonneg_float, nargs=2, metavar=("T0", "T1"),
                   help="replay only the requests arriving in [T0, T1) seconds of trace "
                   "time (before --trace-speed)")
    p.add_argument("--print-profile", action="store_true",
                   help="print the profile in effect as TOML -- every value, with where it "
                   "came from (built-in default, the file, a flag) -- and exit; saved as a "
                   "profile it gives the same run")
    _add_deployment(p)
    p.set_defaults(func=dispatch, _run=_cmd_sim, _parser=p)

    s = subparsers.add_parser(
        "sweep", formatter_class=fmt,
        help="simulate a grid of points, one result JSON per point",
        description="Simulate modes x input lengths x rates (x iterations) in parallel "
        "processes; write {mode}_qps{q}_in{i}_out{o}_iter{n}.json per point, the same "
        "files `vllm bench serve --save-result` would write under the post's naming.",
    )
    s.add_argument("--modes", nargs="+", type=_mode, default=["pull", "push"],
                   help=f"modes ({', '.join(MODE_LABELS)})")
    s.add_argument("--input-lens", nargs="+", type=_pos_int,
                   default=[1024, 2048, 4096, 8192, 16384], help="prompt lengths")
    s.add_argument("--rates", nargs="+", type=_rate, default=[1.0, 2.0, 4.0, 8.0],
                   help="request rates (QPS)")
    s.add_argument("--output-len", type=_pos_int, default=128, help="generated tokens")
    s.add_argument("--num-prompts", type=_pos_int, default=100, help="requests per point")
    s.add_argument("--iterations", type=_pos_int, default=SweepSpec().iterations,
                   help="iterations per point, each its own random streams (arrivals, block "
                   "pools): several seeds per point, one file each (_iter0, _iter1, ...)")
    s.add_argument("--out", default="results/sim", metavar="DIR", help="output directory")
    s.add_argument("--jobs", type=_pos_int, default=default_jobs(),
                   help="worker processes (default: the CPU count)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_deployment(s)
    s.set_defaults(func=dispatch, _run=_cmd_sweep, _parser=s)

    q = subparsers.add_parser(
        "plot", formatter_class=fmt,
        help="draw TTFT or TPOT against input length from result files",
        description="Plot a metric against input length, one line per mode and rate, from "
        "{mode}_qps{q}_in{i}_out{o}_iter{n}.json files (simulated or real `vllm bench "
        "serve` results); iterations are averaged and their spread drawn as error bars. "
        "Writes a PNG.",
    )
    q.add_argument("--results-dir", required=True, metavar="DIR", help="result files")
    q.add_argument("--metric", choices=["ttft", "tpot", "itl", "e2el"], required=True,
                   help="which latency to plot")
    q.add_argument("--stat", choices=["mean", "median", "p50", "p90", "p99"], default="mean",
                   help="which statistic of the metric (p50 = median; p90 from the files' "
                   "per-request lists)")
    q.add_argument("--out", metavar="FILE", help="PNG path (default: DIR/METRIC.png)")
    q.add_argument("--output-len", type=_pos_int,
                   help="output length to plot when the directory mixes several")
    q.add_argument("--modes", nargs="+", metavar="MODE", help="only these modes")
    q.add_argument("--title", help="figure title")
    q.add_argument("--cdf", action="store_true",
                   help="trace runs (mode_trace-NAME_iterN.json): the metric's distribution "
                   "over the requests, one line per file, p50/p90/p99 marked (default "
                   "file: DIR/METRIC_cdf.png)")
    q.add_argument("--overlay", metavar="DIR", help="a second directory of result files "
                   "drawn on the same axes (e.g. measured runs over simulated ones)")
    q.add_argument("--labels", nargs=2, default=["simulated", "measured"],
                   metavar=("FIRST", "SECOND"), help="legend names of the two directories")
    q.set_defaults(func=dispatch, _run=_cmd_plot, _parser=q)


def dispatch(args: argparse.Namespace) -> int:
    """Run a parsed subcommand; user errors end with ``parser.error`` (exit 2)."""
    from .plot import PlotError

    parser: argparse.ArgumentParser = args._parser
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return run(args)
    except (*_ERRORS, PlotError) as exc:
        parser.error(str(exc))
    except ModuleNotFoundError as exc:
        if exc.name not in ("simpy", "matplotlib", "tqdm"):
            raise
        parser.error(f"this command needs {exc.name}: pip install 'pushkv[sim]'")
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        parser.error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    return 2  # pragma: no cover - parser.error exits


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pushkv", description="Simulate pull vs push KV transfer and plot the results.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    args = parser.parse_args(argv)
    return dispatch(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["dispatch", "main", "register"]
