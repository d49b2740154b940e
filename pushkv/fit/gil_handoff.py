"""How long a thread blocked on a queue takes to run once another thread feeds it,
when the feeding thread then sleeps and when it keeps running Python.

pushkv's transport thread waits for commands the engine's thread hands it
(:mod:`pushkv.transports.nixl.runtime.loop`). When the engine's thread goes on running
Python, the woken thread needs the interpreter lock, which CPython hands over after
its switch interval (``sys.getswitchinterval()``, 5 ms by default). :func:`handoffs`
measures that price on this machine, one way at a time (:data:`WAYS`);
:func:`verdict` is the one JSON object of both. ``benchmarks/bench_gil_handoff.py``
is the command line.
"""

from __future__ import annotations

import queue
import statistics
import sys
import threading
import time
from typing import Any

#: (name, the feeder keeps running Python) of each way, in the order they are measured
WAYS = (("idle", False), ("busy", True))


def handoffs(n: int, gap_s: float, busy: bool) -> list[float]:
    """Seconds from each ``put`` to the consumer thread's ``get`` returning, ``n``
    times, ``gap_s`` apart; meanwhile the feeding thread spins in Python (``busy``)
    or sleeps."""
    q: queue.Queue[float | None] = queue.Queue()
    got: list[float] = []

    def consume() -> None:
        while (t := q.get()) is not None:
            got.append(time.perf_counter() - t)

    th = threading.Thread(target=consume, name="consumer")
    th.start()
    x = 0
    for _ in range(n):
        q.put(time.perf_counter())
        end = time.perf_counter() + gap_s
        if busy:
            while time.perf_counter() < end:
                x += 1
        else:
            time.sleep(gap_s)
    q.put(None)
    th.join()
    return got


def summary(xs: list[float]) -> dict[str, float]:
    """The median and the p90 of ``xs`` (seconds), in ms."""
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3)}


def verdict(ways: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The run's one JSON object: the switch interval, each way's :func:`summary`, and
    ``busy_over_idle``, the ratio of the medians."""
    ratio = ways["busy"]["median_ms"] / max(ways["idle"]["median_ms"], 1e-6)
    return {"switch_interval_s": sys.getswitchinterval(), **ways,
            "busy_over_idle": round(ratio, 1)}
