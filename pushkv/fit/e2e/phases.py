"""A run of bench_e2e: the deployments up phase by phase (``--phases``), each phase's
rounds (:mod:`.rounds`), optionally ``vllm bench serve``, and the verdict.

:func:`run` does everything but the last report; ``benchmarks/e2e/run.py`` is its
command line (the flags :func:`run` reads are its flags).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from pushkv.vllm.testing import write_tiny_llama, write_word_tokenizer

from .deployment import Deployment, Endpoint, Freezer
from .modes import MODES
from .overheads import verdict
from .rounds import measure, serve

#: Deployments ``--phases auto`` puts up at once: the ratio the benchmark is about
#: (pushkv against vLLM's push connector) then pairs both with the same plain rounds.
PAIRED = ("pushkv", "nixl-push")


def plan_phases(spec: str, kinds: list[str]) -> list[list[str]]:
    """The deployments up at once, phase by phase (see ``--phases``)."""
    base = [k for k in kinds if k == "plain"]
    if spec in ("all", "turns"):  # turns: all up at once, one thawed at a time
        return [kinds]
    if spec == "auto":  # the two push connectors side by side, anything else alone
        together = [k for k in kinds if k in PAIRED]
        alone = [[k] for k in kinds if k != "plain" and k not in PAIRED]
        return [[*base, *g] for g in ([together] if together else []) + alone] or [base]
    if spec == "each":
        return [[*base, k] for k in kinds if k != "plain"] or [base]
    groups = [[k for k in g.split("+") if k] for g in spec.split(",")]
    named = [k for g in groups for k in g]
    unknown = sorted(set(named) - set(kinds) - {"plain"})
    missing = [k for k in kinds if k != "plain" and k not in named]
    if unknown or missing or len(named) != len(set(named)):
        raise SystemExit(f"--phases {spec!r}: name each deployment of the chosen modes "
                         f"({', '.join(k for k in kinds if k != 'plain')}) once"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return [[*base, *(k for k in g if k != "plain")] for g in groups]


def cycle_phases(phases: list[list[str]], cycles: int) -> list[tuple[int, list[str]]]:
    """The phases ``cycles`` times, every other time in reverse order (A B, B A, A B...),
    so that a machine drifting over the run reaches the first and the last phase alike."""
    if cycles < 1:
        raise SystemExit(f"--cycles must be at least 1, got {cycles}")
    return [(c, ph) for c in range(cycles) for ph in (phases if c % 2 == 0 else phases[::-1])]


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[str], bool]:
    """Every phase of the run ``args`` asks for, its servers started and stopped in
    turn; each phase's verdict so far in ``summary.json``, every request in
    ``latency.json``. Returns the run's verdict (with its ``status``, and its
    ``failed_rounds`` if any), the modes measured, and whether all went well (every
    deployment and round ran and every output was plain's)."""
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    names = args.modes.split(",")
    for name in names:
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    max_len = -(-(args.input_len + args.output_len + 64) // 256) * 256
    kinds = list(dict.fromkeys(MODES[n].deployment for n in names))
    # "each": the plain server stays up and the connectors' deployments come up one
    # at a time (7 vLLM servers at once need about 21 GiB); "all": everything at once.
    phases = cycle_phases(plan_phases(args.phases, kinds), args.cycles)
    deps: dict[str, Deployment] = {}
    eps: dict[str, Endpoint] = {}
    status: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    measured: list[str] = []
    rng = random.Random(args.seed)
    try:
        for cycle, phase in phases:
            for kind in phase:
                if kind in deps:
                    continue
                dep = Deployment(kind, str(model), out, max_model_len=max_len,
                                 delay_us=args.delay_us, plain_cores=args.plain_cores,
                                 spin_s=args.spin_s)
                t0 = time.monotonic()
                try:
                    dep.start()
                except Exception as exc:  # a baseline that does not start is reported
                    status[kind] = f"did not start: {exc}"
                    print(f"[{kind}] {status[kind]}", flush=True)
                    dep.stop()
                    continue
                deps[kind] = dep
                print(f"[{kind}] up in {time.monotonic() - t0:.0f} s", flush=True)
            eps = {}
            for name in names:
                dep = deps.get(MODES[name].deployment)
                if dep is not None and MODES[name].deployment in phase:
                    try:
                        eps[name] = Endpoint(MODES[name], dep, out)
                    except Exception as exc:
                        status[name] = f"router did not start: {exc}"
                        print(f"[{name}] {status[name]}", flush=True)
            label = "+".join(phase) + (f"#{cycle}" if args.cycles > 1 else "")
            turns = None
            if args.phases == "turns":
                turns = {kind: Freezer(deps[kind], [ep for ep in eps.values()
                                                    if ep.dep.kind == kind])
                         for kind in phase if kind in deps}
            try:
                try:
                    records += asyncio.run(measure(args, eps, str(model), label, rng, failures,
                                                   turns))
                except Exception as exc:  # e.g. a warm-up failed: the next phase still runs
                    status[label] = f"failed: {exc!r:.300}"
                    print(f"[{label}] {status[label]}", flush=True)
                if args.serve_qps:
                    serve(args, eps, str(model), out, status)
            finally:
                for freezer in (turns or {}).values():
                    freezer.thaw()  # a stopped process would not hear the stop
                for ep in eps.values():
                    ep.stop()
                for kind in phase:
                    if kind != "plain" and kind in deps:
                        deps.pop(kind).stop()
            measured += [n for n in eps if n not in measured]
            partial = verdict(records, [n for n in names if n in measured])
            (out / "summary.json").write_text(json.dumps(partial, indent=1))  # so far
    finally:
        for dep in deps.values():
            dep.stop()
    (out / "latency.json").write_text(json.dumps(records))
    measured = [n for n in names if n in measured]
    summary = verdict(records, measured)
    summary["status"] = status or "ok"
    if failures:
        summary["failed_rounds"] = failures
    ok = not status and not failures and summary["outputs_identical_to_plain"]
    return summary, measured, ok
