"""Failover under decode deaths: 1P2D real vLLM CPU servers behind ``pushkv proxy``, a
decode instance killed (SIGKILL) and restarted at random moments under load
(:mod:`pushkv.fit.e2e.failover`).

A plain server computes the greedy reference of every prompt first, and stops.
Then 1 prefill and 2 decode servers start, with a proxy in front, and
``--requests`` fresh token-id requests (``--stream`` of them streamed) run with
``--clients`` concurrent clients while ``--kills`` decode deaths come; each
request is checked token by token. ``--failover retarget``: a decode leg lost
before the answer goes, as the same transfer, to the other decode instance
(protocol rule 12; the prefill instance holds a source for ``--hold`` seconds
after its consumer died, and after writing it until the consumer's first decode
step). With ``--baseline`` the same drill runs again on fresh
prompts through a proxy with ``--resumes 0`` (streams broken mid-way end with an
error event; failures before the answer are retried as a new transfer, as before
resumable streams); with ``--baseline retry`` it runs again with ``--failover
retry`` on the same prompts and the same kill moments (the same seed), every
server restarted first so that no prefix cache holds a prompt of the first run;
``--bind late`` with ``--baseline arrival`` compares choosing the decode instance
once the prefill leg answered with choosing it at arrival, likewise.

Prints progress on stderr, a table, then one JSON line: ``client_errors``,
``wrong_tokens``, ``resume_p99_ms``, ``failovers``, ``prompt_recompute_share``
(prompt tokens re-sent to prefill by failovers before the answer began, over
every request's prompt tokens), the drill's other figures, the same from the
baseline (``*_baseline``) when run, and ``wall_s``::

    PYTHONPATH=. python benchmarks/bench_failover.py [--requests 1000] [--kills 10] \\
        [--failover retarget] [--bind late] [--baseline [retry|arrival]] \\
        > failover.out 2>&1 &
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

KEYS = ("client_errors", "wrong_tokens", "resume_p99_ms", "failovers", "prompt_recompute_share",
        "prefill_excess_share")
#: What ``--baseline`` compares with.
NO_RESUMES, RETRY, ARRIVAL = "no-resumes", "retry", "arrival"
BASELINES: dict[str, dict[str, Any]] = {
    NO_RESUMES: {"resumes": 0}, RETRY: {"failover": "retry"}, ARRIVAL: {"bind": "arrival"}}
SERVERS = ("prefill-1", "decode-1", "decode-2")


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    rng = random.Random(args.seed)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="bench-failover-"))
    model = str(write_tiny_llama(logs / "model"))
    fleet = Fleet(model, logs)
    for name, cpu in zip(SERVERS, (0, 1, 0), strict=True):
        hold = {"retarget_hold_s": args.hold} if name.startswith("prefill") else {}
        fleet.add(name, name.split("-")[0], cpu, **hold)
    same = args.baseline in (RETRY, ARRIVAL)  # the baseline runs the same prompts again
    runs = 2 if args.baseline else 1
    fresh = 1 if same else runs
    prompts = [prompt(rng.randint(8, 120), 50_000 + i) for i in range(fresh * args.requests + 8)]
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
        fleet.start(*SERVERS)
        settings = DrillSettings(requests=args.requests, kills=args.kills, clients=args.clients,
                                 stream=args.stream, resumes=args.resumes,
                                 failover=args.failover, bind=args.bind)
        result: dict[str, Any] = {"settings": vars(args)}
        baseline = BASELINES.get(args.baseline or NO_RESUMES, {})
        drills: list[tuple[str, dict[str, Any]]] = [("", {}), ("_baseline", baseline)]
        for n, (label, change) in enumerate(drills[:runs]):
            run_settings = DrillSettings(**{**settings.__dict__, **change})
            at = 8 + (0 if same else n) * args.requests
            chunk = pairs[at: at + args.requests]
            if n and same:  # no prefix cache may hold a prompt of the first run
                log("restarting every server")
                for name in SERVERS:
                    fleet.respawn(name)
                fleet.wait_healthy(*SERVERS)
            url = fleet.proxy(["prefill-1"], ["decode-1", "decode-2"], "--resumes",
                              str(run_settings.resumes), "--failover", run_settings.failover,
                              "--bind", run_settings.bind,
                              timeout_s=settings.timeout_s)
            proxy_log = str(max(logs.glob("proxy-*.log"),
                                key=lambda f: int(f.stem.split("-")[1])))
            warm(url, model, jobs_for(pairs[n * 4: n * 4 + 4], 0.0, rng))
            log(f"drill{label or ''}: {args.requests} requests, {args.kills} kills, "
                f"--resumes {run_settings.resumes} --failover {run_settings.failover} "
                f"--bind {run_settings.bind}")
            # the same seed: the same streamed requests, kill points and moments
            drng = random.Random(args.seed if same else rng.random())
            report = drill(fleet, url, jobs_for(chunk, args.stream, drng), run_settings,
                           drng, proxy_log=proxy_log, progress=log)
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
    p.add_argument("--failover", choices=("retry", "retarget"), default="retry",
                   help="the proxy's --failover")
    p.add_argument("--bind", choices=("arrival", "late"), default="arrival",
                   help="the proxy's --bind")
    p.add_argument("--hold", type=float, default=20.0,
                   help="the prefill instance's retarget_hold_s (seconds)")
    p.add_argument("--baseline", nargs="?", const=NO_RESUMES, choices=tuple(BASELINES),
                   default=None, help="also run the drill with --resumes 0 on fresh prompts "
                   "(no value), or on the same prompts and kill moments with --failover retry "
                   "(retry) or --bind arrival (arrival)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", default=None, help="directory for server logs")
    args = p.parse_args()
    result = run(args)
    print()
    base = {RETRY: "--failover retry", ARRIVAL: "--bind arrival"}.get(args.baseline or "",
                                                                      "--resumes 0")
    print(f"| figure | --failover {args.failover} --bind {args.bind} --resumes {args.resumes} "
          f"| baseline ({base}) |")
    print("|---|---|---|")
    for k in (*KEYS, "latency_p50_ms", "latency_p99_ms", "kills", "failovers_before_answer",
              "failovers_source_released", "failovers_mid_stream",
              "resume_p50_ms", "outcomes"):
        print(f"| {k} | {result.get(k)} | {result.get(k + '_baseline', '')} |")
    if "prompt_recompute_share_baseline" not in result:
        result["prompt_recompute_share_baseline"] = None
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
