"""Chaos and soak of pushkv on real vLLM CPU servers, with a plain server's greedy outputs
as the reference for every request (:mod:`pushkv.vllm.chaos`, the code the test suite
runs in short: ``tests/vllm/test_chaos.py``).

1. **Chaos.** Two prefill and two decode servers (PushKVConnector, default side-channel
   settings). Through a proxy over 2 prefill + 1 decode, then one over 1 prefill +
   2 decode, concurrent clients run while an instance is killed (SIGKILL) and
   restarted, and while another is frozen (SIGSTOP) until the proxy takes it out of
   rotation, then thawed. After each deployment every live server must hold no KV
   block and run no more threads than it did idle.
2. **Soak.** A proxy over all four; ``--requests`` requests of mixed prompt and output
   lengths, streamed or not, ``--leave`` of them from clients that disconnect at a
   random point (:func:`~pushkv.vllm.chaos.soak`). Resident memory of every server and
   the proxy right after the warm-up (the first tenth) and at the end; p99 latency of
   the requests served in full, per tenth of the run after the warm-up, and whether it
   rises (a Mann-Kendall test over every window, :mod:`pushkv.vllm.trend`); threads of
   each server idle before and after; KV blocks each still references at the end.

Every request is classified: correct, clear error, wrong, hung, unclear, or left on
purpose. Prints progress, a table, then one JSON line: ``requests``, ``correct``,
``clear_errors``, ``hung``, ``wrong_outputs``, ``unclear``, ``left``, ``leaked_blocks``,
``failover_p99_ms`` (p99 latency of the requests in flight when a fault hit),
``soak_rss_growth_pct`` (resident memory at the end over after the warm-up), ``outcomes``,
``chaos`` (its outcomes, retries, p99 of the requests in flight when a fault hit,
blocks and threads after each deployment), ``soak`` (its figures), ``checks`` and
``wall_s``. The exit status is 0 when every check holds.

    PYTHONPATH=. python benchmarks/bench_chaos.py --requests 2000 > /tmp/chaos.out 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pushkv.vllm.chaos import (  # noqa: E402
    STARTUP_S,
    Fleet,
    Job,
    Load,
    Outcome,
    p99,
    prompt,
    references,
    soak,
    soak_jobs,
    wait_for,
    warm,
)
from pushkv.vllm.testing import get_text, metric, write_tiny_llama  # noqa: E402

NAMES = ("prefill-1", "prefill-2", "decode-1", "decode-2")
LENGTHS = (5, 17, 31, 33, 64, 97, 150, 200)
MAX_OUT = 32
BOUND_S = 30.0
PATIENCE_S = BOUND_S + 20


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.logs = Path(args.logs or tempfile.mkdtemp(prefix="bench-chaos-"))
        model = write_tiny_llama(self.logs / "tiny-llama")
        self.fleet = Fleet(str(model), self.logs)
        for name, cpu in zip(NAMES, (0, 1, 1, 0), strict=True):
            self.fleet.add(name, name.split("-")[0], cpu)
        self.refs: list[tuple[list[int], list[int]]] = []
        self.failover: list[float] = []
        self.chaos_outcomes: list[Outcome] = []
        self.after: dict[str, Any] = {}

    def pairs(self, n: int) -> list[tuple[list[int], list[int]]]:
        out, self.refs = self.refs[:n], self.refs[n:]
        return out

    def jobs(self, n: int) -> list[Job]:
        return soak_jobs(self.pairs(n), self.rng, leave=0.0)

    def warm_round(self, url: str) -> dict[str, int]:
        f = self.fleet
        warm(url, f.model, self.jobs(4))
        self.chaos_outcomes += Load(url, f.model, self.jobs(2 * self.args.clients),
                                    clients=self.args.clients,
                                    timeout_s=PATIENCE_S).start().join(PATIENCE_S * 8)
        f.wait_idle(120)
        return f.all_threads()

    def phase(self, url: str, fault: Callable[[], None], what: str) -> None:
        n, clients = self.args.chaos_jobs, self.args.clients
        load = Load(url, self.fleet.model, self.jobs(n), clients=clients,
                    timeout_s=PATIENCE_S).start()
        wait_for(lambda: load.done >= clients, 300, "first answers")
        t_fault = time.monotonic()
        fault()
        outcomes = load.join(PATIENCE_S * n)
        # Requests in flight when the fault hit: they began before it, ended after.
        self.failover += [o.latency_s for o in outcomes
                          if o.started < t_fault < o.started + o.latency_s]
        self.chaos_outcomes += outcomes
        log(f"  {what}: {dict(Load.summary(outcomes))}")

    def chaos(self) -> dict[str, Any]:
        f = self.fleet
        retries = 0.0
        for prefill, decode, victim, frozen in (
                (["prefill-1", "prefill-2"], ["decode-1"], "prefill-2", "prefill-1"),
                (["prefill-1"], ["decode-1", "decode-2"], "decode-2", "decode-1")):
            url = f.proxy(prefill, decode, timeout_s=BOUND_S)
            idle = self.warm_round(url)
            log(f"chaos: {prefill} x {decode}: kill {victim}, freeze {frozen}; "
                f"threads idle {idle}")
            self.phase(url, lambda v=victim: f.kill(v), f"{victim} killed")
            f.restart(victim)
            wait_for(lambda u=url, v=victim: f.in_rotation(u, v), 120, f"{victim} back")
            idle[victim] = self.warm_round(url)[victim]

            def freeze(u: str = url, name: str = frozen) -> None:
                f.freeze(name)
                try:
                    wait_for(lambda: not f.in_rotation(u, name), 60, f"{name} out")
                finally:
                    f.thaw(name)

            self.phase(url, freeze, f"{frozen} frozen")
            retries += metric(get_text(url + "/metrics"), "pushkv_proxy_retries_total")
            blocks: dict[str, int] = {}
            try:
                blocks = f.wait_idle(120)
            except AssertionError as exc:
                log(f"  {exc}")
                blocks = f.all_blocks()
            threads: dict[str, int] = {}
            try:
                threads = f.wait_threads(idle, 60)
            except AssertionError as exc:
                log(f"  {exc}")
                threads = f.all_threads()
            key = f"{len(prefill)}p{len(decode)}d"
            self.after[key] = {"blocks": blocks, "threads_idle": idle, "threads_end": threads}
            log(f"  after {key}: blocks {blocks}, threads {threads}")
            f.close_proxy(url)
        return {"requests": len(self.chaos_outcomes),
                "outcomes": dict(Load.summary(self.chaos_outcomes)),
                "retries": retries, "failover_p99_ms": round(1000 * p99(self.failover), 1),
                "failover_requests": len(self.failover), **self.after}

    def soak(self) -> dict[str, Any]:
        f, a = self.fleet, self.args
        url = f.proxy(["prefill-1", "prefill-2"], ["decode-1", "decode-2"], timeout_s=BOUND_S)
        warm(url, f.model, self.jobs(8))
        f.wait_idle(120)
        jobs = soak_jobs(self.pairs(a.requests), self.rng, leave=a.leave)
        log(f"soak: {len(jobs)} requests, {a.clients} clients, "
            f"{sum(j.leave_after is not None for j in jobs)} leaving")
        report = soak(f, url, f.model, jobs, clients=a.clients, timeout_s=PATIENCE_S,
                      progress=lambda text: log("  " + text))
        f.close_proxy(url)
        out = report.figures()
        out["bad_first"] = [o.__dict__ for o in report.bad[:3]]
        return out

    def run(self) -> dict[str, Any]:
        a, f = self.args, self.fleet
        need = a.requests + 4 * (a.chaos_jobs + 2 * a.clients + 4) + 64
        plain = f.plain(cpu=0)
        started = time.monotonic()
        try:
            plain.start()
            plain.wait_healthy(STARTUP_S)
            prompts = [prompt(self.rng.choice(LENGTHS), 10_000 + i) for i in range(need)]
            log(f"references: {need} prompts on a plain server")
            outs = references(plain.url, f.model, prompts, MAX_OUT, workers=8)
            plain.stop()  # before the fleet starts: at most four servers at once
            log("starting the fleet")
            f.start(*NAMES)
            self.refs = list(zip(prompts, outs, strict=True))
            chaos = self.chaos() if not a.soak_only else {"requests": 0, "outcomes": {}}
            soaked = self.soak()
        finally:
            plain.stop()
            f.stop()
        kinds = Counter(chaos["outcomes"]) + Counter(soaked["outcomes"])
        leaked = soaked["leaked_blocks"] + sum(
            sum(v["blocks"].values()) for k, v in chaos.items() if isinstance(v, dict)
            and "blocks" in v)
        threads_back = all(soaked["threads_end"].get(k, 0) <= v
                           for k, v in soaked["threads_idle"].items()) and all(
            v["threads_end"].get(k, 0) <= n for v in self.after.values()
            for k, n in v["threads_idle"].items())
        checks = {
            "no_wrong_hung_or_unclear": kinds["wrong"] + kinds["hung"] + kinds["unclear"] == 0,
            "no_leaked_blocks": leaked == 0,
            "rss_within_10pct": soaked["rss_ratio"] <= 1.10,
            # every window at once, not the last against the first (pushkv.vllm.trend)
            "p99_not_rising": bool(soaked["p99_ms_windows"])
            and not soaked["p99_trend"]["rising"],
            "threads_back_to_idle": threads_back,
        }
        return {"requests": chaos["requests"] + soaked["requests"],
                "correct": kinds["correct"], "clear_errors": kinds["clear_error"],
                "hung": kinds["hung"], "wrong_outputs": kinds["wrong"],
                "unclear": kinds["unclear"], "left": kinds["left"],
                "leaked_blocks": leaked,
                "failover_p99_ms": chaos.get("failover_p99_ms", 0.0),
                "soak_rss_growth_pct": round(100 * (soaked["rss_ratio"] - 1), 2),
                "outcomes": dict(kinds), "chaos": chaos, "soak": soaked, "checks": checks,
                "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="soak requests")
    p.add_argument("--chaos-jobs", type=int, default=40, help="requests per chaos phase")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--leave", type=float, default=0.1,
                   help="fraction of soak clients that disconnect at a random point")
    p.add_argument("--soak-only", action="store_true", help="skip the chaos phases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for server logs")
    args = p.parse_args()
    result = Bench(args).run()
    print()
    print("| metric | value |")
    print("|---|---|")
    for k in ("requests", "outcomes", "leaked_blocks", "checks", "wall_s"):
        print(f"| {k} | {result[k]} |")
    for k in ("rss_ratio", "p99_ms_first", "p99_ms_last", "p99_ms_windows", "p99_trend",
              "threads_idle",
              "threads_end", "blocks_end"):
        print(f"| soak {k} | {result['soak'][k]} |")
    print(json.dumps(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
