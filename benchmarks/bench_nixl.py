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

* **packed**: the same fragmented request as a packed write -- the producer
  gathers its runs into a staging buffer registered once with NIXL
  (:mod:`pushkv.transports.staging`, numpy on host memory), writes it into the
  consumer's staging buffer, and the consumer scatters it into its blocks when
  the write's notification arrives; timed from the parent's command to both
  sides' end. Up to five ways (``--ways``; default serial, image, ahead, ring),
  in the same round:

  - **serial**: gather everything, write it in 16 MiB descriptors, scatter
    everything (one stage after the other);
  - **image** (pipelined, :mod:`pushkv.transports.packed_pipeline`): chunks of
    ``--chunk-mib`` at their offsets of the staging image; the producer gathers
    chunk k+1 after posting chunk k, the consumer scatters each chunk on its
    notification;
  - **ahead**: the image, with the gather of chunk k+1 on a worker thread while
    the producer's thread posts chunk k (numpy's copies release the interpreter
    lock, NIXL's post holds it);
  - **ring** (pipelined): chunks of ``--ring-chunk-mib`` in ``--ring-slots``
    slots reused on the consumer's acks, small enough to stay in the CPU cache;
  - **split**: the ring, with ``--read-share`` of its chunks read by the consumer
    instead of written by the producer (UCX copies on the initiator's core on host
    memory, so this moves wire copies to the consumer's core).

  ``fragmented_packed_vs_copy`` is the ``--packed`` way (default: image). Per
  stage: the producer's gather and post (prepare + ``transfer()``, where UCX
  copies on host memory), the consumer's scatter (and reads), each as wall time
  and as the thread's CPU time (what the stage costs whatever the load), and
  each process's CPU time over the write. This drives the staging path
  with its own NIXL agents, beside the runtime (``bench_packed_runtime.py``
  measures the runtime's own packed writes, serial and pipelined).

The last line is one JSON object: ``contiguous_vs_copy``, ``fragmented_vs_copy``,
``fragmented_packed_vs_copy``, ``packed_vs_fragmented`` (and ``_best``: best
rounds), ``packed_descriptors``, ``packed_<way>_vs_copy``, ``packed_stage_ms``,
``load_average``, ``handoff_us_median``, ``inline_us_median`` (and a few raw
figures).

    PYTHONPATH=. python benchmarks/bench_nixl.py [--reps 5] [--packed image] [--ways ...]
    PYTHONPATH=. python benchmarks/bench_nixl.py --tokens 512 --reps 1   # a smoke run
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

import numpy as np

PACKED_WAYS = ("serial", "image", "ahead", "ring", "split")
LAYERS, HEAD_DIM, DTYPE, BLOCK = 64, 128, 2, 16
#: the request's tokens; ``--tokens`` (a smoke run) passes it to the spawned sides
TOKENS = int(os.environ.get("PUSHKV_BENCH_NIXL_TOKENS", "16384"))
BLOCKS = TOKENS // BLOCK + max(8, TOKENS // BLOCK * 76 // 1024)  # room to fragment: 1,100


def _ranks(engine: str) -> Any:
    from pushkv.protocol import uniform_ranks

    return uniform_ranks(engine, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                         dtype_bytes=DTYPE, num_blocks=BLOCKS, block_size=BLOCK)[0]


def _pattern(region: int, size: int) -> np.ndarray:
    from pushkv.transports.nixl.testing import pattern

    return pattern(region, size)


def _memory(info: Any, fill: bool) -> list[np.ndarray]:
    size = info.layout.region_bytes
    return [_pattern(r, size) if fill else np.zeros(size, np.uint8)
            for r in range(info.layout.num_regions)]




def producer_main(conn: Any) -> None:
    from pushkv.protocol import plan_transfer
    from pushkv.protocol.mapping import assignment
    from pushkv.transports.nixl import NixlRuntime
    from pushkv.transports.nixl.testing import wait_for_event

    info = _ranks("prefill-0")
    memory = _memory(info, fill=True)
    rt = NixlRuntime(info, memory, role="producer")
    conn.send(rt.address)
    stager = Stager("pack-prefill", progress_thread=False)
    conn.send((stager.agent.metadata(), stager.base))
    handoffs: list[float] = []
    while True:
        cmd = conn.recv()
        if cmd[0] == "pack_peer":
            peer = stager.agent.add_peer(cmd[1])
            conn.send(None)
        elif cmd[0] == "packed":
            _, tid, src, dst, remote_base = cmd
            conn.send(stager.push(memory, _packed(src, dst), peer, remote_base, tid))
        elif cmd[0] == "pipelined":
            _, tid, src, dst, remote_base, chunk, slots, share, ahead = cmd
            conn.send(stager.send(memory, _packed(src, dst), peer, remote_base, tid, chunk,
                                  slots, share, ahead))
        elif cmd[0] == "prefill":
            _, tid, ids = cmd
            t0 = time.perf_counter()
            rt.prefill_finished(tid, ids, TOKENS)
            handoffs.append(time.perf_counter() - t0)
            conn.send(None)
        elif cmd[0] == "released":
            wait_for_event(rt, "ReleaseSource", cmd[1])
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
            stager.close()
            rt.close()
            conn.send(None)
            return


def consumer_main(conn: Any, producer_address: str) -> None:
    from pushkv.transports.nixl import NixlRuntime
    from pushkv.transports.nixl.testing import blocks_match, wait_for_event

    info = _ranks("decode-0")
    memory = _memory(info, fill=False)
    rt = NixlRuntime(info, memory, role="consumer")
    rt.connect("prefill-0", [producer_address], eager=True)
    while not rt.connected("prefill-0"):
        rt.wait(0.01)
    stager = Stager("pack-decode", progress_thread=True)
    conn.send((stager.agent.metadata(), stager.base))
    while True:
        cmd = conn.recv()
        if cmd[0] == "pack_peer":
            peer = stager.agent.add_peer(cmd[1])
            conn.send(None)
        elif cmd[0] == "packed":
            _, tid, src, dst = cmd
            conn.send(stager.land(memory, _packed(src, dst), tid))
        elif cmd[0] == "pipelined":
            _, tid, src, dst, remote_base, chunk, slots, share = cmd
            conn.send(stager.receive(memory, _packed(src, dst), peer, remote_base, tid, chunk,
                                     slots, share))
        elif cmd[0] == "push":
            _, tid, ids = cmd
            t0 = time.perf_counter()
            rt.register(tid, "prefill-0", ids, TOKENS)
            wait_for_event(rt, "TransferReady", tid)
            conn.send(time.perf_counter() - t0)
        elif cmd[0] == "verify":
            _, src, dst = cmd
            conn.send(blocks_match(memory, info.layout.block_bytes, src, dst))
        elif cmd[0] == "close":
            stager.close()
            rt.close()
            conn.send(None)
            return


def _packed(src: list[int], dst: list[int]) -> Any:
    """The packed byte maps of the request (both sides compute them from the plan)."""
    from pushkv.protocol import plan_transfer
    from pushkv.protocol.mapping import assignment
    from pushkv.protocol.packing import PackedPlan, PackingConfig

    p, d = _ranks("prefill-0"), _ranks("decode-0")
    plan = plan_transfer(p.layout, d.layout, assignment(p.engine, d.engine, 0, 0), src, dst,
                         TOKENS)
    return PackedPlan(plan, PackingConfig().chunk_bytes)


class Stager:
    """The packed path: a staging buffer registered once with its own NIXL agent.
    The producer gathers into it and writes it in chunk descriptors into the
    consumer's, which scatters when the write's notification arrives."""

    def __init__(self, name: str, *, progress_thread: bool) -> None:
        from pushkv.transports.nixl.agent import Agent
        from pushkv.transports.nixl.config import NixlConfig
        from pushkv.transports.nixl.memory import KVMemory

        size = LAYERS * 2 * TOKENS * HEAD_DIM * DTYPE
        self.buffer = np.ones(size, np.uint8)  # pages faulted in, as a pool would be
        self.agent = Agent(name, NixlConfig(), progress_thread=progress_thread)
        self.memory = KVMemory.from_regions([self.buffer])
        self.agent.register(self.memory)
        self.base = self.memory.bases[0]
        self.sender: Any = None
        self.receiver: Any = None

    def push(self, memory: list[np.ndarray], packed: Any, peer: str, remote_base: int,
             tid: str) -> dict[str, float]:
        """Serial: gather, write, wait for completion (seconds per stage)."""
        from pushkv.transports.staging import gather_host

        t0, c0 = time.perf_counter(), time.thread_time()
        gather_host(packed, memory, self.buffer)
        t1, c1 = time.perf_counter(), time.thread_time()
        n = packed.wire.shape[0]
        local = np.stack([packed.wire[:, 0] + self.base, packed.wire[:, 1],
                          np.zeros(n, np.int64)], axis=1)
        remote = local.copy()
        remote[:, 0] += remote_base - self.base
        handle = self.agent.prepare_write(local, remote, peer, tid.encode(), "DRAM")
        state = self.agent.post(handle)
        at_post = state
        while state == "PROC":
            state = self.agent.state(handle)
        self.agent.release(handle)
        if state != "DONE":
            raise RuntimeError(f"packed write ended {state}")
        return {"gather": t1 - t0, "gather_cpu": c1 - c0, "post": time.perf_counter() - t1,
                "post_cpu": time.thread_time() - c1, "descriptors": n,
                "done_at_post": float(at_post == "DONE")}

    def land(self, memory: list[np.ndarray], packed: Any, tid: str) -> dict[str, float]:
        """Serial: wait for the write's notification, then scatter (seconds)."""
        from pushkv.transports.staging import scatter_host

        end = time.monotonic() + 60
        c0 = time.process_time()
        while not any(m == tid.encode() for _, m in self.agent.notifications()):
            if time.monotonic() > end:
                raise TimeoutError(f"no packed write for {tid}")
            time.sleep(0.0002)
        wait_cpu = time.process_time() - c0
        t0, c1 = time.perf_counter(), time.thread_time()
        scatter_host(packed, self.buffer, memory)
        return {"scatter": time.perf_counter() - t0, "scatter_cpu": time.thread_time() - c1,
                "wait_cpu": wait_cpu}

    def send(self, memory: list[np.ndarray], packed: Any, peer: str, remote_base: int,
             tid: str, chunk: int, slots: int | None, share: float,
             ahead: bool) -> dict[str, float]:
        """Pipelined (image or ring): seconds per stage of the producer."""
        from pushkv.transports.packed_pipeline import PackedSender, PipelinePlan

        if self.sender is None:  # one per peer: its prepared requests are reused
            self.sender = PackedSender(self.agent, self.buffer, self.base, remote_base, peer)
        self.sender.gather_ahead = ahead
        c0 = time.thread_time()
        t = self.sender.send(PipelinePlan(packed, chunk, slots, share), memory, tid.encode())
        return {"gather": t.gather_s, "gather_cpu": t.gather_cpu_s, "post": t.post_s,
                "post_cpu": t.post_cpu_s, "wait": t.wait_s, "total": t.total_s,
                "thread_cpu": time.thread_time() - c0, "chunks": t.chunks,
                "done_at_post": t.done_at_post / max(t.chunks - t.posted_by_peer, 1)}

    def receive(self, memory: list[np.ndarray], packed: Any, peer: str, remote_base: int,
                tid: str, chunk: int, slots: int | None, share: float) -> dict[str, float]:
        """Pipelined: seconds per stage of the consumer (CPU: the whole process)."""
        from pushkv.transports.packed_pipeline import PackedReceiver, PipelinePlan

        if self.receiver is None:  # one per peer: its prepared reads are reused
            self.receiver = PackedReceiver(self.agent, self.buffer, peer, local_base=self.base,
                                           remote_base=remote_base)
        t = self.receiver.receive(PipelinePlan(packed, chunk, slots, share), memory,
                                  tid.encode())
        return {"scatter": t.scatter_s, "scatter_cpu": t.scatter_cpu_s, "read": t.post_s,
                "read_cpu": t.post_cpu_s, "wait": t.wait_s, "total": t.total_s, "cpu": t.cpu_s,
                "reads": t.posted_by_peer}

    def close(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        self.agent.close()


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
    ap.add_argument("--packed", choices=PACKED_WAYS, default="image",
                    help="the packed way fragmented_packed_vs_copy reports (default image)")
    ap.add_argument("--ways", default="serial,image,ahead,ring",
                    help="packed ways to run, comma-separated, of " + ",".join(PACKED_WAYS)
                    + " (default serial,image,ahead,ring: split is slow here, see the docs)")
    ap.add_argument("--chunk-mib", type=float, default=4.0,
                    help="chunk of the pipelined image way (default 4)")
    ap.add_argument("--ring-chunk-mib", type=float, default=1.0,
                    help="chunk of the ring way (default 1)")
    ap.add_argument("--ring-slots", type=int, default=4, help="slots of the ring (default 4)")
    ap.add_argument("--read-share", type=float, default=0.5,
                    help="split way: share of the ring's chunks the consumer reads (default 0.5)")
    ap.add_argument("--tokens", type=int, default=TOKENS,
                    help="request length (default 16384; smaller for a smoke run)")
    args = ap.parse_args()
    ways = tuple(w for w in PACKED_WAYS if w in args.ways.split(","))
    if args.packed not in ways:
        ap.error(f"--packed {args.packed} is not among --ways {args.ways}")
    if args.tokens != TOKENS:
        os.environ["PUSHKV_BENCH_NIXL_TOKENS"] = str(args.tokens)
        os.execv(sys.executable, [sys.executable, *sys.argv])  # re-read the shape
    ring = int(args.ring_chunk_mib * 2**20), args.ring_slots
    image = int(args.chunk_mib * 2**20), None, 0.0
    pipelined = {"image": image, "ahead": image, "ring": (*ring, 0.0),
                 "split": (*ring, args.read_share)}
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    prod = ctx.Process(target=producer_main, args=(p_child,), daemon=True)
    prod.start()
    address = p_conn.recv()
    p_meta, p_staging = p_conn.recv()
    cons = ctx.Process(target=consumer_main, args=(c_child, address), daemon=True)
    cons.start()
    c_meta, c_staging = c_conn.recv()
    for conn, meta in ((p_conn, c_meta), (c_conn, p_meta)):
        conn.send(("pack_peer", meta))
        conn.recv()

    nblocks = TOKENS // BLOCK
    rng = np.random.default_rng(0)
    layouts = {
        "contiguous": (list(range(nblocks)), list(range(1, nblocks + 1))),
        "fragmented": (rng.permutation(BLOCKS)[:nblocks].tolist(),
                       rng.permutation(BLOCKS)[:nblocks].tolist()),
    }
    nbytes = LAYERS * 2 * TOKENS * HEAD_DIM * DTYPE
    times: dict[str, list[float]] = {k: [] for k in (*layouts, *ways, "copy",
                                                      "copy_scattered")}
    parts: dict[str, dict[str, list[float]]] = {w: {} for w in ways}
    wire_descriptors = 0
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
        # the packed ways on the same fragmented request, in the same round
        src, dst = layouts["fragmented"]
        for way in ways:
            tid = f"packed-{way}-{i}"
            i += 1
            t0 = time.perf_counter()
            if way == "serial":
                c_conn.send(("packed", tid, src, dst))
                p_conn.send(("packed", tid, src, dst, c_staging))
            else:
                chunk, slots, share = pipelined[way]
                c_conn.send(("pipelined", tid, src, dst, p_staging, chunk, slots, share))
                p_conn.send(("pipelined", tid, src, dst, c_staging, chunk, slots, share,
                             way == "ahead"))
            prod_parts = p_conn.recv()
            cons_parts = c_conn.recv()
            took = time.perf_counter() - t0
            if way == "serial":
                wire_descriptors = int(prod_parts["descriptors"])
            if rep:
                times[way].append(took)
                for side, got in (("p", prod_parts), ("c", cons_parts)):
                    for k, v in got.items():
                        parts[way].setdefault(f"{side}_{k}", []).append(v)
            if way not in verified:
                c_conn.send(("verify", src, dst))
                verified[way] = c_conn.recv()
    src, dst = layouts["fragmented"]
    p_conn.send(("report", src, dst))
    handoffs, plan_s, writes = p_conn.recv()
    for conn in (c_conn, p_conn):
        conn.send(("close",))
        conn.recv()
    prod.join(30)
    cons.join(30)

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    gbps = {k: nbytes / v / 1e9 for k, v in med.items()}
    copy_gbps = gbps["copy"]
    frag_writes = [w for w in writes if w.transfer_id.startswith("fragmented-")][1:]
    prep = statistics.median(plan_s + w.prepare_s for w in frag_writes)
    inline = statistics.median(plan_s + w.total_s for w in frag_writes)
    descs = frag_writes[0].descriptors if frag_writes else 0
    handoff_us = statistics.median(handoffs) * 1e6

    print(f"request: {TOKENS} tokens, {LAYERS} layers x K/V, 256 B/token/plane/layer, "
          f"block {BLOCK}: {nbytes / 2**20:.0f} MiB; bytes verified: {verified}")
    print(f"{'what':44s} {'median':>12s} {'GB/s':>8s} {'vs copy':>8s} {'best':>10s} "
          f"{'vs best':>8s}")
    rows = [
        ("numpy copy, contiguous", "copy"),
        ("numpy copy, scattered blocks", "copy_scattered"),
        ("NIXL push, contiguous (register -> ready)", "contiguous"),
        (f"NIXL push, fragmented ({descs} descriptors)", "fragmented"),
        (f"packed serial ({wire_descriptors} desc.)", "serial"),
        (f"packed image, {args.chunk_mib:g} MiB chunks", "image"),
        ("packed image, gather one chunk ahead (thread)", "ahead"),
        (f"packed ring, {args.ring_slots} x {args.ring_chunk_mib:g} MiB", "ring"),
        (f"packed ring, {args.read_share:g} of chunks read by consumer", "split"),
    ]
    for label, key in rows:
        if key not in med:
            continue
        print(f"{label:44s} {med[key] * 1e3:9.1f} ms {gbps[key]:8.2f} "
              f"{gbps[key] / copy_gbps:8.2f} {best[key] * 1e3:7.1f} ms "
              f"{best['copy'] / best[key]:8.2f}")
    counts = ("chunks", "at_post", "descriptors", "reads")  # not seconds

    def _ms(k: str, v: list[float]) -> float:
        return round(statistics.median(v) * (1 if k.endswith(counts) else 1e3), 2)

    stage_ms = {w: {k: _ms(k, v) for k, v in ps.items()} for w, ps in parts.items()}
    for w, ps in stage_ms.items():
        print(f"  packed {w}: " + ", ".join(f"{k} {v}" for k, v in ps.items()))
    print(f"{'engine-thread hand-off per pushed request':44s} {handoff_us:9.1f} us")
    print(f"{'inline: plan + descriptors + NIXL request':44s} {prep * 1e6:9.1f} us")
    print(f"{'inline: ... + post to completion (copy)':44s} {inline * 1e6:9.1f} us")
    print(json.dumps({
        "contiguous_vs_copy": round(gbps["contiguous"] / copy_gbps, 3),
        "fragmented_vs_copy": round(gbps["fragmented"] / copy_gbps, 3),
        "fragmented_packed_vs_copy": round(gbps[args.packed] / copy_gbps, 3),
        "packed_vs_fragmented": round(gbps[args.packed] / gbps["fragmented"], 3),
        "packed_way": args.packed,
        "packed_descriptors": wire_descriptors if args.packed == "serial" else
        int(stage_ms[args.packed]["p_chunks"]),
        **{f"packed_{w}_vs_copy": round(gbps[w] / copy_gbps, 3) for w in ways},
        "packed_vs_fragmented_best": round(best["fragmented"] / best[args.packed], 3),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "packed_stage_ms": stage_ms,
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
