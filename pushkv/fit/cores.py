"""What a process meets on each CPU core of a shared machine: a probe.

:class:`CoreProbe` runs one small process pinned to each core for the length of a
measurement; :mod:`pushkv.fit.measure` and ``benchmarks/bench_sim_vs_real.py`` turn
what it saw into the profile's ``cpu_share`` and ``wake_s``.

A probe is a fresh interpreter (``spawn``): starting the two of a 2-core machine took
both cores for about 0.4 s here (0.8-1 s of CPU), the time 3-4 requests at 8 QPS take
to arrive. Entering a :class:`CoreProbe` therefore returns only once every probe is in
its loop, so that what it measures never pays for the probes' own start.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

#: loop iterations of one unit of the probe's work (:func:`_unit`)
UNIT_LOOPS = 100


def _unit() -> int:
    """A fixed piece of pure-Python work (a few microseconds): the probe's measure of how
    fast the core runs an interpreter, whatever else shares it."""
    x = 0
    for i in range(UNIT_LOOPS):
        x += i * i
    return x


def _probe(core: int, period_s: float, burst_s: float, stop: Any, out: Any) -> None:
    """On ``core``: send ``("ready", time.monotonic())`` once started; then every
    ``period_s`` sleep, wake, spin ``burst_s`` of CPU time in units of :func:`_unit`; send
    (wake delays, burst shares, units per CPU second, when each wake-up was due) when
    ``stop`` is set."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {core})
    out.send(("ready", time.monotonic()))
    wakes, shares, speeds, due = [], [], [], []
    nxt = time.monotonic() + period_s
    while not stop.is_set():
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        woke = time.monotonic()
        wakes.append(max(0.0, woke - nxt))
        due.append(nxt)
        c0, w0 = time.thread_time(), time.perf_counter()
        units = 0
        while (cpu := time.thread_time() - c0) < burst_s:
            _unit()
            units += 1
        shares.append(cpu / (time.perf_counter() - w0))
        speeds.append(units / cpu)
        nxt = max(nxt + period_s, time.monotonic())
    out.send((wakes, shares, speeds, due))


def _reap(proc: Any) -> None:
    """A probe process told to stop: gone, killed if it outlives a generous wait."""
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(10)


def quantiles(xs: Sequence[float], n: int) -> list[float]:
    """``xs`` at ``n`` evenly spaced quantiles, the midpoints of ``n`` equal slices of
    their distribution (the nearest sample): equally likely draws from them have about
    ``xs``' mean and keep the tail. Empty for no samples."""
    if n < 1:
        raise ValueError(f"quantiles need at least one point, got {n!r}")
    got = sorted(xs)
    return [got[min(len(got) - 1, int((i + 0.5) * len(got) / n))] for i in range(n)] \
        if got else []


class ProbeError(RuntimeError):
    """A core probe did not start: its process died or stayed silent past the deadline."""


#: how long entering a :class:`CoreProbe` waits for its probes to start (s): generous,
#: a fresh interpreter on two cores shared with vLLM servers takes seconds at worst
READY_S = 120.0


class CoreProbe:
    """What a process woken on each core meets, while a measurement runs: a probe
    process pinned to the core sleeps ``period_s``, then spins ``burst_s`` of CPU time
    (about 4% of the core). ``wake_s(core)``: the median delay between its timer and its
    running (run-queue wait of a woken process); ``share(core)``: the median share of
    the core its bursts got (CPU time / wall time); ``speed(core)``: the median rate its
    bursts ran :func:`_unit` at, per CPU second (a host that runs the machine slower
    lowers it; other processes on the core do not).

    Entering returns once every probe has started (``started``: core -> the
    ``time.monotonic()`` its loop began), so the measurement that follows does not share
    the cores with the probes' own start-up; :class:`ProbeError` (and no probe left
    running) where one dies first or stays silent for ``ready_s``."""

    def __init__(self, cores: Sequence[int] = (0, 1), period_s: float = 0.025,
                 burst_s: float = 0.001, ready_s: float = READY_S) -> None:
        if not 0 < burst_s < period_s:
            raise ValueError(f"a probe's burst must be positive and shorter than its "
                             f"period, got burst {burst_s!r} s, period {period_s!r} s")
        if not ready_s > 0:
            raise ValueError(f"ready_s must be positive, got {ready_s!r}")
        self.ready_s = ready_s
        self.started: dict[int, float] = {}
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._procs = []
        self._pipes = []
        self._ends = []  #: the probes' ends of the pipes, closed here once they start
        self.cores = tuple(cores)
        for c in self.cores:
            parent, child = ctx.Pipe(duplex=False)
            self._procs.append(ctx.Process(target=_probe, args=(c, period_s, burst_s,
                                                                self._stop, child),
                                           daemon=True))
            self._pipes.append(parent)
            self._ends.append(child)
        self.wakes: dict[int, list[float]] = {}
        #: when each of ``wakes`` was due (``time.monotonic()``), by core
        self.wake_times: dict[int, list[float]] = {}
        self.shares: dict[int, list[float]] = {}
        self.speeds: dict[int, list[float]] = {}

    def __enter__(self) -> CoreProbe:
        for proc, end in zip(self._procs, self._ends, strict=True):
            proc.start()
            end.close()  # the probe holds it now: its death reads as the pipe's end here
        deadline = time.monotonic() + self.ready_s
        for c, pipe in zip(self.cores, self._pipes, strict=True):
            why = f"stayed silent for {self.ready_s:g} s"
            try:
                if pipe.poll(max(0.0, deadline - time.monotonic())):
                    _, when = pipe.recv()
                    self.started[c] = float(when)
                    continue
            except (EOFError, OSError):
                why = "died before it started"
            self._stop.set()
            for proc in self._procs:
                _reap(proc)
            raise ProbeError(f"the core probe on core {c} {why}; nothing was measured")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for c, pipe, proc in zip(self.cores, self._pipes, self._procs, strict=True):
            with contextlib.suppress(EOFError, OSError):  # a probe that died reports none
                if pipe.poll(30):
                    (self.wakes[c], self.shares[c], self.speeds[c],
                     self.wake_times[c]) = pipe.recv()
            _reap(proc)

    def wake_s(self, core: int) -> float:
        got = self.wakes.get(core)
        return statistics.median(got) if got else 0.0

    def wake_tail(self, core: int) -> dict[str, float]:
        """The wake-up delays' tail on ``core``: p90, p99 and the largest (s), and the
        fraction of wake-ups later than 10 ms (a stall, not a run-queue wait); zeros
        without samples."""
        got = sorted(self.wakes.get(core) or ())
        if not got:
            return {"p90_s": 0.0, "p99_s": 0.0, "max_s": 0.0, "over_10ms": 0.0}

        def q(p: float) -> float:
            return got[min(len(got) - 1, int(p * len(got)))]

        return {"p90_s": q(0.9), "p99_s": q(0.99), "max_s": got[-1],
                "over_10ms": sum(w > 0.01 for w in got) / len(got)}

    def speed(self, core: int) -> float:
        """Units of :func:`_unit` per CPU second on ``core``, median (0 without samples)."""
        got = self.speeds.get(core)
        return statistics.median(got) if got else 0.0

    def share(self, core: int) -> float:
        got = self.shares.get(core)
        return min(1.0, statistics.median(got)) if got else 1.0
