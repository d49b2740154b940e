"""One core shared by processes: the kernel on this machine against the simulator's two
models of it, side by side, in one run.

The kernel (:mod:`pushkv.fit.sched`): two CPU-bound processes pinned to one core -- how
long each turn lasts (the tick); then a sleeper pinned to that core beside 0, 1 or 2
CPU-bound spinners, which sleeps 0.5-5 ms (uniform) and then works 0.2 or 2 ms of CPU
-- how long after each due wake-up its work is done. The models run the same
experiment in SimPy: :class:`pushkv.sim.host.fair.FairCore` with the measured tick
(``host.tick_s``) and processor sharing, :class:`pushkv.sim.host.cores.SharedCores`
of one core (``host.tick_s = 0``)::

    python benchmarks/bench_fair_core.py            # about 15 s; nothing else running

Prints a table (ms: mean and p90 of the time from a due wake-up to its work done, for
the kernel and each model) and, last, one JSON object: ``tick_ms`` and per case the
three means and p90s, and ``fair_over_kernel`` / ``sharing_over_kernel`` (the ratios of
the means).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import simpy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pushkv.fit.sched import tick, wake_waits
from pushkv.sim.host.cores import SharedCores
from pushkv.sim.host.fair import FairCore, base_slice_s

#: (spinners, the sleeper's work per wake-up in s)
CASES = ((0, 0.2e-3), (1, 0.2e-3), (1, 2e-3), (2, 0.2e-3), (2, 2e-3))
GAP_S = (0.5e-3, 5e-3)


def modelled(core: FairCore | SharedCores, env: simpy.Environment, spinners: int,
             work_s: float, seconds: float, seed: int) -> list[float]:
    """The sleeper's due-to-done times (s) on ``core`` beside ``spinners`` spinners."""
    for i in range(spinners):
        core.spin(1.0, process=f"spinner {i}")
    rng = np.random.default_rng(seed)
    times: list[float] = []

    def sleeper():
        while env.now < seconds:
            yield env.timeout(float(rng.uniform(*GAP_S)))
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
    print("\n| spinners | work (ms) | kernel mean / p90 | fair mean / p90 | sharing mean / p90 |")
    print("|---|---|---|---|---|")
    out: dict[str, object] = {"tick_ms": round(tick_s * 1e3, 3), "cases": []}
    for spinners, work_s in CASES:
        kernel = [done for _, done in wake_waits(spinners, work_s, core=args.core,
                                                  seconds=args.seconds, gap_s=GAP_S)]
        env = simpy.Environment()
        fair = modelled(FairCore(env, tick_s, slice_s=base_slice_s(os.cpu_count() or 1)),
                        env, spinners, work_s, args.seconds, 0)
        env = simpy.Environment()
        sharing = modelled(SharedCores(env, 1), env, spinners, work_s, args.seconds, 0)
        k, f, s = stats(kernel), stats(fair), stats(sharing)
        print(f"| {spinners} | {work_s * 1e3:g} | {k[0]} / {k[1]} | {f[0]} / {f[1]} | "
              f"{s[0]} / {s[1]} |", flush=True)
        out["cases"].append({  # type: ignore[attr-defined]
            "spinners": spinners, "work_ms": work_s * 1e3, "kernel": k, "fair": f,
            "sharing": s, "fair_over_kernel": round(f[0] / k[0], 3),
            "sharing_over_kernel": round(s[0] / k[0], 3)})
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
