"""What an idle P/D pair costs the server next to it.

A plain server on each core serves sequential requests (128 tokens in, 32 out)
alone, then with one connector's prefill/decode pair up and idle beside it
(after a warm-up that made its handshakes), then alone again once the pair is
stopped; connector by connector. It also reads the CPU time the idle pair's
processes used over ``--idle-s`` seconds (``/proc``). The pairs are bench_e2e's
(:class:`run.Deployment`: the same progress-thread sleep, thread placement and
busy-loop cap). Last line: one JSON object, per connector the plain median with
the pair up over the median without it (the mean of before and after), and the
idle pair's CPU in cores.

    python benchmarks/e2e/idle_cost.py --out /tmp/idle [--kinds nixl-push,pushkv]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pushkv.fit.e2e import rounds  # noqa: E402
from pushkv.fit.e2e.client import Client  # noqa: E402
from pushkv.fit.e2e.deployment import Deployment, Endpoint  # noqa: E402
from pushkv.fit.e2e.modes import MODES  # noqa: E402
from pushkv.hostprobe import group_cpu_s  # noqa: E402
from pushkv.vllm.testing import write_tiny_llama, write_word_tokenizer  # noqa: E402

CLIENT_MODE = {"pushkv": "push-client", "nixl-push": "vllm-push-client",
               "nixl-pull": "pull-client"}


async def latencies(model: str, ep: Endpoint, n: int, rng: random.Random) -> list[float]:
    async with Client(model) as client:
        results = await rounds.run_mode(client, ep, rounds.prompts(n, 128, rng), 32, False)
    return [r.latency_s * 1e3 for r in results]


async def warm(model: str, ep: Endpoint, rng: random.Random) -> None:
    async with Client(model) as client:
        if ep.target.dispatch == "pushkv":
            await client.discover(ep.target)
        await rounds.run_mode(client, ep, rounds.prompts(4, 128, rng), 8, False)
        await rounds.run_mode(client, ep, rounds.prompts(8, 128, rng), 8, True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "idle")
    p.add_argument("--kinds", default="nixl-push,pushkv",
                   help=f"connectors' pairs, in turn ({', '.join(CLIENT_MODE)})")
    p.add_argument("--requests", type=int, default=30, help="plain requests per measurement")
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--delay-us", type=int, default=100)
    args = p.parse_args()
    kinds = args.kinds.split(",")
    for k in kinds:
        if k not in CLIENT_MODE:
            raise SystemExit(f"unknown connector {k!r}; choose from {', '.join(CLIENT_MODE)}")
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    rng = random.Random(0)
    plain = Deployment("plain", str(model), out, max_model_len=256,
                             delay_us=args.delay_us)
    rows: dict[str, float] = {}
    verdict: dict[str, dict[str, float]] = {}
    try:
        plain.start()
        pep = Endpoint(MODES["plain"], plain, out)
        asyncio.run(latencies(str(model), pep, 6, rng))  # warm-up
        before = statistics.median(asyncio.run(latencies(str(model), pep, args.requests, rng)))
        rows["plain alone"] = before
        for kind in kinds:
            dep = Deployment(kind, str(model), out, max_model_len=256,
                                   delay_us=args.delay_us)
            try:
                dep.start()
                asyncio.run(warm(str(model), Endpoint(MODES[CLIENT_MODE[kind]], dep, out),
                                 rng))
                groups = [s.proc.pid for s in dep.servers if s.proc is not None]
                c0, t0 = group_cpu_s(groups), time.monotonic()
                time.sleep(args.idle_s)  # the pair idles: what does it burn?
                cores = (group_cpu_s(groups) - c0) / (time.monotonic() - t0)
                beside = statistics.median(asyncio.run(
                    latencies(str(model), pep, args.requests, rng)))
            finally:
                dep.stop()
            after = statistics.median(asyncio.run(latencies(str(model), pep, args.requests, rng)))
            rows[f"plain beside an idle {kind} pair"] = beside
            rows[f"plain alone after {kind}"] = after
            verdict[kind] = {"slowdown": round(beside / ((before + after) / 2), 3),
                             "idle_cpu_cores": round(cores, 3)}
            print(f"[{kind}] plain {beside:.1f} ms beside it, {before:.1f} / {after:.1f} ms "
                  f"without; idle pair {cores:.3f} cores", flush=True)
            before = after
    finally:
        plain.stop()
    print("\n| plain server, sequential | median latency (ms) |\n|---|---|")
    for name, v in rows.items():
        print(f"| {name} | {v:.1f} |")
    print(json.dumps({"idle_neighbour": verdict}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
