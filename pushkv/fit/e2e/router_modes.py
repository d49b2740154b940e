"""bench_e2e.sh modes behind vllm-router (PD mode, sequential dispatch).

Four rows for :data:`.modes.MODES`, one per connector, each behind the same
``vllm-router --vllm-pd-disaggregation --kv-connector nixl``:

* ``router-pushkv``: ``PushKVConnector`` (its default ``direction: auto`` pulls
  here, with the decode side's background reader);
* ``router-pull``: vLLM's ``NixlConnector`` (pull, reads posted in the decode
  engine loop);
* ``router-vllm-push``: vLLM's ``NixlPushConnector`` behind the same router;
* ``router-pushkv-push``: ``PushKVConnector`` with ``direction: push`` (the producer
  pushes once the decode side registered).

:func:`router_verdict` adds ``router_vllm_push_vs_pull_<load>`` (median latency
of router-vllm-push over router-pull) to the run's last JSON line; pushkv's
ratios, with their intervals, are :func:`.overheads.router_intervals`'. No import
of :mod:`.modes`.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

#: (mode name, deployment) of each vllm-router mode.
ROUTER_ROWS = (
    ("router-pushkv", "pushkv"),
    ("router-pull", "nixl-pull"),
    ("router-vllm-push", "nixl-push"),
    # pushkv forced to push behind the sequential router (direction: push): what the
    # direction rule's "sequential dispatch pulls" is measured against
    ("router-pushkv-push", "pushkv-push"),
)


def router_binary() -> str:
    """vllm-router on PATH, else beside this Python (a venv's bin)."""
    return shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")


def vllm_router(a: Any) -> list[str]:
    """The router's command line for a :class:`.modes.RouterArgs` (each router its own
    metrics port: by default they all bind 29000, so a second one would not start)."""
    from pushkv.vllm.testing import free_port

    return [router_binary(), "--vllm-pd-disaggregation", "--kv-connector", "nixl",
            "--prefill", a.prefill_url, "--decode", a.decode_url,
            "--host", "127.0.0.1", "--port", str(a.port), "--policy", "round_robin",
            "--prometheus-port", str(free_port()), "--log-level", "warning"]


def router_verdict(lat: dict[tuple[str, str], float]) -> dict[str, Any]:
    """From median latencies by (mode, load): vLLM's push over its pull behind the
    router, per load."""
    out: dict[str, Any] = {}
    for load in ("seq", "conc"):
        pull = lat.get(("router-pull", load))
        push = lat.get(("router-vllm-push", load))
        out[f"router_vllm_push_vs_pull_{load}"] = (
            round(push / pull, 3) if push and pull and push == push and pull == pull else None)
    return out
