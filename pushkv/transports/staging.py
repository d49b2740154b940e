"""Staging memory of packed writes: a pool lent like destination blocks, and
vectorised gather/scatter on host memory (numpy) and on a device (torch).

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


def _pair_rows(packed: PackedPlan) -> tuple[int, int]:
    pairs = int(packed.plan.src_regions.shape[0])
    return pairs, int(packed.plan.runs.shape[0])


def gather_host(packed: PackedPlan, src: Sequence[np.ndarray], staging: np.ndarray) -> None:
    """Copy every source run into its place in ``staging`` (numpy, host memory)."""
    pairs, r = _pair_rows(packed)
    groups = _groups(packed.plan.runs[:, 2])
    out = staging.reshape(-1)
    for k in range(pairs):
        rows = packed.gather[k * r:(k + 1) * r]
        buf = src[int(rows[0, 0])] if r else None
        for n, idx in groups:
            win = sliding_window_view(buf, n)  # type: ignore[arg-type]
            dst_win = sliding_window_view(out, n, writeable=True)
            dst_win[rows[idx, 2]] = win[rows[idx, 1]]


def scatter_host(packed: PackedPlan, staging: np.ndarray, dst: Sequence[np.ndarray]) -> None:
    """Copy every staged run to its destination (numpy, host memory)."""
    pairs, r = _pair_rows(packed)
    groups = _groups(packed.plan.runs[:, 2])
    src = staging.reshape(-1)
    for k in range(pairs):
        rows = packed.scatter[k * r:(k + 1) * r]
        if not r:
            continue
        buf = dst[int(rows[0, 1])]
        for n, idx in groups:
            dst_win = sliding_window_view(buf, n, writeable=True)
            dst_win[rows[idx, 2]] = sliding_window_view(src, n)[rows[idx, 0]]


def copy_staging(src: np.ndarray, dst: np.ndarray, wire: np.ndarray) -> None:
    """The wire of a packed write in memory: one copy per wire descriptor."""
    for off, n in wire.tolist():
        dst[off:off + n] = src[off:off + n]


__all__ = ["StagingExhausted", "StagingPool", "copy_staging", "gather_host", "scatter_host"]
