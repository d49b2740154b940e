"""The servers of one connector (or the plain server), a mode's way in to them, and
how a deployment is stopped while another one's turn runs.

A :class:`Deployment` starts the vLLM servers of ``plain``, ``pushkv``, ``pushkv-push``
(pushkv with ``direction: push``), ``nixl-push`` or ``nixl-pull`` (see :mod:`.modes`)
through :mod:`pushkv.vllm.testing`; an
:class:`Endpoint` puts a mode's router (if it has one) in front of them and says where
its requests go (:class:`~.client.Target`); a :class:`Freezer` stops and thaws a
deployment's processes (``--phases turns``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from pushkv.hostprobe import process_cpu_s
from pushkv.vllm.testing import (
    CPU_TUNING,
    PROCESS_GROUP,
    Server,
    ServerSpec,
    free_port,
    kv_transfer_config,
    wait_up,
)

from .client import Target
from .modes import SPIN_S, Mode, RouterArgs

#: The directory pushkv is imported from: on the ``PYTHONPATH`` of every process started
ROOT = Path(__file__).resolve().parents[3]
THROTTLE = CPU_TUNING  # its sitecustomize: vLLM's NIXL agents, core, busy loop, timeline
#: every server's idle keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default)
KEEP_ALIVE_S = "3600"


def nixl_config(connector: str, role: str, engine_id: str) -> dict[str, Any]:
    return {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu",
            "engine_id": engine_id, "kv_connector_extra_config": {"backends": ["UCX"]}}


class Deployment:
    """The servers of one connector (or the plain server)."""

    def __init__(self, kind: str, model: str, out: Path, *, max_model_len: int,
                 delay_us: int, plain_cores: str = "0,1", spin_s: str = SPIN_S) -> None:
        self.kind, self.model, self.out = kind, model, out
        self.spin_s = spin_s
        self.plain_cores = plain_cores
        self.max_model_len, self.delay_us = max_model_len, delay_us
        self.timeline_dir = out / "timeline" / kind
        self.servers: list[Server] = []
        self.side_port = 0

    def spec(self, cpu: int, kv: dict[str, Any] | None = None,
             env: dict[str, str] | None = None) -> ServerSpec:
        # An idle keep-alive connection survives a frozen turn (--phases turns): with
        # uvicorn's 5 s, a thawed server closed the connection its next request was
        # already on its way over. Latency is the same either way.
        env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": KEEP_ALIVE_S} | dict(env or {})
        return ServerSpec(model=self.model, port=free_port(), cpu=cpu, kv_config=kv,
                          tokenizer=True, prefix_caching=False,
                          max_model_len=self.max_model_len, env=env,
                          spin_s=self.spin_s or None)  # every server alike

    def start(self) -> None:
        logs = self.out / "logs"
        if self.kind == "plain":
            # one replica per core: the same cores a pair's prefill and decode use
            cores = [int(c) for c in self.plain_cores.split(",")]
            self.servers = [Server(self.spec(c), logs / f"plain-{c}.log") for c in cores]
        elif self.kind in ("pushkv", "pushkv-push"):
            extra = {"progress_delay_us": self.delay_us, "timeline_dir": str(self.timeline_dir)}
            # every server process records from its start (the API server's pauses too)
            env = {"PUSHKV_BENCH_TIMELINE_DIR": str(self.timeline_dir)}
            # pushkv-push: the producer's direction override, a push behind a sequential
            # router too (pushkv.direction)
            own = {"direction": "push"} if self.kind == "pushkv-push" else {}
            p = self.spec(0, kv_transfer_config("kv_producer", "prefill-0", **extra, **own),
                          env)
            d = self.spec(1, kv_transfer_config("kv_consumer", "decode-0", **extra), env)
            self.servers = [Server(p, logs / f"{self.kind}-prefill.log"),
                            Server(d, logs / f"{self.kind}-decode.log")]
        else:
            connector = "NixlConnector" if self.kind == "nixl-pull" else "NixlPushConnector"
            self.side_port = free_port()
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   # what vLLM sets itself when NIXL is imported after it (the throttle
                   # imports NIXL first)
                   "UCX_RCACHE_MAX_UNRELEASED": "1024",
                   "PUSHKV_BENCH_NIXL_DELAY_US": str(self.delay_us),
                   "PUSHKV_BENCH_TIMELINE_DIR": str(self.timeline_dir),
                   "PYTHONPATH": os.pathsep.join(
                       p for p in (str(THROTTLE), str(ROOT), os.environ.get("PYTHONPATH"))
                       if p)}
            p = self.spec(0, nixl_config(connector, "kv_producer", "prefill-0"),
                          env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
                                 "PUSHKV_BENCH_KEEP_CORE": "0"})
            d = self.spec(1, nixl_config(connector, "kv_consumer", "decode-0"),
                          env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                 "PUSHKV_BENCH_KEEP_CORE": "1"})
            self.servers = [Server(p, logs / f"{self.kind}-prefill.log"),
                            Server(d, logs / f"{self.kind}-decode.log")]
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_healthy(600)  # a busy machine starts vLLM slowly

    @property
    def prefill(self) -> Server:
        return self.servers[0]

    @property
    def decode(self) -> Server:
        return self.servers[-1]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class Endpoint:
    """A mode ready to serve: its target, and its router process if any."""

    def __init__(self, mode: Mode, dep: Deployment, out: Path) -> None:
        self.mode, self.dep = mode, dep
        self.timeline_dir = out / "timeline" / mode.name
        self.router: subprocess.Popen[bytes] | None = None
        dispatch = mode.client_dispatch
        url = dep.decode.url
        if mode.router is not None:
            port = free_port()
            cmd = mode.router(RouterArgs(
                prefill_url=dep.prefill.url, decode_url=dep.decode.url, port=port,
                prefill_side_port=dep.side_port, timeline_dir=str(self.timeline_dir)))
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            with (out / "logs" / f"{mode.name}-router.log").open("ab") as log:
                self.router = subprocess.Popen(cmd, env=env, stdout=log,
                                               stderr=subprocess.STDOUT,
                                               process_group=PROCESS_GROUP)
            url = f"http://127.0.0.1:{port}"
            wait_up(url, f"{mode.name}: router")
        replicas = tuple(s.url for s in dep.servers) if dep.kind == "plain" else ()
        self.target = Target(url=url, dispatch=dispatch, prefill_url=dep.prefill.url,
                             prefill_side_port=dep.side_port, replicas=replicas)

    def router_cpu_s(self) -> float:
        """CPU time the router process used so far (NaN without one)."""
        return process_cpu_s(self.router.pid) if self.router is not None else float("nan")

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGINT)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.router.pid, signal.SIGKILL)
                self.router.wait(5)


class Freezer:
    """One deployment's processes stopped while another deployment's turn runs
    (``--phases turns``): ``SIGSTOP`` to its routers' and servers' process groups (each
    started in a session of its own), ``SIGCONT`` to thaw, servers first. A stopped
    process takes no CPU, so an idle pair costs its neighbours nothing (an idle
    ``NixlPushConnector`` pair slowed a plain server beside it 1.4-1.75x here) while the
    connectors still take turns seconds apart, not phases minutes apart. As a context
    manager: thawed inside, frozen again on the way out."""

    def __init__(self, dep: Deployment, eps: list[Endpoint]) -> None:
        self.servers = [s.proc.pid for s in dep.servers if s.proc is not None]
        self.routers = [ep.router.pid for ep in eps if ep.router is not None]
        self.frozen = False

    def _signal(self, pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:  # a process that died is reported by its requests
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)

    def freeze(self) -> None:
        self._signal(self.routers, signal.SIGSTOP)  # before a router can see its servers stop
        self._signal(self.servers, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self._signal(self.servers, signal.SIGCONT)
        self._signal(self.routers, signal.SIGCONT)
        self.frozen = False

    def __enter__(self) -> Freezer:
        self.thaw()
        return self

    def __exit__(self, *exc: object) -> None:
        self.freeze()
