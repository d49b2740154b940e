"""Measure the constants a packed write's cost model weighs, on the machine at hand.

``python -m pushkv.transports.calibrate`` measures what
:class:`~pushkv.protocol.packing.PackingConfig` weighs and prints it as settings:

* **post_per_descriptor_s**: a direct NIXL WRITE between two processes (UCX, host
  memory, like the transport's), prepared and posted to completion on the calling
  thread, of ``N`` descriptors of ``--descriptor-bytes`` each against one
  descriptor of the same ``N x`` bytes: the difference over ``N - 1`` is what one
  more descriptor costs the posting thread, the bytes' copy cancelled out. One
  descriptor of ``--descriptor-bytes`` alone is the fixed cost of a write
  (``post_fixed_s``).
* **gather_bytes_per_s / scatter_bytes_per_s**: :func:`~pushkv.transports.staging.gather_host`
  and :func:`~pushkv.transports.staging.scatter_host` of a fragmented request
  (one Qwen3-32B TP8 rank's layout, random block ids on both sides: one run per
  block per region) of ``--mib`` MiB; with ``--device`` (``cuda``, ``cuda:1``,
  ``cpu``) also the torch path on that device, and those figures become the
  settings (the gather runs where the KV lives).
* for reference: a numpy copy of the same bytes, and the wire of a packed write
  (``--chunk-mib`` descriptors).

Medians of ``--reps`` interleaved rounds. The output is a TOML snippet: a
``[packing]`` table of ``PackingConfig`` fields (the transport's packing
settings) and a ``[network]`` table a simulator profile takes
(``pushkv sim --profile FILE``; the simulator's gather/scatter bandwidth is its
device assumption, not a profile key), then one JSON line of every figure.
``--out FILE`` also writes the snippet to a file.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..protocol.errors import ConfigError


class CalibrationError(RuntimeError):
    """A measurement came out non-positive or not finite (too small to see, or broken)."""


# ------------------------------------------------------------------ NIXL


def _target(conn: Any, size: int) -> None:
    from .nixl.agent import Agent
    from .nixl.config import NixlConfig
    from .nixl.memory import KVMemory

    buf = np.zeros(size, np.uint8)
    agent = Agent("calibrate-target", NixlConfig())
    mem = KVMemory.from_regions([buf])
    agent.register(mem)
    conn.send((agent.metadata(), mem.bases[0]))
    conn.recv()
    agent.close()


def measure_post(descriptors: int, each: int, chunk: int, reps: int) -> dict[str, float]:
    """Posting-thread time of direct NIXL writes between two processes (seconds)."""
    from .nixl.agent import Agent
    from .nixl.config import NixlConfig
    from .nixl.memory import KVMemory

    size = 2 * descriptors * each  # room for descriptors that are not adjacent
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(child, size), daemon=True)
    proc.start()
    agent = None
    try:
        meta, remote_base = parent.recv()
        src = np.full(size, 7, np.uint8)
        agent = Agent("calibrate-initiator", NixlConfig(), progress_thread=False)
        mem = KVMemory.from_regions([src])
        agent.register(mem)
        peer = agent.add_peer(meta)
        local_base = mem.bases[0]

        def rows(base: int, n: int, length: int, gap: int) -> np.ndarray:
            out = np.zeros((n, 3), np.int64)
            out[:, 0] = base + np.arange(n, dtype=np.int64) * gap
            out[:, 1] = length
            return out

        def write(n: int, length: int, gap: int) -> float:
            t0 = time.perf_counter()
            h = agent.prepare_write(rows(local_base, n, length, gap),
                                    rows(remote_base, n, length, gap), peer, b"", "DRAM")
            state = agent.post(h)
            while state == "PROC":
                state = agent.state(h)
            took = time.perf_counter() - t0
            agent.release(h)
            if state != "DONE":
                raise CalibrationError(f"NIXL WRITE of {n} descriptors ended {state}")
            return took

        total = descriptors * each
        n_chunks = max(1, -(-total // chunk))
        shapes: dict[str, Callable[[], float]] = {
            "one_small": lambda: write(1, each, each),
            "many": lambda: write(descriptors, each, 2 * each),
            "one_large": lambda: write(1, total, total),
            "chunks": lambda: write(n_chunks, min(chunk, total), min(chunk, total)),
        }
        for fn in shapes.values():  # connection set-up, first touches
            fn()
        times: dict[str, list[float]] = {k: [] for k in shapes}
        for _ in range(reps):
            for k, fn in shapes.items():
                times[k].append(fn())
        med = {k: statistics.median(v) for k, v in times.items()}
        return {
            "post_per_descriptor_s": (med["many"] - med["one_large"]) / max(descriptors - 1, 1),
            "post_fixed_s": med["one_small"],
            "direct_s": med["many"],
            "direct_bytes_per_s": total / med["many"],
            "wire_bytes_per_s": total / med["chunks"],
            "one_descriptor_bytes_per_s": total / med["one_large"],
        }
    finally:
        if agent is not None:
            agent.close()
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------- gather/scatter


def request(mib: float, seed: int = 0) -> tuple[Any, list[np.ndarray]]:
    """A fragmented request of about ``mib`` MiB of one Qwen3-32B TP8 rank (64 layers x
    K/V, 4 KiB blocks of 16 tokens), random block ids on both sides; its PackedPlan
    and a source filled with a pattern."""
    from ..protocol import plan_transfer, uniform_ranks
    from ..protocol.mapping import assignment
    from ..protocol.packing import PackedPlan, PackingConfig

    per_block = 64 * 2 * 4096
    blocks = max(2, int(mib * 2**20 // per_block))
    num_blocks = blocks + max(2, blocks // 10)
    p, d = (uniform_ranks(name, num_layers=64, num_kv_heads=1, head_dim=128, dtype_bytes=2,
                          num_blocks=num_blocks, block_size=16)[0]
            for name in ("calibrate-p", "calibrate-d"))
    rng = np.random.default_rng(seed)
    src_ids = rng.permutation(num_blocks)[:blocks].tolist()
    dst_ids = rng.permutation(num_blocks)[:blocks].tolist()
    plan = plan_transfer(p.layout, d.layout, assignment(p.engine, d.engine, 0, 0), src_ids,
                         dst_ids, blocks * 16)
    size = p.layout.region_bytes
    src = [((np.arange(size, dtype=np.uint32) * 7 + r) % 251).astype(np.uint8)
           for r in range(p.layout.num_regions)]
    return PackedPlan(plan, PackingConfig().chunk_bytes), src


def measure_host(mib: float, reps: int) -> dict[str, float]:
    """Host gather/scatter (numpy) and a numpy copy of the same bytes, bytes/s."""
    from .staging import gather_host, scatter_host

    packed, src = request(mib)
    dst = [np.ones_like(s) for s in src]  # pages faulted in
    staging = np.ones(packed.nbytes, np.uint8)
    flat_src = np.concatenate(src)[:packed.nbytes]
    flat_dst = np.ones_like(flat_src)

    def timed(fn: Callable[[], None]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    steps: dict[str, Callable[[], None]] = {
        "gather": lambda: gather_host(packed, src, staging),
        "scatter": lambda: scatter_host(packed, staging, dst),
        "copy": lambda: np.copyto(flat_dst, flat_src),
    }
    for fn in steps.values():
        fn()
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            times[k].append(timed(fn))
    return {f"{k}_bytes_per_s": packed.nbytes / statistics.median(v) for k, v in times.items()}


def measure_device(mib: float, reps: int, device: str) -> dict[str, float]:
    """The torch path on ``device``: gather/scatter bytes/s (CUDA: on a side stream,
    timed with events)."""
    import torch

    from .staging import gather_torch, scatter_torch

    packed, src_np = request(mib)
    dev = torch.device(device)
    src = [torch.from_numpy(s).to(dev) for s in src_np]
    dst = [torch.zeros_like(s) for s in src]
    staging = torch.empty(packed.nbytes, dtype=torch.uint8, device=dev)
    cuda = dev.type == "cuda"
    stream = torch.cuda.Stream(device=dev) if cuda else None  # type: ignore[no-untyped-call]

    def timed(fn: Callable[[], None]) -> float:
        if cuda:
            torch.cuda.synchronize(dev)
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            return float(start.elapsed_time(end)) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    steps: dict[str, Callable[[], None]] = {
        "gather": lambda: gather_torch(packed, src, staging, stream),
        "scatter": lambda: scatter_torch(packed, staging, dst, stream),
    }
    for fn in steps.values():
        timed(fn)
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(reps):
        for k, fn in steps.items():
            times[k].append(timed(fn))
    return {f"device_{k}_bytes_per_s": packed.nbytes / statistics.median(v)
            for k, v in times.items()}


# ------------------------------------------------------------------ output


def settings(figures: dict[str, float], device: str | None) -> dict[str, dict[str, float]]:
    """The ``[packing]`` (PackingConfig fields) and ``[network]`` (simulator profile)
    tables of a calibration."""
    key = "device_" if device else ""
    packing = {
        "post_per_descriptor_s": figures["post_per_descriptor_s"],
        "gather_bytes_per_s": figures[f"{key}gather_bytes_per_s"],
        "scatter_bytes_per_s": figures[f"{key}scatter_bytes_per_s"],
    }
    network = {"post_per_descriptor_s": figures["post_per_descriptor_s"],
               "post_fixed_s": figures["post_fixed_s"]}
    for table in (packing, network):
        for name, value in table.items():
            if not (np.isfinite(value) and value > 0):
                raise CalibrationError(f"{name} measured {value}: not a positive time or rate "
                                       "(too small a measurement on a busy machine? raise "
                                       "--descriptors / --mib / --reps)")
    return {"packing": packing, "network": network}


def render(tables: dict[str, dict[str, float]], header: Sequence[str]) -> str:
    lines = [f"# {h}" for h in header]
    notes = {"packing": "PackingConfig fields: the NIXL transport's packing settings",
             "network": "a simulator profile override (pushkv sim --profile FILE)"}
    for name, table in tables.items():
        lines += ["", f"# {notes[name]}", f"[{name}]"]
        lines += [f"{k} = {v:.4g}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pushkv.transports.calibrate",
                                 description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--descriptors", type=int, default=16384,
                    help="descriptors of the many-descriptor write (default 16384)")
    ap.add_argument("--descriptor-bytes", type=int, default=4096,
                    help="bytes per descriptor (default 4096: one 16-token block of one "
                    "Qwen3-32B TP8 rank's layer plane)")
    ap.add_argument("--chunk-mib", type=float, default=16.0,
                    help="wire descriptor of a packed write (default 16)")
    ap.add_argument("--mib", type=float, default=256.0,
                    help="size of the request gathered and scattered (default 256)")
    ap.add_argument("--reps", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--device", default=None,
                    help="also measure the torch gather/scatter on this device (cuda, cpu)")
    ap.add_argument("--out", default=None, help="also write the TOML snippet here")
    args = ap.parse_args(argv)
    if args.descriptors < 2 or args.descriptor_bytes < 1 or args.reps < 1 or args.mib <= 0 \
            or args.chunk_mib <= 0:
        raise ConfigError("need --descriptors >= 2, --descriptor-bytes >= 1, --reps >= 1, "
                          "--mib > 0 and --chunk-mib > 0")
    load = os.getloadavg()
    figures: dict[str, float] = {}
    figures.update(measure_post(args.descriptors, args.descriptor_bytes,
                                int(args.chunk_mib * 2**20), args.reps))
    figures.update(measure_host(args.mib, args.reps))
    if args.device:
        figures.update(measure_device(args.mib, args.reps, args.device))
    tables = settings(figures, args.device)
    header = [
        f"pushkv packing calibration, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.node()}: {os.cpu_count()} CPUs, load average {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f}",
        f"NIXL UCX host memory, two processes: {args.descriptors} x "
        f"{args.descriptor_bytes} B direct {figures['direct_s'] * 1e3:.1f} ms "
        f"({figures['direct_bytes_per_s'] / 1e9:.2f} GB/s), one descriptor "
        f"{figures['one_descriptor_bytes_per_s'] / 1e9:.2f} GB/s, "
        f"{args.chunk_mib:g} MiB chunks {figures['wire_bytes_per_s'] / 1e9:.2f} GB/s",
        f"host ({args.mib:g} MiB fragmented): gather {figures['gather_bytes_per_s'] / 1e9:.2f}"
        f" GB/s, scatter {figures['scatter_bytes_per_s'] / 1e9:.2f} GB/s, numpy copy "
        f"{figures['copy_bytes_per_s'] / 1e9:.2f} GB/s",
    ]
    if args.device:
        header.append(f"torch on {args.device}: gather "
                      f"{figures['device_gather_bytes_per_s'] / 1e9:.2f} GB/s, scatter "
                      f"{figures['device_scatter_bytes_per_s'] / 1e9:.2f} GB/s")
    text = render(tables, header)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    sys.stdout.write(text)
    print(json.dumps({**tables, "figures": figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
