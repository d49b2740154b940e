"""Packed writes through the NIXL runtime: serial (one chunk) against pipelined.

Shape (as ``bench_nixl.py``): one Qwen3-32B TP8 rank -- 64 layers x K/V, one KV
head of 128 x bf16, block size 16: a 16,384-token request is 1,024 blocks, 512
MiB, with random block ids on both sides (about one descriptor per block per
region). Two processes, producer and consumer, each hold two runtime pairs over
the same KV memory, every write packed (``PackingConfig(mode="always")``):

* **serial**: ``pipeline_bytes=0``: the producer's writer gathers the whole
  staging image, writes it, notifies; the consumer's scatter thread scatters it
  all (gather, wire and scatter one after the other);
* **pipelined**: ``pipeline_bytes=--chunk-mib``: chunk by chunk, each with its
  own notification; the consumer scatters chunk k while the producer gathers
  and writes later chunks.

Timed from the consumer's ``register`` to its ``TransferReady`` (the producer
finished prefill first), the two ways alternating in each round, beside a
numpy copy of the same bytes. The bytes are checked once per way.

The last line is one JSON object: ``serial_ms``, ``pipelined_ms`` (medians),
``pipelined_vs_serial`` (serial time / pipelined time), ``*_vs_copy``,
``copy_ms``, ``chunks``, ``chunk_mib``, ``load_average``.

    PYTHONPATH=. python benchmarks/bench_packed_runtime.py [--reps 5] [--chunk-mib 4]
    PYTHONPATH=. python benchmarks/bench_packed_runtime.py --tokens 512 --reps 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np

LAYERS, HEAD_DIM, DTYPE, BLOCK = 64, 128, 2, 16
WAYS = ("serial", "pipelined")


def _shape(tokens: int) -> tuple[int, int]:
    """Blocks of the request, and of each pool (room to fragment)."""
    n = tokens // BLOCK
    return n, n + max(8, n * 76 // 1024)


def _ranks(engine: str, tokens: int) -> Any:
    from pushkv.protocol import uniform_ranks

    return uniform_ranks(engine, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                         dtype_bytes=DTYPE, num_blocks=_shape(tokens)[1],
                         block_size=BLOCK)[0]


def _pattern(region: int, size: int) -> np.ndarray:
    from pushkv.transports.nixl.testing import pattern

    return pattern(region, size)


def _packing(way: str, tokens: int, chunk: int) -> Any:
    from pushkv.protocol import PackingConfig

    nbytes = LAYERS * 2 * tokens * HEAD_DIM * DTYPE
    return PackingConfig(mode="always", staging_bytes=nbytes + (1 << 20),
                         pipeline_bytes=chunk if way == "pipelined" else 0)




def producer_main(conn: Any, tokens: int, chunk: int) -> None:
    from pushkv.protocol import ProducerConfig
    from pushkv.transports.nixl import NixlRuntime
    from pushkv.transports.nixl.testing import wait_for_event

    info = _ranks("prefill-x", tokens)
    memory = [_pattern(r, info.layout.region_bytes) for r in range(info.layout.num_regions)]
    rts = {w: NixlRuntime(_ranks(f"prefill-{w}", tokens), memory, role="producer",
                          producer_config=ProducerConfig(packing=_packing(w, tokens, chunk)))
           for w in WAYS}
    conn.send({w: rt.address for w, rt in rts.items()})
    while True:
        cmd = conn.recv()
        if cmd[0] == "prefill":
            _, way, tid, ids = cmd
            rts[way].prefill_finished(tid, ids, tokens)
            conn.send(None)
        elif cmd[0] == "released":
            wait_for_event(rts[cmd[1]], "ReleaseSource", cmd[2], 120.0)
            conn.send(None)
        elif cmd[0] == "close":
            for rt in rts.values():
                rt.close()
            conn.send(None)
            return


def consumer_main(conn: Any, tokens: int, chunk: int, addresses: dict[str, str]) -> None:
    from pushkv.protocol import ConsumerConfig
    from pushkv.transports.nixl import NixlRuntime
    from pushkv.transports.nixl.testing import blocks_match, wait_for_event

    info = _ranks("decode-x", tokens)
    memory = [np.zeros(info.layout.region_bytes, np.uint8)
              for _ in range(info.layout.num_regions)]
    rts = {w: NixlRuntime(_ranks(f"decode-{w}", tokens), memory, role="consumer",
                          consumer_config=ConsumerConfig(packing=_packing(w, tokens, chunk)))
           for w in WAYS}
    for w, rt in rts.items():
        rt.connect(f"prefill-{w}", [addresses[w]], eager=True)
        while not rt.connected(f"prefill-{w}"):
            rt.wait(0.01)
    conn.send(None)
    while True:
        cmd = conn.recv()
        if cmd[0] == "push":
            _, way, tid, ids = cmd
            t0 = time.perf_counter()
            rts[way].register(tid, f"prefill-{way}", ids, tokens)
            wait_for_event(rts[way], "TransferReady", tid, 120.0)
            took = time.perf_counter() - t0
            stats = rts[way].inspect().stats
            conn.send((took, stats.get("scatters_ok", 0)))
        elif cmd[0] == "verify":
            _, src, dst = cmd
            conn.send(blocks_match(memory, info.layout.block_bytes, src, dst))
        elif cmd[0] == "close":
            for rt in rts.values():
                rt.close()
            conn.send(None)
            return


def _copy_s(tokens: int) -> float:
    """A numpy copy of the request's bytes, region by region (the reference)."""
    n, _ = _shape(tokens)
    per_region = n * BLOCK * HEAD_DIM * DTYPE
    src = [_pattern(r, per_region) for r in range(LAYERS * 2)]
    dst = [np.ones(per_region, np.uint8) for _ in range(LAYERS * 2)]
    t0 = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        np.copyto(d, s)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-mib", type=float, default=4.0,
                    help="pipeline_bytes of the pipelined way, in MiB (default 4)")
    ap.add_argument("--tokens", type=int, default=16384,
                    help="request length (default 16384; smaller for a smoke run)")
    args = ap.parse_args()
    tokens, chunk = args.tokens, int(args.chunk_mib * 2**20)
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=producer_main, args=(p_child, tokens, chunk), daemon=True)
    prod.start()
    addresses = p_conn.recv()
    cons = ctx.Process(target=consumer_main, args=(c_child, tokens, chunk, addresses),
                       daemon=True)
    cons.start()
    c_conn.recv()
    nblocks, pool = _shape(tokens)
    rng = np.random.default_rng(0)
    src = rng.permutation(pool)[:nblocks].tolist()
    dst = rng.permutation(pool)[:nblocks].tolist()
    times: dict[str, list[float]] = {w: [] for w in (*WAYS, "copy")}
    scatters: dict[str, int] = dict.fromkeys(WAYS, 0)
    verified: dict[str, bool] = {}
    i = chunks = 0
    try:
        for rep in range(args.reps + 1):  # the first round warms up
            copy = _copy_s(tokens)
            if rep:
                times["copy"].append(copy)
            for way in (WAYS if rep % 2 else WAYS[::-1]):  # alternate the order
                tid = f"{way}-{i}"
                i += 1
                p_conn.send(("prefill", way, tid, src))
                p_conn.recv()
                c_conn.send(("push", way, tid, dst))
                took, total = c_conn.recv()
                p_conn.send(("released", way, tid))
                p_conn.recv()
                if rep:
                    times[way].append(took)
                scatters[way], per = total, total - scatters[way]
                if way == "pipelined":
                    chunks = per  # scatters of this write: one per chunk
                if way not in verified:
                    c_conn.send(("verify", src, dst))
                    verified[way] = c_conn.recv()
    finally:
        for conn in (p_conn, c_conn):
            conn.send(("close",))
            conn.recv()
        prod.join(30)
        cons.join(30)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    load = os.getloadavg()
    print(f"{tokens} tokens, {LAYERS * 2 * tokens * HEAD_DIM * DTYPE / 2**20:.0f} MiB, "
          f"fragmented, {args.reps} reps, load {load[0]:.2f}")
    for k in (*WAYS, "copy"):
        print(f"  {k:10s} median {med[k]:8.1f} ms  (min {min(times[k]) * 1e3:.1f})")
    print(f"  pipelined in {chunks} chunks of {args.chunk_mib:g} MiB; bytes exact: {verified}")
    out = {
        "serial_ms": round(med["serial"], 2),
        "pipelined_ms": round(med["pipelined"], 2),
        "pipelined_vs_serial": round(med["serial"] / med["pipelined"], 3),
        "serial_vs_copy": round(med["serial"] / med["copy"], 3),
        "pipelined_vs_copy": round(med["pipelined"] / med["copy"], 3),
        "copy_ms": round(med["copy"], 2),
        "serial_min_ms": round(min(times["serial"]) * 1e3, 2),
        "pipelined_min_ms": round(min(times["pipelined"]) * 1e3, 2),
        "chunks": chunks,
        "chunk_mib": args.chunk_mib,
        "tokens": tokens,
        "reps": args.reps,
        "verified": all(verified.values()),
        "load_average": [round(x, 2) for x in load],
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
