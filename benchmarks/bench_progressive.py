"""Progressive push: TTFT of chunk-wise and layer-wise push against whole-request push.

(a) Simulator (:mod:`pushkv.sim.progressive`): for each profile -- the
    calibrated p5en one, 100 Gbps TCP, 8x H20 with 4x400 Gbps InfiniBand
    serving a 72B model -- one request on idle engines at 1k, 4k, 8k and 16k
    input: TTFT of each mode, its ratio to whole-request push, and the share
    of push's exposed transfer each mode hides behind prefill (1: at the
    free-transfer floor).
(a') Simulator under load (:func:`pushkv.sim.progressive.loaded_table`): the
    same profiles in the cluster simulator, closed loop (``vllm bench serve
    --max-concurrency``) at concurrency 1, 8 and 32, input 1k, 4k, 8k and 16k
    (4 x concurrency fresh prompts, 128 output tokens): mean TTFT of push,
    chunk and layer, their ratios, the absolute saving of layer-wise push, and
    the mean exposed transfer (READY after prefill end) of push and layer, the
    share of requests whose registration reached prefill before their prefill
    ended (only those can overlap; layer-wise runs) and layer-wise's writes.
    ``--quick``: 4k only, 1 x concurrency prompts of 16 output tokens.
(b) Real vLLM CPU engines (tiny model, this machine): one decode server for
    the run; for each granularity a prefill server (chunked prefill of
    ``--budget`` tokens a step, prefix caching off on both) and ``pushkv proxy``
    in front. Rounds alternate the granularities (the order rotates each
    round; the prefill server and the proxy restart for each); in each, after
    one warm-up request, ``--requests`` streamed requests of ``--length``
    fresh tokens are sent one at a time and timed to their first token at the
    client. A granularity's TTFT is the median over rounds of each round's
    median; its ratio is that over whole-request push's. Greedy outputs must
    agree across granularities.

The last line is one JSON object: ``sim_hidden_share_16k`` (layer-wise, the
smallest over the profiles), ``sim_ttft_ratio_layer_16k`` (the largest over
the profiles), ``sim_loaded_ttft_ratio_layer_c32_4k`` (per profile: layer over
push at concurrency 32, 4k input), ``real_ttft_ratio_layer``,
``real_ttft_ratio_chunk``.

    PYTHONPATH=. python benchmarks/bench_progressive.py [--sim-only | --real-only]
        [--quick] [--profiles P ...] [--jobs J] [--short] [--rounds N] [--requests K] [--length L]
        [--budget B]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pushkv.sim.progressive import PROFILES, loaded_table, named_profile, table

LENGTHS = (1024, 4096, 8192, 16384)
CONCURRENCIES = (1, 8, 32)


def simulate(profiles: tuple[str, ...] = tuple(PROFILES)) -> dict[str, list[dict[str, float]]]:
    return {name: table(named_profile(name), LENGTHS) for name in profiles}


def simulate_loaded(*, quick: bool, jobs: int, profiles: tuple[str, ...] = tuple(PROFILES)
                    ) -> dict[str, list[dict[str, Any]]]:
    """Part (a'): each profile's closed-loop table."""
    lengths, per_slot, out_len = ((4096,), 1, 16) if quick else (LENGTHS, 4, 128)
    return {name: loaded_table(named_profile(name), lengths, CONCURRENCIES,
                               prompts_per_slot=per_slot, output_len=out_len, jobs=jobs)
            for name in profiles}


def print_loaded(results: dict[str, list[dict[str, Any]]]) -> None:
    print("simulator under load: mean TTFT (ms) by push mode, closed loop")
    print(f"{'profile':<9} {'conc':>4} {'input':>6} {'push':>9} {'chunk':>9} {'layer':>9}"
          f" {'chunk/push':>10} {'layer/push':>10} {'saved ms':>8} {'exp push':>8}"
          f" {'exp layer':>9} {'reg early':>9} {'writes':>6}")
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<9} {r['concurrency']:>4} {r['input_len']:>6}"
                  f" {r['ttft_push_ms']:>9.1f} {r['ttft_chunk_ms']:>9.1f}"
                  f" {r['ttft_layer_ms']:>9.1f} {r['ratio_chunk']:>10.3f}"
                  f" {r['ratio_layer']:>10.3f} {r['saved_layer_ms']:>8.1f}"
                  f" {r['exposed_push_ms']:>8.1f} {r['exposed_layer_ms']:>9.1f}"
                  f" {r['registered_early']:>9.2f} {r['writes_layer']:>6.0f}")


def print_sim(results: dict[str, list[dict[str, float]]]) -> None:
    print("simulator: TTFT (ms) by push mode, one request on idle engines")
    head = (f"{'profile':<9} {'input':>6} {'push':>8} {'chunk':>8} {'layer':>8} {'free':>8}"
            f" {'chunk/push':>10} {'layer/push':>10} {'hid chunk':>9} {'hid layer':>9}"
            f" {'writes':>6}")
    print(head)
    for name, rows in results.items():
        for r in rows:
            print(f"{name:<9} {r['input_len']:>6} {r['ttft_push_ms']:>8.1f}"
                  f" {r['ttft_chunk_ms']:>8.1f} {r['ttft_layer_ms']:>8.1f}"
                  f" {r['ttft_free_ms']:>8.1f} {r['ratio_chunk']:>10.3f}"
                  f" {r['ratio_layer']:>10.3f} {r['hidden_chunk']:>9.3f}"
                  f" {r['hidden_layer']:>9.3f} {r['writes_layer']:>6.0f}")


GRANULARITIES = ("request", "chunk", "layer")


def _ttft(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[float, list[int]]:
    """(seconds to the first streamed token, every token id) of one request."""
    import time
    import urllib.request

    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    from pushkv.vllm.testing import sse_events

    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        for event in sse_events(resp):
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            got = event["choices"][0].get("token_ids") or []
            if got and first is None:
                first = time.perf_counter() - t0
            tokens += got
    if first is None:
        raise RuntimeError("no token streamed")
    return first, tokens


class _Proxy:
    """``pushkv proxy`` in front of one prefill and one decode server."""

    def __init__(self, prefill: str, decode: str, log: Any) -> None:
        import os
        import subprocess
        import sys
        from pathlib import Path

        from pushkv.vllm.testing import PROCESS_GROUP, free_port

        self.port = free_port()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pushkv.cli", "proxy", "--prefill", prefill,
                 "--decode", decode, "--port", str(self.port), "--timeout", "120"],
                env=env, stdout=out, stderr=subprocess.STDOUT, process_group=PROCESS_GROUP)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = 60.0) -> None:
        import time

        from pushkv.vllm.testing import get_text

        end = time.monotonic() + timeout_s
        while True:
            try:
                get_text(self.url + "/health", timeout=5)
                return
            except OSError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError("the proxy did not come up") from None
                time.sleep(0.2)

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def real(*, rounds: int, requests: int, length: int, budget: int, max_tokens: int,
         logs: str) -> dict[str, Any]:
    """Part (b): TTFT of each granularity on real vLLM CPU engines (see the module docs)."""
    import statistics
    import tempfile
    import time
    from pathlib import Path

    from pushkv.vllm.testing import (
        Server,
        ServerSpec,
        free_port,
        kv_transfer_config,
        running,
        write_tiny_llama,
    )

    log_dir = Path(logs or tempfile.mkdtemp(prefix="bench-progressive-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = str(write_tiny_llama(log_dir / "tiny-llama"))
    max_len = max(2048, length + max_tokens)

    def spec(cpu: int, kv: dict[str, Any], chunked: bool) -> ServerSpec:
        extra = ("--max-num-batched-tokens", str(budget)) if chunked else ()
        return ServerSpec(model=model, port=free_port(), cpu=cpu, kv_config=kv,
                          max_model_len=max_len, prefix_caching=False, extra_args=extra)

    def prompt(salt: int) -> list[int]:
        return [(salt * 131 + 7 * i) % 990 + 5 for i in range(length)]

    ttft: dict[str, list[list[float]]] = {g: [] for g in GRANULARITIES}
    outputs: dict[str, dict[int, list[int]]] = {g: {} for g in GRANULARITIES}
    failed: list[str] = []  # runs lost to an error (on a loaded machine: timeouts)
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}

    def run_one(g: str, r: int, decode: Server) -> None:
        prefill = Server(spec(0, kv_transfer_config(
            "kv_producer", f"prefill-{g}-{r}", push_granularity=g), True),
            log_dir / f"prefill-{g}-{r}.log")
        with running(prefill):
            proxy = _Proxy(prefill.url, decode.url, log_dir / f"proxy-{g}-{r}.log")
            try:
                proxy.wait()
                _ttft(proxy.url, {**body, "prompt": prompt(10**6 + r)})  # warm-up
                times = []
                for i in range(requests):
                    salt = 1000 * r + i
                    t, tokens = _ttft(proxy.url, {**body, "prompt": prompt(salt)})
                    times.append(t)
                    outputs[g][salt] = tokens
                ttft[g].append(times)
                print(f"round {r} {g:<8} TTFT ms: "
                      + " ".join(f"{t * 1000:.1f}" for t in times), flush=True)
            finally:
                proxy.stop()

    decode = Server(spec(1, kv_transfer_config("kv_consumer", "decode-bench"), False),
                    log_dir / "decode.log")
    started = time.monotonic()
    with running(decode):
        for r in range(rounds):
            for g in GRANULARITIES[r % 3:] + GRANULARITIES[:r % 3]:  # rotate the order
                try:
                    run_one(g, r, decode)
                except (OSError, RuntimeError) as exc:  # urllib's errors are OSErrors
                    failed.append(f"round {r} {g}: {exc}")
                    print(f"round {r} {g:<8} failed: {exc}", flush=True)
                    if not decode.alive():
                        raise
    if not all(ttft.values()):
        raise RuntimeError(f"no completed run of some granularity: {failed}")
    agree = all(outputs[g][k] == outputs["request"][k] for g in GRANULARITIES
                for k in outputs[g].keys() & outputs["request"].keys())
    per_round = {g: [statistics.median(ts) for ts in runs] for g, runs in ttft.items()}
    median = {g: statistics.median(v) for g, v in per_round.items()}
    return {
        "real_ttft_ms": {g: round(v * 1000, 2) for g, v in median.items()},
        "real_ttft_ms_by_round": {g: [round(v * 1000, 2) for v in vs]
                                  for g, vs in per_round.items()},
        "real_ttft_ratio_layer": round(median["layer"] / median["request"], 4),
        "real_ttft_ratio_chunk": round(median["chunk"] / median["request"], 4),
        "real_outputs_agree": agree,
        "real_runs_failed": failed,
        "real_setup": {"length": length, "budget": budget, "rounds": rounds,
                       "requests": requests, "max_tokens": max_tokens},
        "real_wall_s": round(time.monotonic() - started, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--sim-only", action="store_true", help="part (a) only")
    only.add_argument("--real-only", action="store_true", help="part (b) only")
    ap.add_argument("--quick", action="store_true",
                    help="a short loaded simulation: 4k input only, fewer, shorter requests")
    ap.add_argument("--profiles", nargs="+", choices=list(PROFILES), default=list(PROFILES),
                    help="simulated profiles (default: all)")
    ap.add_argument("--jobs", type=int, default=2,
                    help="processes for the loaded simulation (default 2)")
    ap.add_argument("--short", action="store_true",
                    help="a quick real run: 1 round, 2 requests, 1000-token prompts")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (real)")
    ap.add_argument("--requests", type=int, default=8, help="timed requests per round")
    ap.add_argument("--length", type=int, default=2040,
                    help="prompt tokens (the tiny model's positions end at 2048)")
    ap.add_argument("--budget", type=int, default=256,
                    help="the prefill server's --max-num-batched-tokens (chunk size)")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--logs", default="", help="directory for server logs (default: a temp)")
    args = ap.parse_args()
    if args.short:
        args.rounds, args.requests, args.length = 1, 2, 1000
    out: dict[str, Any] = {
        "sim_hidden_share_16k": None,
        "sim_ttft_ratio_layer_16k": None,
        "real_ttft_ratio_layer": None,
        "real_ttft_ratio_chunk": None,
    }
    if not args.real_only:
        sim = simulate(tuple(args.profiles))
        print_sim(sim)
        at16 = {name: rows[-1] for name, rows in sim.items()}
        out |= {
            "sim_hidden_share_16k": round(min(r["hidden_layer"] for r in at16.values()), 4),
            "sim_ttft_ratio_layer_16k": round(max(r["ratio_layer"] for r in at16.values()), 4),
            "sim_hidden_share_16k_by_profile": {n: round(r["hidden_layer"], 4)
                                                for n, r in at16.items()},
        }
        loaded = simulate_loaded(quick=args.quick, jobs=args.jobs,
                                 profiles=tuple(args.profiles))
        print_loaded(loaded)
        out |= {
            "sim_loaded_ttft_ratio_layer_c32_4k": {
                n: round(r["ratio_layer"], 4) for n, rows in loaded.items() for r in rows
                if r["concurrency"] == 32 and r["input_len"] == 4096},
            "sim_loaded_saved_layer_ms_4k": {
                n: {r["concurrency"]: round(r["saved_layer_ms"], 2) for r in rows
                    if r["input_len"] == 4096} for n, rows in loaded.items()},
            "sim_loaded_quick": args.quick,
        }
    if not args.sim_only:
        got = real(rounds=args.rounds, requests=args.requests, length=args.length,
                   budget=args.budget, max_tokens=args.max_tokens, logs=args.logs)
        print("real engines: TTFT ms (median of round medians) "
              + ", ".join(f"{g} {v}" for g, v in got["real_ttft_ms"].items()))
        out |= got
    print(json.dumps(out))


if __name__ == "__main__":
    main()
