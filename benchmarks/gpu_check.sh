#!/usr/bin/env bash
# GPU check of the NIXL transport, in one go:
#   two processes on one GPU each register CUDA KV tensors (one Qwen3-32B TP8
#   rank: 64 layers x K/V, one KV head of 128 x bf16, block size 16), the
#   producer pushes a fragmented 16,384-token request (512 MiB, ~131k
#   descriptors) and a contiguous one with the NIXL transport, the consumer
#   verifies every byte on the GPU, and the throughput is printed; then packing:
#   the same fragmented request gathered into a staging tensor and scattered
#   into destination blocks on the GPU (torch index_select / index_copy_ on a
#   side stream), whole and pipelined in chunks, bytes verified against the
#   direct copy, throughput printed; last, python -m pushkv.transports.calibrate
#   --device cuda prints the packing settings measured there.
# Fails fast (exit 2) with a clear message when no GPU or no nixl is present.
#
#   PYTHONPATH=. benchmarks/gpu_check.sh            # GPU 0
#   GPU=1 REPS=5 PYTHON=.venv/bin/python benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH="${PYTHONPATH:-$PWD}"

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or failing); nothing to check" >&2
    exit 2
fi
if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_check: torch sees no CUDA device (CPU-only torch build?)" >&2
    exit 2
fi
if ! "$PY" -c 'import nixl._api, zmq' 2>/dev/null; then
    echo "gpu_check: the nixl (or pyzmq) package is missing: pip install 'pushkv[nixl]'" >&2
    exit 2
fi

script=$(mktemp --suffix=.py)
trap 'rm -f "$script"' EXIT
cat >"$script" <<'PYEOF'
import multiprocessing as mp
import os
import statistics
import sys
import time

LAYERS, HEAD_DIM, BLOCK, TOKENS, BLOCKS = 64, 128, 16, 16_384, 1_100
GPU = int(os.environ.get("GPU", "0"))
REPS = int(os.environ.get("REPS", "3"))


def ranks(engine):
    from pushkv.protocol import uniform_ranks
    return uniform_ranks(engine, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM,
                         dtype_bytes=2, num_blocks=BLOCKS, block_size=BLOCK)[0]


def pattern(torch, region, nbytes):
    """Deterministic bytes of one region, computed on the GPU."""
    i = torch.arange(nbytes, dtype=torch.int64, device=f"cuda:{GPU}")
    return ((i * 7 + region * 13) % 251).to(torch.uint8)


def caches(torch, info, fill):
    """Separate K and V tensors per layer, [blocks, block_size, heads, head_dim] bf16."""
    lo = info.layout
    shape = (lo.num_blocks, lo.block_size, lo.num_heads, lo.head_dim)
    k, v = [], []
    for layer in range(lo.num_layers):
        for plane, out in ((0, k), (1, v)):
            t = torch.zeros(shape, dtype=torch.bfloat16, device=f"cuda:{GPU}")
            if fill:
                t.view(torch.uint8).view(-1).copy_(pattern(torch, 2 * layer + plane,
                                                           lo.region_bytes))
            out.append(t)
    torch.cuda.synchronize()
    return k, v


def wait_for(rt, kind, tid, timeout_s=120.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for e in rt.poll():
            name = type(e).__name__
            if name == kind and getattr(e, "transfer_id", None) == tid:
                return e
            if name in ("TransferFailed", "CallFailed"):
                raise RuntimeError(repr(e))
        rt.wait(0.01)
    raise TimeoutError(f"no {kind} for {tid} within {timeout_s} s")


def producer(conn):
    import torch
    torch.cuda.set_device(GPU)
    from pushkv.transports.nixl import KVMemory, NixlRuntime
    info = ranks("prefill-0")
    k, v = caches(torch, info, fill=True)
    mem = KVMemory.from_kv(k, v)
    assert mem.kind == "VRAM" and mem.device == GPU, (mem.kind, mem.device)
    rt = NixlRuntime(info, mem, role="producer")
    conn.send(rt.address)
    while True:
        cmd = conn.recv()
        if cmd[0] == "prefill":
            rt.prefill_finished(cmd[1], cmd[2], TOKENS)
            conn.send(None)
        elif cmd[0] == "released":
            wait_for(rt, "ReleaseSource", cmd[1])
            conn.send(None)
        else:
            conn.send(rt.inspect().recent_writes)
            rt.close()
            return


def consumer(conn, address):
    import torch
    torch.cuda.set_device(GPU)
    from pushkv.transports.nixl import KVMemory, NixlRuntime
    info = ranks("decode-0")
    k, v = caches(torch, info, fill=False)
    regions = [t for kv in zip(k, v, strict=True) for t in kv]
    rt = NixlRuntime(info, KVMemory.from_kv(k, v), role="consumer")
    rt.connect("prefill-0", [address], eager=True)
    end = time.monotonic() + 60
    while not rt.connected("prefill-0"):
        if time.monotonic() > end:
            raise TimeoutError("handshake with the producer did not complete")
        rt.wait(0.01)
    conn.send(None)
    bb = info.layout.block_bytes
    while True:
        cmd = conn.recv()
        if cmd[0] == "push":
            _, tid, dst = cmd
            t0 = time.perf_counter()
            rt.register(tid, "prefill-0", dst, TOKENS)
            wait_for(rt, "TransferReady", tid)
            conn.send(time.perf_counter() - t0)
        elif cmd[0] == "verify":
            _, src, dst = cmd
            s_idx = torch.tensor(src, device=f"cuda:{GPU}")
            d_idx = torch.tensor(dst, device=f"cuda:{GPU}")
            bad = 0
            for r, t in enumerate(regions):
                got = t.view(torch.uint8).view(-1, bb)[d_idx]
                want = pattern(torch, r, info.layout.region_bytes).view(-1, bb)[s_idx]
                bad += int((got != want).sum().item())
                t.zero_()
            torch.cuda.synchronize()
            conn.send(bad)
        else:
            rt.close()
            conn.send(None)
            return


def main():
    import numpy as np
    ctx = mp.get_context("spawn")
    pa, pb = ctx.Pipe()
    ca, cb = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(pb,), daemon=True)
    prod.start()
    address = pa.recv()
    cons = ctx.Process(target=consumer, args=(cb, address), daemon=True)
    cons.start()
    ca.recv()
    n = TOKENS // BLOCK
    rng = np.random.default_rng(0)
    cases = {
        "fragmented": (rng.permutation(BLOCKS)[:n].tolist(), rng.permutation(BLOCKS)[:n].tolist()),
        "contiguous": (list(range(n)), list(range(1, n + 1))),
    }
    nbytes = LAYERS * 2 * TOKENS * HEAD_DIM * 2
    ok = True
    i = 0
    for name, (src, dst) in cases.items():
        times = []
        for rep in range(REPS + 1):
            tid = f"{name}-{i}"
            i += 1
            pa.send(("prefill", tid, src))
            pa.recv()
            ca.send(("push", tid, dst))
            took = ca.recv()
            pa.send(("released", tid))
            pa.recv()
            ca.send(("verify", src, dst))
            bad = ca.recv()
            ok &= bad == 0
            if rep:
                times.append(took)
            print(f"{name:10s} rep {rep}: {took * 1e3:8.1f} ms, {bad} bad bytes", flush=True)
        med = statistics.median(times)
        print(f"{name:10s} median {med * 1e3:8.1f} ms = {nbytes / med / 1e9:6.2f} GB/s "
              f"({nbytes / 2**20:.0f} MiB, register -> ready)", flush=True)
    pa.send(("report",))
    writes = pa.recv()
    frag = [w for w in writes if w.transfer_id.startswith("fragmented")]
    if frag:
        w = frag[-1]
        print(f"fragmented write: {w.descriptors} descriptors, prepared in "
              f"{w.prepare_s * 1e3:.1f} ms, done in {w.total_s * 1e3:.1f} ms", flush=True)
    ca.send(("close",))
    ca.recv()
    prod.join(60)
    cons.join(60)
    print("GPU CHECK PASSED" if ok else "GPU CHECK FAILED: bytes differ", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
PYEOF
timeout "${TIMEOUT_S:-600}" "$PY" "$script"

# Packing on CUDA: gather the fragmented request's runs into a staging tensor and
# scatter them into destination blocks with pushkv.transports.staging's torch path
# (one index_select(out=) / index_copy_ per region pair on a side stream), whole and
# pipelined in 16 MiB chunks (gather of chunk k+1 on one stream while chunk k is
# scattered on another, ordered by events), every byte verified on the GPU against
# the direct per-block copy, and the kernels' throughput printed; then the
# calibration command measures the packing settings with --device cuda.
# PACK_DEVICE=cpu PACK_TOKENS=1024 runs this section's logic on the CPU (a dry run).
cat >"$script" <<'PYEOF'
import os
import statistics
import sys
import time

import numpy as np
import torch

from pushkv.protocol import plan_transfer, uniform_ranks
from pushkv.protocol.mapping import assignment
from pushkv.protocol.packing import PackedPlan, PackingConfig
from pushkv.transports.staging import chunk_bounds, gather_torch, row_map, scatter_torch

LAYERS, HEAD_DIM, BLOCK = 64, 128, 16
TOKENS = int(os.environ.get("PACK_TOKENS", "16384"))
BLOCKS = TOKENS // BLOCK + max(8, TOKENS // BLOCK * 76 // 1024)
GPU = int(os.environ.get("GPU", "0"))
REPS = int(os.environ.get("REPS", "3"))
CHUNK = int(os.environ.get("PACK_CHUNK_MIB", "16")) << 20
dev = torch.device(os.environ.get("PACK_DEVICE", f"cuda:{GPU}"))
cuda = dev.type == "cuda"
p, d = (uniform_ranks(e, num_layers=LAYERS, num_kv_heads=1, head_dim=HEAD_DIM, dtype_bytes=2,
                      num_blocks=BLOCKS, block_size=BLOCK)[0] for e in ("prefill", "decode"))
rng = np.random.default_rng(0)
n = TOKENS // BLOCK
src_ids = rng.permutation(BLOCKS)[:n].tolist()
dst_ids = rng.permutation(BLOCKS)[:n].tolist()
plan = plan_transfer(p.layout, d.layout, assignment(p.engine, d.engine, 0, 0), src_ids,
                     dst_ids, TOKENS)
packed = PackedPlan(plan, PackingConfig().chunk_bytes)
rm = row_map(packed)
print(f"packing: {packed.gather.shape[0]} runs, row unit {rm.unit if rm else None} B",
      flush=True)
size, bb = p.layout.region_bytes, p.layout.block_bytes
g = torch.Generator(device=dev).manual_seed(0)
src = [torch.randint(0, 256, (size,), dtype=torch.uint8, device=dev, generator=g)
       for _ in range(p.layout.num_regions)]
dst = [torch.zeros(size, dtype=torch.uint8, device=dev) for _ in range(d.layout.num_regions)]
staging = torch.empty(packed.nbytes, dtype=torch.uint8, device=dev)
streams = [torch.cuda.Stream(device=dev) for _ in range(2)] if cuda else [None, None]
bounds = chunk_bounds(packed, CHUNK)
s_idx = torch.tensor(src_ids, device=dev)
d_idx = torch.tensor(dst_ids, device=dev)


def sync():
    if cuda:
        torch.cuda.synchronize(dev)


def pipelined():
    """Gather chunk k on stream 0, scatter it on stream 1 once its gather is done."""
    g_s, s_s = streams
    for a, b in zip(bounds, bounds[1:]):
        part = staging[a:b]
        gather_torch(packed, src, part, g_s, start=a, stop=b)
        if cuda:
            ev = torch.cuda.Event()
            ev.record(g_s)
            s_s.wait_event(ev)
        scatter_torch(packed, part, dst, s_s, start=a, stop=b)


def timed(fn):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


times = {"gather": [], "scatter": [], "pipelined": []}
steps = (("gather", lambda: gather_torch(packed, src, staging, streams[0])),
         ("scatter", lambda: scatter_torch(packed, staging, dst, streams[0])),
         ("pipelined", pipelined))
ok = True
for rep in range(REPS + 1):
    for name, fn in steps:
        if name != "scatter":
            for t in dst:
                t.zero_()
            staging.zero_()
        took = timed(fn)
        if rep:
            times[name].append(took)
        if name == "gather":
            continue
        bad = 0
        for s, t in zip(src, dst, strict=True):  # direct reference: whole blocks, id to id
            bad += int((t.view(-1, bb)[d_idx] != s.view(-1, bb)[s_idx]).sum())
        ok &= bad == 0
        print(f"packing rep {rep} {name}: {bad} bad bytes", flush=True)
for name, v in times.items():
    med = statistics.median(v)
    what = "gather + scatter, " + f"{len(bounds) - 1} chunks" if name == "pipelined" else name
    print(f"packing {what:28s} median {med * 1e3:8.2f} ms = "
          f"{packed.nbytes / med / 1e9:7.1f} GB/s ({packed.nbytes / 2**20:.0f} MiB, "
          f"{packed.gather.shape[0]} runs -> {packed.wire_descriptors} wire descriptors)",
          flush=True)
print("GPU PACKING CHECK PASSED" if ok else "GPU PACKING CHECK FAILED: bytes differ",
      flush=True)
sys.exit(0 if ok else 1)
PYEOF
timeout "${TIMEOUT_S:-600}" "$PY" "$script"

# The packing settings of this machine, gather/scatter measured on the GPU.
timeout "${TIMEOUT_S:-600}" "$PY" -m pushkv.transports.calibrate \
    --device "${PACK_DEVICE:-cuda:${GPU:-0}}" --mib "${PACK_MIB:-512}" --reps "${REPS:-3}"
