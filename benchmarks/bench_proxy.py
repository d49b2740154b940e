"""What ``pushkv proxy`` itself costs a request: its CPU time and its hop, per event loop.

A stand-in for a prefill and a decode vLLM server (one process, two ports: discovery,
health, a prefill leg's JSON answer, a decode leg streaming ``--tokens`` SSE events
``--gap-ms`` apart) sits behind one ``pushkv proxy`` process per event loop
(``--event-loop``: uvloop's and asyncio's). One client sends the same streamed
completion to each proxy and straight to the stand-in decode, in turn, request by
request, ``--requests`` times, so the machine's drift reaches every path alike.

Per proxy: its process's CPU time per request (``/proc``, over the whole run, the
robust figure on a shared machine) and its hop, the client's median latency through it
less the direct one's, paired request by request. The engines are stand-ins, so this
is the proxy alone; benchmarks/bench_e2e.sh measures it in front of real vLLM servers
(``--modes plain,push-client,push,push-asyncio``).

    PYTHONPATH=. python benchmarks/bench_proxy.py [--requests 400] [--tokens 32]

``--non-streamed``: non-streamed completions, through a proxy that answers them from a
streamed decode leg (the default, so that a decode lost mid-answer is resumed) and one
that passes them through whole (``--resumes 0``): what resumability costs.

Last line: one JSON object (``cpu_ms_per_request``, ``hop_ms``, their uvloop / asyncio
ratios; with ``--non-streamed`` ``cpu_ratio_assembled_vs_whole`` and
``hop_ms_assembled_minus_whole``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pushkv.hostprobe import process_cpu_s  # noqa: E402
from pushkv.vllm.params import ENDPOINT_KEY, POLICY_KEY, Endpoint  # noqa: E402
from pushkv.vllm.testing import PROCESS_GROUP, free_port, wait_up  # noqa: E402

LOOPS = ("uvloop", "asyncio")


def stand_in(tokens: int, gap_s: float, role: str = "producer") -> web.Application:
    """A vLLM server's answers, as far as the proxy reads them (its discovery answer
    names ``role``: the proxy checks each instance's)."""
    endpoint = Endpoint(engine_id=f"{role}-0", host="127.0.0.1", port=1,
                        role=role).to_json()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 4096}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        usage = {"prompt_tokens": 64, "completion_tokens": tokens,
                 "total_tokens": 64 + tokens}
        if params.get("pushkv_discover") or (params.get("do_remote_decode")
                                             and not body.get("stream")):
            return web.json_response({"choices": [{"text": "", "finish_reason": "length"}],
                                      "kv_transfer_params": {ENDPOINT_KEY: endpoint,
                                                             POLICY_KEY: "fail"}})
        if not body.get("stream"):  # a decode leg answered whole, as vLLM does
            if gap_s:
                await asyncio.sleep(gap_s * tokens)
            return web.json_response({
                "id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
                "choices": [{"index": 0, "text": "".join(f" w{i}" for i in range(tokens)),
                             "logprobs": None, "finish_reason": "length",
                             "stop_reason": None, "prompt_logprobs": None}],
                "usage": usage})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(tokens):
            if gap_s:
                await asyncio.sleep(gap_s)
            event = {"id": "cmpl-1", "object": "text_completion", "created": 1,
                     "model": "tiny",
                     "choices": [{"index": 0, "text": f" w{i}", "logprobs": None,
                                  "finish_reason": "length" if i == tokens - 1 else None,
                                  "stop_reason": None}]}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            event = {"id": "cmpl-1", "object": "text_completion", "created": 1,
                     "model": "tiny", "choices": [], "usage": usage}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    return app


def serve_stand_in(ports: tuple[int, int], tokens: int, gap_s: float) -> None:
    async def main() -> None:
        for port, role in zip(ports, ("producer", "consumer"), strict=True):
            runner = web.AppRunner(stand_in(tokens, gap_s, role), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        await asyncio.Event().wait()

    asyncio.run(main())


async def one(session: aiohttp.ClientSession, url: str, max_tokens: int,
              stream: bool = True) -> float:
    t0 = time.perf_counter()
    body = {"model": "tiny", "prompt": [5] * 64, "max_tokens": max_tokens, "stream": stream}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {(await r.text())[:200]}")
        if stream:
            async for _ in r.content.iter_any():
                pass
        else:
            answer = await r.json()
            if answer["choices"][0]["text"].count(" w") != max_tokens:
                raise RuntimeError(f"{url}: a wrong answer {answer!r:.200}")
    return time.perf_counter() - t0


async def measure(urls: dict[str, str], pids: dict[str, int], requests: int,
                  max_tokens: int, stream: bool = True
                  ) -> tuple[dict[str, list[float]], dict[str, float]]:
    names = list(urls)
    lat: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, float] = dict.fromkeys(pids, 0.0)
    async with aiohttp.ClientSession() as session:
        for name in names:  # warm-up: connections, the proxy's discovery
            for _ in range(5):
                await one(session, urls[name], max_tokens, stream)
        for i in range(requests):
            for name in names[i % len(names):] + names[:i % len(names)]:
                c0 = process_cpu_s(pids[name]) if name in pids else 0.0
                lat[name].append(await one(session, urls[name], max_tokens, stream))
                if name in pids:
                    cpu[name] += process_cpu_s(pids[name]) - c0
            if (i + 1) % max(1, requests // 10) == 0:
                print(f"  {i + 1}/{requests} rounds", flush=True)
    return lat, {n: c / requests for n, c in cpu.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=400, help="requests per path")
    p.add_argument("--tokens", type=int, default=32, help="SSE events per answer")
    p.add_argument("--gap-ms", type=float, default=1.0,
                   help="the stand-in decode's time between two events")
    p.add_argument("--loops", default=",".join(LOOPS), help="proxies' event loops")
    p.add_argument("--non-streamed", action="store_true",
                   help="non-streamed completions instead, through a proxy that answers "
                        "them from a streamed decode leg (the default: resumable) and one "
                        "that passes them through whole (--resumes 0), on uvloop")
    args = p.parse_args()
    if args.requests < 1 or args.tokens < 1 or args.gap_ms < 0:
        p.error("--requests and --tokens must be at least 1, --gap-ms at least 0")
    loops = args.loops.split(",")
    for loop in loops:
        if loop not in LOOPS:
            p.error(f"unknown event loop {loop!r}: one of {', '.join(LOOPS)}")
    import multiprocessing as mp

    ports = (free_port(), free_port())
    upstream = mp.get_context("spawn").Process(
        target=serve_stand_in, args=(ports, args.tokens, args.gap_ms / 1000), daemon=True)
    upstream.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        prefill, decode = (f"http://127.0.0.1:{port}" for port in ports)
        wait_up(decode, "the stand-in servers")
        urls = {"direct": decode}
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        flags = {loop: ["--event-loop", loop] for loop in loops}
        if args.non_streamed:  # the same loop; the two ways of a non-streamed answer
            flags = {"assembled": ["--event-loop", "uvloop"],
                     "whole": ["--event-loop", "uvloop", "--resumes", "0"]}
            loops = list(flags)
        for name, extra in flags.items():
            port = free_port()
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "pushkv.cli", "proxy", "--prefill", prefill,
                 "--decode", decode, "--port", str(port), "--log-level", "WARNING", *extra],
                env=env, process_group=PROCESS_GROUP)
            urls[name] = f"http://127.0.0.1:{port}"
            wait_up(urls[name], f"pushkv proxy ({name})")
        print(f"{args.requests} requests per path, {args.tokens} events "
              f"{args.gap_ms} ms apart, {'non-' if args.non_streamed else ''}streamed; "
              f"paths: {', '.join(urls)}", flush=True)
        lat, cpu = asyncio.run(measure(urls, {n: pr.pid for n, pr in procs.items()},
                                       args.requests, args.tokens, not args.non_streamed))
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                os.killpg(pr.pid, signal.SIGINT)
                pr.wait(10)
        upstream.terminate()
        upstream.join(10)
    direct = lat["direct"]
    hop = {n: statistics.median(a - b for a, b in zip(lat[n], direct, strict=True)) * 1e3
           for n in loops}
    print("\n| path | median latency (ms) | hop over direct (ms) | proxy CPU per request (ms) |")
    print("|---|---|---|---|")
    print(f"| direct | {statistics.median(direct) * 1e3:.2f} | - | - |")
    for n in loops:
        print(f"| {n} | {statistics.median(lat[n]) * 1e3:.2f} | {hop[n]:.2f} | "
              f"{cpu[n] * 1e3:.2f} |")
    out = {"requests": args.requests, "tokens": args.tokens, "gap_ms": args.gap_ms,
           "cpu_ms_per_request": {n: round(cpu[n] * 1e3, 3) for n in loops},
           "hop_ms": {n: round(hop[n], 3) for n in loops}}
    if args.non_streamed:
        out["cpu_ratio_assembled_vs_whole"] = round(cpu["assembled"] / cpu["whole"], 3) \
            if cpu["whole"] else None
        out["hop_ms_assembled_minus_whole"] = round(hop["assembled"] - hop["whole"], 3)
    if set(LOOPS) <= set(loops):
        out["cpu_ratio_uvloop_vs_asyncio"] = round(cpu["uvloop"] / cpu["asyncio"], 3) \
            if cpu["asyncio"] else None
        out["hop_ratio_uvloop_vs_asyncio"] = round(hop["uvloop"] / hop["asyncio"], 3) \
            if hop["asyncio"] > 0 else None
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
