"""Replay a public request trace, pull vs push, on the published profile.

By default the first hour of Mooncake's conversation trace (the FAST'25 trace
release, github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache-2.0;
give its path with ``--trace``) at 1x, 1P1D, on the built-in Qwen3-32B TP8 H200 EFA
profile (or ``--profile``): each mode in its own process, progress on standard
error. Progressive push is not modelled by the cluster simulator; the result says
so. The last line is one JSON object: TTFT and TPOT p50 / p90 (ms) per mode, the
prefix-cache hit rate the trace's block hashes gave, and the wall times.

    PYTHONPATH=. python benchmarks/bench_trace.py --trace mooncake_conversation.jsonl \\
        [--window 0 3600] [--speed 1] [--modes pull push] [--profile FILE]

Without ``--trace`` it replays the slice shipped with pushkv (300 requests).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pushkv.sim.profile import DEFAULT, ProfileError
from pushkv.sim.provenance import resolve
from pushkv.sim.replay import compare
from pushkv.sim.trace import TraceError, read_trace, shipped_slice


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", default=str(shipped_slice()),
                   help="JSON-lines trace (default: the slice shipped with pushkv)")
    p.add_argument("--window", nargs=2, type=float, default=(0.0, 3600.0),
                   metavar=("T0", "T1"), help="seconds of trace time to replay")
    p.add_argument("--speed", type=float, default=1.0, help="arrival time scaling")
    p.add_argument("--modes", nargs="+", default=["pull", "push"], help="transfer modes")
    p.add_argument("--profile", help=f"TOML profile (default: built-in {DEFAULT.name})")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes")
    p.add_argument("--progress-every", type=float, default=300.0, metavar="S",
                   help="a progress line per mode every S simulated seconds (0: none)")
    args = p.parse_args()
    try:
        resolved = resolve(args.profile)
        for line in resolved.warnings:
            print(f"warning: {line}", file=sys.stderr)
        trace = read_trace(args.trace, speed=args.speed, window=tuple(args.window))
    except (ProfileError, TraceError) as exc:
        p.error(str(exc))
    print(f"{trace.name}: {len(trace.requests)} requests over {trace.span_s:.0f} s "
          f"(x{args.speed:g}), modes {', '.join(args.modes)}, profile "
          f"{resolved.profile.name}", file=sys.stderr, flush=True)
    out = compare(trace, tuple(args.modes), profile=resolved.profile,
                  num_prefill=args.num_prefill, num_decode=args.num_decode, jobs=args.jobs,
                  progress_every_s=args.progress_every)
    for mode, m in out["modes"].items():
        print(f"{mode:>10}: TTFT p50 {m['ttft_p50_ms']:.0f} ms, p90 {m['ttft_p90_ms']:.0f} "
              f"ms; TPOT p50 {m['tpot_p50_ms']:.2f} ms, p90 {m['tpot_p90_ms']:.2f} ms; "
              f"prefix hits {m['prefix_hit_rate']:.1%}; {m['wall_s']:.0f} s wall")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
