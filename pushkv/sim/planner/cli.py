"""``pushkv plan``: search P/D configurations for goodput under latency SLOs.

Bad input -- a non-positive SLO, a budget smaller than one 1P1D deployment, a TP
outside the node, an unknown mode, a missing profile -- ends with one line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ..profile import DEFAULT, ProfileError, load_profile
from ..sweep import MODE_LABELS, default_jobs
from ..trace import read_trace, trace_workload
from ..workload import ARRIVALS, WorkloadConfig, WorkloadError
from .backends import BACKENDS, BackendError, check_backend
from .measure import SLO
from .search import PACKS, PlanError, PlanSpec

_DEFAULT = PlanSpec()


def _number(text: str, kind: type, what: str, *, low: float, inclusive: bool) -> Any:
    try:
        v = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if isinstance(v, float) and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    if not (v >= low if inclusive else v > low):
        raise argparse.ArgumentTypeError(f"{text} must be {'>=' if inclusive else '>'} {low:g}")
    return v


def _pos_float(text: str) -> float:
    return float(_number(text, float, "a number", low=0, inclusive=False))


def _pos_int(text: str) -> int:
    return int(_number(text, int, "an integer", low=1, inclusive=True))


def _nonneg_int(text: str) -> int:
    return int(_number(text, int, "an integer", low=0, inclusive=True))


def _mode(text: str) -> str:
    if text not in MODE_LABELS:
        raise argparse.ArgumentTypeError(
            f"unknown mode {text!r} (choose from {', '.join(MODE_LABELS)})")
    return text


def _one_line_error(self: argparse.ArgumentParser, message: str) -> NoReturn:
    """argparse's error, as one line (no usage block): ``pushkv plan: error: ...``."""
    self.exit(2, f"{self.prog}: error: {message}\n")


def register(subparsers: Any) -> None:
    """Add ``plan`` to an ``argparse`` subparsers object (``args.func(args)`` runs it)."""
    w, s = _DEFAULT.workload, _DEFAULT.slo
    p = subparsers.add_parser(
        "plan", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        help="search xPyD, TP and transfer mode for the best goodput per GPU under SLOs",
        description="Plan a prefill/decode deployment: for every configuration within the "
        "GPU budget (xPyD, TP per side, transfer mode), find its goodput -- the highest "
        "request rate at which at least the target fraction of requests meet both the TTFT "
        "and the TPOT SLO -- by bisecting the rate in the simulator, after pruning those "
        "whose closed-form floors already miss the SLO. Prints a ranked table and the "
        "recommended configuration; progress goes to stderr. See docs/plan.md.",
    )
    p.error = _one_line_error.__get__(p)  # type: ignore[method-assign]
    g = p.add_argument_group("deployment")
    g.add_argument("--profile", metavar="FILE",
                   help=f"TOML profile overriding the built-in default ({DEFAULT.name})")
    b = g.add_mutually_exclusive_group()
    b.add_argument("--gpus", type=_pos_int, metavar="N",
                   help=f"GPU budget (default {_DEFAULT.gpus} when --nodes is not given)")
    b.add_argument("--nodes", type=_pos_int, metavar="N",
                   help="budget in nodes of network.gpus_per_node GPUs")
    g.add_argument("--tp", type=_pos_int, nargs="+", metavar="TP",
                   help="TP sizes to search, the same on both sides (default: the two "
                   "largest that fit one node and the model)")
    g.add_argument("--modes", type=_mode, nargs="+", default=list(_DEFAULT.modes),
                   help=f"transfer modes ({', '.join(MODE_LABELS)})")
    g.add_argument("--packing", choices=PACKS, nargs="+", default=list(_DEFAULT.packs),
                   help="packed-write settings to search for push modes (as pushkv sim "
                   "--pack; default: never)")
    wl = p.add_argument_group("workload (as pushkv sim takes it; the rate is searched)")
    wl.add_argument("--input-len", type=_pos_int, default=w.input_len, help="prompt tokens")
    wl.add_argument("--output-len", type=_pos_int, default=w.output_len,
                    help="generated tokens")
    wl.add_argument("--burstiness", type=_pos_float, default=w.burstiness,
                    help="gamma shape of the arrival gaps: 1 is Poisson, < 1 burstier")
    wl.add_argument("--arrivals", choices=ARRIVALS, default=w.arrivals,
                    help="gap generator (see pushkv sim)")
    wl.add_argument("--num-prompts", type=_pos_int, default=w.num_prompts,
                    help="requests per simulation (the simulated duration)")
    wl.add_argument("--seed", type=_nonneg_int, default=w.seed, help="workload seed")
    wl.add_argument("--seeds", type=_pos_int, default=_DEFAULT.seeds,
                    help="iterations (random streams) per simulated rate, requests pooled")
    wl.add_argument("--trace", metavar="FILE",
                    help="replay a JSON-lines trace (Mooncake's FAST'25 format or pushkv's, "
                    "as pushkv sim --trace) instead of the generated workload: its lengths, "
                    "prefix hashes and arrival pattern, scaled to each rate tried; "
                    "--input-len, --output-len, --burstiness, --arrivals and --num-prompts "
                    "are then not used")
    wl.add_argument("--trace-window", type=float, nargs=2, metavar=("T0", "T1"),
                    help="replay only the trace's requests arriving in [T0, T1) seconds")
    sl = p.add_argument_group("SLO")
    sl.add_argument("--ttft-slo", type=float, default=s.ttft_s, metavar="S",
                    help="time to first token, seconds")
    sl.add_argument("--tpot-slo", type=float, default=s.tpot_s, metavar="S",
                    help="time per output token, seconds")
    sl.add_argument("--percentile", type=float, default=s.percentile,
                    help="percentile at which the SLOs are stated and TTFT/TPOT reported")
    sl.add_argument("--attainment", type=float, metavar="F",
                    help="fraction of requests that must meet both SLOs (default: the "
                    "percentile's, 0.9 for p90)")
    se = p.add_argument_group("search")
    se.add_argument("--rate-tol", type=_pos_float, default=_DEFAULT.rate_tol,
                    help="rate resolution: ladder rungs 1 + TOL apart")
    se.add_argument("--rate-range", type=_pos_float, default=_DEFAULT.rate_range,
                    help="the ladder runs from the capacity bound down by this factor")
    se.add_argument("--jobs", type=_pos_int, default=default_jobs(),
                    help="worker processes, or the CPUs of a local Ray instance (default: "
                    "the CPU count, at most 8)")
    se.add_argument("--backend", choices=BACKENDS, default=BACKENDS[0],
                    help="where the simulations run: local worker processes, or Ray "
                    "(pip install 'pushkv[ray]'; a local instance unless --ray-address)")
    se.add_argument("--ray-address", metavar="ADDR",
                    help="a running Ray cluster to use (ray://HOST:10001 or HOST:6379; "
                    "'auto': the one this machine belongs to); only with --backend ray")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true",
                   help="print the plan as one JSON object instead of the table")
    o.add_argument("--plot", metavar="FILE",
                   help="also draw the Pareto plot (goodput per GPU vs TTFT) as a PNG")
    o.add_argument("--top", type=_nonneg_int, default=20,
                   help="rows of the table (0: all)")
    o.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=_run, _parser=p)


def spec_from_args(args: argparse.Namespace) -> PlanSpec:
    """The :class:`PlanSpec` the flags describe (:class:`PlanError` and the profile's
    and workload's errors on bad values)."""
    profile = (load_profile(args.profile) if args.profile else DEFAULT).validate()
    trace = None
    if args.trace is not None:
        window = tuple(args.trace_window) if args.trace_window is not None else None
        trace = read_trace(args.trace, window=window)
    elif args.trace_window is not None:
        raise PlanError("--trace-window needs --trace FILE")
    gpus = (args.nodes * profile.network.gpus_per_node if args.nodes is not None
            else args.gpus if args.gpus is not None else _DEFAULT.gpus)
    attainment = args.attainment if args.attainment is not None else args.percentile / 100
    return PlanSpec(
        profile=profile,
        workload=WorkloadConfig(
            input_len=args.input_len, output_len=args.output_len,
            burstiness=args.burstiness, arrivals=args.arrivals,
            num_prompts=args.num_prompts, seed=args.seed) if trace is None
        else trace_workload(trace, seed=args.seed),  # its mean lengths, for the report
        slo=SLO(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo, percentile=args.percentile,
                attainment=attainment),
        gpus=gpus, modes=tuple(args.modes), packs=tuple(args.packing),
        tps=tuple(args.tp) if args.tp else None, seeds=args.seeds,
        rate_tol=args.rate_tol, rate_range=args.rate_range, trace=trace,
    )


def _run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    try:
        spec = spec_from_args(args)
        from .search import candidates

        candidates(spec)  # refuse a budget or TP that fits nothing before any work
        check_backend(args.backend, args.ray_address)  # Ray missing: before any work
    except (PlanError, ProfileError, WorkloadError, BackendError) as exc:
        parser.error(str(exc))
    except OSError as exc:
        parser.error(f"{exc.strerror or exc}: {exc.filename or ''}".rstrip(": "))
    try:
        from .report import plot_pareto, recommendation, table, to_json
        from .search import run_plan

        plan = run_plan(spec, jobs=args.jobs, backend=args.backend,
                        ray_address=args.ray_address,
                        progress=None if args.quiet else sys.stderr)
        plot_path = plot_pareto(plan, args.plot) if args.plot else None
    except BackendError as exc:
        parser.error(str(exc))
    except ModuleNotFoundError as exc:
        if exc.name not in ("simpy", "matplotlib"):
            raise
        parser.error(f"this command needs {exc.name}: pip install 'pushkv[sim]'")
    if args.json:
        doc = to_json(plan)
        if plot_path is not None:
            doc["plot"] = str(plot_path)
        print(json.dumps(doc, indent=1))
        return 0
    slo = spec.slo
    what = (f"in={spec.workload.input_len} out={spec.workload.output_len}"
            if spec.trace is None else
            f"trace {spec.trace.name} ({len(spec.trace.requests)} requests, mean "
            f"{spec.trace.mean_rate:.3g} req/s as recorded)")
    print(f"{spec.profile.name}: {what}, {spec.gpus} GPUs; SLO p{slo.percentile:g} "
          f"TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s, met by >= "
          f"{100 * slo.attainment:g}% of requests")
    print(table(plan, args.top or None))
    pruned = sum(o.pruned is not None for o in plan.outcomes)
    print(f"\n{len(plan.outcomes)} configurations ({pruned} pruned by their floors), "
          f"{plan.simulations} simulations (the full ladder: {plan.full_grid}), "
          f"{plan.wall_s:.1f} s on {plan.jobs} worker(s) ({plan.backend})"
          + (f"; {plan.reruns} rerun after losing their worker" if plan.reruns else ""))
    rec = recommendation(plan)
    if rec is None:
        print("no configuration meets the SLO at any rate tried: loosen the SLO, "
              "raise the budget or search more TP sizes")
    else:
        print(f"recommended: {rec['config']['label']}: {rec['reason']}")
    if plot_path is not None:
        print(f"wrote {plot_path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pushkv")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["main", "register", "spec_from_args"]
