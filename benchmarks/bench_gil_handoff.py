"""How long a thread blocked on a queue takes to run once another thread feeds it,
when the feeding thread then sleeps and when it keeps running Python.

pushkv's transport thread waits for commands the engine's thread hands it
(:mod:`pushkv.transports.nixl.runtime.loop`). When the engine's thread goes on running
Python, the woken thread needs the interpreter lock, which CPython hands over after
its switch interval (``sys.getswitchinterval()``, 5 ms by default). This measures
that price on this machine, side by side, in one run::

    python benchmarks/bench_gil_handoff.py              # CPython's 5 ms
    python benchmarks/bench_gil_handoff.py --switch-s 0.001

The last line is one JSON object: the medians and p90s (ms) of both ways, and
``busy_over_idle``, the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time


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
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs) * 1e3, 3),
            "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=100, help="hand-offs each way")
    p.add_argument("--gap-s", type=float, default=0.012,
                   help="time between hand-offs (longer than a switch interval)")
    p.add_argument("--switch-s", type=float, default=None,
                   help="sys.setswitchinterval first (default: leave CPython's)")
    args = p.parse_args(argv)
    if args.n < 1 or not args.gap_s > 0:
        p.error("--n must be >= 1 and --gap-s > 0")
    if args.switch_s is not None:
        if not args.switch_s > 0:
            p.error("--switch-s must be > 0")
        sys.setswitchinterval(args.switch_s)
    ways = {}
    for way, busy in (("idle", False), ("busy", True)):
        ways[way] = s = summary(handoffs(args.n, args.gap_s, busy))
        print(f"feeder {'runs Python' if busy else 'sleeps'}: hand-off median "
              f"{s['median_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms", flush=True)
    ratio = ways["busy"]["median_ms"] / max(ways["idle"]["median_ms"], 1e-6)
    print(json.dumps({"switch_interval_s": sys.getswitchinterval(), **ways,
                      "busy_over_idle": round(ratio, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
