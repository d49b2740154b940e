"""The rounds of one phase: every mode serves the same fresh prompts, sequentially and
concurrently, outputs checked against the plain server's; and ``vllm bench serve``
against the router modes."""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from pushkv import timeline

from .bench_client import bench_serve
from .client import Client, Result
from .deployment import Endpoint, Freezer
from .overheads import median


def prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(5, 995) for _ in range(length)] for _ in range(n)]


async def run_mode(client: Client, ep: Endpoint, batch: list[list[int]], max_tokens: int,
                   concurrent: bool) -> list[Result]:
    """Serve ``batch`` through ``ep``; each result's ``router_cpu_ms`` is its share of the
    CPU time the router process used meanwhile (kernel ticks: exact only on average)."""
    timeline.configure(None)
    timeline.configure(ep.timeline_dir, f"client-{ep.mode.name}")
    cpu0 = ep.router_cpu_s()
    try:
        if concurrent:
            got = list(await asyncio.gather(*(client.request(ep.target, p, max_tokens)
                                              for p in batch)))
        else:
            got = [await client.request(ep.target, p, max_tokens) for p in batch]
    finally:
        timeline.configure(None)
    share = (ep.router_cpu_s() - cpu0) * 1e3 / max(1, len(got))
    for r in got:
        r.router_cpu_ms = share
    return got


def rotated(xs: list[str], k: int) -> list[str]:
    """``xs`` started at its ``k``-th item (mod its length): whose turn comes first."""
    k %= len(xs)
    return xs[k:] + xs[:k]


class Stage:
    """The one deployment that runs (``--phases turns``), every other one frozen, the
    plain server's included. Before a mode serves, :meth:`enter` makes its deployment
    the running one: it freezes the one that ran and thaws this one, and ``settle``
    sends the thawed deployment's first request per mode (it pays for the pause:
    timers overdue, connections woken). So plain's requests run with every pair
    stopped, and no connector's idle pair slows the baseline its overhead is taken
    against: a thawed, idle ``NixlPushConnector`` pair slowed plain's requests by 2-8 ms
    here, which made vLLM push's overhead look that much smaller."""

    def __init__(self, freezers: dict[str, Freezer], modes: dict[str, list[str]],
                 settle: Callable[[str], Awaitable[None]]) -> None:
        self.freezers, self.modes, self.settle = freezers, modes, settle
        self.running: str | None = None
        self.thaws = 0

    def freeze_all(self) -> None:
        for freezer in self.freezers.values():
            freezer.freeze()
        self.running = None

    def thaw_all(self) -> None:
        for freezer in self.freezers.values():
            freezer.thaw()
        self.running = None

    async def enter(self, kind: str) -> None:
        """``kind``'s deployment running, every other frozen; a no-op if it already runs."""
        if kind == self.running:
            return
        if self.running is not None:
            self.freezers[self.running].freeze()
        self.running = None
        self.freezers[kind].thaw()
        self.running = kind
        self.thaws += 1
        for name in self.modes[kind]:
            await self.settle(name)

    def order(self, names: list[str], k: int) -> list[str]:
        """``names`` kept together by deployment, the deployments' order and each one's
        modes rotated by ``k``: one thaw per deployment, not one per mode."""
        kind_of = {n: kind for kind, ns in self.modes.items() for n in ns}
        kinds = list(dict.fromkeys(kind_of[n] for n in names))
        return [n for kind in rotated(kinds, k)
                for n in rotated([m for m in names if kind_of[m] == kind], k)]


async def serve_round(client: Client, eps: dict[str, Endpoint], names: list[str],
                      args: argparse.Namespace, load: str, batch: list[list[int]], it: int,
                      phase: str, failures: list[str], turn: str | None = None,
                      stage: Stage | None = None) -> list[dict[str, Any]]:
    """One round of ``load`` ("seq" or "conc"): every mode of ``names`` (the first in
    ``names`` leads; order as given) serves ``batch``; the records, each output checked
    against plain's. ``turn``: the deployment whose turn it is (``--phases turns``),
    kept in each record so that a mode pairs with plain's requests of its own turn;
    ``stage``: each mode's deployment is made the only one running before it serves."""

    async def serve(name: str, part: list[list[int]]) -> list[Result]:
        if stage is not None:
            await stage.enter(eps[name].dep.kind)
        return await run_mode(client, eps[name], part, args.output_len, load == "conc")

    n = len(batch)
    got: dict[str, list[Result]] = {}
    slots: list[int] = [-1] * n
    tag = f"[{phase}{'/' + turn if turn else ''} iter {it}]"
    if load == "seq" and args.interleave:
        # request by request: every mode serves prompt i (in an order rotated per prompt)
        # before any serves prompt i+1, so the machine's drift reaches every mode alike
        # and each pair of latencies is a few hundred milliseconds apart
        got = {name: [] for name in names}
        slots = list(range(n))
        dead: set[str] = set()
        for i, p in enumerate(batch):
            for name in rotated(names, i) if stage is None else stage.order(names, i):
                if name in dead:
                    continue
                try:
                    got[name] += await serve(name, [p])
                except Exception as exc:
                    failures.append(f"{name} {load} round {it}: {exc!r:.200}")
                    print(f"{tag} {name:18s} {load:4s} FAILED: {exc!r:.200}", flush=True)
                    dead.add(name)
        for name in dead:
            got.pop(name)
        for name, results in got.items():
            lat = median([r.latency_s * 1e3 for r in results])
            print(f"{tag} {name:18s} {load:4s} median {lat:7.1f} ms (interleaved)",
                  flush=True)
    else:
        for name in names:
            try:
                got[name] = await serve(name, batch)
            except Exception as exc:  # reported; the other modes still run
                failures.append(f"{name} {load} round {it}: {exc!r:.200}")
                print(f"{tag} {name:18s} {load:4s} FAILED: {exc!r:.200}", flush=True)
                continue
            lat = median([r.latency_s * 1e3 for r in got[name]])
            print(f"{tag} {name:18s} {load:4s} median {lat:7.1f} ms", flush=True)
    records: list[dict[str, Any]] = []
    reference = got.get("plain")
    for name, results in got.items():
        bad = 0
        for i, (p, r) in enumerate(zip(batch, results, strict=True)):
            same = reference is not None and r.tokens == reference[i].tokens
            bad += not same
            rec = {"mode": name, "load": load, "iter": it, "phase": phase, "slot": slots[i],
                   "prompt_len": len(p), "latency_ms": r.latency_s * 1e3,
                   "ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3,
                   "tokens": len(r.tokens), "router_cpu_ms": r.router_cpu_ms,
                   "same_as_plain": same}
            if turn is not None:
                rec["turn"] = turn
            records.append(rec)
        if bad:
            print(f"{tag} {name}: {bad} outputs differ from plain's (or plain failed)",
                  flush=True)
    return records


async def discovered(client: Client, ep: Endpoint) -> None:
    """A client-dispatched pushkv mode knows its prefill's endpoint (asked once)."""
    if ep.target.dispatch == "pushkv" and ep.target.endpoint is None:
        await client.discover(ep.target)


async def warm(client: Client, eps: list[Endpoint], args: argparse.Namespace,
               rng: random.Random) -> None:
    """Handshakes, first allocations, and a concurrent batch of the measured size and
    length, so the engines have met every batch size before the first round (the first
    rounds were the slowest of a run without it)."""
    for ep in eps:
        await discovered(client, ep)
        batch = prompts(2 + args.conc_requests, args.input_len, rng)
        await run_mode(client, ep, batch[:2], 4, concurrent=False)
        await run_mode(client, ep, batch[2:], args.output_len, concurrent=True)


async def measure(args: argparse.Namespace, eps: dict[str, Endpoint], model: str,
                  phase: str, rng: random.Random, failures: list[str],
                  turns: dict[str, Freezer] | None = None) -> list[dict[str, Any]]:
    """Every round of one phase. With ``turns`` (``--phases turns``: deployment -> its
    :class:`Freezer`, plain's too), the pairs take turns within each round (order
    rotated per round): in a pair's turn its modes and plain serve the round's prompts,
    each with only its own deployment running (:class:`Stage`); the records carry the
    ``turn``. Every deployment runs again when the rounds are done."""
    names = list(eps)
    records: list[dict[str, Any]] = []

    def modes_of(kind: str) -> list[str]:
        return [n for n in names if eps[n].dep.kind == kind]

    async with Client(model) as client:
        async def settle(name: str) -> None:
            await discovered(client, eps[name])
            await run_mode(client, eps[name], prompts(1, args.input_len, rng), 2, False)

        stage = None if turns is None else Stage(
            turns, {kind: modes_of(kind) for kind in turns}, settle)
        try:
            if stage is None:
                await warm(client, list(eps.values()), args, rng)
            else:
                stage.freeze_all()
                for kind in stage.freezers:
                    await stage.enter(kind)
                    await warm(client, [eps[n] for n in modes_of(kind)], args, rng)
            for it in range(args.iters):
                batches = [(load, prompts(n, args.input_len, rng))
                           for load, n in (("seq", args.seq_requests),
                                           ("conc", args.conc_requests))
                           if n > 0]  # e.g. --seq-requests 0: concurrent rounds only
                if stage is None:
                    order = rotated(names, it)
                    for load, batch in batches:
                        records += await serve_round(client, eps, order, args, load, batch,
                                                     it, phase, failures)
                    continue
                for kind in rotated([k for k in stage.freezers if k != "plain"], it):
                    order = stage.order([n for n in names
                                         if eps[n].dep.kind in ("plain", kind)], it)
                    for load, batch in batches:
                        records += await serve_round(client, eps, order, args, load, batch,
                                                     it, phase, failures, turn=kind,
                                                     stage=stage)
        finally:  # a failed warm-up included: nothing is left stopped
            if stage is not None:
                stage.thaw_all()
    return records


def serve(args: argparse.Namespace, eps: dict[str, Endpoint], model: str, out: Path,
          status: dict[str, str]) -> None:
    """``vllm bench serve`` against the router modes (and plain) of this phase."""
    for name, ep in eps.items():
        if ep.target.dispatch != "router":
            continue
        for qps in args.serve_qps.split(","):
            fname = f"{name}_qps{qps}_in{args.input_len}_out{args.output_len}_iter0.json"
            if (out / fname).exists():
                continue  # plain: once per run
            ok = bench_serve(ep.target.url, model, out, fname, qps=qps,
                             input_len=args.input_len, output_len=args.output_len,
                             num_prompts=args.serve_prompts, seed=args.seed,
                             log=out / "logs" / f"{name}-bench.log")
            print(f"[{name}] vllm bench serve qps {qps}: {'ok' if ok else 'FAILED'}",
                  flush=True)
            if not ok:
                status[name] = f"vllm bench serve failed at qps {qps}"
