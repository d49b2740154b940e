"""How much the planner's search saves, and what Ray costs: a plan of at least 200
configurations on the published profile, on the process pool and on a local Ray
instance, against the full grid.

The default plan is the post's hardware and model (the built-in profile: Qwen3-32B,
H200, EFA) with a 16-GPU budget, TP 1, 2, 4 and 8 (155 xPyD topologies), pull and
push: 310 configurations; 4096-token prompts, 128 output tokens, 200 requests per
simulation, p90 TTFT <= 0.8 s and TPOT <= 12 ms for 90% of requests. It runs:

1. the search on the process pool (``--jobs`` workers);
2. the same search on a local Ray instance of ``--jobs`` CPUs started here (skipped
   with ``--no-ray`` or without Ray installed); its JSON must equal the pool's;
3. the full grid's answer, to check the search's best configuration: the full grid
   simulates every configuration at every rung of its rate ladder
   (``full_grid_simulations``); only a rung whose goodput per GPU would reach the
   search's best can change the answer, and a pruned configuration meets the SLO
   at no rate, so the check (:func:`pushkv.sim.planner.search.grid_best`)
   simulates only those rungs of every configuration not pruned
   (``verify_simulations``) and ranks as the plan does (skipped with
   ``--no-verify``);
4. the published 1P1D TP8 deployment (16,384-token prompts, 100 requests, p90 TTFT
   <= 1 s, TPOT <= 50 ms), push against pull: ``post_push_over_pull``.

The last line is one JSON object: ``configurations``, ``pruned``,
``simulations_run``, ``full_grid_simulations``, ``simulation_fraction``,
``wall_s`` (``process``, ``ray``), ``ray_over_process``, ``same_plan_on_ray``,
``search_best``, ``full_grid_best``, ``same_best``, ``verify_simulations``,
``post_push_over_pull``, ``cores``.

    python benchmarks/bench_plan_search.py [--jobs N] [--num-prompts 200] [--no-ray]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

from pushkv.sim import DEFAULT, WorkloadConfig
from pushkv.sim.planner import SLO, Plan, PlanSpec, run_plan
from pushkv.sim.planner.report import table, to_json
from pushkv.sim.planner.search import grid_best
from pushkv.sim.sweep import default_jobs

RUN_KEYS = ("wall_s", "jobs", "backend", "reruns")  # where and how fast, not what


def spec_from(args: argparse.Namespace) -> PlanSpec:
    return PlanSpec(
        profile=DEFAULT, gpus=args.gpus, tps=tuple(args.tp), modes=("pull", "push"),
        workload=WorkloadConfig(input_len=4096, output_len=128, num_prompts=args.num_prompts),
        slo=SLO(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo))


def _same(a: Plan, b: Plan) -> bool:
    da, db = to_json(a), to_json(b)
    for k in RUN_KEYS:
        da.pop(k)
        db.pop(k)
    return json.dumps(da) == json.dumps(db)


def post_ratio() -> float:
    spec = PlanSpec(profile=DEFAULT, gpus=16, tps=(8,), modes=("pull", "push"),
                    workload=WorkloadConfig(input_len=16384, output_len=128, num_prompts=100),
                    slo=SLO(ttft_s=1.0, tpot_s=0.05))
    plan = run_plan(spec, jobs=2, progress=None)
    g = {o.candidate.mode: o.goodput for o in plan.outcomes}
    return g["push"] / g["pull"] if g["pull"] > 0 else math.inf


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=16, help="GPU budget")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8], help="TP sizes")
    p.add_argument("--ttft-slo", type=float, default=0.8)
    p.add_argument("--tpot-slo", type=float, default=0.012)
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--jobs", type=int, default=default_jobs(),
                   help="worker processes, and the local Ray instance's CPUs")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    p.add_argument("--no-verify", action="store_true", help="skip the full grid's check")
    args = p.parse_args()
    spec = spec_from(args)

    pool = run_plan(spec, jobs=args.jobs, progress=sys.stderr)
    print(table(pool, top=8))
    walls: dict[str, float] = {"process": round(pool.wall_s, 2)}
    same_on_ray: bool | None = None
    if not args.no_ray:
        try:
            import ray
        except ImportError:
            print("ray is not installed: pip install 'pushkv[ray]' (Ray run skipped)",
                  file=sys.stderr)
        else:
            t0 = time.perf_counter()
            ray.init(num_cpus=args.jobs, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False)
            start = time.perf_counter() - t0
            try:
                on_ray = run_plan(spec, backend="ray", progress=sys.stderr)
            finally:
                ray.shutdown()
            walls["ray"] = round(on_ray.wall_s, 2)
            walls["ray_start"] = round(start, 2)
            same_on_ray = _same(pool, on_ray)
    grid, verify = (None, 0) if args.no_verify else grid_best(pool)
    grid_label = grid.label if grid is not None else None
    best = pool.best.candidate.label if pool.best else None
    ratio = post_ratio()
    print(f"\n{len(pool.outcomes)} configurations, {pool.simulations} simulations against "
          f"the full grid's {pool.full_grid} ({pool.simulations / pool.full_grid:.1%}); "
          f"process pool {walls['process']} s"
          + (f", Ray {walls['ray']} s ({walls['ray'] / walls['process']:.2f}x; instance "
             f"start {walls['ray_start']} s more), same plan: {same_on_ray}"
             if "ray" in walls else ""))
    if not args.no_verify:
        print(f"best: search {best}, full grid {grid_label} ({verify} simulations to check)")
    print(f"the post's 1P1D TP8, 16k prompts: push's goodput {ratio:.2f}x pull's")
    out: dict[str, Any] = {
        "configurations": len(pool.outcomes),
        "pruned": sum(o.pruned is not None for o in pool.outcomes),
        "simulations_run": pool.simulations,
        "full_grid_simulations": pool.full_grid,
        "simulation_fraction": round(pool.simulations / pool.full_grid, 4),
        "wall_s": walls,
        "ray_over_process": round(walls["ray"] / walls["process"], 3) if "ray" in walls
        else None,
        "same_plan_on_ray": same_on_ray,
        "search_best": best,
        "full_grid_best": grid_label,
        "same_best": None if args.no_verify else grid_label == best,
        "verify_simulations": verify,
        "post_push_over_pull": round(ratio, 3),
        "jobs": args.jobs,
        "cores": os.cpu_count(),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
