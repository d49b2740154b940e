"""One core shared by processes: the kernel on this machine against the simulator's
model of it (processor sharing), side by side, in one run.

The simulator runs every piece of CPU work on a shared core as a fluid: ``n`` runnable
pieces each advance at ``1 / n`` of the core from the instant they are runnable
(:class:`pushkv.sim.host.cores.SharedCores`). The kernel runs one task at a time and
switches at its tick. This measures how far apart the two are where it matters to a
frontend: a sleeper pinned to one core beside 0, 1 or 2 CPU-bound spinners, which
sleeps 0.5-5 ms (uniform) and then works 0.2 or 2 ms of CPU -- how long after each due
wake-up its work is done. The kernel's side is :mod:`pushkv.fit.sched` (and the tick:
how long two CPU-bound processes on one core each run before the other takes over);
the model's is the same experiment in SimPy on one core::

    python benchmarks/bench_core_sharing.py         # about 15 s; nothing else running

Prints a table (ms: mean and p90 of the time from a due wake-up to its work done, the
kernel's and the model's) and, last, one JSON object: ``tick_ms`` and per case both
means and p90s and ``sharing_over_kernel`` (the ratio of the means).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import simpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pushkv.fit.sched import SLEEP_S, tick, wake_waits
from pushkv.sim.host.cores import SharedCores

#: (spinners, the sleeper's work per wake-up in s)
CASES = ((0, 0.2e-3), (1, 0.2e-3), (1, 2e-3), (2, 0.2e-3), (2, 2e-3))


def modelled(core: SharedCores, spinners: int, work_s: float, seconds: float,
             seed: int) -> list[float]:
    """The sleeper's due-to-done times (s) on ``core`` beside ``spinners`` spinners."""
    env = core.env
    for i in range(spinners):
        core.spin(1.0, process=f"spinner {i}")
    rng = np.random.default_rng(seed)
    times: list[float] = []

    def sleeper():
        while env.now < seconds:
            yield env.timeout(float(rng.uniform(*SLEEP_S)))
            due = env.now
            yield core.run(work_s, process="sleeper")
            times.append(env.now - due)

    env.process(sleeper())
    env.run(until=seconds + 1.0)
    return times


def stats(xs: list[float]) -> tuple[float, float]:
    """Mean and p90, ms."""
    xs = sorted(xs)
    return (round(statistics.fmean(xs) * 1e3, 3), round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=2.0, help="length of each case")
    p.add_argument("--core", type=int, default=0, help="the core the processes share")
    args = p.parse_args(argv)
    if not args.seconds > 0:
        p.error(f"--seconds must be > 0, got {args.seconds}")
    tick_s = tick(args.core)
    print(f"the kernel's tick here: {tick_s * 1e3:.2f} ms (two processes on core {args.core})")
    print("\n| spinners | work (ms) | kernel mean / p90 | sharing mean / p90 | sharing / kernel |")
    print("|---|---|---|---|---|")
    out: dict[str, object] = {"tick_ms": round(tick_s * 1e3, 3), "cases": []}
    for spinners, work_s in CASES:
        kernel = [done for _, done in wake_waits(spinners, work_s, core=args.core,
                                                  seconds=args.seconds)]
        env = simpy.Environment()
        sharing = modelled(SharedCores(env, 1), spinners, work_s, args.seconds, 0)
        k, s = stats(kernel), stats(sharing)
        print(f"| {spinners} | {work_s * 1e3:g} | {k[0]} / {k[1]} | {s[0]} / {s[1]} | "
              f"{s[0] / k[0]:.2f} |", flush=True)
        out["cases"].append({  # type: ignore[attr-defined]
            "spinners": spinners, "work_ms": work_s * 1e3, "kernel": k, "sharing": s,
            "sharing_over_kernel": round(s[0] / k[0], 3)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
