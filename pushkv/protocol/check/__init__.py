"""An exhaustive model checker for the pushkv protocol (a package: its world,
scopes, invariants, search and injected bugs, one module each).

It explores **every** interleaving of a small scope with the real
:class:`~pushkv.protocol.producer.Producer` and
:class:`~pushkv.protocol.consumer.Consumer` endpoints: a network that may
deliver any item in flight next, duplicate or drop a frame; writes that land or
fail; engines that die; every timer firing at every point it can; engines that
abort, preempt, reissue, finish prefill and reuse freed blocks at once; a
transfer id used again by a later incarnation. States are canonical snapshots,
hashed to prune revisits; every promise of ``docs/protocol.md`` is checked in
every reachable state and once nothing can happen any more. A violation is
printed as the shortest trace that reaches it.

Run ``python -m pushkv.protocol.check --help``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import fields, replace

from ..errors import ConfigError
from .invariants import INVARIANTS
from .model import Model, Violation
from .scope import CI_SCOPES, DEEP_SCOPES, SCOPES, Scope, scope
from .search import Found, Result, explore, print_progress, replay

__all__ = ["CI_SCOPES", "DEEP_SCOPES", "INVARIANTS", "SCOPES", "Found",
           "Model", "Result",
           "Scope", "Violation", "explore", "main", "replay", "scope"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pushkv.protocol.check",
        description="Explore every interleaving of small scopes with the real endpoints.")
    ap.add_argument("scopes", nargs="*", help="named scopes (default: the CI scopes)")
    ap.add_argument("--list", action="store_true", help="list the named scopes and exit")
    ap.add_argument("--order", choices=("bfs", "dfs"), default="bfs",
                    help="bfs: shortest traces, more memory; dfs: hashes only")
    ap.add_argument("--max-states", type=int, default=None)
    ap.add_argument("--all", action="store_true", help="keep going after a violation")
    ap.add_argument("--progress", type=float, default=10.0, metavar="S",
                    help="print progress every S seconds (0: never)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    for f in fields(Scope):
        if f.name != "name" and f.type in ("int", "float", "bool", "str"):
            ap.add_argument(f"--{f.name.replace('_', '-')}", dest=f"set_{f.name}",
                            type=(lambda s: s.lower() in ("1", "true", "yes"))
                            if f.type == "bool" else eval(str(f.type)),
                            default=None, help=f.metadata.get("help"))
    args = ap.parse_args(argv)
    if args.list:
        for s in SCOPES.values():
            tag = "ci  " if s.name in CI_SCOPES else "deep"
            print(f"{tag} {s.name:18s} {s.describe()}")
        return 0
    overrides = {k[4:]: v for k, v in vars(args).items() if k.startswith("set_") and v is not None}
    names = args.scopes or list(CI_SCOPES)
    try:  # every scope checked before any runs: bad input is one line, exit 2
        scopes = [replace(scope(name), **overrides) for name in names]
    except ConfigError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc.message}\n")
    results: list[Result] = []
    for sc in scopes:
        print(f"{sc.name}: {sc.describe()}", flush=True)
        res = explore(sc, order=args.order, max_states=args.max_states,
                      stop_on_violation=not args.all,
                      progress=print_progress if args.progress else None,
                      progress_every_s=args.progress or 10.0)
        results.append(res)
        for v in res.violations:
            print(v.report())
        print(res.summary(), flush=True)
    if not any(r.violations for r in results):
        print("invariants checked in every state: " + ", ".join(INVARIANTS))
    if args.json:
        total = sum(r.seconds for r in results)
        print(json.dumps({
            "states_explored": sum(r.states for r in results),
            "states_per_s": round(sum(r.states for r in results) / total, 1) if total else 0,
            "max_depth": max(r.max_depth for r in results),
            "violations": sum(len(r.violations) for r in results),
            "scopes": {r.scope.name: r.states for r in results},
            "visibility": sorted({r.scope.visibility for r in results}),
            "invariants": list(INVARIANTS),
        }))
    return 1 if any(r.violations or not r.complete for r in results) else 0

