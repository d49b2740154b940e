"""The frontend processes' CPU as one queue: API servers, router and client.

On a CPU deployment the Python processes in front of the engines -- each
instance's vLLM API server (one asyncio loop: HTTP, the hand-off to the engine
core, every output token's SSE chunk), the router relaying every chunk, and the
benchmark client parsing it -- are not pinned and share the machine's cores with
the engines. Without this mechanism (``control.frontend_cores = 0``) their times are
delays: a leg waits ``ingest_s`` behind its own instance's legs only, a token
reaches the client ``decode.return_s`` after decode emitted it, whatever else is
going on. With ``frontend_cores = n`` they are *service times* of one FIFO queue of
``n`` servers shared by everything the frontends do: a leg's ``ingest_s`` at its
API server, a prefill leg's answer (``prefill.return_s``, :mod:`pushkv.sim.router`) and
each output token's ``decode.return_s`` on its way out. A new leg
then waits behind the tokens of the requests still streaming, and tokens emitted
faster than the frontends can pass them on reach the client late and together.

The service times are the profile's measured connector keys (medians of requests
that ran alone, where a hop's wall time is its processes' time); the queue adds
no parameter but the number of cores the frontends share. With
``control.host_cores`` (:mod:`pushkv.sim.cpu`) a job in service is work on the host's
cores, which the engines' steps share: ``frontend_cores`` is then how many frontend
jobs run at once.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import simpy

from .cpu import SharedCores, work
from .request import SimRequest

#: cores a P/D pair of the measured deployment pins an engine to (one each)
PAIR_ENGINE_CORES = 2


def frontend_cores(cpu_count: int) -> int:
    """The cores the frontends (API servers, router, client) share on a machine of
    ``cpu_count`` cores with a P/D pair's engines pinned to one core each: the cores no
    engine holds, and at least one -- with every core pinned they float and get one
    core's worth, the core whose engine is not stepping (``control.frontend_cores``)."""
    return max(1, cpu_count - PAIR_ENGINE_CORES)


class Frontend:
    """One FIFO queue of ``cores`` servers for the frontends' work."""

    def __init__(self, env: simpy.Environment, cores: int, token_s: float,
                 token_latency_s: float = 0.0) -> None:
        if cores < 1:
            raise ValueError(f"a frontend needs at least one core, got {cores}")
        self.env = env
        self.cpu = simpy.Resource(env, capacity=cores)
        self.token_s = token_s  #: service time of one output token's way out
        self.token_latency_s = token_latency_s  #: what the way adds besides (hops, wakes)
        self.busy_s = 0.0
        self.jobs = 0
        self.waited_s = 0.0
        self.pending = 0
        self._drained: simpy.Event | None = None
        #: the host's cores the frontends share with the engines (``control.host_cores``)
        self.host: SharedCores | None = None

    def serve(self, service_s: float, then: Callable[[], None], wait_s: float = 0.0,
              started: Callable[[], None] | None = None) -> None:
        """``then()`` once ``service_s`` of frontend time has run, after the work ahead,
        and ``wait_s`` more has passed outside the queue (a stall: holding no core);
        ``started()`` when the job's turn comes."""
        self.pending += 1
        self.env.process(self._job(service_s, then, wait_s, started))

    def _job(self, service_s: float, then: Callable[[], None], wait_s: float = 0.0,
             started: Callable[[], None] | None = None) -> Generator[Any, Any, None]:
        t0 = self.env.now
        with self.cpu.request() as slot:
            yield slot
            self.waited_s += self.env.now - t0
            if started is not None:
                started()
            if service_s > 0:  # a frontend process's work, on the host's cores if shared
                yield work(self.env, self.host, service_s)
        if wait_s > 0:
            yield self.env.timeout(wait_s)
        self.busy_s += service_s
        self.jobs += 1
        self.pending -= 1
        then()
        if self.pending == 0 and self._drained is not None and not self._drained.triggered:
            self._drained.succeed()

    def token(self, req: SimRequest) -> None:
        """Decode emitted a token of ``req`` now: it reaches the client after its turn
        in the queue, its service and the way's latency (``req.client_times``)."""
        def delivered() -> None:
            req.client_times.append(self.env.now + self.token_latency_s)

        self.serve(self.token_s, delivered)

    def drained(self) -> simpy.Event:
        """An event that fires once no work is queued or running."""
        ev = self.env.event()
        if self.pending == 0:
            ev.succeed()
        else:
            self._drained = ev
        return ev
