"""How fast the simulator runs: the full default sweep, then one point in-process.

Runs ``pushkv sweep`` with its defaults (pull and push x 5 input lengths x 4
rates x 5 iterations, 100 prompts each) on every core into a temporary directory, then the
heaviest single point (pull, 8 QPS, 16k input) in this process. Prints
simulated requests per wall-second; the last line is one JSON object with
``sweep_wall_s`` and ``sim_requests_per_s`` (of the sweep).

    PYTHONPATH=. python benchmarks/bench_sim.py [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from pushkv.sim import SimConfig, TransferMode, WorkloadConfig, run
from pushkv.sim.sweep import SweepSpec, configs, default_jobs, run_sweep


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes")
    args = p.parse_args()

    cfgs = configs(SweepSpec())
    requests = sum(c.workload.num_prompts for c in cfgs)
    with tempfile.TemporaryDirectory() as out:
        _, wall = run_sweep(cfgs, out, jobs=args.jobs, progress=False)
    rate = requests / wall
    print(f"default sweep: {len(cfgs)} points, {requests} requests, {args.jobs} workers "
          f"on {os.cpu_count()} cores: {wall:.1f} s, {rate:.0f} simulated requests/s")

    heavy = SimConfig(mode=TransferMode.PULL, workload=WorkloadConfig(
        request_rate=8, input_len=16384, output_len=128, num_prompts=100))
    t0 = time.perf_counter()
    r = run(heavy)
    one = time.perf_counter() - t0
    print(f"one point (pull, 8 QPS, 16k, 100 prompts) in-process: {one:.2f} s, "
          f"{heavy.workload.num_prompts / one:.0f} simulated requests/s, "
          f"{r.result['duration']:.1f} simulated s")
    print(json.dumps({"sweep_wall_s": round(wall, 3), "sim_requests_per_s": round(rate, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
