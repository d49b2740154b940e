"""KV memory as numpy byte arrays, and copying a plan's bytes between them."""


from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...protocol import (
    TransferPlan,
)
from ...protocol.layout import KVLayout


def region_memory(layout: KVLayout, fill: int | None = None,
                  rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """One zeroed (or random, or constant) byte array per region of ``layout``."""
    out = []
    for _ in range(layout.num_regions):
        if rng is not None:
            out.append(rng.integers(0, 256, layout.region_bytes, dtype=np.uint8))
        else:
            out.append(np.full(layout.region_bytes, fill or 0, dtype=np.uint8))
    return out


def copy_plan(plan: TransferPlan, src: Sequence[np.ndarray], dst: Sequence[np.ndarray]) -> None:
    """Execute a plan between two sets of region buffers."""
    runs = plan.runs.tolist()
    for s_reg, d_reg in zip(plan.src_regions.tolist(), plan.dst_regions.tolist(), strict=True):
        s_buf, d_buf = src[s_reg], dst[d_reg]
        for so, do, n in runs:
            d_buf[do:do + n] = s_buf[so:so + n]


def read_ahead(plan: TransferPlan, src: Sequence[np.ndarray]
               ) -> tuple[TransferPlan, list[np.ndarray]]:
    """The source bytes of ``plan`` read now: one buffer per region pair, and the
    plan rebased onto them (``copy_plan(rebased, buffers, dst)`` lands them later)."""
    runs = plan.runs
    lengths = runs[:, 2]
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(runs.dtype)
    pairs = int(plan.src_regions.shape[0])
    rebased = TransferPlan(runs=np.stack([offsets, runs[:, 1], lengths], axis=1),
                           src_regions=np.arange(pairs, dtype=plan.src_regions.dtype),
                           dst_regions=plan.dst_regions)
    buffers = [np.empty(int(lengths.sum()), np.uint8) for _ in range(pairs)]
    spans = list(zip(runs[:, 0].tolist(), offsets.tolist(), lengths.tolist(), strict=True))
    for s_reg, buf in zip(plan.src_regions.tolist(), buffers, strict=True):
        s_buf = src[s_reg]
        for so, o, n in spans:
            buf[o:o + n] = s_buf[so:so + n]
    return rebased, buffers


def touched_blocks(plan: TransferPlan, stride: int, side: int) -> set[int]:
    """Blocks a plan touches on one side (0: source, 1: destination)."""
    out: set[int] = set()
    for off, n in zip(plan.runs[:, side].tolist(), plan.runs[:, 2].tolist(), strict=True):
        out.update(range(off // stride, (off + n - 1) // stride + 1))
    return out
