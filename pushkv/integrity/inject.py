"""A fault injector for landed KV: what a layout bug, a wrong registration, a
reused block or a NIC could do to a write's destination bytes.

Kinds (each changes the bytes of one write, after they landed and before the
consumer checks them):

* ``flip``: one bit of one byte of one cell;
* ``neighbour``: the write's bytes of one block land in the next block of the
  range (the range written one block off; one token off when it has one block);
* ``stale``: one block of the range holds bytes of another block of the cache
  (a replay of an old range: what the block held for an earlier request);
* ``zero``: the range's cells of one block are zeroed.

It works on numpy arrays and torch tensors (CPU or CUDA) alike. ``injected``
counts the writes whose bytes it actually changed (a fault that leaves the bytes
as they were -- a stale block equal to the right one -- is not a corruption).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pushkv.protocol.errors import ConfigError
from pushkv.protocol.events import WriteScope
from pushkv.protocol.layout import KVLayout

from .digest import _cells

KINDS: tuple[str, ...] = ("flip", "neighbour", "stale", "zero")


def flat_bytes(region: Any) -> Any:
    """A flat uint8 view of a region (numpy array or torch tensor), same memory."""
    if isinstance(region, np.ndarray):
        return region.reshape(-1).view(np.uint8)
    import torch

    return region.reshape(-1).view(torch.uint8)


@dataclass
class Injector:
    """Corrupt one write in every ``every`` it is shown (the first of each ``every``),
    cycling through ``kinds``; ``limit`` bounds the corruptions (None: no bound)."""

    kinds: tuple[str, ...] = KINDS
    every: int = 1
    seed: int = 0
    limit: int | None = None
    seen: int = 0
    injected: int = 0
    #: (transfer id, incarnation, attempt, producer rank, kind) of each corrupted write
    log: list[tuple[str, int, int, int, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        bad = [k for k in self.kinds if k not in KINDS]
        if not self.kinds or bad:
            raise ConfigError(f"injector kinds must be among {', '.join(KINDS)}, "
                              f"not {self.kinds!r}")
        if self.every < 1:
            raise ConfigError(f"injector every must be >= 1, not {self.every}")
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> Injector:
        """``"kind[,kind...][:every]"``, e.g. ``"flip:10"`` or ``"flip,zero,stale:10"``."""
        kinds, _, every = str(text).partition(":")
        try:
            n = int(every) if every else 1
        except ValueError:
            raise ConfigError(f"injector rate must be an integer: {text!r}") from None
        return cls(tuple(k.strip() for k in kinds.split(",") if k.strip()), n, seed)

    def maybe(self, key: tuple[str, int, int, int], scope: WriteScope,
              regions: Sequence[Any], layout: KVLayout) -> bool:
        """Shown one landed write: corrupt it if it is its turn. True if bytes changed."""
        turn = self.seen % self.every == 0
        self.seen += 1
        if not turn or (self.limit is not None and self.injected >= self.limit):
            return False
        kind = self.kinds[self.injected % len(self.kinds)]
        if not corrupt(kind, scope, regions, layout, self._rng):
            return False
        self.injected += 1
        self.log.append((*key, kind))
        return True


def _block_cells(scope: WriteScope, layout: KVLayout
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(offsets of the scope's cells, their tokens, their logical blocks, cell bytes)."""
    off, tok, _, nbytes = _cells(layout, scope)
    tok = np.ascontiguousarray(tok).reshape(-1)
    return off.reshape(-1), tok, tok // layout.block_size, nbytes


def _copy_cells(mem: Any, src: np.ndarray, dst: np.ndarray, nbytes: int) -> None:
    idx = np.arange(nbytes, dtype=np.int64)[None, :]
    s, d = (src[:, None] + idx).reshape(-1), (dst[:, None] + idx).reshape(-1)
    if isinstance(mem, np.ndarray):
        mem[d] = mem[s].copy()
    else:
        import torch

        ds, ss = torch.as_tensor(d, device=mem.device), torch.as_tensor(s, device=mem.device)
        mem[ds] = mem[ss].clone()


def _snapshot(mem: Any, offs: np.ndarray, nbytes: int) -> bytes:
    idx = (offs[:, None] + np.arange(nbytes, dtype=np.int64)[None, :]).reshape(-1)
    if isinstance(mem, np.ndarray):
        return bytes(mem[idx].tobytes())
    import torch

    return bytes(mem[torch.as_tensor(idx, device=mem.device)].cpu().numpy().tobytes())


def corrupt(kind: str, scope: WriteScope, regions: Sequence[Any], layout: KVLayout,
            rng: random.Random) -> bool:
    """Apply one fault of ``kind`` to the scope's landed bytes; True if any byte changed."""
    if kind not in KINDS:
        raise ConfigError(f"unknown fault {kind!r} (one of {', '.join(KINDS)})")
    offs, toks, blocks, nbytes = _block_cells(scope, layout)
    if offs.size == 0 or not len(scope.layers):
        return False
    layer = rng.choice(list(scope.layers))
    plane = rng.randrange(layout.planes)
    mem = flat_bytes(regions[layout.region_index(layer, plane)])
    logical = sorted(set(blocks.tolist()))
    k = rng.choice(logical)
    here = offs[blocks == k]
    before = _snapshot(mem, offs, nbytes)
    if kind == "flip":
        at = int(rng.choice(offs.tolist())) + rng.randrange(nbytes)
        mem[at] ^= 1 << rng.randrange(8)
    elif kind == "zero":
        idx = (here[:, None] + np.arange(nbytes, dtype=np.int64)[None, :]).reshape(-1)
        if isinstance(mem, np.ndarray):
            mem[idx] = 0
        else:
            import torch

            mem[torch.as_tensor(idx, device=mem.device)] = 0
    elif kind == "neighbour":
        if len(logical) > 1:  # block k's bytes land in the next block of the range
            k2 = logical[(logical.index(k) + 1) % len(logical)]
            there = offs[blocks == k2]
            n = min(here.size, there.size)
            _copy_cells(mem, here[:n], there[:n], nbytes)
        else:  # one block: the range written one token off
            step = layout.token_bytes if layout.order == "NHD" else (
                layout.head_dim * layout.dtype_bytes)
            lower = offs[toks < toks.max()]
            if layout.order == "BLOCK" or lower.size == 0:
                mem[int(here[0])] ^= 0xFF  # nothing to shift within: a wrong byte
            else:
                _copy_cells(mem, lower, lower + step, nbytes)
    else:  # stale: another block of the cache (an older request's) replayed here
        ids = list(scope.block_ids)
        used = set(ids)
        others = [b for b in range(layout.num_blocks) if b not in used]
        if not others:
            return False
        phys = ids[k]
        other = rng.choice(others)
        _copy_cells(mem, here + (other - phys) * layout.stride, here, nbytes)
    return _snapshot(mem, offs, nbytes) != before


__all__ = ["KINDS", "Injector", "corrupt", "flat_bytes"]
