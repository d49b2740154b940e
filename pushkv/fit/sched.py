"""How the kernel shares one core among processes: two measurements.

* :func:`tick` -- two CPU-bound processes pinned to one core: how long each runs
  before the other takes over (the scheduler's tick, where it switches between them);
* :func:`wake_waits` -- a process that sleeps a random while and then works, pinned to
  one core beside ``spinners`` CPU-bound ones: how long after each due wake-up it runs,
  and when its work is done.

Each starts fresh interpreters (``spawn``) pinned with ``os.sched_setaffinity``, so it
measures the machine it runs on; nothing else should run meanwhile. Linux only.
``benchmarks/bench_core_sharing.py`` prints them beside the simulator's processor
sharing (:class:`pushkv.sim.host.cores.SharedCores`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import statistics
import time
from typing import Any

#: a gap in a spinning loop longer than this is another process's turn (s): the loop
#: itself takes well under a microsecond a turn
GAP_S = 50e-6
#: how long the sleeper of :func:`wake_waits` sleeps between its works (s, uniform)
SLEEP_S = (0.5e-3, 5e-3)


class SchedError(RuntimeError):
    """A measurement that could not be taken (no such core, nothing seen)."""


def _spin(core: int, seconds: float, out: Any, ready: Any = None) -> None:
    """Spin on ``core`` for ``seconds`` (saying so on ``ready`` first); send the lengths of
    the runs between gaps."""
    os.sched_setaffinity(0, {core})
    if ready is not None:
        ready.put(core)
    runs: list[float] = []
    now = start = last = time.perf_counter()
    end = start + seconds
    while last < end:
        now = time.perf_counter()
        if now - last > GAP_S:
            runs.append(last - start)
            start = now
        last = now
    out.put(runs[1:])  # the first run started with the process, not with a turn


def _sleeper(core: int, seconds: float, work_s: float, gap_s: tuple[float, float],
             seed: int, out: Any) -> None:
    """On ``core``: sleep a while drawn uniformly from ``gap_s``, then spin ``work_s``,
    for ``seconds``; send, for each wake-up, how late it ran and how long after it was
    due its work was done."""
    os.sched_setaffinity(0, {core})
    rng = random.Random(seed)
    late: list[tuple[float, float]] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        wait = rng.uniform(*gap_s)
        due = time.perf_counter() + wait
        time.sleep(wait)
        woke = time.perf_counter()
        c0 = time.thread_time()
        while time.thread_time() - c0 < work_s:  # work_s of CPU, however long it takes
            pass
        late.append((woke - due, time.perf_counter() - due))
    out.put(late)


def _check_core(core: int) -> None:
    if core not in os.sched_getaffinity(0):
        raise SchedError(f"core {core} is not one this process may run on "
                         f"({sorted(os.sched_getaffinity(0))})")


def tick(core: int = 0, seconds: float = 1.0) -> float:
    """The median length (s) of the turns two CPU-bound processes pinned to ``core``
    take, over ``seconds``. SchedError when no turn was seen."""
    _check_core(core)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_spin, args=(core, seconds, out)) for _ in range(2)]
    for p in procs:
        p.start()
    runs = [r for _ in procs for r in out.get(timeout=seconds + 60)]
    for p in procs:
        p.join()
    if not runs:
        raise SchedError(f"two processes on core {core} took no turns in {seconds} s")
    return statistics.median(runs)


def wake_waits(spinners: int, work_s: float, *, core: int = 0, seconds: float = 2.0,
               gap_s: tuple[float, float] = SLEEP_S, seed: int = 0
               ) -> list[tuple[float, float]]:
    """A sleeper on ``core`` beside ``spinners`` CPU-bound processes there: it sleeps a
    while drawn from ``gap_s``, then works ``work_s`` of CPU, for ``seconds``. For each
    wake-up, how late (s) it ran and how long after it was due its work was done.
    SchedError when it never woke."""
    _check_core(core)
    if spinners < 0 or not work_s >= 0:
        raise SchedError(f"spinners must be >= 0 and work >= 0 s, got {spinners}, {work_s}")
    ctx = mp.get_context("spawn")
    out, sink, ready = ctx.Queue(), ctx.Queue(), ctx.Queue()
    spins = [ctx.Process(target=_spin, args=(core, seconds + 1.0, sink, ready))
             for _ in range(spinners)]
    for p in spins:
        p.start()
    for _ in spins:  # every spinner in its loop before the sleeper starts
        ready.get(timeout=60)
    sleeper = ctx.Process(target=_sleeper, args=(core, seconds, work_s, gap_s, seed, out))
    sleeper.start()
    late = out.get(timeout=seconds + 60)
    sleeper.join()
    for _ in spins:
        sink.get(timeout=60)
    for p in spins:
        p.join()
    if not late:
        raise SchedError("the sleeper never woke")
    return late
