"""``vllm bench serve`` against a deployment: run in a process of its own, or kept up
for many runs (:class:`BenchClient`, ``python -m pushkv.fit.e2e.bench_serve
--jobs-from-stdin``)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

from .deployment import ROOT

#: ``vllm bench serve`` through vLLM's own entry point (see bench_serve.py)
BENCH_SERVE = (sys.executable, "-m", "pushkv.fit.e2e.bench_serve")


def bench_serve_env() -> dict[str, str]:
    """The client's environment, in a process of its own or kept up: offline, pushkv
    importable."""
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


class BenchClient:
    """``vllm bench serve`` kept up in one process for many runs
    (``bench_serve.py --jobs-from-stdin``): importing vLLM and torch, about ten
    seconds of this machine's cores, is paid once, not before every point and
    gauge. The runs are vLLM's own benchmark code as before, each with its flags,
    its seed and a fresh event loop. A client that dies or overruns a run is
    stopped and the run fails; the next run starts a fresh one. ``timeline_dir``: the
    client's garbage-collector pauses are recorded there (:mod:`pushkv.timeline`). As a
    context manager: stopped on the way out."""

    def __init__(self, *, timeout_s: float = 600.0, timeline_dir: Path | None = None) -> None:
        self.timeout_s, self.timeline_dir = timeout_s, timeline_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self._reply: Any = None
        self.runs = 0

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*BENCH_SERVE, "--jobs-from-stdin", str(write_fd),
                 *([str(self.timeline_dir)] if self.timeline_dir else [])],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(write_fd,), env=bench_serve_env())
        finally:
            os.close(write_fd)
        self._reply = os.fdopen(read_fd, "r")

    @property
    def pid(self) -> int | None:
        """The client process's, while one is up."""
        return self.proc.pid if self.proc is not None else None

    def run(self, argv: list[str], log: Path) -> bool:
        """One ``vllm bench serve`` with ``argv``, its output appended to ``log``;
        True when it returned (the result file tells how its requests went)."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.runs += 1
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # the client died between runs
            self.stop()
            return False
        ready, _, _ = select.select([self._reply], [], [], self.timeout_s)
        line = self._reply.readline() if ready else ""
        if not line:  # overran or died: this run failed, the next one starts afresh
            self.stop()
            return False
        return bool(json.loads(line).get("ok"))

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._reply is not None:
            self._reply.close()
            self._reply = None

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bench_serve(url: str, model: str, out: Path, name: str, *, qps: str, input_len: int,
                output_len: int, num_prompts: int, seed: int, log: Path,
                extra: tuple[str, ...] = (), client: BenchClient | None = None) -> bool:
    """``vllm bench serve`` (random dataset, ``--ignore-eos``) against ``url``, its result
    in ``out/name``; ``extra``: more of its flags; ``client``: run it there (kept up),
    else in a process of its own. True when every request completed."""
    flags = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
             "--model", model, "--tokenizer", model, "--dataset-name", "random",
             "--random-input-len", str(input_len), "--random-output-len", str(output_len),
             "--random-range-ratio", "0", "--num-prompts", str(num_prompts),
             "--request-rate", qps, "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
             "--save-result", "--result-dir", str(out), "--result-filename", name, *extra]
    if client is not None:
        returned = client.run(flags, log)
    else:
        cmd = [*BENCH_SERVE, *flags]
        with log.open("ab") as f:
            f.write(f"\n$ {' '.join(cmd)}\n".encode())
            f.flush()
            done = subprocess.run(cmd, env=bench_serve_env(), stdout=f,
                                  stderr=subprocess.STDOUT, timeout=600)
        returned = done.returncode == 0
    if not returned or not (out / name).exists():
        return False
    result = json.loads((out / name).read_text())
    return int(result.get("failed", 0)) == 0 and int(result.get("completed", 0)) == num_prompts
