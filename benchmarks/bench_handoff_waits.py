"""Where a request's hand-off into decode's API server goes while another decodes.

On this 2-core machine a request that meets exactly one other request in flight is
slower, hand-off by hand-off, than one that runs alone, and by more than the
simulator's processor-sharing cores give it (``docs/sim.md``, 'Where a neighbour's
cost lands'). This runs a real pushkv push pair behind its router and sends short
requests (2 output tokens) one at a time: first alone, then while one long request
streams its tokens. Meanwhile a sampler reads every thread's ``schedstat`` (time run,
time waited on a run queue, slices: ``/proc/PID/task/TID/schedstat``) of the router,
decode's API server, decode's engine and prefill's instance every ~2 ms. For each
short request's 'legs out -> decode arrives' (the router sending the decode leg, to
decode's API server handing it to its engine) it tells how long each part ran and
waited on a run queue meanwhile::

    PYTHONPATH=. python benchmarks/bench_handoff_waits.py --out /tmp/handoff

It prints the hand-off alone and beside a stream (mean, median, p90, largest, ms),
then the slowest hand-offs beside a stream with each part's run / run-queue wait,
and, around the hand-offs beside a stream slower than the alone ones' p90, how
many of decode's API server's threads waited on a run queue on average. The last line is one
JSON object (``alone``, ``beside``, ``slow``, ``api_wait_share``). Takes 2-3 minutes
(the servers' start most of it).

The accounting is :mod:`pushkv.fit.handoff`, the ``/proc`` reader
:class:`pushkv.hostprobe.ThreadReader`.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pushkv.fit.handoff import api_wait_share, bracket, by_part, handoffs, stats_ms  # noqa: E402
from pushkv.hostprobe import ThreadReader  # noqa: E402


def run(args: argparse.Namespace, say: Callable[[str], None]) -> dict[str, Any]:
    from pushkv.fit import segments
    from pushkv.fit.e2e.deployment import Deployment, Endpoint
    from pushkv.fit.e2e.modes import MODES as E2E_MODES
    from pushkv.fit.sim_vs_real.deployment import SchedSamples
    from pushkv.hostprobe import group_pids
    from pushkv.vllm.testing import (
        post_json,
        stream_token_ids,
        write_tiny_llama,
        write_word_tokenizer,
    )

    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    dep = Deployment("pushkv", str(model), out, max_model_len=1024, delay_us=0)
    ep = None
    sent: list[tuple[str, float, float]] = []
    try:
        t = time.monotonic()
        dep.start()
        ep = Endpoint(E2E_MODES["push"], dep, out)
        say(f"pushkv pair and router up in {time.monotonic() - t:.0f} s")
        url = ep.target.url
        api = dep.decode.proc.pid
        assert ep.router is not None
        parts = {"decode_api": [api], "router": [ep.router.pid],
                 "decode": [p for p in group_pids([api]) if p != api],
                 "prefill": group_pids([dep.prefill.proc.pid])}

        def short(group: str, i: int) -> None:
            t0 = time.monotonic()
            status, body = post_json(url + "/v1/completions", {
                "model": str(model), "prompt": [7 + (i * 13 + j) % 900 for j in range(64)],
                "max_tokens": 2, "temperature": 0, "ignore_eos": True})
            if status != 200:
                raise RuntimeError(f"short request {i}: HTTP {status}: {body!r:.200}")
            sent.append((group, t0, time.monotonic()))

        for i in range(4):  # the pair's first transfers pay one-off costs
            short("warm-up", i)
        reader = ThreadReader(parts)
        with SchedSamples(reader, period_s=0.002) as sampler:
            for i in range(args.alone):
                short("alone", i)
                time.sleep(args.gap_s)
            say(f"{args.alone} hand-offs alone")
            for k in range(args.streams):
                body = {"model": str(model), "prompt": [9 + (k * 7 + j) % 900 for j in range(64)],
                        "max_tokens": args.stream_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                errors: list[BaseException] = []

                def stream(body: dict[str, Any] = body, errors: list[BaseException] = errors
                           ) -> None:
                    try:
                        stream_token_ids(url, body, timeout=600)
                    except BaseException as exc:
                        errors.append(exc)

                th = threading.Thread(target=stream, name=f"stream-{k}")
                th.start()
                time.sleep(args.gap_s)  # its first token out
                i = 1000 * (k + 1)
                while th.is_alive():
                    short("beside", i)
                    i += 1
                    time.sleep(args.gap_s)
                th.join()
                if errors:
                    raise RuntimeError(f"stream {k}: {errors[0]!r}")
                say(f"stream {k + 1} of {args.streams}: "
                    f"{sum(g == 'beside' for g, _, _ in sent)} hand-offs beside a stream so far")
    finally:
        if ep is not None:
            ep.stop()
        dep.stop()
    requests = segments.load([out / "timeline" / "push", out / "timeline" / "pushkv"])
    got = handoffs(requests, [s for s in sent if s[0] != "warm-up"])
    alone = [t1 - t0 for t0, t1 in got.get("alone", [])]
    beside = got.get("beside", [])
    if not alone or not beside:
        raise RuntimeError(f"no hand-off recorded (alone {len(alone)}, beside "
                           f"{len(beside)}): see {out / 'logs'}")
    cut = stats_ms(alone)["p90"] / 1e3
    slow = [h for h in beside if h[1] - h[0] > cut]
    worst = sorted(beside, key=lambda h: h[0] - h[1])[:args.show]
    return {"alone": stats_ms(alone), "beside": stats_ms([t1 - t0 for t0, t1 in beside]),
            "slow": len(slow), "slow_cut_ms": round(cut * 1e3, 2),
            "api_wait_share": round(api_wait_share(slow, sampler.samples, reader.names), 3),
            "worst": [{"ms": round((t1 - t0) * 1e3, 2), "bracket_ms": round(
                (sampler.samples[j][0] - sampler.samples[i][0]) * 1e3, 1), "parts": {
                part: {"run_ms": round(r * 1e3, 1), "wait_ms": round(w * 1e3, 1)}
                for part, (r, w) in sorted(by_part(sampler.samples, reader.names,
                                                   t0, t1).items())}}
                for t0, t1 in worst for i, j in [bracket(sampler.samples, t0, t1)]]}


def report(got: dict[str, Any]) -> str:
    lines = ["'legs out -> decode arrives' (ms):", "",
             "| | n | mean | median | p90 | largest |", "|---|---|---|---|---|---|"]
    for name in ("alone", "beside"):
        s = got[name]
        lines.append(f"| {name} {'a stream' if name == 'beside' else ''} | {s['n']} | "
                     f"{s['mean']} | {s['median']} | {s['p90']} | {s['max']} |")
    lines += ["", "The slowest beside a stream, each part's threads' run / run-queue wait "
              "(ms, summed over its threads) between the samples around it:", ""]
    for w in got["worst"]:
        lines.append(f"{w['ms']:7.1f} ms (samples {w['bracket_ms']} ms apart): " + "; ".join(
            f"{p} {v['run_ms']} / {v['wait_ms']}" for p, v in w["parts"].items()))
    lines += ["", f"{got['slow']} hand-offs beside a stream took longer than the alone "
              f"p90 ({got['slow_cut_ms']} ms); around them {got['api_wait_share']:.2f} of decode's "
              f"API server's threads waited on a run queue, on average"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/pushkv-handoff"),
                   help="where the servers' logs and timelines go")
    p.add_argument("--alone", type=int, default=30, help="hand-offs with nothing else in flight")
    p.add_argument("--streams", type=int, default=6, help="long requests, one at a time")
    p.add_argument("--stream-tokens", type=int, default=600, help="each long request's tokens")
    p.add_argument("--gap-s", type=float, default=0.15, help="pause between short requests")
    p.add_argument("--show", type=int, default=8, help="slowest hand-offs to list")
    args = p.parse_args(argv)
    if args.alone < 1 or args.streams < 1 or args.stream_tokens < 2 or args.gap_s < 0:
        p.error("--alone and --streams must be >= 1, --stream-tokens >= 2, --gap-s >= 0")
    got = run(args, lambda line: print(line, flush=True))
    print(report(got), flush=True)
    print(json.dumps({k: v for k, v in got.items() if k != "worst"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
