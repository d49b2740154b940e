"""One core as the kernel's fair scheduler shares it: one process at a time, by ticks.

Processor sharing (:class:`.cores.SharedCores`) gives every runnable piece its share of
a core at once, a fluid. The kernel does not, and the difference is what a frontend
meets near saturation. Measured on a 2-core VM with Linux 6.18
(``benchmarks/bench_fair_core.py``: the kernel beside this model, the same experiment):

* two CPU-bound processes pinned to one core take turns of one tick each (4.0 ms,
  ``CONFIG_HZ=250``), not half a core each at every instant;
* a process that sleeps and wakes beside CPU-bound ones mostly runs within 0.1 ms of
  its wake-up, but now and then waits for the next tick, the more often the more it
  works and the more processes share the core.

Linux's fair scheduler (EEVDF since 6.6, ``kernel/sched/fair.c``) keeps a virtual
runtime per task (its CPU time, all weights equal here) and a deadline, a slice ahead
of it (the base slice: :func:`base_slice_s`). Its running task keeps the core until it
has run out its slice (``RUN_TO_PARITY``); the slice is found run out, and a new one
set, when the scheduler next looks -- at a tick, or when a task wakes -- and then the
task furthest behind runs. A waking task is placed at its old virtual runtime, but at
most a lag bound behind the queue's (``update_entity_lag``: max(2 slices, a tick)).
The model keeps those rules:

* one piece runs at a time, at full speed; the rest wait;
* each *process* (a piece's ``process``: an engine's loop, an API server, the relay)
  has a virtual runtime: the CPU time it got; a piece starts at its process's, but no
  more than ``tick_s`` behind the core's floor (the least virtual runtime of the
  runnable pieces, which never goes back); a process new to the core starts at the
  floor; a piece's slice ends ``slice_s`` of virtual runtime after it starts;
* a piece that takes the core keeps it until the slice it holds then has run out
  (``RUN_TO_PARITY``); after that, a piece arriving behind it takes the core at once;
* at every tick (multiples of ``tick_s``) the running piece's slice is checked: if it
  has run out, a new one is set and the runnable piece furthest behind runs (the
  running one stays on a tie);
* a spinner of demand d (an engine loop stepping empty) runs d of each tick and sleeps
  the rest; of demand 1 it is always runnable.

A process that moves to another core keeps its distance from the floor (as the kernel
renormalises a migrating task's virtual runtime). Left out: eligibility (the kernel
protects no task ahead of the queue's mean) and the pick by earliest deadline (the
model picks the least virtual runtime), nice levels, a
waking task's own wake-up latency (0.07-0.1 ms here, in the profile's keys), and
moving a waiting task to a core falling idle (weaker).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from .profile import MAX_TICK_S

#: work below this is done (as in :mod:`.cores`)
_EPS = 1e-9


@dataclass
class _Piece:
    process: str | None
    left: float  #: work still to run (s); inf for a spinner
    v: float  #: virtual runtime (s)
    deadline: float  #: the virtual runtime its slice ends at
    done: simpy.Event


@dataclass
class _Left:
    """Where a process's last piece left a core: its virtual runtime and the floor."""

    core: int
    v: float
    floor: float


def base_slice_s(cpus: int) -> float:
    """The fair scheduler's base slice (s) on a machine of ``cpus`` CPUs: 0.75 ms scaled
    by 1 + log2 of the CPUs, at most 8 (``sysctl_sched_base_slice`` and
    ``get_update_sysctl_factor``, ``SCHED_TUNABLESCALING_LOG``, the default; Linux
    ``kernel/sched/fair.c``): 1.5 ms on 2."""
    if cpus < 1:
        raise ValueError(f"a machine has at least one CPU, got {cpus}")
    return 0.75e-3 * (1 + int(math.log2(min(cpus, 8))))


class FairCore:
    """One core shared by ticks (module doc): :meth:`run` returns an event that fires once
    ``work_s`` of CPU has been served; the same interface as :class:`.cores.SharedCores`.
    ``slice_s``: a piece's slice (default: a tick); ``memory`` (shared by the cores of one
    host): where each process left a core."""

    cores = 1

    def __init__(self, env: simpy.Environment, tick_s: float, *, slice_s: float | None = None,
                 index: int = 0, memory: dict[str, _Left] | None = None) -> None:
        if not 0 < tick_s <= MAX_TICK_S:
            raise ValueError(f"a tick must be in (0, {MAX_TICK_S}] s, got {tick_s!r}")
        slice_s = tick_s if slice_s is None else slice_s
        if not 0 < slice_s <= MAX_TICK_S:
            raise ValueError(f"a slice must be in (0, {MAX_TICK_S}] s, got {slice_s!r}")
        self.env = env
        self.tick_s = tick_s
        self.slice_s = slice_s
        self.index = index
        self._memory: dict[str, _Left] = {} if memory is None else memory
        self._pieces: dict[int, _Piece] = {}
        self._current: int | None = None
        self._protect = 0.0  #: the running piece keeps the core until its v reaches this
        self._since = env.now  #: when the running piece was last accounted
        self._floor = 0.0
        self._ids = itertools.count()
        self._gen = 0
        self._spins: dict[int, list[int | None]] = {}  #: spinner -> its piece running
        self.busy_s = 0.0  #: core-seconds served
        #: core-seconds served by the process they were given for ("": none given)
        self.busy_by_process: dict[str, float] = {}
        self.preemptions = 0  #: pieces that took the core from a running one on arrival

    @property
    def runnable(self) -> int:
        return len(self._pieces)

    def run(self, work_s: float, core: int | None = None,
            process: str | None = None) -> simpy.Event:
        """An event that fires when ``work_s`` (>= 0) of ``process``'s work has run here
        (``core``: as :meth:`.cores.SharedCores.run`, one core)."""
        if not work_s >= 0:
            raise ValueError(f"work must be >= 0 seconds, got {work_s!r}")
        done = self.env.event()
        if work_s <= _EPS:
            done.succeed()
            return done
        self._add(work_s, process, done)
        return done

    def _add(self, work_s: float, process: str | None, done: simpy.Event) -> int:
        self._account()
        self._finish()
        k = next(self._ids)
        v = self._placed(process)
        self._pieces[k] = _Piece(process, work_s, v, v + self.slice_s, done)
        cur = self._current
        if cur is None:
            self._pick(k)
        elif not self._protected(cur):  # the scheduler looks: the running one may yield
            self._renew(cur)
            self._repick()
            if self._current != cur:
                self.preemptions += 1
        self._schedule()
        return k

    def _pick(self, k: int) -> None:
        """Piece ``k`` takes the core: protected until its slice ends (``RUN_TO_PARITY``)."""
        self._current = k
        self._renew(k)
        self._protect = self._pieces[k].deadline

    def _protected(self, k: int) -> bool:
        """Whether the running piece ``k`` keeps the core from a piece arriving: while the
        slice it took the core with lasts."""
        return self._pieces[k].v < self._protect - _EPS

    def _renew(self, k: int) -> None:
        """A new slice for piece ``k`` if its last one ran out."""
        piece = self._pieces[k]
        if piece.v >= piece.deadline - _EPS:
            piece.deadline = piece.v + self.slice_s

    def _placed(self, process: str | None) -> float:
        """The virtual runtime a piece of ``process`` arriving now starts at."""
        left = self._memory.get(process) if process is not None else None
        if left is None:
            return self._floor
        v = left.v if left.core == self.index else self._floor + (left.v - left.floor)
        return max(v, self._floor - self.tick_s)

    def spin(self, demand: float = 1.0, core: int | None = None,
             process: str | None = None) -> int:
        """``process`` keeps up to ``demand`` (0, 1] of the core busy from now until
        :meth:`unspin` of the handle returned: always runnable at 1, else runnable
        ``demand`` of each tick."""
        if not 0 < demand <= 1:
            raise ValueError(f"a spinner's demand must be in (0, 1] of a core, got {demand!r}")
        h = next(self._ids)
        running: list[int | None] = [None]
        self._spins[h] = running
        if demand >= 1:
            running[0] = self._add(math.inf, process, self.env.event())
        else:
            self.env.process(self._duty(h, running, demand, process))
        return h

    def _duty(self, h: int, running: list[int | None], demand: float,
              process: str | None) -> Generator[Any, Any, None]:
        while h in self._spins:
            done = self.env.event()
            running[0] = self._add(demand * self.tick_s, process, done)
            yield done
            running[0] = None
            if h not in self._spins:
                return
            yield self.env.timeout((1 - demand) * self.tick_s)

    def unspin(self, handle: int) -> None:
        """The spinner ``handle`` stops (a handle already stopped: nothing)."""
        running = self._spins.pop(handle, None)
        if running is None or running[0] is None:
            return
        self._account()
        piece = self._pieces.pop(running[0])
        self._left(piece)
        if self._current == running[0]:
            self._current = None
        if not piece.done.triggered:
            piece.done.succeed()
        self._schedule()

    def _left(self, piece: _Piece) -> None:
        if piece.process is not None:
            self._memory[piece.process] = _Left(self.index, piece.v, self._floor)

    def _account(self) -> None:
        """Serve the running piece up to now, its slice renewed at each tick that found
        it run out (the kernel looks at every tick, whoever else is runnable); raise the
        floor."""
        now = self.env.now
        dt = now - self._since
        cur = self._current
        if cur is not None and dt > 0:
            piece = self._pieces[cur]
            first = math.floor(self._since / self.tick_s) + 1  # the ticks crossed
            last = math.floor(now / self.tick_s)
            if last >= first:  # at the first, and (a tick longer than any slice left) the last
                for n in ((first, last) if last > first else (first,)):
                    v_at = piece.v + (n * self.tick_s - self._since)
                    if v_at >= piece.deadline - _EPS:
                        piece.deadline = v_at + self.slice_s
            piece.left -= dt
            piece.v += dt
            self.busy_s += dt
            name = piece.process or ""
            self.busy_by_process[name] = self.busy_by_process.get(name, 0.0) + dt
        self._since = now
        if self._pieces:
            self._floor = max(self._floor, min(p.v for p in self._pieces.values()))

    def _finish(self) -> None:
        """The running piece ends if its work is done."""
        cur = self._current
        if cur is not None and self._pieces[cur].left <= _EPS:
            piece = self._pieces.pop(cur)
            self._left(piece)
            piece.done.succeed()
            self._current = None

    def _schedule(self) -> None:
        """Finish the running piece if it is done, pick one if none runs, and wake at
        its end or the next tick, whichever comes first."""
        self._finish()
        cur = self._current
        if cur is None and self._pieces:
            self._pick(min(self._pieces, key=lambda k: (self._pieces[k].v, k)))
            cur = self._current
        self._gen += 1
        if cur is None:
            return
        end = self._pieces[cur].left
        tick = math.inf
        if len(self._pieces) > 1:
            tick = (math.floor(self.env.now / self.tick_s) + 1) * self.tick_s - self.env.now
            if tick <= _EPS:  # on a tick already (float rounding): the next one
                tick += self.tick_s
        wait = min(end, tick)
        if math.isinf(wait):
            return
        gen, at_tick = self._gen, tick <= end
        slice_over = at_tick and (self._pieces[cur].v + tick
                                  >= self._pieces[cur].deadline - _EPS)

        def fire(_: object) -> None:
            if gen != self._gen:  # pieces came or went since: a newer timer holds
                return
            self._account()  # renews the slice at this tick if it ran out
            self._finish()
            if slice_over:
                self._repick()
            self._schedule()

        self.env.timeout(wait).callbacks.append(fire)

    def _repick(self) -> None:
        """The runnable piece furthest behind runs (the running one stays on a tie)."""
        cur = self._current
        if cur is None:
            return
        best = min(self._pieces, key=lambda k: (self._pieces[k].v, k))
        if self._pieces[best].v < self._pieces[cur].v:
            self._pick(best)
