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

import operator
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import SupportsIndex, cast

import numpy as np
import numpy.typing as npt

from .errors import ConfigError, PlanError
from .layout import KVLayout
from .mapping import Assignment

IntArray = npt.NDArray[np.int64]


class TransferPlan:
    """Byte runs to copy, relative to region starts, and the region pairs they apply to.

    Descriptor ``(k, r)`` copies ``runs[r, 2]`` bytes from offset ``runs[r, 0]``
    of source region ``src_regions[k]`` to offset ``runs[r, 1]`` of destination
    region ``dst_regions[k]``. Treat it as immutable (a plain slotted class: one
    is built per write, on the hot path).
    """

    __slots__ = ("dst_regions", "runs", "src_regions")

    def __init__(self, *, runs: IntArray, src_regions: IntArray, dst_regions: IntArray) -> None:
        self.runs = runs  # (R, 3): src_offset, dst_offset, length
        self.src_regions = src_regions  # (P,)
        self.dst_regions = dst_regions  # (P,)

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
        return (
            self._expand(0, np.asarray(src_bases, dtype=np.int64)[self.src_regions], src_dev),
            self._expand(1, np.asarray(dst_bases, dtype=np.int64)[self.dst_regions], dst_dev),
        )

    def _expand(self, column: int, bases: IntArray, dev: int) -> IntArray:
        template = np.empty((self.runs.shape[0], 3), dtype=np.int64)
        template[:, 0] = self.runs[:, column]
        template[:, 1] = self.runs[:, 2]
        template[:, 2] = dev
        out = np.empty((bases.shape[0], self.runs.shape[0], 3), dtype=np.int64)
        out[:] = template  # one broadcast copy, then shift each region by its base
        out[:, :, 0] += bases[:, None]
        return out.reshape(-1, 3)

    def __repr__(self) -> str:
        return (
            f"TransferPlan(runs_per_region={self.runs_per_region}, "
            f"regions={self.src_regions.shape[0]}, nbytes={self.nbytes})"
        )


def block_tuple(block_ids: npt.ArrayLike) -> tuple[int, ...]:
    """Block ids as a tuple of ints; ConfigError for anything else (floats, nesting)."""
    if isinstance(block_ids, np.ndarray):
        if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
            raise ConfigError(f"block ids must be a flat integer array, got {block_ids.dtype}"
                              f" of shape {block_ids.shape}")
        return tuple(block_ids.tolist())
    try:
        return tuple(map(operator.index, cast("Iterable[SupportsIndex]", block_ids)))
    except TypeError as exc:
        raise ConfigError(f"block ids must be a flat sequence of ints: {exc}") from None


def _check_ids(side: str, layout: KVLayout, count: int, lo: int, hi: int, tokens: int) -> None:
    if count and (lo < 0 or hi >= layout.num_blocks):
        raise PlanError(f"{side} block id outside [0, {layout.num_blocks}): min {lo}, max {hi}")
    if count * layout.block_size < tokens:
        raise PlanError(
            f"{side} has {count} blocks of {layout.block_size} tokens, {tokens} tokens needed"
        )


def _as_ids(block_ids: npt.ArrayLike, layout: KVLayout, side: str, tokens: int) -> IntArray:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise PlanError(f"{side} block ids must be a flat list")
    if ids.size:
        _check_ids(side, layout, ids.size, int(ids.min()), int(ids.max()), tokens)
    else:
        _check_ids(side, layout, 0, 0, 0, tokens)
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
    if "BLOCK" in (src.order, dst.order):
        num_tokens = _whole_blocks(src, dst, assignment, first_token, num_tokens)
    if first_token == num_tokens:
        runs = np.empty((0, 3), dtype=np.int64)
    elif (
        isinstance(src_block_ids, tuple | list)
        and isinstance(dst_block_ids, tuple | list)
        and -(-num_tokens // src.block_size) <= _SMALL
        and _whole_tokens(src, dst, assignment, first_token, num_tokens)
    ):
        runs = _small_plan(src, dst, src_block_ids, dst_block_ids, first_token, num_tokens)
    else:
        s_ids = _as_ids(src_block_ids, src, "source", num_tokens)
        d_ids = _as_ids(dst_block_ids, dst, "destination", num_tokens)
        if _whole_tokens(src, dst, assignment, first_token, num_tokens):
            runs = _block_runs(src, dst, s_ids, d_ids, first_token, num_tokens)
        else:
            runs = _element_runs(src, dst, assignment, s_ids, d_ids, first_token, num_tokens)
        if runs.shape[0]:  # belt and braces: no byte outside either region
            if int((runs[:, 0] + runs[:, 2]).max()) > src.region_bytes:
                raise PlanError("plan would read outside the source region")
            if int((runs[:, 1] + runs[:, 2]).max()) > dst.region_bytes:
                raise PlanError("plan would write outside the destination region")
    src_regions, dst_regions = _region_pairs(src, dst, layers)
    return TransferPlan(runs=runs, src_regions=src_regions, dst_regions=dst_regions)


def _whole_blocks(
    src: KVLayout, dst: KVLayout, assignment: Assignment, first: int, n: int
) -> int:
    """Opaque blocks move whole: check both sides agree, return ``n`` rounded up to
    the end of its block (the tail of the last block is the request's own)."""
    if src.order != dst.order:
        raise PlanError(f"an opaque (BLOCK) layout moves only to its like, not {dst.order}")
    if src.block_size != dst.block_size or src.block_bytes != dst.block_bytes:
        raise PlanError("opaque (BLOCK) layouts need the same block size and shape")
    if src.num_heads != dst.num_heads or assignment.heads != ((0, 0, src.num_heads),):
        raise PlanError("opaque (BLOCK) layouts cannot move a slice of the heads")
    bs = src.block_size
    if first % bs:
        raise PlanError(f"opaque (BLOCK) layouts start at a block boundary, not token {first}")
    return -(-n // bs) * bs


def _whole_tokens(
    src: KVLayout, dst: KVLayout, assignment: Assignment, first: int, n: int
) -> bool:
    """True when every token's slice is its whole row, laid out alike on both sides,
    so a block's tokens [a, b) are one contiguous range on each side."""
    if src.block_size != dst.block_size or src.order != dst.order:
        return False
    if src.num_heads != dst.num_heads or assignment.heads != ((0, 0, src.num_heads),):
        return False
    bs = src.block_size
    return src.order == "NHD" or (first % bs == 0 and (n % bs == 0))


#: Up to this many blocks, plain Python beats numpy's per-call overhead.
_SMALL = 48


def _small_plan(
    src: KVLayout,
    dst: KVLayout,
    s_ids: Sequence[int],
    d_ids: Sequence[int],
    first: int,
    n: int,
) -> IntArray:
    """The block fast path for short requests in plain Python (same result as
    :func:`_block_runs`, with the same checks)."""
    for side, ids, lo in (("source", s_ids, src), ("destination", d_ids, dst)):
        try:
            low, high = (min(ids), max(ids)) if ids else (0, 0)
            if type(low) is not int or type(high) is not int:
                raise TypeError
        except TypeError:
            raise PlanError(f"{side} block ids must be a flat list of ints") from None
        _check_ids(side, lo, len(ids), low, high, n)
    bs, tb, s_stride, s_region = _geometry(src)
    _, _, d_stride, d_region = _geometry(dst)
    cands = []
    for b in range(first // bs, -(-n // bs)):
        start = first if first > b * bs else b * bs
        inner = (start - b * bs) * tb
        length = ((n if n < b * bs + bs else b * bs + bs) - start) * tb
        cands.append((s_ids[b] * s_stride + inner, d_ids[b] * d_stride + inner, length))
    cands.sort()
    runs: list[list[int]] = []
    src_end = dst_end = 0
    for so, do, ln in cands:
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[2] == so and last[1] + last[2] == do:
            last[2] += ln
        else:
            runs.append([so, do, ln])
        src_end, dst_end = max(src_end, so + ln), max(dst_end, do + ln)
    if src_end > s_region:
        raise PlanError("plan would read outside the source region")
    if dst_end > d_region:
        raise PlanError("plan would write outside the destination region")
    return np.array(runs, dtype=np.int64).reshape(-1, 3)


@lru_cache(maxsize=256)
def _geometry(layout: KVLayout) -> tuple[int, int, int, int]:
    """(block size, token bytes, block stride, region bytes) of a layout."""
    return layout.block_size, layout.token_bytes, layout.stride, layout.region_bytes


def _block_runs(
    src: KVLayout, dst: KVLayout, s_ids: IntArray, d_ids: IntArray, first: int, n: int
) -> IntArray:
    """Fast path: one candidate run per block, then coalesce."""
    bs, tb = src.block_size, src.token_bytes
    blocks = np.arange(first // bs, -(-n // bs), dtype=np.int64)
    start = np.maximum(first, blocks * bs)
    length = (np.minimum(n, (blocks + 1) * bs) - start) * tb
    inner = (start - blocks * bs) * tb
    return coalesce(s_ids[blocks] * src.stride + inner, d_ids[blocks] * dst.stride + inner,
                    length)


@lru_cache(maxsize=1024)
def _region_pairs(src: KVLayout, dst: KVLayout, layers: range) -> tuple[IntArray, IntArray]:
    layer_idx = np.arange(layers.start, layers.stop, dtype=np.int64)
    planes = np.arange(src.planes, dtype=np.int64)
    src_regions = ((layer_idx - src.layer_start)[:, None] * src.planes + planes).ravel()
    dst_regions = ((layer_idx - dst.layer_start)[:, None] * dst.planes + planes).ravel()
    src_regions.flags.writeable = False
    dst_regions.flags.writeable = False
    return src_regions, dst_regions


def _element_runs(
    src: KVLayout,
    dst: KVLayout,
    assignment: Assignment,
    s_ids: IntArray,
    d_ids: IntArray,
    first_token: int,
    num_tokens: int,
) -> IntArray:
    """General path: every (token, head) element, generated in source order."""
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
    return coalesce(so.ravel(), do.ravel(), np.ascontiguousarray(lengths).ravel())

