"""From a producer's ``prefill_finished`` to its consumer's ``TransferReady``: a small
push between two processes, with and without nudges, side by side in one run.

NIXL cannot wake a thread when a notification arrives, and on host memory over UCX a
write's notification needs several polls of the receiving agent to come through. So
a consumer that polls every ``active_poll_s`` (1 ms) sees a small write some
milliseconds after it was posted. With a nudge (``sc.NUDGE``, a side-channel frame
the producer sends as it starts the write), the consumer polls every
``nudge_poll_s`` until the notification came (at most ``nudge_window_s``).

Two pairs of runtimes live in the same two processes, one with nudges (the default
settings) and one without (``nudge_window_s = 0``); requests alternate between them.
For each request the consumer registers, the producer waits until the registration
has arrived, then reports its prefill finished; the latency is from that call to the
consumer's ``TransferReady`` (both clocks are the host's ``CLOCK_MONOTONIC``).
The request is the tiny model's size by default (128 tokens, 22 layers, 4 KV heads).

Last line: one JSON object with ``ready_ms_median`` and ``ready_ms_p90`` per way,
``nudge_vs_poll`` (median with nudges over median without), ``requests`` and
``load_average``.

    PYTHONPATH=. python benchmarks/bench_ready.py [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

WAYS = ("nudge", "poll")
TOKENS, BLOCK = 128, 16


def _info(engine: str) -> Any:
    from pushkv.protocol import uniform_ranks

    return uniform_ranks(engine, num_layers=22, num_kv_heads=4, head_dim=64, dtype_bytes=2,
                         num_blocks=256, block_size=BLOCK)[0]


def _config(way: str) -> Any:
    from pushkv.transports.nixl import NixlConfig

    return NixlConfig() if way == "nudge" else NixlConfig(nudge_window_s=0)




def _commands(conn: Any, rts: dict[str, Any]) -> Any:
    """The parent's commands, until ``close``: then every runtime is closed and acked."""
    while (cmd := conn.recv())[0] != "close":
        yield cmd
    for rt in rts.values():
        rt.close()
    conn.send(None)


def producer_main(conn: Any, marks: str | None) -> None:
    import numpy as np

    from pushkv import timeline
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime
    from pushkv.transports.nixl.testing import wait_for_event
    from pushkv.vllm.testing import poll

    timeline.configure(marks, "producer")
    rts = {}
    for way in WAYS:
        info = _info(f"prefill-{way}")
        rts[way] = NixlRuntime(info, region_memory(info.layout, rng=np.random.default_rng(1)),
                               role="producer", config=_config(way))
    conn.send({w: rt.address for w, rt in rts.items()})
    for _, way, tid, frames in _commands(conn, rts):
        rt = rts[way]
        seen = poll(lambda rt=rt: rt.stats().get("control_frames", 0),  # the registration
                    lambda n, frames=frames: n >= frames, 30.0, interval_s=0.0005)
        if seen < frames:
            raise TimeoutError(f"no registration for {tid}")
        t0 = time.monotonic()
        timeline.mark(tid, "prefill_finished", t0)
        rt.prefill_finished(tid, list(range(TOKENS // BLOCK)), TOKENS)
        conn.send(t0)
        wait_for_event(rt, "ReleaseSource", tid, 30.0)


def consumer_main(conn: Any, addresses: dict[str, str], marks: str | None) -> None:
    from pushkv import timeline
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime
    from pushkv.transports.nixl.testing import wait_for_event

    timeline.configure(marks, "consumer")
    rts = {}
    for way in WAYS:
        info = _info(f"decode-{way}")
        rt = rts[way] = NixlRuntime(info, region_memory(info.layout), role="consumer",
                                    config=_config(way))
        rt.connect(f"prefill-{way}", [addresses[way]], eager=True)
    for way, rt in rts.items():
        while not rt.connected(f"prefill-{way}"):
            rt.wait(0.01)
    conn.send(None)
    for _, way, tid in _commands(conn, rts):
        rt = rts[way]
        rt.register(tid, f"prefill-{way}", list(range(100, 100 + TOKENS // BLOCK)), TOKENS)
        wait_for_event(rt, "TransferReady", tid, 30.0)
        t1 = time.monotonic()
        timeline.mark(tid, "ready", t1)
        conn.send(t1)


def _segments(directory: str, warm: int) -> None:
    """Median of each step of the way, per way (the warm-up left out)."""
    from pushkv import timeline

    steps = ("prefill_finished", "write_posted", "notify_received", "ready")
    reqs = timeline.by_request(timeline.read(directory))
    print(f"{'segment (median ms)':42s} " + " ".join(f"{w:>8s}" for w in WAYS))
    for a, b in zip(steps, (*steps[1:],), strict=False):
        row = []
        for way in WAYS:
            v = [1e3 * (m[b] - m[a]) for tid, m in reqs.items()
                 if tid.startswith(way + "-") and int(tid.rsplit("-", 1)[1]) >= warm
                 and a in m and b in m]
            row.append(f"{statistics.median(v):8.3f}" if v else f"{'-':>8s}")
        print(f"{a + ' -> ' + b:42s} " + " ".join(row))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="requests per way")
    ap.add_argument("--timeline", metavar="DIR",
                    help="also record pushkv.timeline marks here and print their segments")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=producer_main, args=(p_child, args.timeline),
                      daemon=True)
    prod.start()
    addresses = p_conn.recv()
    cons = ctx.Process(target=consumer_main, args=(c_child, addresses, args.timeline),
                      daemon=True)
    cons.start()
    c_conn.recv()
    lat: dict[str, list[float]] = {w: [] for w in WAYS}
    frames = dict.fromkeys(WAYS, 0)
    warm = 10
    for i in range(warm + args.requests):
        for way in (WAYS if i % 2 else WAYS[::-1]):  # alternate which goes first
            tid = f"{way}-{i}"
            frames[way] += 1  # one Register per request
            c_conn.send(("push", way, tid))
            p_conn.send(("push", way, tid, frames[way]))
            t0 = p_conn.recv()
            t1 = c_conn.recv()
            if i >= warm:
                lat[way].append(1e3 * (t1 - t0))
            time.sleep(0.002)  # let both sides go idle, as between requests
        if i >= warm and (i + 1 - warm) % 50 == 0:
            print(f"  {i + 1 - warm}/{args.requests} requests per way", file=sys.stderr)
    for conn in (p_conn, c_conn):
        conn.send(("close",))
        conn.recv()
    out: dict[str, Any] = {"ready_ms_median": {}, "ready_ms_p90": {}}
    print(f"{'way':8s} {'median ms':>10s} {'p90 ms':>8s} {'p10 ms':>8s}")
    for way in WAYS:
        v = sorted(lat[way])
        med, p90, p10 = statistics.median(v), v[9 * len(v) // 10], v[len(v) // 10]
        out["ready_ms_median"][way] = round(med, 3)
        out["ready_ms_p90"][way] = round(p90, 3)
        print(f"{way:8s} {med:10.3f} {p90:8.3f} {p10:8.3f}")
    if args.timeline:
        _segments(args.timeline, warm)
    out["nudge_vs_poll"] = round(out["ready_ms_median"]["nudge"]
                                 / out["ready_ms_median"]["poll"], 3)
    out["requests"] = args.requests
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
