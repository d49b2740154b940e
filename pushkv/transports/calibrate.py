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
* **post_gil_fraction**: how much of that write's preparing and posting keeps the
  Python interpreter lock (:func:`measure_post_gil`: a thread counting its wake-ups
  beside the post, read against C calls that release and that hold the lock) -- the
  share a background posting thread blocks its engine's loop for, in the simulator.
* for reference: a numpy copy of the same bytes, and the wire of a packed write
  (``--chunk-mib`` descriptors).

Medians of ``--reps`` interleaved rounds. The output is a TOML snippet: a
``[packing]`` table of ``PackingConfig`` fields (the transport's packing
settings) and a ``[network]`` table a simulator profile takes
(``pushkv sim --profile FILE``; the simulator's gather/scatter bandwidth is its
device assumption, not a profile key), then one JSON line of every figure.
``--out FILE`` also writes the snippet to a file, ``--profile-out FILE`` the
``[network]`` table alone: a profile fragment ``pushkv sim --profile FILE`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
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


@contextlib.contextmanager
def _pair(size: int) -> Iterator[tuple[Any, str, int, int]]:
    """A NIXL agent of this process with ``size`` bytes registered, and a peer agent of
    another process with as many: ``(agent, peer, local_base, remote_base)``."""
    from .nixl.agent import Agent
    from .nixl.config import NixlConfig
    from .nixl.memory import KVMemory

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
        yield agent, peer, mem.bases[0], remote_base
    finally:
        if agent is not None:
            agent.close()
        parent.send(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def _rows(base: int, n: int, length: int, gap: int) -> np.ndarray:
    """``n`` Nx3 ``(addr, len, dev)`` descriptor rows of ``length`` bytes, ``gap`` apart."""
    out = np.zeros((n, 3), np.int64)
    out[:, 0] = base + np.arange(n, dtype=np.int64) * gap
    out[:, 1] = length
    return out


def _finish(agent: Any, handle: Any, n: int) -> None:
    """Wait for a posted request to end (``DONE``), release it; raise on ``ERR``."""
    state = agent.state(handle)
    while state == "PROC":
        state = agent.state(handle)
    agent.release(handle)
    if state != "DONE":
        raise CalibrationError(f"NIXL WRITE of {n} descriptors ended {state}")


def measure_post(descriptors: int, each: int, chunk: int, reps: int,
                 pair: tuple[Any, str, int, int] | None = None) -> dict[str, float]:
    """Posting-thread time of direct NIXL writes between two processes (seconds);
    ``pair``: a :func:`_pair` of ``2 x descriptors x each`` bytes to use."""
    with contextlib.ExitStack() as stack:
        if pair is None:  # room for descriptors that are not adjacent
            pair = stack.enter_context(_pair(2 * descriptors * each))
        agent, peer, local_base, remote_base = pair

        def write(n: int, length: int, gap: int) -> float:
            t0 = time.perf_counter()
            h = agent.prepare_write(_rows(local_base, n, length, gap),
                                    _rows(remote_base, n, length, gap), peer, b"", "DRAM")
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


# ------------------------------------------------------- the post and the GIL


class _Counter:
    """A Python thread that wakes from a short sleep again and again and counts its
    wake-ups: each needs the interpreter lock, so it counts only while no other thread
    keeps the lock, and what another thread's call costs it is the time that call kept
    the lock. It sleeps rather than spins so that it needs little CPU: on a busy
    machine a waking thread gets a core quickly, while a spinning one would get only
    its share of the cores."""

    TICK_S = 50e-6

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
        self._thread = threading.Thread(target=self._spin, name="gil-counter", daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self._stop:
            time.sleep(self.TICK_S)
            n += 1
            self.count = n

    def __enter__(self) -> _Counter:
        self._thread.start()
        while self.count == 0:  # running: its first iterations are counted
            time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        self._thread.join()

    def during(self, fn: Callable[[], Any]) -> tuple[float, int]:
        """Run ``fn`` on this thread: its wall time and the counter's iterations meanwhile."""
        c0 = self.count
        t0 = time.perf_counter()
        fn()
        took = time.perf_counter() - t0
        return took, self.count - c0


def _held_calibrators(seconds: float) -> dict[str, Callable[[], Any]]:
    """Two calls of about ``seconds`` in C each that the counter's rate is read against:
    ``released`` hashes a buffer (hashlib releases the lock and keeps a core busy, as a
    post that copies does), ``sleep`` is ``time.sleep`` (releases it, idle), ``held``
    sums a range (one C call that never lets the lock go)."""
    buf = os.urandom(1 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(buf).digest()
    mib = max(1, round(seconds / max(time.perf_counter() - t0, 1e-6)))
    big = buf * min(mib, 256)
    n = 1 << 20
    t0 = time.perf_counter()
    sum(range(n))
    n = max(n, int(n * seconds / max(time.perf_counter() - t0, 1e-6)))
    return {"released": lambda: hashlib.sha256(big).digest(),
            "sleep": lambda: time.sleep(seconds),
            "held": lambda: sum(range(n))}


def held_share(took: float, counted: int, free_rate: float, alone: float) -> float:
    """The share of a call's own time (``alone``, timed without the counter) that it
    kept the counter from running: the wall time it took beside the counter less the
    time the counter's ``counted`` iterations need at its ``free_rate``, over
    ``alone`` (not clipped: a busy machine's noise shows)."""
    if not (alone > 0 and free_rate > 0):
        raise CalibrationError(f"cannot weigh a call of {alone} s at a rate of {free_rate}/s "
                               "(the counter thread never ran: raise --reps on a busy machine)")
    return (took - counted / free_rate) / alone


def measure_post_gil(descriptors: int, each: int, reps: int, window_s: float = 0.05,
                     pair: tuple[Any, str, int, int] | None = None) -> dict[str, float]:
    """How much of a NIXL post keeps the interpreter lock, on the NIXL installed here.

    Direct WRITEs of ``descriptors`` x ``each`` bytes between two processes (UCX,
    host memory), prepared (``initialize_xfer``: makeXferReq) and posted
    (``transfer``: postXferReq) by this thread while a :class:`_Counter` thread runs,
    as many in a row as fill about ``window_s``; the counter's rate while this thread
    runs a C call that releases the lock (:func:`_held_calibrators` ``released``) is
    its free rate. For each part, :func:`held_share` of the medians of ``reps``
    interleaved rounds, scaled so that a C call that never releases the lock
    (``held``, measured the same way in the same rounds) reads 1 -- on a busy machine
    the counter runs faster while this thread waits for the lock than while it keeps a
    core busy, so the raw share of a held call comes out below 1 (``gil_*_raw``, and
    ``gil_control_held_raw`` for the held call, are the unscaled figures); clipped
    to [0, 1]. The post's share (``post_gil_fraction``) weighs the two parts by
    their time alone; a sleep's share (``gil_control_sleep_fraction``, near 0) is
    reported beside it."""
    with contextlib.ExitStack() as stack:
        if pair is None:
            pair = stack.enter_context(_pair(2 * descriptors * each))
        agent, peer, local_base, remote_base = pair
        local = _rows(local_base, descriptors, each, 2 * each)
        remote = _rows(remote_base, descriptors, each, 2 * each)
        handles: list[Any] = []
        kp = kt = 1  # requests prepared, and posted, in a round

        def prepare() -> None:
            for _ in range(kp):
                handles.append(agent.prepare_write(local, remote, peer, b"", "DRAM"))

        def post() -> None:
            for h in handles[:kt]:
                agent.post(h)

        def finish() -> None:
            for h in handles[:kt]:
                _finish(agent, h, descriptors)
            for h in handles[kt:]:
                agent.release(h)
            handles.clear()

        def alone() -> tuple[float, float]:  # a round alone: (prepare, post) times
            times = (_wall(prepare), _wall(post))
            finish()
            return times

        alone()  # connection set-up, first touches
        prep1, post1 = alone()
        kt = max(1, min(1000, round(window_s / max(post1, 1e-6))))
        kp = max(kt, min(1000, round(window_s / max(prep1, 1e-6))))
        solo = [alone() for _ in range(reps)]
        prep_alone = statistics.median(a for a, _ in solo)
        post_alone = statistics.median(b for _, b in solo)
        calib = _held_calibrators(max(min(prep_alone, post_alone), window_s))
        calib_alone = {c: statistics.median(_wall(fn) for _ in range(reps))
                       for c, fn in calib.items()}
        runs: dict[str, list[tuple[float, int]]] = {c: [] for c in ("prepare", "post", *calib)}
        with _Counter() as counter:
            for _ in range(reps):
                for c, fn in calib.items():
                    runs[c].append(counter.during(fn))
                runs["prepare"].append(counter.during(prepare))
                runs["post"].append(counter.during(post))
                finish()
        rate = {c: statistics.median(n / t for t, n in v) for c, v in runs.items()}
        free = rate["released"]

        def share(c: str, alone_s: float) -> float:
            took = statistics.median(t for t, _ in runs[c])
            counted = statistics.median(n for _, n in runs[c])
            return held_share(took, int(counted), free, alone_s)

        held = share("held", calib_alone["held"])
        if not held > 0:
            raise CalibrationError(f"a call that holds the lock measured a held share of "
                                   f"{held:.3g}: the counter cannot tell here (raise --reps)")

        def scaled(raw: float) -> float:  # a call that never releases the lock reads 1
            return min(1.0, max(0.0, raw / held))

        prep_raw, post_raw = share("prepare", prep_alone), share("post", post_alone)
        prep_share, post_share = scaled(prep_raw), scaled(post_raw)
        prep_one, post_one = prep_alone / kp, post_alone / kt  # one write's parts
        whole = (prep_share * prep_one + post_share * post_one) / (prep_one + post_one)
        return {
            "post_gil_fraction": whole,
            "prepare_gil_fraction": prep_share,
            "transfer_gil_fraction": post_share,
            "gil_prepare_raw": prep_raw,
            "gil_transfer_raw": post_raw,
            "gil_prepare_s": prep_alone / kp,
            "gil_transfer_s": post_alone / kt,
            "gil_held_per_descriptor_s": (prep_share * prep_one + post_share * post_one)
            / descriptors,
            "gil_prepared_per_round": float(kp),
            "gil_posted_per_round": float(kt),
            "gil_control_held_raw": held,
            "gil_control_sleep_fraction": scaled(share("sleep", calib_alone["sleep"])),
            "gil_counter_free_per_s": free,
            "gil_counter_sleep_per_s": rate["sleep"],
        }


def _wall(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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


def network_table(figures: dict[str, float]) -> dict[str, float]:
    """The ``[network]`` table of a simulator profile fragment: the posting costs and,
    when measured, the share of a post that holds the interpreter lock."""
    network = {"post_per_descriptor_s": figures["post_per_descriptor_s"],
               "post_fixed_s": figures["post_fixed_s"]}
    if "post_gil_fraction" in figures:
        share = figures["post_gil_fraction"]
        if not 0 <= share <= 1:
            raise CalibrationError(f"post_gil_fraction measured {share}: not in [0, 1]")
        network["post_gil_fraction"] = share
    _check_positive(network, skip=("post_gil_fraction",))
    return network


def _check_positive(table: dict[str, float], skip: tuple[str, ...] = ()) -> None:
    for name, value in table.items():
        if name not in skip and not (np.isfinite(value) and value > 0):
            raise CalibrationError(f"{name} measured {value}: not a positive time or rate "
                                   "(too small a measurement on a busy machine? raise "
                                   "--descriptors / --mib / --reps)")


def settings(figures: dict[str, float], device: str | None) -> dict[str, dict[str, float]]:
    """The ``[packing]`` (PackingConfig fields) and ``[network]`` (simulator profile,
    :func:`network_table`) tables of a calibration."""
    key = "device_" if device else ""
    packing = {
        "post_per_descriptor_s": figures["post_per_descriptor_s"],
        "gather_bytes_per_s": figures[f"{key}gather_bytes_per_s"],
        "scatter_bytes_per_s": figures[f"{key}scatter_bytes_per_s"],
    }
    _check_positive(packing)
    return {"packing": packing, "network": network_table(figures)}


def nixl_version() -> str:
    """The installed NIXL's version (``pip show nixl``), or ``unknown``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "unknown"


def render(tables: dict[str, dict[str, float]], header: Sequence[str]) -> str:
    """The tables as TOML under ``header``'s comment lines; a ``{"network": ...}``
    alone is a profile fragment ``pushkv sim --profile`` reads."""
    lines = [f"# {h}" for h in header]
    notes = {"packing": "PackingConfig fields: the NIXL transport's packing settings",
             "network": "a simulator profile override (pushkv sim --profile FILE)"}
    for name, table in tables.items():
        lines += ["", f"# {notes[name]}", f"[{name}]"]
        lines += [f"{k} = {_toml_float(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _toml_float(v: float) -> str:
    """``v`` to 4 significant digits, read back by TOML as a float (0 -> ``0.0``)."""
    text = f"{v:.4g}"
    return text if any(c in text for c in ".en") else text + ".0"


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
    ap.add_argument("--profile-out", default=None,
                    help="also write the [network] table alone here: a profile fragment "
                    "pushkv sim --profile reads")
    ap.add_argument("--gil-window-ms", type=float, default=50.0,
                    help="posts timed together in each round of the interpreter-lock "
                    "measurement (default 50)")
    args = ap.parse_args(argv)
    if args.descriptors < 2 or args.descriptor_bytes < 1 or args.reps < 1 or args.mib <= 0 \
            or args.chunk_mib <= 0 or not args.gil_window_ms > 0:
        raise ConfigError("need --descriptors >= 2, --descriptor-bytes >= 1, --reps >= 1, "
                          "--mib > 0, --chunk-mib > 0 and --gil-window-ms > 0")
    load = os.getloadavg()
    figures: dict[str, float] = {}
    with _pair(2 * args.descriptors * args.descriptor_bytes) as pair:
        figures.update(measure_post(args.descriptors, args.descriptor_bytes,
                                    int(args.chunk_mib * 2**20), args.reps, pair))
        figures.update(measure_post_gil(args.descriptors, args.descriptor_bytes, args.reps,
                                        args.gil_window_ms / 1e3, pair))
    figures.update(measure_host(args.mib, args.reps))
    if args.device:
        figures.update(measure_device(args.mib, args.reps, args.device))
    tables = settings(figures, args.device)
    header = [
        f"pushkv packing calibration, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{platform.node()}: {os.cpu_count()} CPUs, load average {load[0]:.2f} "
        f"{load[1]:.2f} {load[2]:.2f}",
        f"NIXL {nixl_version()} UCX host memory, two processes: {args.descriptors} x "
        f"{args.descriptor_bytes} B direct {figures['direct_s'] * 1e3:.1f} ms "
        f"({figures['direct_bytes_per_s'] / 1e9:.2f} GB/s), one descriptor "
        f"{figures['one_descriptor_bytes_per_s'] / 1e9:.2f} GB/s, "
        f"{args.chunk_mib:g} MiB chunks {figures['wire_bytes_per_s'] / 1e9:.2f} GB/s",
        f"interpreter lock held for {figures['post_gil_fraction']:.1%} of a post: "
        f"prepare (makeXferReq) {figures['prepare_gil_fraction']:.0%} of "
        f"{figures['gil_prepare_s'] * 1e3:.2f} ms, transfer (postXferReq) "
        f"{figures['transfer_gil_fraction']:.0%} of {figures['gil_transfer_s'] * 1e3:.2f} ms "
        f"(a call that holds it: raw {figures['gil_control_held_raw']:.2f}, read as 1)",
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
    if args.profile_out:
        with open(args.profile_out, "w", encoding="utf-8") as f:
            f.write(render({"network": tables["network"]}, header))
    sys.stdout.write(text)
    print(json.dumps({**tables, "figures": figures}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
