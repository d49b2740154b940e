"""Chaos and soak of pushkv on real vLLM CPU servers, with a plain server's greedy outputs
as the reference for every request.

1. **Chaos.** Two prefill and two decode servers (PushKVConnector, default side-channel
   settings). Through a proxy over 2 prefill + 1 decode, then one over 1 prefill +
   2 decode, concurrent clients run while an instance is killed (SIGKILL) and
   restarted, and while another is frozen (SIGSTOP) and thawed.
2. **Soak.** A proxy over all four; ``--requests`` requests of mixed prompt and output
   lengths, streamed or not, ``--leave`` of them from clients that disconnect at a
   random point. Resident memory of every server and the proxy is sampled after the
   warm-up (the first tenth) and at the end; p99 latency of the first and last halves
   is compared.

Every request is classified (:mod:`pushkv.vllm.chaos`): correct, clear error, wrong,
hung, unclear, or left on purpose. At the end every live server must hold no KV
block. Prints a table, then one JSON line: ``requests``, ``correct``,
``clear_errors``, ``hung``, ``wrong_outputs``, ``leaked_blocks``, ``failover_p99_ms``
(p99 latency of the requests in flight when a fault hit), ``soak_rss_growth_pct``,
and more.

    PYTHONPATH=. python benchmarks/bench_chaos.py --requests 2000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pushkv.vllm.chaos import (  # noqa: E402
    Fleet,
    Job,
    Load,
    Outcome,
    prompt,
    references,
    wait_for,
    warm,
)
from pushkv.vllm.testing import get_text, metric, write_tiny_llama  # noqa: E402

NAMES = ("prefill-1", "prefill-2", "decode-1", "decode-2")
MAX_OUT = 32
BOUND_S = 30.0
PATIENCE_S = BOUND_S + 20


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def rss_kib(pgids: list[int]) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) not in pgids:
                continue
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total


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
        self.outcomes: list[Outcome] = []

    def jobs(self, n: int, leave: float = 0.0) -> list[Job]:
        out = []
        for _ in range(n):
            tokens, ref = self.refs.pop()
            k = self.rng.randint(4, MAX_OUT)
            stream = self.rng.random() < 0.4
            left = self.rng.uniform(0.05, 1.5) if self.rng.random() < leave else None
            out.append(Job(tokens, ref[:k], stream=stream, leave_after=left))
        return out

    def phase(self, url: str, fault: Callable[[], None], n: int) -> None:
        load = Load(url, self.fleet.model, self.jobs(n), clients=self.args.clients,
                    timeout_s=PATIENCE_S).start()
        wait_for(lambda: load.done >= self.args.clients, 300, "first answers")
        t_fault = time.monotonic()
        fault()
        outcomes = load.join(PATIENCE_S * n)
        # Requests in flight when the fault hit: they began before it, ended after.
        self.failover += [o.latency_s for o in outcomes
                          if o.started < t_fault < o.started + o.latency_s]
        self.outcomes += outcomes
        print(f"  phase: {dict(Load.summary(outcomes))}", flush=True)

    def chaos(self) -> None:
        f = self.fleet
        for prefill, decode, victim, frozen in (
                (["prefill-1", "prefill-2"], ["decode-1"], "prefill-2", "prefill-1"),
                (["prefill-1"], ["decode-1", "decode-2"], "decode-2", "decode-1")):
            url = f.proxy(prefill, decode, timeout_s=BOUND_S)
            warm(url, f.model, self.jobs(4))
            print(f"chaos: {prefill} x {decode}: kill {victim}, freeze {frozen}", flush=True)
            self.phase(url, lambda v=victim: f.kill(v), self.args.chaos_jobs)
            f.restart(victim)
            wait_for(lambda u=url, v=victim: metric(
                get_text(u + "/metrics"), "pushkv_proxy_instance_up",
                url=f.instances[v].url) == 1, 120, f"{victim} back")

            def freeze(u: str = url, name: str = frozen) -> None:
                f.freeze(name)
                wait_for(lambda: metric(get_text(u + "/metrics"), "pushkv_proxy_instance_up",
                                        url=f.instances[name].url) == 0, 60, "out")
                f.thaw(name)

            self.phase(url, freeze, self.args.chaos_jobs)

    def soak(self) -> dict[str, float]:
        f = self.fleet
        url = f.proxy(["prefill-1", "prefill-2"], ["decode-1", "decode-2"], timeout_s=BOUND_S)
        warm(url, f.model, self.jobs(8))
        pgids = [i.server.proc.pid for i in f.instances.values() if i.server.proc]
        pgids += [p.pid for p in f.proxies[-1:]]
        n = self.args.requests
        warmed = max(1, n // 10)
        load = Load(url, f.model, self.jobs(n, self.args.leave), clients=self.args.clients,
                    timeout_s=PATIENCE_S).start()
        print(f"soak: {n} requests, {self.args.clients} clients", flush=True)
        wait_for(lambda: load.done >= warmed, PATIENCE_S * n, "warm-up")
        rss_warm = rss_kib(pgids)
        last = 0
        while load.done < n:
            time.sleep(5)
            if load.done - last >= n // 10:
                last = load.done
                print(f"  {last}/{n} done, rss {rss_kib(pgids) / 1024:.0f} MiB", flush=True)
        outcomes = load.join(PATIENCE_S * 4)
        rss_end = rss_kib(pgids)
        self.outcomes += outcomes
        lat = [o.latency_s for o in outcomes if o.kind == "correct"]
        half = len(lat) // 2
        print(f"  soak: {dict(Load.summary(outcomes))}", flush=True)
        return {"soak_rss_warm_mib": rss_warm / 1024, "soak_rss_end_mib": rss_end / 1024,
                "soak_rss_growth_pct": 100.0 * (rss_end - rss_warm) / rss_warm,
                "soak_p99_first_ms": 1000 * p99(lat[:half]),
                "soak_p99_last_ms": 1000 * p99(lat[half:])}

    def leaked(self) -> int:
        f = self.fleet
        try:
            f.wait_idle(90)
        except AssertionError as exc:
            print(f"  {exc}", flush=True)
        total = 0
        for inst in f.live():
            text = get_text(inst.url + "/metrics")
            usage = metric(text, "vllm:kv_cache_usage_perc")
            blocks = 0
            for line in text.splitlines():
                if line.startswith("vllm:cache_config_info") and "num_gpu_blocks=" in line:
                    blocks = int(line.split('num_gpu_blocks="')[1].split('"')[0])
            total += round(usage * blocks)
        return total

    def run(self) -> dict[str, float]:
        a, f = self.args, self.fleet
        need = a.requests + 4 * a.chaos_jobs + 32
        plain = f.plain(cpu=0)
        started = time.monotonic()
        try:
            plain.start()
            f.start(*NAMES)
            plain.wait_healthy()
            prompts = [prompt(self.rng.choice((5, 17, 31, 33, 64, 97, 150, 200)), 10_000 + i)
                       for i in range(need)]
            print(f"references: {need} prompts on a plain server", flush=True)
            outs = references(plain.url, f.model, prompts, MAX_OUT)
            plain.stop()
            self.refs = list(zip(prompts, outs, strict=True))
            self.chaos()
            soak = self.soak()
            leaked = self.leaked()
        finally:
            plain.stop()
            f.stop()
        kinds = Load.summary(self.outcomes)
        return {"requests": len(self.outcomes), "correct": kinds["correct"],
                "clear_errors": kinds["clear_error"], "left": kinds["left"],
                "hung": kinds["hung"], "unclear": kinds["unclear"],
                "wrong_outputs": kinds["wrong"], "leaked_blocks": leaked,
                "failover_p99_ms": round(1000 * p99(self.failover), 1),
                **{k: round(v, 2) for k, v in soak.items()},
                "wall_s": round(time.monotonic() - started, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="soak requests")
    p.add_argument("--chaos-jobs", type=int, default=40, help="requests per chaos phase")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients")
    p.add_argument("--leave", type=float, default=0.1,
                   help="fraction of soak clients that disconnect at a random point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for server logs")
    args = p.parse_args()
    result = Bench(args).run()
    print()
    print("| metric | value |")
    print("|---|---|")
    for k, v in result.items():
        print(f"| {k} | {v} |")
    print(json.dumps(result))
    return 0 if result["hung"] == result["wrong_outputs"] == result["unclear"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
