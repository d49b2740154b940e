"""Staging memory of packed writes: a pool lent like destination blocks, and
vectorised gather/scatter on host memory (numpy) and on any torch device.

A :class:`StagingPool` is one buffer, registered once with the transport. A
write borrows a contiguous range with :meth:`StagingPool.lend` and gives it
back with :meth:`StagingPool.give_back` only once nothing can still land in it
(its write completed or was fenced); ``lent_bytes`` is 0 when nothing leaked.

Gather and scatter copy the runs of a :class:`~pushkv.protocol.PackedPlan`
grouped by run length: one fancy-indexed copy per region and distinct length
(a fragmented plan has one or a few lengths), never a Python loop per run.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..protocol.errors import ConfigError
from ..protocol.packing import PackedPlan


class StagingExhausted(Exception):
    """No contiguous free range of the requested size."""


class StagingPool:
    """First-fit allocator over one buffer; thread safe."""

    def __init__(self, nbytes: int, buffer: Any | None = None) -> None:
        if nbytes < 0:
            raise ConfigError(f"staging pool size must be >= 0, got {nbytes}")
        self.buffer = np.zeros(nbytes, np.uint8) if buffer is None else buffer
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (start, len)
        self._lent: dict[int, int] = {}
        self._lock = threading.Lock()

    @property
    def lent_bytes(self) -> int:
        with self._lock:
            return sum(self._lent.values())

    def largest_free(self) -> int:
        with self._lock:
            return max((n for _, n in self._free), default=0)

    def lend(self, nbytes: int) -> int:
        """Offset of a fresh range of ``nbytes``; StagingExhausted if none."""
        if nbytes <= 0:
            raise ConfigError(f"staging lend size must be > 0, got {nbytes}")
        with self._lock:
            for i, (start, n) in enumerate(self._free):
                if n >= nbytes:
                    if n == nbytes:
                        del self._free[i]
                    else:
                        self._free[i] = (start + nbytes, n - nbytes)
                    self._lent[start] = nbytes
                    return start
        raise StagingExhausted(f"no free staging range of {nbytes} bytes")

    def give_back(self, offset: int) -> None:
        """Return a lent range (only once no write can land in it)."""
        with self._lock:
            n = self._lent.pop(offset)
            free = sorted([*self._free, (offset, n)])
            merged: list[tuple[int, int]] = []
            for s, ln in free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                else:
                    merged.append((s, ln))
            self._free = merged

    def view(self, offset: int, nbytes: int) -> Any:
        return self.buffer[offset:offset + nbytes]


def _groups(lengths: np.ndarray) -> list[tuple[int, np.ndarray]]:
    return [(int(n), np.flatnonzero(lengths == n)) for n in np.unique(lengths)]


def _rows(buf: np.ndarray, n: int, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``buf`` as rows of ``n`` bytes and the row index of each offset: a plain
    reshape when every offset is row aligned (the common case: whole blocks), else
    a sliding window (any offset)."""
    if buf.size % n == 0 and not bool(np.any(offsets % n)):
        return buf.reshape(-1, n), offsets // n
    return sliding_window_view(buf, n, writeable=buf.flags.writeable), offsets


def _copy_runs(src: np.ndarray, s_off: np.ndarray, dst: np.ndarray, d_off: np.ndarray,
               n: int) -> None:
    s_rows, s_idx = _rows(src, n, s_off)
    d_rows, d_idx = _rows(dst, n, d_off)
    if (d_idx.size and s_rows.strides == d_rows.strides == (n, 1)
            and bool(np.all(np.diff(d_idx) == 1))):
        # consecutive destination rows: gather straight into them (np.take copies a
        # strided source whole, so only plain row views take this path)
        lo = int(d_idx[0])
        np.take(s_rows, s_idx, axis=0, out=d_rows[lo:lo + d_idx.size])
    elif (s_idx.size and s_rows.strides == (n, 1) and bool(np.all(np.diff(s_idx) == 1))):
        lo = int(s_idx[0])  # consecutive source rows (a scatter): no gathered temporary
        d_rows[d_idx] = s_rows[lo:lo + s_idx.size]
    else:
        d_rows[d_idx] = s_rows[s_idx]


def _pair_rows(packed: PackedPlan) -> tuple[int, int]:
    pairs = int(packed.plan.src_regions.shape[0])
    return pairs, int(packed.plan.runs.shape[0])


def gather_host(packed: PackedPlan, src: Sequence[np.ndarray], staging: np.ndarray) -> None:
    """Copy every source run into its place in ``staging`` (numpy, host memory)."""
    pairs, r = _pair_rows(packed)
    groups = _groups(packed.plan.runs[:, 2])
    out = staging.reshape(-1)
    for k in range(pairs if r else 0):
        rows = packed.gather[k * r:(k + 1) * r]
        buf = src[int(rows[0, 0])]
        for n, idx in groups:
            _copy_runs(buf, rows[idx, 1], out, rows[idx, 2], n)


def scatter_host(packed: PackedPlan, staging: np.ndarray, dst: Sequence[np.ndarray]) -> None:
    """Copy every staged run to its destination (numpy, host memory)."""
    pairs, r = _pair_rows(packed)
    groups = _groups(packed.plan.runs[:, 2])
    src = staging.reshape(-1)
    for k in range(pairs if r else 0):
        rows = packed.scatter[k * r:(k + 1) * r]
        buf = dst[int(rows[0, 1])]
        for n, idx in groups:
            _copy_runs(src, rows[idx, 0], buf, rows[idx, 2], n)


def _torch_copy_runs(src: Any, s_off: np.ndarray, dst: Any, d_off: np.ndarray, n: int) -> None:
    import torch

    if (src.numel() % n == 0 and dst.numel() % n == 0 and not bool(np.any(s_off % n))
            and not bool(np.any(d_off % n))):
        s_idx = torch.from_numpy(s_off // n).to(src.device, non_blocking=True)
        d_idx = torch.from_numpy(d_off // n).to(dst.device, non_blocking=True)
        dst.view(-1, n).index_copy_(0, d_idx, src.view(-1, n).index_select(0, s_idx))
        return
    for so, do in zip(s_off.tolist(), d_off.tolist(), strict=True):  # unaligned: rare
        dst[do:do + n].copy_(src[so:so + n])


def gather_torch(packed: PackedPlan, src: Sequence[Any], staging: Any,
                 stream: Any | None = None) -> None:
    """:func:`gather_host` for flat uint8 torch tensors on any device: one
    ``index_select``/``index_copy_`` per region and run length. On CUDA, pass a side
    stream and synchronise on it (or an event) before the staging is written."""
    _torch_apply(packed, packed.gather, src, staging, stream, gather=True)


def scatter_torch(packed: PackedPlan, staging: Any, dst: Sequence[Any],
                  stream: Any | None = None) -> None:
    """:func:`scatter_host` for flat uint8 torch tensors on any device."""
    _torch_apply(packed, packed.scatter, dst, staging, stream, gather=False)


def _torch_apply(packed: PackedPlan, table: np.ndarray, regions: Sequence[Any], staging: Any,
                 stream: Any | None, *, gather: bool) -> None:
    import contextlib

    import torch

    pairs, r = _pair_rows(packed)
    groups = _groups(packed.plan.runs[:, 2])
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    flat = staging.reshape(-1)
    with ctx:
        for k in range(pairs if r else 0):
            rows = table[k * r:(k + 1) * r]
            for n, idx in groups:
                if gather:
                    _torch_copy_runs(regions[int(rows[0, 0])], rows[idx, 1], flat,
                                     rows[idx, 2], n)
                else:
                    _torch_copy_runs(flat, rows[idx, 0], regions[int(rows[0, 1])],
                                     rows[idx, 2], n)


def copy_staging(src: np.ndarray, dst: np.ndarray, wire: np.ndarray) -> None:
    """The wire of a packed write in memory: one copy per wire descriptor."""
    for off, n in wire.tolist():
        dst[off:off + n] = src[off:off + n]


__all__ = ["StagingExhausted", "StagingPool", "copy_staging", "gather_host", "gather_torch",
           "scatter_host", "scatter_torch"]
