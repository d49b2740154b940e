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
``busy_over_idle``, the ratio of the medians. The measurement is
:mod:`pushkv.fit.gil_handoff`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pushkv.fit.gil_handoff import WAYS, handoffs, summary, verdict


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
    for way, busy in WAYS:
        ways[way] = s = summary(handoffs(args.n, args.gap_s, busy))
        print(f"feeder {'runs Python' if busy else 'sleeps'}: hand-off median "
              f"{s['median_ms']:.2f} ms, p90 {s['p90_ms']:.2f} ms", flush=True)
    print(json.dumps(verdict(ways)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
