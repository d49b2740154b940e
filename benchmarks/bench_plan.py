"""Planning one 16,384-token request for one Qwen3-32B TP8 rank.

64 layers x (K, V), one KV head of 128 bf16 values per rank: 256 B per token
per plane per layer, 32 KiB per token per rank. Block size 16, so 1,024 blocks.
Times the plan (the coalesced runs and the region pairs they apply to: the
whole information, from which any descriptor list follows) for a fully
fragmented allocation (random block ids) and a contiguous one, then the same
plus materialising NIXL-shaped (addr, len, dev) Nx3 arrays for both sides,
against a naive builder that emits one descriptor per (layer, plane, block) in
a Python loop -- what a straightforward connector does -- measured in the same
run. Last line: one JSON object of the figures.
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

from pushkv.protocol import KVLayout, plan_transfer
from pushkv.protocol.mapping import Assignment

TOKENS, BLOCK, LAYERS, NUM_BLOCKS = 16_384, 16, 64, 8_192
LAYOUT = KVLayout(num_blocks=NUM_BLOCKS, block_size=BLOCK, num_heads=1, head_dim=128,
                  dtype_bytes=2, layer_end=LAYERS)
ASSIGN = Assignment(src_rank=0, dst_rank=0, layers=range(LAYERS), heads=((0, 0, 1),))
SRC_BASES = np.arange(LAYOUT.num_regions, dtype=np.int64) * (1 << 32) + (1 << 40)
DST_BASES = np.arange(LAYOUT.num_regions, dtype=np.int64) * (1 << 32) + (1 << 41)


def plan(src_ids, dst_ids):
    return plan_transfer(LAYOUT, LAYOUT, ASSIGN, src_ids, dst_ids, TOKENS)


def plan_and_descriptors(src_ids, dst_ids):
    p = plan(src_ids, dst_ids)
    src, dst = p.descriptors(SRC_BASES, DST_BASES)
    return p, src, dst


def naive(src_ids, dst_ids):
    """One descriptor per (layer, plane, block), built in Python."""
    bb = LAYOUT.block_bytes
    src, dst = [], []
    for region in range(LAYOUT.num_regions):
        sb, db = int(SRC_BASES[region]), int(DST_BASES[region])
        for s, d in zip(src_ids, dst_ids, strict=True):
            src.append((sb + s * bb, bb, 0))
            dst.append((db + d * bb, bb, 0))
    return np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)


def timeit(fn, *args, repeat=30):
    fn(*args)  # warm up
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(*args)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    rng = np.random.default_rng(0)
    n = TOKENS // BLOCK
    frag_src = rng.permutation(NUM_BLOCKS)[:n].tolist()
    frag_dst = rng.permutation(NUM_BLOCKS)[:n].tolist()
    cont_src, cont_dst = list(range(100, 100 + n)), list(range(3000, 3000 + n))

    frag_plan, cont_plan = plan(frag_src, frag_dst), plan(cont_src, cont_dst)
    t_frag, t_cont = timeit(plan, frag_src, frag_dst), timeit(plan, cont_src, cont_dst)
    d_frag = timeit(plan_and_descriptors, frag_src, frag_dst)
    d_cont = timeit(plan_and_descriptors, cont_src, cont_dst)
    t_naive = timeit(naive, frag_src, frag_dst, repeat=5)

    print(f"request: {TOKENS} tokens, {n} blocks of {BLOCK}, {LAYERS} layers x K/V, "
          f"{frag_plan.nbytes / 2**20:.0f} MiB per rank")
    print(f"{'allocation':<12}{'plan ms':>9}{'+Nx3 ms':>9}{'descriptors':>13}{'runs/region':>13}")
    for name, p, t, d in (("fragmented", frag_plan, t_frag, d_frag),
                          ("contiguous", cont_plan, t_cont, d_cont)):
        print(f"{name:<12}{t * 1e3:>9.3f}{d * 1e3:>9.3f}{p.descriptor_count:>13}"
              f"{p.runs_per_region:>13}")
    print(f"{'naive':<12}{'':>9}{t_naive * 1e3:>9.3f}{n * LAYERS * 2:>13}{n:>13}")
    print(f"speedup vs naive, fragmented: plan {t_naive / t_frag:.0f}x, "
          f"plan + Nx3 arrays {t_naive / d_frag:.0f}x")
    print(json.dumps({
        "fragmented_plan_ms": round(t_frag * 1e3, 4),
        "contiguous_plan_ms": round(t_cont * 1e3, 4),
        "fragmented_descriptors": frag_plan.descriptor_count,
        "contiguous_descriptors": cont_plan.descriptor_count,
        "speedup_vs_naive": round(t_naive / t_frag, 2),
        "fragmented_plan_with_descriptors_ms": round(d_frag * 1e3, 4),
        "speedup_vs_naive_with_descriptors": round(t_naive / d_frag, 2),
    }))


if __name__ == "__main__":
    main()
