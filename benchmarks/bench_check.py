"""How fast the model checker explores, on deep scopes.

Runs the deep scopes of ``pushkv.protocol.check.scope`` depth-first (a set of
64-bit state hashes, so millions of states fit), two scopes at a time in two
worker processes, each within a time budget, and keeps exploring past a
violation (one trace per kind), every scope under adversarial write visibility
(a write's bytes land in pieces, apart from its completion; see
docs/protocol.md). Then runs every known injected bug of
``pushkv.protocol.check.mutations`` and counts those the checker finds. Prints a
table, then as its last line one JSON object: ``states_explored``,
``states_per_s`` (all workers, over the wall time), ``max_depth``,
``violations``, ``visibility``, ``mutations_found`` / ``mutations_total``,
``scopes`` (distinct states per scope).

    python benchmarks/bench_check.py [--budget-s 480] [--workers 2] [SCOPE ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from pushkv.protocol.check import DEEP_SCOPES, Result, explore, scope
from pushkv.protocol.check.mutations import MAX_STATES, MUTATIONS, Patcher


def mutant(index: int) -> tuple[str, bool]:
    """Inject mutation ``index`` and look for the violation it must show."""
    mutate, sc, kind = MUTATIONS[index]
    with Patcher() as patch:
        mutate(patch)
        res = explore(sc, want=kind, max_states=MAX_STATES)
    return f"{mutate.__name__}-{sc.name}", bool(res.violations) and res.violations[0].kind == kind


def run(name: str, budget_s: float) -> tuple[str, dict[str, object]]:
    res: Result = explore(scope(name), order="dfs", stop_on_violation=False,
                          max_seconds=budget_s)
    return name, {
        "states": res.states, "transitions": res.transitions, "finals": res.finals,
        "max_depth": res.max_depth, "seconds": round(res.seconds, 1),
        "complete": res.complete or (not res.violations and res.seconds < budget_s),
        "violations": [f"{v.kind}: {v.detail}" for v in res.violations],
        "traces": [v.report() for v in res.violations],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scopes", nargs="*", default=list(DEEP_SCOPES))
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="wall-clock budget of the whole run")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    names = args.scopes
    # Each worker gets an equal share of the budget per scope it will run.
    per = args.budget_s / max(1, -(-len(names) // args.workers))
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        results = dict(pool.map(run, names, [per] * len(names)))
        wall = time.perf_counter() - start
        found = dict(pool.map(mutant, range(len(MUTATIONS))))
    print(f"{'scope':24s} {'states':>11s} {'transitions':>12s} {'final':>8s} {'depth':>6s} "
          f"{'s':>7s} {'states/s':>9s}  done  violations")
    for name in names:
        r = results[name]
        rate = r["states"] / r["seconds"] if r["seconds"] else 0.0  # type: ignore[operator]
        print(f"{name:24s} {r['states']:>11,} {r['transitions']:>12,} {r['finals']:>8,} "
              f"{r['max_depth']:>6} {r['seconds']:>7} {rate:>9,.0f}  "
              f"{'yes' if r['complete'] else 'no ':4s}  {'; '.join(r['violations']) or '-'}")  # type: ignore[arg-type]
    print(f"\ninjected bugs found: {sum(found.values())} of {len(found)}"
          + "".join(f"\n  MISSED {n}" for n, ok in found.items() if not ok))
    for name in names:
        for trace in results[name]["traces"]:  # type: ignore[attr-defined]
            print(f"\n[{name}] {trace}")
    total = sum(int(r["states"]) for r in results.values())  # type: ignore[call-overload]
    print(json.dumps({
        "states_explored": total,
        "states_per_s": round(total / wall, 1),
        "max_depth": max(int(r["max_depth"]) for r in results.values()),  # type: ignore[call-overload]
        "violations": sum(len(r["violations"]) for r in results.values()),  # type: ignore[arg-type]
        "visibility": sorted({scope(n).visibility for n in names}),
        "mutations_found": sum(found.values()),
        "mutations_total": len(found),
        "mutations_missed": sorted(n for n, ok in found.items() if not ok),
        "scopes": {n: results[n]["states"] for n in names},
        "wall_s": round(wall, 1),
        "workers": args.workers,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
