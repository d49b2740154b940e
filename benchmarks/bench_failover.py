"""Failover under decode deaths: 1P2D real vLLM CPU servers behind ``pushkv proxy``, a
decode instance killed (SIGKILL) and restarted at random moments under load
(:mod:`pushkv.fit.e2e.failover`).

A plain server computes the greedy reference of every prompt first, and stops.
Then 1 prefill and 2 decode servers start, with a proxy in front, and
``--requests`` fresh token-id requests (``--stream`` of them streamed) run with
``--clients`` concurrent clients while ``--kills`` decode deaths come; each
request is checked token by token. With ``--baseline`` the same drill runs again
on fresh prompts through a proxy with ``--resumes 0`` (streams broken mid-way end
with an error event; failures before the answer are retried as a new transfer,
as before resumable streams).

Prints progress on stderr, a table, then one JSON line: ``client_errors``,
``wrong_tokens``, ``resume_p99_ms``, ``failovers``, ``prompt_recompute_share``
(prompt tokens re-sent to prefill by failovers before the answer began, over
every request's prompt tokens), the drill's other figures, the same from the
baseline (``*_baseline``) when run, and ``wall_s``::

    PYTHONPATH=. python benchmarks/bench_failover.py [--requests 1000] [--kills 10] \\
        [--baseline] > /tmp/failover.out 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pushkv.fit.e2e.failover import DrillSettings, drill, jobs_for  # noqa: E402
from pushkv.vllm.chaos import STARTUP_S, Fleet, prompt, references, warm  # noqa: E402
from pushkv.vllm.testing import write_tiny_llama  # noqa: E402

KEYS = ("client_errors", "wrong_tokens", "resume_p99_ms", "failovers", "prompt_recompute_share")


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    rng = random.Random(args.seed)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench-failover-"))
    model = str(write_tiny_llama(logs / "model"))
    fleet = Fleet(model, logs)
    for name, cpu in (("prefill-1", 0), ("decode-1", 1), ("decode-2", 0)):
        fleet.add(name, name.split("-")[0], cpu)
    runs = 2 if args.baseline else 1
    prompts = [prompt(rng.randint(8, 120), 50_000 + i) for i in range(runs * args.requests + 8)]
    outs = [rng.randint(16, args.max_tokens) for _ in prompts]
    plain = fleet.plain(cpu=0)
    try:
        log(f"plain server: references of {len(prompts)} prompts")
        plain.start().wait_healthy(STARTUP_S)
        refs = []
        for n in sorted(set(outs)):  # one batch per output length
            idx = [i for i, o in enumerate(outs) if o == n]
            got = references(plain.url, model, [prompts[i] for i in idx], n)
            refs += list(zip(idx, got, strict=True))
        plain.stop()
        ref = dict(refs)
        pairs = [(prompts[i], ref[i]) for i in range(len(prompts))]
        log("starting 1 prefill + 2 decode servers")
        fleet.start("prefill-1", "decode-1", "decode-2")
        settings = DrillSettings(requests=args.requests, kills=args.kills, clients=args.clients,
                                 stream=args.stream, resumes=args.resumes)
        result: dict[str, Any] = {"settings": vars(args)}
        for n, (label, resumes) in enumerate([("", args.resumes), ("_baseline", 0)][:runs]):
            chunk = pairs[8 + n * args.requests: 8 + (n + 1) * args.requests]
            url = fleet.proxy(["prefill-1"], ["decode-1", "decode-2"], "--resumes",
                              str(resumes), timeout_s=settings.timeout_s)
            proxy_log = str(max(logs.glob("proxy-*.log"),
                                key=lambda f: int(f.stem.split("-")[1])))
            warm(url, model, jobs_for(pairs[n * 4: n * 4 + 4], 0.0, rng))
            log(f"drill{label or ''}: {args.requests} requests, {args.kills} kills, "
                f"--resumes {resumes}")
            report = drill(fleet, url, jobs_for(chunk, args.stream, rng),
                           DrillSettings(**{**settings.__dict__, "resumes": resumes}), rng,
                           proxy_log=proxy_log, progress=log)
            figures = report.figures()
            log(f"drill{label}: {json.dumps(figures)}")
            for k, v in figures.items():
                result[f"{k}{label}"] = v
            fleet.close_proxy(url)
        result["wall_s"] = round(time.monotonic() - started, 1)
        return result
    finally:
        plain.stop()
        fleet.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests per drill")
    p.add_argument("--kills", type=int, default=10, help="decode deaths per drill")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients")
    p.add_argument("--stream", type=float, default=0.7, help="share of streamed requests")
    p.add_argument("--max-tokens", type=int, default=120,
                   help="longest answer (each request: 16 to this many tokens)")
    p.add_argument("--resumes", type=int, default=2, help="the proxy's --resumes")
    p.add_argument("--baseline", action="store_true",
                   help="also run the drill with --resumes 0, on fresh prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for server logs")
    args = p.parse_args()
    result = run(args)
    print()
    print("| figure | resumable | baseline (--resumes 0) |")
    print("|---|---|---|")
    for k in (*KEYS, "kills", "failovers_before_answer", "failovers_mid_stream",
              "resume_p50_ms", "outcomes"):
        print(f"| {k} | {result.get(k)} | {result.get(k + '_baseline', '')} |")
    if "prompt_recompute_share_baseline" not in result:
        result["prompt_recompute_share_baseline"] = None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
