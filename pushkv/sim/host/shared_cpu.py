"""A shared CPU: the engines, their API servers, the router and the client on one
machine's cores (``host.model = "shared-cpu"``), as on the CPU deployments
:mod:`pushkv.fit` measures.

Its mechanisms, each off at its key's default (so a ``shared-cpu`` profile that sets
nothing else runs exactly as ``dedicated``):

* **a share of a core** (``host.prefill/decode.cpu_share``, ``cpu_speed``): the
  profile's host times last ``1 / (share x speed)`` as long (:func:`on_shared_cores`);
* **wake-ups** (``wake_s``): a woken process waits on the run queue before it runs --
  an idle engine's (``ENGINE_WAKES``), a router hop's (``HOP_WAKES``), a token's way
  out (``RETURN_WAKES``), a message's receiver, a posting thread;
* **the host's cores** (``host.cores``): every engine step and frontend job is work on
  one processor-sharing pool (:mod:`.cores`; with ``host.pinned`` a pool per core, each
  engine's loop on its own, the rest floating), a step brings the work of the processes
  around it (``cores_busy``), and an engine holding a request on a transfer keeps
  stepping empty as *spinners* (``steps_while_holding``);
* **the frontends as a queue** (``host.frontend_cores``, ``token_work_s``): the API
  servers', router's and client's times are jobs of one FIFO queue (:mod:`.frontend`),
  and a frontend woken beside another request first waits a drawn run-queue wait
  (``host.wake_beside_s``);
* **host times around their medians** (``host.spread``, :mod:`.spread`).

The engine's interpreter lock (``step_python_s``, ``network.post_gil_fraction``) is not
here: it is a lock of one engine process, on GPU nodes as on CPUs
(:meth:`pushkv.sim.transport.SimTransport.run_step`); on shared cores the time it holds
is work on them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from ..profile import Profile
from ..sections import CONNECTOR_KEYS, EngineProfile
from .cores import PinnedCores, SharedCores, work
from .dedicated import Dedicated
from .frontend import Frontend
from .model import token_return_s
from .profile import (
    ENGINE_WAKES,
    HOP_WAKES,
    PINNED_CORE,
    RETURN_WAKES,
    HostSide,
    beside_process,
    engine_process,
)
from .spread import Spread

if TYPE_CHECKING:
    from ..request import SimRequest
    from .model import Side


def on_shared_cores(profile: Profile) -> Profile:
    """The profile its engines run under when they share CPU cores: every host time
    divided by the share of a core its processes get (``cpu_share``) times the cores'
    speed against the profile's measurement (``cpu_speed``), both then 1. The same
    profile when all four are 1 (the default)."""
    h = profile.host
    sp = h.prefill.cpu_share * h.prefill.cpu_speed
    sd = h.decode.cpu_share * h.decode.cpu_speed
    if sp == 1 and sd == 1:
        return profile

    def side(e: EngineProfile, share: float) -> EngineProfile:
        return dataclasses.replace(
            e, prefill_step_overhead_s=e.prefill_step_overhead_s / share,
            decode_step_overhead_s=e.decode_step_overhead_s / share,
            step_token_s=e.step_token_s / share, step_python_s=e.step_python_s / share,
            **{k: getattr(e, k) / share for k in CONNECTOR_KEYS})

    both = (sp + sd) / 2
    n, c = profile.network, profile.control
    return dataclasses.replace(
        profile, prefill=side(profile.prefill, sp), decode=side(profile.decode, sd),
        network=dataclasses.replace(
            n, post_fixed_s=n.post_fixed_s / both,
            post_per_descriptor_s=n.post_per_descriptor_s / both,
            router_hop_s=n.router_hop_s / both, client_hop_s=n.client_hop_s / both,
            client_first_s=n.client_first_s / both, notify_wait_s=n.notify_wait_s / both),
        control=dataclasses.replace(c, message_send_s=c.message_send_s / both,
                                    message_recv_s=c.message_recv_s / both),
        host=dataclasses.replace(
            h, prefill=dataclasses.replace(h.prefill, cpu_share=1.0, cpu_speed=1.0),
            decode=dataclasses.replace(h.decode, cpu_share=1.0, cpu_speed=1.0)))


class SharedCpu(Dedicated):
    """The host model of one machine's cores shared by every process."""

    name = "shared-cpu"

    def __init__(self, env: simpy.Environment, profile: Profile,
                 seeds: np.random.SeedSequence,
                 in_flight: Callable[[], int] = lambda: 0) -> None:
        """``seeds``: the run's seed sequence, from which the spread's and the wake-ups'
        streams are spawned (only after the run's own: a profile without them draws
        nothing); ``in_flight``: the requests in flight now (the wake-ups beside)."""
        profile = on_shared_cores(profile)
        super().__init__(env, profile)
        h = profile.host
        self._sides = {"prefill": h.prefill, "decode": h.decode}
        w = (h.prefill.wake_s + h.decode.wake_s) / 2
        self.hop_wake_s = HOP_WAKES * w if w else 0.0
        self.return_wake_s = RETURN_WAKES * h.decode.wake_s if h.decode.wake_s else 0.0
        self._spread = Spread(h.spread, np.random.default_rng(seeds.spawn(1)[0]))
        self.cores: SharedCores | PinnedCores | None = None
        if h.cores and h.pinned:  # a core each engine, its ties drawn from a stream of its own
            self.cores = PinnedCores(env, h.cores, np.random.default_rng(seeds.spawn(1)[0]))
        elif h.cores:
            self.cores = SharedCores(env, h.cores)
        self.frontend: Frontend | None = None
        if h.frontend_cores:  # the frontends' times queue on their cores
            # A token's frontend work: as measured when known (token_work_s), else its
            # whole way out (return_s); what is left of the way out is latency.
            return_s = token_return_s(profile, self.return_wake_s)
            token_s = (min(h.token_work_s, return_s) if h.token_work_s > 0
                       else profile.decode.return_s)
            wakes = intake = None
            if h.wake_beside_s:  # each its own stream: the router's take no job's draw
                wakes = Spread(h.wake_beside_s, np.random.default_rng(seeds.spawn(1)[0]))
                intake = Spread(h.wake_beside_s, np.random.default_rng(seeds.spawn(1)[0]))
            self.frontend = Frontend(env, h.frontend_cores, token_s, return_s - token_s,
                                     host=self.cores, wakes=wakes, intake_wakes=intake,
                                     in_flight=in_flight, merge=h.merge_tokens,
                                     api_s=h.token_api_s, item_s=h.token_item_s,
                                     api_item_s=h.token_api_item_s)

    def _side(self, side: Side) -> HostSide:
        return self._sides[side]

    @property
    def busy_s(self) -> float:
        return self.cores.busy_s if self.cores is not None else 0.0

    @property
    def busy_by_process(self) -> dict[str, float]:
        return self.cores.busy_by_process if self.cores is not None else {}

    def spread(self, seconds: float) -> float:
        return self._spread(seconds)

    def split(self, seconds: float) -> tuple[float, float]:
        return self._spread.split(seconds)

    def work(self, seconds: float, side: Side) -> simpy.Event:
        return work(self.env, self.cores, seconds, PINNED_CORE[side],  # the engine's loop
                    engine_process(side))

    def beside(self, side: Side, dt: float) -> None:
        extra = self._side(side).cores_busy - 1
        if extra > 0 and self.cores is not None:
            self.cores.run(extra * dt, process=beside_process(side))

    def idle(self, side: Side, holding: bool,
             sleep: Callable[[], simpy.Event]) -> Generator[Any, Any, float]:
        """Nothing to compute: sleep until poked. A loop that holds a request on a
        transfer (``holding``) steps empty meanwhile (``steps_while_holding``): it keeps
        ``cores_busy`` cores of the host busy, and wakes without a sleeper's delay."""
        s = self._side(side)
        spins = self._spin(s.cores_busy, side) if holding and s.steps_while_holding else []
        t0 = self.env.now
        yield sleep()
        for k in spins:
            self.cores.unspin(k)  # type: ignore[union-attr]
        spun = self.env.now - t0 if spins else 0.0
        if s.wake_s and not spins:  # an idle engine's processes wake on a busy core
            yield self.env.timeout(ENGINE_WAKES * s.wake_s)
        return spun

    def _spin(self, cores: float, side: Side) -> list[Any]:
        """An engine loop stepping empty keeps ``cores`` of the host's cores busy: one
        spinner a core, the last one the fraction left (none without shared cores); with
        the engines pinned the first is the loop's, on ``side``'s core, the rest (its
        other threads') float."""
        if self.cores is None:
            return []
        spins: list[Any] = []
        while cores > 1e-9:
            core, process = ((PINNED_CORE[side], engine_process(side)) if not spins
                             else (None, beside_process(side)))
            spins.append(self.cores.spin(min(1.0, cores), core, process))
            cores -= 1.0
        return spins

    def thread_wake(self, side: Side) -> Generator[Any, Any, None]:
        wake = self._side(side).wake_s
        if wake:  # the thread wakes on a busy core
            yield self.env.timeout(wake)

    def wake_s(self, side: Side) -> float:
        return self._side(side).wake_s

    def ingest(self, process: str, work_s: float, wait_s: float,
               started: Callable[[], None], then: Callable[[], None]) -> None:
        """With a frontend queue, the leg is a job there behind all the frontends' work;
        else the API server's own queue."""
        if self.frontend is None:
            super().ingest(process, work_s, wait_s, started, then)
            return
        self.frontend.serve(work_s, then, wait_s, started=started, process=process,
                            own_loop=self.frontend.loops)

    def answer(self, process: str, work_s: float, wait_s: float,
               after: Callable[[float], None]) -> None:
        if self.frontend is not None and work_s + wait_s:
            self.frontend.serve(work_s, lambda: after(0.0), wait_s, process=process,
                                own_loop=self.frontend.loops)
        else:
            after(work_s + wait_s)

    def token(self, req: SimRequest) -> None:
        if self.frontend is not None:
            self.frontend.token(req)

    def intake_wait(self, process: str) -> float:
        return self.frontend.wake_wait(process) if self.frontend is not None else 0.0

    def drain(self, env: simpy.Environment) -> None:
        if self.frontend is not None:  # the last tokens still on their way to the client
            env.run(until=self.frontend.drained())
