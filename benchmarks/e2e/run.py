"""Drive bench_e2e.sh: start each P/D deployment on this machine, run ``vllm bench
serve`` against its router at a few request rates, write one result JSON per point.

Modes (one prefill server on core 0, one decode server on core 1, tiny model):

* ``push``      -- pushkv: ``PushKVConnector`` on both, ``pushkv proxy`` in front.
* ``pull``      -- vLLM's ``NixlConnector``: prefill first, then the decode reads.
* ``vllm-push`` -- vLLM's ``NixlPushConnector``: both legs at once, the prefill writes.
* ``plain``     -- one server without disaggregation (core 0), for reference.

Result files are named ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json`` (what
``pushkv plot --results-dir`` reads). Prefix caching is off on every server so
repeated random prompts never skip a transfer. A mode that fails to start or
to serve is reported and skipped; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pushkv.vllm.testing import (  # noqa: E402
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    post_json,
    write_tiny_llama,
    write_word_tokenizer,
)

MODES = ("push", "pull", "vllm-push", "plain")


def nixl_config(connector: str, role: str, engine_id: str) -> dict[str, Any]:
    return {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu",
            "engine_id": engine_id, "kv_connector_extra_config": {"backends": ["UCX"]}}


class Deployment:
    """The servers and router of one mode."""

    def __init__(self, mode: str, model: str, logs: Path, max_model_len: int,
                 nixl_delay_us: int = 0) -> None:
        self.mode, self.model, self.logs = mode, model, logs
        self.nixl_delay_us = nixl_delay_us
        self.servers: list[Server] = []
        self.router: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.max_model_len = max_model_len

    def spec(self, cpu: int, kv: dict[str, Any] | None = None,
             env: dict[str, str] | None = None) -> ServerSpec:
        return ServerSpec(model=self.model, port=free_port(), cpu=cpu, kv_config=kv,
                          tokenizer=True, prefix_caching=False,
                          max_model_len=self.max_model_len, env=env or {})

    def start(self) -> None:
        mode = self.mode
        if mode == "plain":
            plain = Server(self.spec(0), self.logs / "plain.log")
            self.servers = [plain]
            plain.start().wait_healthy()
            self.url = plain.url
            return
        if mode == "push":
            p = self.spec(0, kv_transfer_config("kv_producer", "prefill-0", free_port()))
            d = self.spec(1, kv_transfer_config("kv_consumer", "decode-0", free_port()))
        else:
            connector = "NixlConnector" if mode == "pull" else "NixlPushConnector"
            p_side, d_side = free_port(), free_port()
            nixl_env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}
            if self.nixl_delay_us:
                throttle = str(ROOT / "benchmarks" / "e2e" / "nixl_throttle")
                nixl_env |= {"PUSHKV_BENCH_NIXL_DELAY_US": str(self.nixl_delay_us),
                             "PYTHONPATH": os.pathsep.join(
                                 p for p in (throttle, str(ROOT), os.environ.get("PYTHONPATH"))
                                 if p)}
            p = self.spec(0, nixl_config(connector, "kv_producer", "prefill-0"),
                          nixl_env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(p_side)})
            d = self.spec(1, nixl_config(connector, "kv_consumer", "decode-0"),
                          nixl_env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(d_side)})
        prefill = Server(p, self.logs / f"{mode}-prefill.log")
        decode = Server(d, self.logs / f"{mode}-decode.log")
        self.servers = [prefill, decode]
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_healthy()
        port = free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        if mode == "push":
            cmd = [sys.executable, "-m", "pushkv.cli", "proxy", "--prefill", prefill.url,
                   "--decode", decode.url, "--port", str(port), "--log-level", "WARNING"]
        else:
            cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e" / "vllm_proxy.py"), "--mode",
                   mode, "--prefill", prefill.url, "--decode", decode.url, "--port", str(port),
                   "--prefill-port", p.env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "0")]
        with (self.logs / f"{mode}-router.log").open("ab") as out:
            self.router = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 30
        while True:
            try:
                get_text(self.url + "/health", timeout=5)
                break
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError(f"{mode} router did not come up") from None
                time.sleep(0.2)

    def warm_up(self) -> None:
        """A few requests first (handshakes, first allocations); each must succeed."""
        for i in range(4):
            text = " ".join(f"w{(97 * i + 13 * j) % 990 + 5}" for j in range(64 + 40 * i))
            status, answer = post_json(self.url + "/v1/completions", {
                "model": self.model, "prompt": text, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True}, timeout=60)
            if status != 200:
                raise RuntimeError(f"{self.mode}: warm-up request failed: {status} {answer}")

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGINT)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.router.pid, signal.SIGKILL)
                self.router.wait(5)
        for s in self.servers:
            s.stop()


def bench(url: str, model: str, out: Path, name: str, *, qps: str, input_len: int,
          output_len: int, num_prompts: int, seed: int, log: Path) -> bool:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "e2e" / "bench_serve.py"),
           "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", model, "--tokenizer", model, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--random-range-ratio", "0", "--num-prompts", str(num_prompts),
           "--request-rate", qps, "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out), "--result-filename", name]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    with log.open("ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=600)
    if done.returncode != 0 or not (out / name).exists():
        return False
    result = json.loads((out / name).read_text())
    return int(result.get("failed", 0)) == 0 and int(result.get("completed", 0)) == num_prompts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--qps", default="2,8,inf", help="request rates, comma separated")
    p.add_argument("--input-len", default="128,512", help="prompt lengths, comma separated")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--iters", type=int, default=1)
    p.add_argument("--nixl-delay-us", type=int, default=0,
                   help="pull / vllm-push: make NIXL's progress thread sleep this long "
                   "between polls, as pushkv's does (0: as vLLM ships it, busy-spinning)")
    args = p.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    model = out / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    lengths = [int(x) for x in args.input_len.split(",")]
    max_len = max(lengths) + args.output_len + 64
    status: dict[str, str] = {}
    for mode in args.modes.split(","):
        if mode not in MODES:
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        dep = Deployment(mode, str(model), logs, max_model_len=-(-max_len // 256) * 256,
                         nixl_delay_us=args.nixl_delay_us)
        t0 = time.monotonic()
        try:
            dep.start()
            dep.warm_up()
        except Exception as exc:  # a baseline that does not run here is reported, not fatal
            status[mode] = f"did not start or serve: {exc}"
            print(f"[{mode}] {status[mode]}", flush=True)
            dep.stop()
            continue
        print(f"[{mode}] up in {time.monotonic() - t0:.0f} s", flush=True)
        failed = []
        try:
            for it in range(args.iters):
                for input_len in lengths:
                    for qps in args.qps.split(","):
                        name = f"{mode}_qps{qps}_in{input_len}_out{args.output_len}_iter{it}.json"
                        seed = 1000 * it + input_len + len(qps) * 7
                        ok = bench(dep.url, str(model), out, name, qps=qps,
                                   input_len=input_len, output_len=args.output_len,
                                   num_prompts=args.num_prompts, seed=seed,
                                   log=logs / f"{mode}-bench.log")
                        print(f"[{mode}] {name}: {'ok' if ok else 'FAILED'}", flush=True)
                        if not ok:
                            failed.append(name)
        finally:
            dep.stop()
        status[mode] = "ok" if not failed else f"failed points: {', '.join(failed)}"
    (out / "status.json").write_text(json.dumps(status, indent=1))
    print(json.dumps(status, indent=1))
    return 0 if all(v == "ok" for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
