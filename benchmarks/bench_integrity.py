"""What end-to-end integrity costs and catches.

1. Digest throughput on host memory, one core (numpy is single-threaded): the
   digest of one fragmented 16k-token request of one rank (8 KV heads of 128,
   bf16, block 16, K and V of one layer; ``--mib`` in all), through the
   whole-row path (the layouts match: every write between like ranks) and the
   general path (a head slice: heterogeneous TP, or ``NHD`` against ``HND``),
   against a numpy copy of as many bytes measured in the same run, rounds
   alternating, best round of each. For reference, ``xxhash``'s XXH3 and
   ``crc32c`` over the same bytes laid contiguously, when installed (they are not
   what pushkv uses: see ``pushkv/integrity/digest.py``).
2. Detection through the in-memory transport (adversarial delivery): transfers
   of 40 tokens, TP 2 -> 1 and block 32 -> 16, the injector corrupting one landed
   write in ten, cycling through its four faults; with integrity ``on``:
   ``injected``, ``detected`` (transfers failed with CORRUPT) and
   ``served_from_corrupt`` (READY over injected bytes: must be 0), then the same
   with ``off`` (``served_from_corrupt_off``: what the check prevents). The same
   for pulls (the injector corrupting one landed read in ten; each producer
   rank's publication sealed and relayed): ``pull_injected``, ``pull_detected``,
   ``pull_served_from_corrupt``, ``pull_served_from_corrupt_off``.
3. ``--e2e``: the latency cost on the CPU deployment (a prefill and a decode vLLM
   CPU server and ``pushkv proxy``, the tiny model): ``on`` against ``off``, servers
   restarted per setting, rounds alternating, median of round medians.
   ``--e2e-router``: the same behind ``vllm-router`` (pull: the prefill's last step
   waits for its source's seal, which rides in its answer).

Last line: one JSON object: ``digest_gbps``, ``general_gbps``, ``copy_gbps``,
``digest_vs_copy``, ``general_vs_copy``, ``xxh3_gbps``, ``crc32c_gbps`` (null when
not installed), ``torch_device``, ``torch_gbps`` and ``torch_vs_copy`` (the torch
path CUDA KV takes, on CUDA when there is one, else on the CPU), ``request_ms`` (one
side's digest of a 200-token request of the CPU recipe), ``injected``,
``detected``, ``served_from_corrupt``, ``served_from_corrupt_off``, the four
``pull_`` counts, ``e2e_overhead_ratio`` (null without ``--e2e``),
``e2e_router_overhead_ratio`` (null without ``--e2e-router``), ``load_average``.

    PYTHONPATH=. python benchmarks/bench_integrity.py [--mib 64] [--rounds 7] [--e2e]
        [--e2e-router]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import numpy as np

from pushkv.integrity import KINDS, Injector, IntegrityConfig, Scope, digest
from pushkv.protocol import FailReason, Mode, TransferFailed, TransferReady, uniform_ranks
from pushkv.protocol.layout import KVLayout
from pushkv.transports.inmemory import pair


def _best(fns: dict[str, Any], rounds: int) -> dict[str, float]:
    """Seconds of each function's best round; the functions alternate within a round."""
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def throughput(mib: int, rounds: int) -> dict[str, float | None]:
    tokens = 16384
    heads, dim, bs = 8, 128, 16
    token_bytes = heads * dim * 2
    per_region = mib * (1 << 20) // 2  # K and V of one layer
    tokens = min(tokens, per_region // token_bytes)
    nblocks = tokens // bs
    lay = KVLayout(num_blocks=2 * nblocks, block_size=bs, num_heads=heads, head_dim=dim,
                   dtype_bytes=2, layer_end=1)
    rng = np.random.default_rng(0)
    regions = [rng.integers(0, 256, lay.region_bytes, dtype=np.uint8) for _ in range(2)]
    ids = tuple(rng.permutation(lay.num_blocks)[:nblocks].tolist())  # fragmented
    whole = Scope(ids, 0, tokens, range(0, 1), ((0, 0, heads),))
    half = Scope(ids, 0, tokens, range(0, 1), ((0, 0, heads // 2),
                                                (heads // 2, heads // 2, heads // 2)))
    nbytes = 2 * tokens * token_bytes
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0  # touched: no page faults in the timed copies
    fns: dict[str, Any] = {
        "copy": lambda: np.copyto(dst, src),
        "digest": lambda: digest(regions, lay, whole),
        "general": lambda: digest(regions, lay, half),
    }
    try:
        import xxhash

        fns["xxh3"] = lambda: xxhash.xxh3_64_intdigest(src)
    except ImportError:
        pass
    try:
        import crc32c

        fns["crc32c"] = lambda: crc32c.crc32c(src)
    except ImportError:
        pass
    best = _best(fns, rounds)
    gbps = {k: nbytes / v / 1e9 for k, v in best.items()}
    assert digest(regions, lay, whole) == digest(regions, lay, half)  # one definition
    print(f"host memory, one core, {nbytes / (1 << 20):.0f} MiB ({tokens} tokens x 8 heads x "
          f"128 x bf16, K and V, {nblocks} blocks of {bs} in random order), best of {rounds}:")
    print(f"  {'what':<34} {'GB/s':>8} {'vs copy':>8}")
    names = {"copy": "numpy copy", "digest": "digest, whole rows (like layouts)",
             "general": "digest, head slices (hetero TP)", "xxh3": "xxhash XXH3-64 (contiguous)",
             "crc32c": "crc32c (contiguous)"}
    for k, v in gbps.items():
        print(f"  {names[k]:<34} {v:8.2f} {v / gbps['copy']:8.2f}")
    out: dict[str, Any] = {"digest_gbps": gbps["digest"], "general_gbps": gbps["general"],
                           "copy_gbps": gbps["copy"], "xxh3_gbps": gbps.get("xxh3"),
                           "crc32c_gbps": gbps.get("crc32c")}
    out |= torch_throughput(regions, lay, whole, nbytes, rounds)
    out["request_ms"] = small_request(rounds)
    return out


def small_request(rounds: int) -> float:
    """Milliseconds of one side's digest of a small request as the vLLM CPU backend
    lays it out (a "token" is a whole (block, head) page: 13 pages of 8 KiB, two
    layers, one KV head: a 200-token prompt of the CPU recipe's model)."""
    lay = KVLayout(num_blocks=4096, block_size=1, num_heads=1, head_dim=16 * 128,
                   dtype_bytes=4, layer_end=2, planes=1, order="HND")
    rng = np.random.default_rng(1)
    regions = [rng.integers(0, 256, lay.region_bytes, dtype=np.uint8) for _ in range(2)]
    scope = Scope(tuple(rng.permutation(4096)[:13].tolist()), 0, 13, range(0, 2),
                  ((0, 0, 1),))
    best = _best({"d": lambda: [digest(regions, lay, scope) for _ in range(20)]}, rounds)
    ms = best["d"] / 20 * 1000
    print(f"  one side of a 200-token request of the CPU recipe (13 pages of 8 KiB x 2 "
          f"layers): {ms:.2f} ms")
    return ms


def torch_throughput(regions: list[Any], lay: KVLayout, scope: Any, nbytes: int,
                     rounds: int) -> dict[str, Any]:
    """The torch path (what CUDA KV goes through) on the device torch has: CUDA when
    one is there, else the CPU (the same code, slower there than numpy's), against a
    copy on that device; its digest must equal numpy's."""
    try:
        import torch
    except ImportError:
        return {"torch_device": None, "torch_gbps": None, "torch_vs_copy": None}
    from pushkv.integrity import digest_torch

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    regs = [torch.from_numpy(r).to(dev) for r in regions]
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    fns = {"copy": lambda: (b.copy_(a), sync()),
           "digest": lambda: (digest_torch(regs, lay, scope), sync())}
    best = _best(fns, rounds)
    assert digest_torch(regs, lay, scope) == digest(regions, lay, scope)  # same bits
    t, c = nbytes / best["digest"] / 1e9, nbytes / best["copy"] / 1e9
    print(f"  {'torch digest on ' + dev.type:<34} {t:8.2f} {t / c:8.2f}  (copy on {dev.type}: "
          f"{c:.2f} GB/s)")
    return {"torch_device": dev.type, "torch_gbps": t, "torch_vs_copy": t / c}


def detection(transfers: int, integrity: str, pull: bool = False) -> dict[str, int]:
    """Push (or ``pull``) ``transfers`` transfers, one landed write (read) in ten
    corrupted: the counts."""
    inj = Injector(KINDS, every=10, seed=1)
    net = pair(uniform_ranks("P", tp=2, num_kv_heads=2, block_size=32),
               uniform_ranks("D", num_kv_heads=2, block_size=16, num_blocks=4 * transfers),
               integrity=IntegrityConfig.parse(integrity), injector=inj, keep_log=True, seed=2)
    (c,) = net.consumers.values()
    for i in range(transfers):
        tid, src, dst = f"t{i}", [i % 60, (i + 7) % 60], [3 * i, 3 * i + 1, 3 * i + 2]
        if pull:  # published, then read with each producer rank's seal relayed
            for p in net.producers.values():
                p.apply(p.endpoint.prefill_finished(tid, src, 40, net.now, mode=Mode.PULL))
            net.run(until=net.now + 0.01)
            seals = {p.peer.rank: p.published[tid].seal for p in net.producers.values()}
            c.start_pull(tid, "P", src, dst, 40, seals=seals if all(seals.values()) else None)
            net.run()
            continue
        c.apply(c.endpoint.register(tid, "P", dst, 40, net.now))
        net.run(until=net.now + 0.01)
        for p in net.producers.values():
            p.apply(p.endpoint.prefill_finished(tid, src, 40, net.now))
        net.run()
    detected = sum(1 for _, a in c.log if isinstance(a, TransferFailed)
                   and a.code is FailReason.CORRUPT)
    ready = sum(1 for _, a in c.log if isinstance(a, TransferReady))
    assert ready + detected == transfers and not net.violations
    return {"injected": inj.injected, "detected": detected,
            "served_from_corrupt": int(net.stats["served_from_corrupt"])}


def e2e(rounds: int, requests: int, front: str = "proxy") -> float:
    """Median over rounds of (median latency with integrity on / off), behind
    ``pushkv proxy`` (push) or ``vllm-router`` (pull: the seal rides in the
    prefill's answer, so the prefill's last step waits for the digest)."""
    from pathlib import Path
    from tempfile import mkdtemp

    from pushkv.vllm.testing import (
        Server,
        ServerSpec,
        free_port,
        kv_transfer_config,
        post_json,
        running,
        start_proxy,
        start_router,
        stop_proxy,
        stop_router,
        write_tiny_llama,
    )

    work = Path(mkdtemp(prefix="bench-integrity-"))
    model = str(write_tiny_llama(work / "model"))
    medians: dict[str, list[float]] = {"on": [], "off": []}

    def run(mode: str, salt: int) -> float:
        p = ServerSpec(model=model, port=free_port(), cpu=0, kv_config=kv_transfer_config(
            "kv_producer", "prefill-0", integrity=mode))
        d = ServerSpec(model=model, port=free_port(), cpu=1, kv_config=kv_transfer_config(
            "kv_consumer", "decode-0", integrity=mode))
        prefill, decode = Server(p, work / f"p-{mode}.log"), Server(d, work / f"d-{mode}.log")
        with running(prefill, decode):
            if front == "router":
                proc, url = start_router([prefill.url], decode.url, "round_robin",
                                         work / "router.log")
            else:
                proc, url = start_proxy(prefill.url, decode.url, work / "proxy.log")
            try:
                lat = []
                for i in range(requests):
                    tokens = [(salt * 7919 + i * 131 + 7 * k) % 990 + 5 for k in range(200)]
                    t0 = time.perf_counter()
                    status, _ = post_json(url + "/v1/completions", {
                        "model": model, "prompt": tokens, "max_tokens": 1,
                        "temperature": 0}, timeout=120)
                    assert status == 200
                    lat.append(time.perf_counter() - t0)
                return statistics.median(lat[2:])  # the first two warm the servers
            finally:
                (stop_router if front == "router" else stop_proxy)(proc)

    for r in range(rounds):
        for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
            medians[mode].append(run(mode, r * 2 + (mode == "on")))
            print(f"  round {r} {mode:>3}: median {medians[mode][-1] * 1000:.1f} ms")
    ratio = statistics.median(medians["on"]) / statistics.median(medians["off"])
    behind = "vllm-router, pull" if front == "router" else "pushkv proxy, push"
    print(f"e2e (CPU deployment behind {behind}, {requests} requests a round, 200-token "
          f"prompts, 1 output token): on / off = {ratio:.3f}")
    return ratio


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="bytes digested per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--transfers", type=int, default=200)
    ap.add_argument("--e2e", action="store_true", help="also the CPU deployment, on vs off")
    ap.add_argument("--e2e-router", action="store_true",
                    help="also the CPU deployment behind vllm-router (pull), on vs off")
    ap.add_argument("--e2e-rounds", type=int, default=3)
    ap.add_argument("--e2e-requests", type=int, default=22)
    args = ap.parse_args(argv)
    if args.mib < 1 or args.rounds < 1 or args.transfers < 10:
        ap.error("--mib and --rounds must be >= 1, --transfers >= 10")
    out: dict[str, Any] = throughput(args.mib, args.rounds)
    out["digest_vs_copy"] = out["digest_gbps"] / out["copy_gbps"]
    out["general_vs_copy"] = out["general_gbps"] / out["copy_gbps"]
    on = detection(args.transfers, "on")
    off = detection(args.transfers, "off")
    print(f"in-memory transport, {args.transfers} transfers, one write in ten corrupted: "
          f"on: injected {on['injected']}, detected {on['detected']}, served from corrupt "
          f"{on['served_from_corrupt']}; off: served from corrupt {off['served_from_corrupt']}")
    out |= on
    out["served_from_corrupt_off"] = off["served_from_corrupt"]
    pon = detection(args.transfers, "on", pull=True)
    poff = detection(args.transfers, "off", pull=True)
    print(f"pulls: on: injected {pon['injected']}, detected {pon['detected']}, served from "
          f"corrupt {pon['served_from_corrupt']}; off: served from corrupt "
          f"{poff['served_from_corrupt']}")
    out |= {f"pull_{k}": v for k, v in pon.items()}
    out["pull_served_from_corrupt_off"] = poff["served_from_corrupt"]
    out["e2e_overhead_ratio"] = e2e(args.e2e_rounds, args.e2e_requests) if args.e2e else None
    out["e2e_router_overhead_ratio"] = e2e(args.e2e_rounds, args.e2e_requests, "router") \
        if args.e2e_router else None
    out["load_average"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
