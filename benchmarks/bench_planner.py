"""How much the planner's search saves: a plan on the published profile, against the
full ladder of every configuration.

Runs ``pushkv plan``'s search (:func:`pushkv.sim.planner.run_plan`) with its
defaults -- Qwen3-32B TP4/TP8 on H200, 16 GPUs, pull and push, 4096-token
prompts, 128 output tokens, p90 TTFT <= 1 s and TPOT <= 50 ms -- or the flags
given, and prints the ranked table's head; the last line is one JSON object:
``configurations``, ``pruned``, ``simulations_run``, ``full_grid_simulations``,
``wall_s``, ``jobs`` and ``recommended``.

    PYTHONPATH=. python benchmarks/bench_planner.py [--gpus 16] [--tp 4 8] [--jobs N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pushkv.sim.planner import SLO, PlanSpec, run_plan
from pushkv.sim.planner.report import recommendation, table
from pushkv.sim.sweep import default_jobs


def main() -> int:
    d = PlanSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=d.gpus, help="GPU budget")
    p.add_argument("--tp", type=int, nargs="+", help="TP sizes (default: the two largest)")
    p.add_argument("--ttft-slo", type=float, default=d.slo.ttft_s)
    p.add_argument("--tpot-slo", type=float, default=d.slo.tpot_s)
    p.add_argument("--num-prompts", type=int, default=d.workload.num_prompts)
    p.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes")
    args = p.parse_args()
    import dataclasses

    spec = PlanSpec(
        gpus=args.gpus, tps=tuple(args.tp) if args.tp else None,
        slo=SLO(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo),
        workload=dataclasses.replace(d.workload, num_prompts=args.num_prompts),
    )
    plan = run_plan(spec, jobs=args.jobs, progress=sys.stderr)
    print(table(plan, top=5))
    rec = recommendation(plan)
    print(json.dumps({
        "configurations": len(plan.outcomes),
        "pruned": sum(o.pruned is not None for o in plan.outcomes),
        "simulations_run": plan.simulations,
        "full_grid_simulations": plan.full_grid,
        "simulation_fraction": round(plan.simulations / plan.full_grid, 3)
        if plan.full_grid else None,
        "wall_s": round(plan.wall_s, 2),
        "jobs": plan.jobs,
        "cores": os.cpu_count(),
        "recommended": rec["config"]["label"] if rec else None,
        "recommended_goodput_per_gpu": round(rec["goodput_per_gpu"], 4) if rec else None,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
