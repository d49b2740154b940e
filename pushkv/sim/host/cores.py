"""The host's CPU cores as one processor-sharing pool.

On a CPU deployment the engines and the frontends (API servers, router, client)
are processes of one machine. Each engine is pinned to a core, the frontends
float, and when more of them are runnable than there are cores the kernel
shares the cores among them: a decode step that runs while the prefill engine
steps and an API server streams tokens gets two thirds of a core on a 2-core
machine, and lasts half as long again. With ``host.cores = c`` the
simulator runs every engine step and every frontend job as *work* on one pool of
``c`` cores under processor sharing: while ``n`` pieces of work are runnable each
advances at ``min(1, c / n)`` seconds of work per second (a piece is one
single-threaded process, so it never gets more than one core). ``host.cores = 0``
(the default): every piece runs at full speed, as before.

With ``host.pinned`` the cores are not one pool but ``c`` pools of one core each
(:class:`PinnedCores`), as the measured deployment runs: each engine's loop -- its
steps and, holding a request, its empty steps -- runs on its side's core (prefill on
core 0, decode on core 1: vLLM's CPU worker binds its OpenMP threads, the loop's
among them, to ``VLLM_CPU_OMP_THREADS_BIND``'s cores with ``OMP_PLACES`` and
``OMP_PROC_BIND=true``, ``vllm/utils/ompmultiprocessing.py``, vLLM 0.32), and every
other piece -- a frontend job, the work beside a step -- floats: it starts on an idle
core when there is one (a waking task goes to an idle core: ``select_idle_sibling``,
Linux ``kernel/sched/fair.c``), else on a core drawn at random, and stays there until
it ends. With no core idle the kernel puts a waking task on its previous core or its
waker's (``wake_affine``, by load averages that lag the queues, or neither once a
task wakes many: ``wake_wide``), not on the core whose queue is shortest now; the model
knows none of those, so it draws -- the weaker assumption: placing each piece on the
shorter queue, as the model did before, gave the engines their cores back and put the
simulated knees 1.12 and 1.39 times the real ones, drawn 1.01 and 1.21
(``docs/validation/2026-12-06-sim-saturation.md``). The kernel also moves a waiting
task to a core that falls idle; the model does not, which leaves a pinned engine no
better off than the kernel would.

Each piece may name its process (an engine's loop, the work beside its steps, an API
server, the relay): :attr:`SharedCores.busy_by_process` then says which process had the
cores, as the real runs' threads do (``pushkv.fit.sim_vs_real.tables.cpu_rows``).

Processor sharing is the kernel's mean, measured: a sleeper pinned to one core beside
one or two CPU-bound processes, working 0.2 or 2 ms of CPU a wake-up, has its work done
on average 0.75-1.15x as long after it was due in the pool as under Linux 6.18 on a
2-core VM, whose fair scheduler runs one task at a time and switches at its 4 ms tick
(``benchmarks/bench_core_sharing.py``); what the pool leaves out is the spread, a
wake-up now and then waiting for a tick (p90 3.4 ms beside two spinners, 0.6 here).

The pool adds no parameter but the number of cores: the work itself is what the
profile measured on requests that ran alone (where nothing shares the cores and
a piece's wall time is its work), so a lone request takes exactly as long with
the pool as without it on a machine with enough cores.

Besides work that ends, a process can *spin* (:meth:`SharedCores.spin`): an engine
loop that steps empty while it holds KV for a transfer keeps up to ``demand`` of a
core busy for as long as it spins, whatever it gets done. The cores go by max-min
fairness (water-filling): with ``cores`` short, every piece gets the same level
``x`` of a core, a spinner at most its ``demand``, and ``sum(min(demand, x)) =
cores``; a piece of work has a demand of one core.
"""

from __future__ import annotations

import itertools

import numpy as np
import simpy

#: work below this is done (a nanosecond: far above the float rounding of the rates'
#: products at any simulated time, far below any cost the profiles hold)
_EPS = 1e-9


class SharedCores:
    """``cores`` cores shared by all runnable work: :meth:`run` returns an event that
    fires once its ``work_s`` seconds of CPU have been served, each runnable piece
    advancing at ``min(1, cores / runnable)``."""

    def __init__(self, env: simpy.Environment, cores: int) -> None:
        if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
            raise ValueError(f"a shared CPU needs at least one core, got {cores!r}")
        self.env = env
        self.cores = cores
        self._left: dict[int, float] = {}  #: piece -> work still to run (s)
        self._done: dict[int, simpy.Event] = {}
        self._ids = itertools.count()
        self._since = env.now  #: when ``_left`` was last brought up to date
        self._gen = 0  #: the timer of an older schedule finds a newer generation and stops
        self.busy_s = 0.0  #: core-seconds served
        #: core-seconds served by the process they were given for ("": none given)
        self.busy_by_process: dict[str, float] = {}
        self._spins: dict[int, float] = {}  #: spinner -> its demand (cores)
        self._process: dict[int, str] = {}  #: piece or spinner -> its process

    @property
    def runnable(self) -> int:
        return len(self._left) + len(self._spins)

    def rate(self) -> float:
        """Seconds of work each runnable piece of work gets per second now: the level
        at which the cores fill (at most one core)."""
        n = len(self._left)
        if not self._spins:
            return min(1.0, self.cores / n) if n else 1.0
        demands = sorted([*self._spins.values(), *([1.0] * n)])
        if sum(demands) <= self.cores:
            return 1.0
        left, k = float(self.cores), len(demands)
        for d in demands:  # the smallest demands are met in full while they fit under
            if d * k >= left:  # the level the rest would share
                return left / k
            left -= d
            k -= 1
        return 1.0  # every demand met (the sum above was over only by rounding)

    def in_use(self) -> float:
        """Cores in use now: the work's and the spinners'."""
        return self._in_use(self.rate())

    def _in_use(self, rate: float) -> float:
        return rate * len(self._left) + sum(min(d, rate) for d in self._spins.values())

    def spin(self, demand: float = 1.0, core: int | None = None,
             process: str | None = None) -> int:
        """A process that keeps up to ``demand`` (0, 1] of a core busy from now until
        :meth:`unspin` of the handle returned; it slows the work beside it as work does
        (``core``: as in :meth:`run`; ``process``: whose, for :attr:`busy_by_process`)."""
        if not 0 < demand <= 1:
            raise ValueError(f"a spinner's demand must be in (0, 1] of a core, got {demand!r}")
        self._advance()
        k = next(self._ids)
        self._spins[k] = demand
        self._process[k] = process or ""
        self._schedule()
        return k

    def unspin(self, handle: int) -> None:
        """The spinner ``handle`` stops (a handle already stopped: nothing)."""
        if handle not in self._spins:
            return
        self._advance()
        del self._spins[handle]
        del self._process[handle]
        self._schedule()

    def run(self, work_s: float, core: int | None = None,
            process: str | None = None) -> simpy.Event:
        """An event that fires when ``work_s`` (>= 0) of work has run on the pool
        (``core``: the core a pinned piece would run on; in one pool any piece runs on
        any core; ``process``: whose work it is, for :attr:`busy_by_process`)."""
        if not work_s >= 0:
            raise ValueError(f"work must be >= 0 seconds, got {work_s!r}")
        done = self.env.event()
        if work_s <= _EPS:
            done.succeed()
            return done
        self._advance()
        k = next(self._ids)
        self._left[k] = work_s
        self._done[k] = done
        self._process[k] = process or ""
        self._schedule()
        return done

    def _advance(self) -> None:
        """Serve the work of every runnable piece up to now at the rate that held."""
        dt = self.env.now - self._since
        self._since = self.env.now
        if dt <= 0 or not (self._left or self._spins):
            return
        r = self.rate()  # once: with spinners it sorts their demands
        self.busy_s += dt * self._in_use(r)
        by = self.busy_by_process
        for k in self._left:
            self._left[k] -= dt * r
            by[self._process[k]] = by.get(self._process[k], 0.0) + dt * r
        for k, d in self._spins.items():
            by[self._process[k]] = by.get(self._process[k], 0.0) + dt * min(d, r)

    def _schedule(self) -> None:
        """Finish what is done; wake at the next piece's end at the current rate."""
        for k in [k for k, left in self._left.items() if left <= _EPS]:
            del self._left[k]
            del self._process[k]
            self._done.pop(k).succeed()
        self._gen += 1
        if not self._left:
            return
        gen = self._gen
        wait = min(self._left.values()) / self.rate()

        def fire(_: object) -> None:
            if gen != self._gen:  # work came or went since: a newer timer holds
                return
            self._advance()
            self._schedule()

        self.env.timeout(wait).callbacks.append(fire)


class PinnedCores:
    """``cores`` cores, each a pool of its own (:class:`SharedCores` of one core): a
    piece given a ``core`` runs there, any other starts on an idle core (more than one:
    drawn from ``rng``), else on any core, drawn, and stays there until it ends."""

    def __init__(self, env: simpy.Environment, cores: int, rng: np.random.Generator) -> None:
        if not isinstance(cores, int) or isinstance(cores, bool) or cores < 1:
            raise ValueError(f"pinned cores need at least one core, got {cores!r}")
        self.env = env
        self.cores = cores
        self.pools = [SharedCores(env, 1) for _ in range(cores)]
        self._rng = rng

    @property
    def busy_s(self) -> float:
        """Core-seconds served, on every core."""
        return sum(p.busy_s for p in self.pools)

    @property
    def busy_by_process(self) -> dict[str, float]:
        """Core-seconds served by process, on every core."""
        out: dict[str, float] = {}
        for p in self.pools:
            for name, s in p.busy_by_process.items():
                out[name] = out.get(name, 0.0) + s
        return out

    @property
    def runnable(self) -> int:
        return sum(p.runnable for p in self.pools)

    def _core(self, core: int | None) -> int:
        """``core`` checked, or for a floating piece the core it starts on."""
        if core is not None:
            if not 0 <= core < self.cores:
                raise ValueError(f"core {core} is not one of the host's {self.cores}")
            return core
        pick = [i for i, p in enumerate(self.pools) if p.runnable == 0] or range(self.cores)
        return pick[0] if len(pick) == 1 else pick[int(self._rng.integers(len(pick)))]

    def run(self, work_s: float, core: int | None = None,
            process: str | None = None) -> simpy.Event:
        """As :meth:`SharedCores.run`, on ``core`` (None: the piece floats)."""
        return self.pools[self._core(core)].run(work_s, process=process)

    def spin(self, demand: float = 1.0, core: int | None = None,
             process: str | None = None) -> tuple[int, int]:
        """As :meth:`SharedCores.spin`, on ``core`` (None: the spinner floats)."""
        i = self._core(core)
        return i, self.pools[i].spin(demand, process=process)

    def unspin(self, handle: tuple[int, int]) -> None:
        core, k = handle
        self.pools[core].unspin(k)


def work(env: simpy.Environment, cores: SharedCores | PinnedCores | None,
         seconds: float, core: int | None = None, process: str | None = None
         ) -> simpy.Event:
    """``seconds`` of ``process``'s work: on the host's shared ``cores`` when the profile
    has them (``host.cores``; ``core``: the core it is pinned to, None: it floats), else
    simply that long."""
    return (cores.run(seconds, core, process) if cores is not None
            else env.timeout(seconds))
