"""What bench_e2e.sh compares: deployments (servers) and modes (how requests reach them).

A **deployment** is a set of vLLM servers with one connector: ``plain`` (one
server, no disaggregation), ``pushkv`` (``PushKVConnector``), ``nixl-push``
(vLLM's ``NixlPushConnector``), ``nixl-pull`` (vLLM's ``NixlConnector``). Prefill
on core 0, decode on core 1, prefix caching off, and the same transport
settings for every connector: NIXL's progress thread sleeps ``delay_us``
between polls (vLLM's agents through ``pushkv/vllm/cpu_tuning/sitecustomize.py``, pushkv
through ``progress_delay_us``), and every transport thread stays on its
server's own core (vLLM's NIXL worker would pin itself to the machine's last
core in both servers; the same sitecustomize keeps it on the server's core).

A **mode** is a row of :data:`MODES`: a deployment plus a dispatch --
``client`` (the benchmark client sends both legs itself, see :mod:`.client`) or
``router`` (a router process in front; :attr:`Mode.router` builds its command
line from a :class:`RouterArgs`). Modes sharing a deployment share its servers.
To add a router mode, add a row::

    Mode("vllm-router-pull", "nixl-pull", "router", router=lambda a: [
        "vllm-router", "--vllm-pd-disaggregation", "--kv-connector", "nixl",
        "--prefill", a.prefill_url, "--decode", a.decode_url, "--port", str(a.port)])
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

#: How long every vLLM server of a run may busy-loop on its shared-memory queues after
#: a message: the tests' value (one definition, pushkv.vllm.testing.SPIN_S).
from pushkv.vllm.testing import SPIN_S  # noqa: F401

from .router_modes import ROUTER_ROWS, vllm_router


@dataclass(frozen=True, kw_only=True)
class RouterArgs:
    """What a router's command line may need."""

    prefill_url: str
    decode_url: str
    port: int  #: the port the router must listen on (127.0.0.1)
    prefill_engine_id: str = "prefill-0"
    prefill_side_port: int = 0  #: vLLM connectors: the prefill's VLLM_NIXL_SIDE_CHANNEL_PORT
    timeline_dir: str = ""  #: where the router may record its timeline marks


@dataclass(frozen=True)
class Mode:
    name: str
    deployment: str  #: "plain", "pushkv", "pushkv-push", "nixl-push" or "nixl-pull"
    dispatch: str  #: "client" or "router" ("plain": the server itself)
    router: Callable[[RouterArgs], list[str]] | None = None

    @property
    def client_dispatch(self) -> str:
        """How the benchmark client sends a request of this mode (see :class:`client.Target`)."""
        if self.dispatch == "router" or self.deployment == "plain":
            return "router"
        return {"pushkv": "pushkv", "nixl-push": "vllm-push", "nixl-pull": "vllm-pull"}[
            self.deployment]


def _pushkv_proxy(loop: str) -> Callable[[RouterArgs], list[str]]:
    def cmd(a: RouterArgs) -> list[str]:
        out = [sys.executable, "-m", "pushkv.cli", "proxy", "--prefill", a.prefill_url,
               "--decode", a.decode_url, "--port", str(a.port), "--log-level", "WARNING",
               "--event-loop", loop]
        return out + (["--timeline-dir", a.timeline_dir] if a.timeline_dir else [])
    return cmd


def _vllm_example_proxy(kind: str) -> Callable[[RouterArgs], list[str]]:
    def cmd(a: RouterArgs) -> list[str]:
        out = [sys.executable, "-m", "pushkv.fit.e2e.vllm_proxy", "--mode", kind,
               "--prefill", a.prefill_url, "--decode", a.decode_url, "--port", str(a.port),
               "--prefill-engine-id", a.prefill_engine_id,
               "--prefill-port", str(a.prefill_side_port)]
        return out + (["--timeline-dir", a.timeline_dir] if a.timeline_dir else [])
    return cmd


#: Every mode bench_e2e.sh knows, by name.
MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("plain", "plain", "router"),
    Mode("push-client", "pushkv", "client"),
    Mode("push", "pushkv", "router", router=_pushkv_proxy("auto")),
    # pushkv proxy on asyncio's own loop (push: uvloop's, where installed), to measure
    # what the loop costs the hop side by side: --modes plain,push-client,push,push-asyncio
    Mode("push-asyncio", "pushkv", "router", router=_pushkv_proxy("asyncio")),
    Mode("vllm-push-client", "nixl-push", "client"),
    Mode("vllm-push", "nixl-push", "router", router=_vllm_example_proxy("vllm-push")),
    Mode("pull-client", "nixl-pull", "client"),
    Mode("pull", "nixl-pull", "router", router=_vllm_example_proxy("pull")),
)}

MODES |= {name: Mode(name, deployment, "router", router=vllm_router)
          for name, deployment in ROUTER_ROWS}

#: The modes run when none are named.
DEFAULT_MODES = ("plain", "push-client", "push", "vllm-push-client", "vllm-push",
                 "pull-client", "pull")
