"""A KV block allocator whose free list looks like a warmed-up server's.

vLLM hands out blocks from the head of a free queue and puts freed blocks at
its tail. On a fresh server the queue is in id order, so a request gets
physically contiguous blocks and the planner merges them into one descriptor
per region. After hours of traffic the queue is a shuffle of runs. The pool
starts in that state: the block ids are cut into runs, a new run starting at
each block with probability ``fragmentation`` (so runs are geometric with mean
``1 / fragmentation``), and the runs are shuffled. ``fragmentation = 0`` is a
fresh server; ``1`` scatters every block.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class OutOfBlocks(RuntimeError):
    """The pool cannot satisfy an allocation."""


def fragmented_order(num_blocks: int, fragmentation: float, rng: np.random.Generator) -> np.ndarray:
    """Block ids in free-queue order: runs of consecutive ids, shuffled."""
    if not 0.0 <= fragmentation <= 1.0:
        raise ValueError(f"fragmentation must be in [0, 1], got {fragmentation}")
    ids = np.arange(num_blocks, dtype=np.int64)
    if fragmentation == 0.0 or num_blocks < 2:
        return ids
    cuts = np.flatnonzero(rng.random(num_blocks - 1) < fragmentation) + 1
    starts = np.concatenate(([0], cuts))
    lengths = np.diff(np.concatenate((starts, [num_blocks])))
    perm = rng.permutation(starts.size)
    new_starts, new_lengths = starts[perm], lengths[perm]
    offsets = np.concatenate(([0], np.cumsum(new_lengths)[:-1]))
    return np.repeat(new_starts - offsets, new_lengths) + ids


FREE_ORDERS = ("tail", "vllm-cached", "vllm-uncached")


class BlockPool:
    """Free-queue allocator of one engine's KV blocks (per rank; ranks are symmetric).

    ``free_order`` says where freed blocks go, so that the descriptor counts of
    later requests follow from the pool's history: ``"tail"`` appends them in
    their order (a static shuffle stays static); vLLM frees a request's blocks
    in reverse order (``single_type_kv_cache_manager.free``) and puts blocks
    that carry a prefix-cache hash at the tail (LRU, ``"vllm-cached"``) and
    blocks without one at the head, to be reused first (``"vllm-uncached"``,
    ``block_pool.free_blocks``: LIFO for GPU locality).
    """

    def __init__(self, num_blocks: int, fragmentation: float, rng: np.random.Generator,
                 free_order: str = "tail") -> None:
        if free_order not in FREE_ORDERS:
            raise ValueError(f"free_order must be one of {FREE_ORDERS}, got {free_order!r}")
        self.num_blocks = num_blocks
        self.free_order = free_order
        self._free: deque[int] = deque(fragmented_order(num_blocks, fragmentation, rng).tolist())
        self._used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._used

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks wanted, {len(self._free)} free")
        pop = self._free.popleft
        out = [pop() for _ in range(n)]
        self._used += n
        return out

    def free(self, block_ids: list[int] | tuple[int, ...]) -> None:
        if self.free_order == "tail":
            self._free.extend(block_ids)
        elif self.free_order == "vllm-cached":
            self._free.extend(reversed(block_ids))
        else:  # reversed, then prepended as a run: the request's last block comes first
            self._free.extendleft(block_ids)
        self._used -= len(block_ids)
        if self._used < 0:
            raise AssertionError("more blocks freed than allocated")


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
