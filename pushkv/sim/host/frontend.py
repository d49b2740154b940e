"""The frontend processes' CPU as one queue: API servers, router and client.

On a CPU deployment the Python processes in front of the engines -- each
instance's vLLM API server (one asyncio loop: HTTP, the hand-off to the engine
core, every output token's SSE chunk), the router relaying every chunk, and the
benchmark client parsing it -- are not pinned and share the machine's cores with
the engines. Without this mechanism (``host.frontend_cores = 0``) their times are
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
``host.cores`` (:mod:`pushkv.sim.host.cores`) a job in service is work on the host's
cores, which the engines' steps share: ``frontend_cores`` is then how many frontend
jobs run at once.

A request's tokens that reach the queue while an earlier token of it still waits for
its turn there join that token's job, up to ``host.merge_tokens`` of them: vLLM's API
server hands each streamed request its outputs through a per-request collector that
merges them while the request's handler is behind (``RequestOutputCollector.put``,
vllm/v1/engine/output_processor.py, vLLM 0.32), so a backlog of tokens leaves as one
chunk, at one chunk's cost. Without it every token is a job, and a frontend that falls
behind under load falls further behind with every step decode takes.

Where vLLM merges, and what a token costs, follow the processes. An API server is one
asyncio loop: it takes its legs in, answers, and handles every output ready for it in
one wake-up, merging a request's outputs only while it is behind; the router and the
client relay each chunk it writes. And a frontend's CPU is mostly its wake-ups: on the
2-core machine pushkv is measured on, decode's API server spent 0.17-0.21 ms each time
it was scheduled at every rate from 2 to 24 QPS, while the times it was scheduled per
output token fell from 3.6 to 1.5-1.8 (the core probe's per-process schedule,
``docs/sim.md``, 'A wake-up shared'). With ``host.token_api_s`` (and ``merge_tokens`` >
1) each API server is a loop of its own (:meth:`Frontend.loop`: one FIFO server, its
work on the host's cores): its legs' intake and its answers queue there, not on the
frontend queue, and a token's way out is two jobs. First one of its decode API server's
loop: it costs ``token_api_s``, and every token that reaches that loop while the job
still waits for its turn, of any request, joins it for ``token_api_item_s`` more, a
request's joining tokens merging into its chunk, up to ``merge_tokens``. Then the relay
of the job's chunks through the router and the client, one job on the frontend queue:
``token_work_s - token_api_s`` for the first chunk, and chunks of later API jobs that
reach the queue while it waits join it for ``token_item_s - token_api_item_s`` each.
Without it the frontend queue serves everything, a token's whole way out one job there,
and a request's tokens merge while theirs waits behind any frontend work.

A process woken while other requests are in flight may wait on the kernel's run queue
before it runs -- on a shared CPU machine decode's API server waits tens to hundreds
of milliseconds beside a streaming request (``benchmarks/bench_handoff_waits.py``) --
and the keys, measured on lone requests, hold only what it meets alone. With
``host.wake_beside_s`` a job that wakes its process (an instance's API server, none
of whose jobs is pending) while more than one request is in flight first waits one of
those extra waits, drawn at random, holding no core; a request's later tokens queue
behind a waiting one, in order.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import simpy

from ..request import SimRequest
from .cores import PinnedCores, SharedCores, work
from .profile import PINNED_CORE, RELAY
from .spread import Spread

#: a token's delivery to the client, given how long before its job's end it came
Deliver = Callable[[float], None]


#: cores a P/D pair of the measured deployment pins an engine to (one each)
PAIR_ENGINE_CORES = len(PINNED_CORE)


def frontend_cores(cpu_count: int) -> int:
    """The cores the frontends (API servers, router, client) share on a machine of
    ``cpu_count`` cores with a P/D pair's engines pinned to one core each: the cores no
    engine holds, and at least one -- with every core pinned they float and get one
    core's worth, the core whose engine is not stepping (``host.frontend_cores``)."""
    return max(1, cpu_count - PAIR_ENGINE_CORES)


class Frontend:
    """One FIFO queue of ``cores`` servers for the frontends' work."""

    def __init__(self, env: simpy.Environment, cores: int, token_s: float,
                 token_latency_s: float = 0.0, *,
                 host: SharedCores | PinnedCores | None = None,
                 wakes: Spread | None = None, intake_wakes: Spread | None = None,
                 in_flight: Callable[[], int] = lambda: 0, merge: int = 0,
                 api_s: float = 0.0, item_s: float = 0.0, api_item_s: float = 0.0) -> None:
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
        #: the host's cores the frontends share with the engines (``host.cores``)
        self.host = host
        #: extra run-queue waits of a frontend woken beside other requests
        #: (``host.wake_beside_s``), and the requests in flight now
        self.wakes = wakes
        #: the same waits for a process that queues no work here (the router), drawn
        #: from a stream of their own (:meth:`wake_wait`)
        self.intake_wakes = intake_wakes
        self.in_flight = in_flight
        self.woken = 0  #: jobs that waited one
        self.woke_s = 0.0  #: and the time they waited
        self._gates: dict[str, simpy.Event] = {}  #: a request's token waiting for a core
        self._by_process: dict[str, int] = {}  #: jobs pending, by the process they wake
        self._waking: dict[str, float] = {}  #: a waking process without jobs: until when
        #: the most tokens a request's token job still waiting carries (``merge_tokens``;
        #: 0 or 1: none joins)
        self.merge = merge
        #: per request, its token job still waiting for its turn: the deliveries it carries
        self._waiting: dict[str, list[Callable[[], None]]] = {}
        #: a token's work in its decode API server's loop, and a token's there when it
        #: joins a job waiting (``token_api_s``, ``token_api_item_s``; 0: no such stage)
        self.api_s = min(api_s, token_s)
        self.api_item_s = min(api_item_s, item_s, self.api_s)
        #: the relay's (router and client) work for a job's first chunk, and for each
        #: chunk joining a relay job waiting
        self.relay_s = token_s - self.api_s
        self.relay_item_s = max(0.0, min(item_s - self.api_item_s, self.relay_s))
        #: per API server, its loop
        self._loops: dict[str, simpy.Resource] = {}
        #: per process, its token job still waiting for its turn, which later tokens
        #: join: a decode API server's (per request carried, its deliveries), the
        #: relay's (its chunks' deliveries)
        self._open: dict[str, Any] = {}

    def serve(self, service_s: float | Callable[[], float], then: Callable[[], None],
              wait_s: float = 0.0,
              started: Callable[[], None] | None = None, gate: str | None = None,
              process: str = "", wakes: bool = True, own_loop: bool = False) -> None:
        """``then()`` once ``service_s`` of frontend time has run, after the work ahead,
        and ``wait_s`` more has passed outside the queue (a stall: holding no core);
        ``started()`` when the job's turn comes (``service_s`` may be a callable, asked
        then: the service of what the job carries by its turn). A job that wakes its ``process`` (an
        instance's API server) beside other requests (:meth:`beside`) first waits a
        drawn run-queue wait, holding no core; while it does, jobs given the same
        ``gate`` wait behind it (not ``wakes``: a process whose wake-ups these are not).
        ``own_loop``: the job queues on ``process``'s own loop (:meth:`loop`) instead of
        the frontend queue."""
        self.pending += 1
        self._by_process[process] = self._by_process.get(process, 0) + 1
        wake = self._wake(process) if wakes else 0.0
        queue = self.loop(process) if own_loop else self.cpu
        self.env.process(self._job(service_s, then, wait_s, started, wake, gate, process,
                                   queue))

    def wake_wait(self, process: str) -> float:
        """How long ``process``, one that queues no work here (the router), takes to
        take up a request that reaches it now: what is left of a wake-up already under
        way; else, woken while another request is in flight, a drawn run-queue wait
        (``host.wake_beside_s``) that requests reaching it meanwhile wait out too;
        else 0."""
        now = self.env.now
        until = self._waking.get(process)
        if until is not None and until > now:
            return until - now
        if self.intake_wakes is None or self.in_flight() <= 1:
            return 0.0
        wait = self.intake_wakes(1.0)
        if wait > 0:
            self._waking[process] = now + wait
            self.woken += 1
            self.woke_s += wait
        return wait

    def _wake(self, process: str) -> float:
        """The run-queue wait of a job just counted for ``process`` (:meth:`beside`)."""
        return self.wakes(1.0) if self.wakes is not None and self.beside(process) else 0.0

    def beside(self, process: str = "") -> bool:
        """Whether a job arriving now (counted in the pending) wakes ``process`` while
        other requests are in flight: none of its jobs pending until it came, and more
        than one request in flight."""
        return self._by_process.get(process, 0) == 1 and self.in_flight() > 1

    def _job(self, service_s: float | Callable[[], float], then: Callable[[], None],
             wait_s: float = 0.0,
             started: Callable[[], None] | None = None, wake_s: float = 0.0,
             gate: str | None = None, process: str = "",
             queue: simpy.Resource | None = None) -> Generator[Any, Any, None]:
        queue = self.cpu if queue is None else queue
        if wake_s > 0:  # the woken process waits for a core, holding none
            self.woken += 1
            self.woke_s += wake_s
            held = self._gates[gate] = self.env.event() if gate is not None else None
            yield self.env.timeout(wake_s)
            if held is not None:
                del self._gates[gate]  # type: ignore[arg-type]
                held.succeed()  # its followers queue behind it, in order
        t0 = self.env.now
        with queue.request() as slot:
            yield slot
            self.waited_s += self.env.now - t0
            if started is not None:
                started()
            service = service_s() if callable(service_s) else service_s
            if service > 0:  # a frontend process's work, on the host's cores if shared
                yield work(self.env, self.host, service, process=process or None)
        if wait_s > 0:
            yield self.env.timeout(wait_s)
        self.busy_s += service
        self.jobs += 1
        self._by_process[process] -= 1
        then()
        self._done()

    def _done(self) -> None:
        """A job ended (after what it handed on was queued)."""
        self.pending -= 1
        if self.pending == 0 and self._drained is not None and not self._drained.triggered:
            self._drained.succeed()

    def token(self, req: SimRequest) -> None:
        """Decode emitted a token of ``req`` now: it reaches the client after its turn
        in the queue, its service and the way's latency (``req.client_times``)."""
        def delivered(early_s: float = 0.0) -> None:  # ``early_s`` before the job ended
            req.client_times.append(self.env.now - early_s + self.token_latency_s)

        key = req.transfer_id
        if self.loops:
            self._to_api(req, delivered)
            return
        if self.merge > 1:
            waiting = self._waiting.get(key)
            if waiting is not None:  # its earlier token still waits: one chunk with it
                waiting.append(delivered)
                if len(waiting) >= self.merge:  # full: the next starts a chunk of its own
                    del self._waiting[key]
                return
            carried = self._waiting[key] = [delivered]

            def started() -> None:  # its turn came: later tokens make a chunk of their own
                if self._waiting.get(key) is carried:
                    del self._waiting[key]

            def chunk() -> None:
                for deliver in carried:
                    deliver()
        else:
            started, chunk = None, delivered  # type: ignore[assignment]

        api = req.decode or ""  # decode's API server passes every token on
        held = self._gates.get(key)
        if held is not None:  # an earlier token of its waits for a core: this one follows
            held.callbacks.append(lambda _: self.serve(self.token_s, chunk, started=started,
                                                       process=api))
            return
        self.serve(self.token_s, chunk, started=started, gate=key, process=api)

    def _to_api(self, req: SimRequest, delivered: Deliver) -> None:
        """:meth:`token` with ``token_api_s``: the token joins its decode API server's
        job still waiting for its turn there, if that job carries fewer than
        ``merge_tokens`` of its request's; else it starts one, which later tokens join."""
        api, key = req.decode or "", req.transfer_id
        carried: dict[str, list[Deliver]] | None = self._open.get(api)
        if carried is not None and len(carried.get(key, ())) < self.merge:
            carried.setdefault(key, []).append(delivered)
            return
        carried = {key: [delivered]}

        def service() -> float:  # one token's work, and each other's item
            return self.api_s + self.api_item_s * (sum(map(len, carried.values())) - 1)

        def relay() -> None:
            for chunk in carried.values():  # a request's tokens in it: one chunk
                self._relay(chunk)

        self._serve_open(api, carried, service, relay, own_loop=True)

    def _serve_open(self, process: str, carried: Any, service: Callable[[], float],
                    then: Callable[[], None], **kw: Any) -> None:
        """Serve ``process``'s job carrying ``carried``, which later tokens join
        (``self._open``) until its turn comes."""
        self._open[process] = carried

        def started() -> None:  # its turn came: later tokens make a job of their own
            if self._open.get(process) is carried:
                del self._open[process]

        self.serve(service, then, started=started, process=process, **kw)

    @property
    def loops(self) -> bool:
        """Whether each API server is a loop of its own (``token_api_s`` with
        ``merge_tokens`` > 1): its legs' intake, its answers and its tokens' first job
        queue there, the relay on the frontend queue."""
        return self.merge > 1 and self.api_s > 0

    def loop(self, process: str) -> simpy.Resource:
        """``process``'s own loop: one FIFO server, its work on the host's cores."""
        loop = self._loops.get(process)
        if loop is None:
            loop = self._loops[process] = simpy.Resource(self.env, capacity=1)
        return loop

    def _relay(self, chunk: list[Deliver]) -> None:
        """The router and the client pass ``chunk`` on: it joins the relay job still
        waiting for its turn on the frontend queue, else starts one. The job passes its
        chunks on in turn: each reaches the client the later chunks' items before the
        job's end."""
        chunks: list[list[Deliver]] | None = self._open.get(RELAY)
        if chunks is not None:
            chunks.append(chunk)
            return
        chunks = [chunk]

        def service() -> float:
            return self.relay_s + self.relay_item_s * (len(chunks) - 1)

        def deliver() -> None:
            for i, c in enumerate(chunks):
                early = (len(chunks) - 1 - i) * self.relay_item_s
                for d in c:
                    d(early)

        self._serve_open(RELAY, chunks, service, deliver, wakes=False)

    def drained(self) -> simpy.Event:
        """An event that fires once no work is queued or running."""
        ev = self.env.event()
        if self.pending == 0:
            ev.succeed()
        else:
            self._drained = ev
        return ev
