"""Transfer planning: block ids in, coalesced byte regions out.

A token ``t`` of a request lives in logical block ``t // block_size`` of each
side, i.e. physical block ``block_ids[t // block_size]``, at offset
``t % block_size``. Inside a block the layout is ``NHD`` (token-major: token,
then head, then head_dim) or ``HND`` (head-major). So every (token, head) --
an *element* of ``head_dim * dtype_bytes`` bytes -- has a byte offset on the
producer and on the consumer, in every region (layer, plane). The offsets are
the same in every region, so one plan is computed once and applied to all of
them.

**Coalescing.** A descriptor may cover a run of elements only if the run is
contiguous on *both* sides. Sorting the elements by source offset and cutting
wherever either side is not contiguous gives the minimum number of descriptors
for the two layouts: every descriptor is an interval of that order, and each
cut is forced. To stay fast we first merge in generation order (which already
collapses whole blocks in the common case), then sort only the resulting runs
and merge again -- the same result at a fraction of the cost.

Everything is vectorised with numpy: no Python loop per token or per block.
Blocks that are physically adjacent on both sides merge across block
boundaries, so a contiguous allocation becomes one descriptor per region.
Block sizes may differ in either direction, and the two sides may use
different in-block orders; a head slice that is not contiguous (a few heads of
an ``NHD`` block, mixed orders) costs more descriptors, and
:attr:`TransferPlan.runs_per_region` says how many.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .errors import PlanError
from .layout import KVLayout
from .mapping import Assignment

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class TransferPlan:
    """Byte runs to copy, relative to region starts, and the region pairs they apply to.

    Descriptor ``(k, r)`` copies ``runs[r, 2]`` bytes from offset ``runs[r, 0]``
    of source region ``src_regions[k]`` to offset ``runs[r, 1]`` of destination
    region ``dst_regions[k]``.
    """

    runs: IntArray  # (R, 3): src_offset, dst_offset, length
    src_regions: IntArray  # (P,)
    dst_regions: IntArray  # (P,)

    @property
    def runs_per_region(self) -> int:
        return int(self.runs.shape[0])

    @property
    def descriptor_count(self) -> int:
        return int(self.runs.shape[0] * self.src_regions.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.runs[:, 2].sum()) * int(self.src_regions.shape[0])

    def descriptors(
        self,
        src_bases: npt.ArrayLike,
        dst_bases: npt.ArrayLike,
        src_dev: int = 0,
        dst_dev: int = 0,
    ) -> tuple[IntArray, IntArray]:
        """NIXL-style ``(addr, len, dev)`` Nx3 arrays for both sides, region-major.

        ``src_bases[i]`` is the address (or any base offset) of source region ``i``.
        """
        sb = np.asarray(src_bases, dtype=np.int64)[self.src_regions]
        db = np.asarray(dst_bases, dtype=np.int64)[self.dst_regions]
        n = self.descriptor_count
        src = np.empty((n, 3), dtype=np.int64)
        dst = np.empty((n, 3), dtype=np.int64)
        src[:, 0] = (sb[:, None] + self.runs[None, :, 0]).ravel()
        dst[:, 0] = (db[:, None] + self.runs[None, :, 1]).ravel()
        lengths = np.tile(self.runs[:, 2], self.src_regions.shape[0])
        src[:, 1] = lengths
        dst[:, 1] = lengths
        src[:, 2] = src_dev
        dst[:, 2] = dst_dev
        return src, dst

    def __repr__(self) -> str:
        return (
            f"TransferPlan(runs_per_region={self.runs_per_region}, "
            f"regions={self.src_regions.shape[0]}, nbytes={self.nbytes})"
        )


def _as_ids(block_ids: npt.ArrayLike, layout: KVLayout, side: str) -> IntArray:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise PlanError(f"{side} block ids must be a flat list")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= layout.num_blocks):
        raise PlanError(
            f"{side} block id outside [0, {layout.num_blocks}): "
            f"min {int(ids.min())}, max {int(ids.max())}"
        )
    return ids


def _element_offsets(
    layout: KVLayout, ids: IntArray, tokens: IntArray, heads: IntArray
) -> IntArray:
    """Offsets of elements (token, head) as a (T, K) array."""
    bs, es = layout.block_size, layout.head_dim * layout.dtype_bytes
    block = ids[tokens // bs] * layout.stride
    within = tokens % bs
    if layout.order == "NHD":
        inner = within[:, None] * (layout.num_heads * es) + heads[None, :] * es
    else:
        inner = heads[None, :] * (bs * es) + within[:, None] * es
    out: IntArray = block[:, None] + inner
    return out


def _merge(src: IntArray, dst: IntArray, length: IntArray) -> IntArray:
    """Merge consecutive entries contiguous on both sides; returns (R, 3)."""
    if src.size == 0:
        return np.empty((0, 3), dtype=np.int64)
    end_s = src[:-1] + length[:-1]
    end_d = dst[:-1] + length[:-1]
    cut = (end_s != src[1:]) | (end_d != dst[1:])
    starts = np.flatnonzero(np.concatenate(([True], cut)))
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, 0] = src[starts]
    out[:, 1] = dst[starts]
    out[:, 2] = np.add.reduceat(length, starts)
    return out


def coalesce(src: IntArray, dst: IntArray, length: IntArray) -> IntArray:
    """Minimum set of runs covering the given element copies (any order)."""
    runs = _merge(src, dst, length)
    if runs.shape[0] > 1 and not bool(np.all(runs[1:, 0] > runs[:-1, 0])):
        runs = runs[np.argsort(runs[:, 0], kind="stable")]
        runs = _merge(runs[:, 0], runs[:, 1], runs[:, 2])
    return runs


def plan_transfer(
    src: KVLayout,
    dst: KVLayout,
    assignment: Assignment,
    src_block_ids: npt.ArrayLike,
    dst_block_ids: npt.ArrayLike,
    num_tokens: int,
    first_token: int = 0,
) -> TransferPlan:
    """Plan copying tokens ``[first_token, num_tokens)`` of the assigned slice.

    Raises :class:`PlanError` before anything moves if the layouts cannot be
    matched, a block id lies outside its side's cache, or either side lacks
    blocks for the tokens.
    """
    if src.head_dim != dst.head_dim or src.dtype_bytes != dst.dtype_bytes:
        raise PlanError(
            f"element shape differs: head_dim {src.head_dim} vs {dst.head_dim}, "
            f"dtype bytes {src.dtype_bytes} vs {dst.dtype_bytes}"
        )
    if src.planes != dst.planes:
        raise PlanError(f"planes differ: {src.planes} vs {dst.planes}")
    if not 0 <= first_token <= num_tokens:
        raise PlanError(f"token range [{first_token}, {num_tokens}) is empty or reversed")
    layers = assignment.layers
    for side, lo in (("source", src), ("destination", dst)):
        if layers.start < lo.layer_start or layers.stop > lo.layer_end:
            raise PlanError(f"{side} rank does not hold layers [{layers.start}, {layers.stop})")
    for hs, hd, n in assignment.heads:
        if hs < 0 or hd < 0 or n < 1 or hs + n > src.num_heads or hd + n > dst.num_heads:
            raise PlanError(f"head run {(hs, hd, n)} outside the ranks' heads")
    s_ids = _as_ids(src_block_ids, src, "source")
    d_ids = _as_ids(dst_block_ids, dst, "destination")
    for side, ids, lo in (("source", s_ids, src), ("destination", d_ids, dst)):
        if ids.size * lo.block_size < num_tokens:
            raise PlanError(
                f"{side} has {ids.size} blocks of {lo.block_size} tokens, "
                f"{num_tokens} tokens needed"
            )

    es = src.head_dim * src.dtype_bytes
    tokens = np.arange(first_token, num_tokens, dtype=np.int64)
    if src.order == "NHD" and dst.order == "NHD":
        # A head run is contiguous within a token on both sides: one element.
        hs = np.array([h for h, _, _ in assignment.heads], dtype=np.int64)
        hd = np.array([h for _, h, _ in assignment.heads], dtype=np.int64)
        ln = np.array([n * es for _, _, n in assignment.heads], dtype=np.int64)
    else:
        hs = np.array([h + i for h, _, n in assignment.heads for i in range(n)], np.int64)
        hd = np.array([h + i for _, h, n in assignment.heads for i in range(n)], np.int64)
        ln = np.full(hs.size, es, dtype=np.int64)
    so = _element_offsets(src, s_ids, tokens, hs)
    do = _element_offsets(dst, d_ids, tokens, hd)
    lengths = np.broadcast_to(ln[None, :], so.shape)
    if src.order == "HND":  # generate in source memory order: head-major within a block
        so, do, lengths = so.T, do.T, lengths.T
    runs = coalesce(so.ravel(), do.ravel(), np.ascontiguousarray(lengths).ravel())

    if runs.size:
        if int((runs[:, 0] + runs[:, 2]).max()) > src.region_bytes:
            raise PlanError("plan would read outside the source region")
        if int((runs[:, 1] + runs[:, 2]).max()) > dst.region_bytes:
            raise PlanError("plan would write outside the destination region")
    layer_idx = np.arange(layers.start, layers.stop, dtype=np.int64)
    planes = np.arange(src.planes, dtype=np.int64)
    src_regions = ((layer_idx - src.layer_start)[:, None] * src.planes + planes).ravel()
    dst_regions = ((layer_idx - dst.layer_start)[:, None] * dst.planes + planes).ravel()
    return TransferPlan(runs=runs, src_regions=src_regions, dst_regions=dst_regions)
