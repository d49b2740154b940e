"""Push one 16,384-token request through the NIXL transport between two processes.

Shape: one Qwen3-32B TP8 rank -- 64 layers x K/V, one KV head of 128 x bf16
(256 B per token per plane per layer), block size 16: 1,024 blocks, 512 MiB.

Measured in one run, on host memory with UCX:

* **throughput** of the request with contiguous blocks (one descriptor per
  region) and with fragmented blocks (random block ids on both sides: about
  one descriptor per block per region), from the consumer's ``register`` to
  its ``TransferReady`` -- as a ratio of a numpy copy of the same 512 MiB in
  this run;
* **hand-off**: the engine thread's time in ``prefill_finished`` per pushed
  request, against **inline**: what the same request's descriptor preparation
  (plan, Nx3 arrays, NIXL request) and posting cost when done on the calling
  thread, as pull does on the decode loop. On host memory UCX copies while
  posting, so the inline post includes the copy; the table splits it.

The last line is one JSON object: ``contiguous_vs_copy``, ``fragmented_vs_copy``,
``handoff_us_median``, ``inline_us_median`` (and a few raw figures).

    PYTHONPATH=. python benchmarks/bench_nixl.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

LAYERS, HEAD_DIM, DTYPE, BLOCK = 64, 128, 2, 16
TOKENS = 16_384
BLOCKS = 1_100  # room for fragmentation around the 1,024 blocks a request needs


def _ranks(engine: str) -> Any:
    from pushkv.protocol import uniform_ranks

    return uniform_ranks(engine, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                         dtype_bytes=DTYPE, num_blocks=BLOCKS, block_size=BLOCK)[0]


def _pattern(region: int, size: int) -> np.ndarray:
    """Deterministic source bytes of one region (cheap to recompute anywhere)."""
    return ((np.arange(size, dtype=np.uint32) * 7 + region * 13) % 251).astype(np.uint8)


def _memory(info: Any, fill: bool) -> list[np.ndarray]:
    size = info.layout.region_bytes
    return [_pattern(r, size) if fill else np.zeros(size, np.uint8)
            for r in range(info.layout.num_regions)]


def _wait_for(rt: Any, kind: str, tid: str, timeout_s: float = 60.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for e in rt.poll():
            if type(e).__name__ == kind and getattr(e, "transfer_id", None) == tid:
                return e
            if type(e).__name__ in ("TransferFailed", "CallFailed"):
                raise RuntimeError(repr(e))
        rt.wait(0.01)
    raise TimeoutError(f"no {kind} for {tid}")


def producer_main(conn: Any) -> None:
    from pushkv.protocol import plan_transfer
    from pushkv.protocol.mapping import assignment
    from pushkv.transports.nixl import NixlRuntime

    info = _ranks("prefill-0")
    rt = NixlRuntime(info, _memory(info, fill=True), role="producer")
    conn.send(rt.address)
    handoffs: list[float] = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "prefill":
            _, tid, ids = cmd
            t0 = time.perf_counter()
            rt.prefill_finished(tid, ids, TOKENS)
            handoffs.append(time.perf_counter() - t0)
            conn.send(None)
        elif cmd[0] == "released":
            _wait_for(rt, "ReleaseSource", cmd[1])
            conn.send(None)
        elif cmd[0] == "report":
            _, src, dst = cmd
            dinfo = _ranks("decode-0")
            a = assignment(info.engine, dinfo.engine, 0, 0)
            plans = []
            for _ in range(5):
                t0 = time.perf_counter()
                plan_transfer(info.layout, dinfo.layout, a, src, dst, TOKENS)
                plans.append(time.perf_counter() - t0)
            writes = rt.inspect().recent_writes
            conn.send((handoffs, statistics.median(plans), writes))
        elif cmd[0] == "close":
            rt.close()
            conn.send(None)
            return


def consumer_main(conn: Any, producer_address: str) -> None:
    from pushkv.transports.nixl import NixlRuntime

    info = _ranks("decode-0")
    memory = _memory(info, fill=False)
    rt = NixlRuntime(info, memory, role="consumer")
    rt.connect("prefill-0", [producer_address], eager=True)
    while not rt.connected("prefill-0"):
        rt.wait(0.01)
    conn.send(None)
    while True:
        cmd = conn.recv()
        if cmd[0] == "push":
            _, tid, ids = cmd
            t0 = time.perf_counter()
            rt.register(tid, "prefill-0", ids, TOKENS)
            _wait_for(rt, "TransferReady", tid)
            conn.send(time.perf_counter() - t0)
        elif cmd[0] == "verify":
            _, src, dst = cmd
            ok = True
            bb = info.layout.block_bytes
            for r, region in enumerate(memory):
                want = _pattern(r, info.layout.region_bytes).reshape(-1, bb)[src]
                ok &= bool(np.array_equal(region.reshape(-1, bb)[dst], want))
                region.fill(0)
            conn.send(ok)
        elif cmd[0] == "close":
            rt.close()
            conn.send(None)
            return


class NumpyCopy:
    """The reference: the same bytes copied by numpy in this process, contiguous
    (one copy per region) and block-scattered (fancy indexing per region)."""

    def __init__(self, src_ids: list[int], dst_ids: list[int]) -> None:
        size = _ranks("x").layout.region_bytes
        self.src = [_pattern(r, size) for r in range(LAYERS * 2)]
        self.dst = [np.ones(size, np.uint8) for _ in range(LAYERS * 2)]  # pages faulted in
        self.block = size // BLOCKS
        self.per_region = TOKENS // BLOCK * self.block
        self.s_idx, self.d_idx = np.asarray(src_ids), np.asarray(dst_ids)

    def contiguous(self) -> float:
        t0 = time.perf_counter()
        n = self.per_region
        for s, d in zip(self.src, self.dst, strict=True):
            np.copyto(d[:n], s[:n])
        return time.perf_counter() - t0

    def scattered(self) -> float:
        t0 = time.perf_counter()
        bb = self.block
        for s, d in zip(self.src, self.dst, strict=True):
            d.reshape(-1, bb)[self.d_idx] = s.reshape(-1, bb)[self.s_idx]
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=producer_main, args=(p_child,), daemon=True)
    prod.start()
    address = p_conn.recv()
    cons = ctx.Process(target=consumer_main, args=(c_child, address), daemon=True)
    cons.start()
    c_conn.recv()

    nblocks = TOKENS // BLOCK
    rng = np.random.default_rng(0)
    layouts = {
        "contiguous": (list(range(nblocks)), list(range(1, nblocks + 1))),
        "fragmented": (rng.permutation(BLOCKS)[:nblocks].tolist(),
                       rng.permutation(BLOCKS)[:nblocks].tolist()),
    }
    nbytes = LAYERS * 2 * TOKENS * HEAD_DIM * DTYPE
    times: dict[str, list[float]] = {k: [] for k in (*layouts, "copy", "copy_scattered")}
    verified = {}
    ref = NumpyCopy(*layouts["fragmented"])
    i = 0
    for rep in range(args.reps + 1):  # the first round warms up
        # numpy and NIXL alternate, so both see the same machine load
        copy_c, copy_s = ref.contiguous(), ref.scattered()
        if rep:
            times["copy"].append(copy_c)
            times["copy_scattered"].append(copy_s)
        for name, (src, dst) in layouts.items():
            tid = f"{name}-{i}"
            i += 1
            p_conn.send(("prefill", tid, src))
            p_conn.recv()
            c_conn.send(("push", tid, dst))
            took = c_conn.recv()
            p_conn.send(("released", tid))
            p_conn.recv()
            if rep:
                times[name].append(took)
            if name not in verified:
                c_conn.send(("verify", src, dst))
                verified[name] = c_conn.recv()
    src, dst = layouts["fragmented"]
    p_conn.send(("report", src, dst))
    handoffs, plan_s, writes = p_conn.recv()
    for conn in (c_conn, p_conn):
        conn.send(("close",))
        conn.recv()
    prod.join(30)
    cons.join(30)

    med = {k: statistics.median(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    copy_gbps = gbps["copy"]
    frag_writes = [w for w in writes if w.transfer_id.startswith("fragmented-")][1:]
    prep = statistics.median(plan_s + w.prepare_s for w in frag_writes)
    inline = statistics.median(plan_s + w.total_s for w in frag_writes)
    descs = frag_writes[0].descriptors if frag_writes else 0
    handoff_us = statistics.median(handoffs) * 1e6

    print(f"request: {TOKENS} tokens, {LAYERS} layers x K/V, 256 B/token/plane/layer, "
          f"block {BLOCK}: {nbytes / 2**20:.0f} MiB; bytes verified: {verified}")
    print(f"{'what':44s} {'median':>12s} {'GB/s':>8s} {'vs copy':>8s}")
    rows = [
        ("numpy copy, contiguous", med["copy"], copy_gbps),
        ("numpy copy, scattered blocks", med["copy_scattered"], gbps["copy_scattered"]),
        ("NIXL push, contiguous (register -> ready)", med["contiguous"], gbps["contiguous"]),
        (f"NIXL push, fragmented ({descs} descriptors)", med["fragmented"], gbps["fragmented"]),
    ]
    for label, secs, rate in rows:
        print(f"{label:44s} {secs * 1e3:9.1f} ms {rate:8.2f} {rate / copy_gbps:8.2f}")
    print(f"{'engine-thread hand-off per pushed request':44s} {handoff_us:9.1f} us")
    print(f"{'inline: plan + descriptors + NIXL request':44s} {prep * 1e6:9.1f} us")
    print(f"{'inline: ... + post to completion (copy)':44s} {inline * 1e6:9.1f} us")
    print(json.dumps({
        "contiguous_vs_copy": round(gbps["contiguous"] / copy_gbps, 3),
        "fragmented_vs_copy": round(gbps["fragmented"] / copy_gbps, 3),
        "handoff_us_median": round(handoff_us, 2),
        "inline_us_median": round(inline * 1e6, 1),
        "inline_prepare_us_median": round(prep * 1e6, 1),
        "copy_gbps": round(copy_gbps, 2),
        "contiguous_gbps": round(gbps["contiguous"], 2),
        "fragmented_gbps": round(gbps["fragmented"], 2),
        "verified": all(verified.values()),
    }))


if __name__ == "__main__":
    main()
