"""vllm-router in front of real vLLM CPU servers, for the tests that need it."""

from __future__ import annotations

import http.client
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from pushkv.vllm.testing import free_port, get_text, stop_group

#: The vLLM project's router (``pip install vllm-router==0.1.17``).
ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def start_router(prefills: list[str], decode: str, policy: str, log: Path
                 ) -> tuple[subprocess.Popen[bytes], str]:
    """vllm-router on a free port; tried again on another port if the one picked was
    taken meanwhile (another process may bind it between the pick and the router)."""
    for _ in range(3):
        port = free_port()
        argv = [ROUTER, "--vllm-pd-disaggregation", "--kv-connector", "nixl",
                "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                "--prometheus-port", str(free_port()), "--decode", decode]
        for p in prefills:
            argv += ["--prefill", p]
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 120
        while time.monotonic() < end and proc.poll() is None:
            try:
                if "Starting server on 127.0.0.1:" + str(port) in log.read_text():
                    get_text(url + "/health", timeout=5)
                    return proc, url
            except (OSError, http.client.HTTPException):
                pass
            time.sleep(0.2)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    raise AssertionError(f"vllm-router did not come up: {log.read_text()[-2000:]}")


def stop_router(proc: subprocess.Popen[bytes]) -> None:
    stop_group(proc)
