"""KV memory as NIXL sees it: one address range per protocol region.

The protocol speaks of *regions* -- region ``i`` is local layer ``i // planes``,
plane ``i % planes`` of a :class:`~pushkv.protocol.layout.KVLayout` -- and byte
offsets inside them. :class:`KVMemory` pins those regions to addresses: a base
address and a size per region, a memory kind (``"DRAM"`` for host memory,
``"VRAM"`` for CUDA memory) and a device id. It keeps the tensors or arrays it
was built from alive for as long as it lives.

Ways to build one, matching the caches engines actually allocate:

* :meth:`KVMemory.from_regions` -- one buffer per region, in region order
  (``[layer0 K, layer0 V, layer1 K, ...]``, or one buffer per layer when the
  layout has ``planes=1``, e.g. vLLM's CPU cache where K and V of a block sit
  together and the layout's ``head_dim`` covers both).
* :meth:`KVMemory.from_kv` -- separate K and V buffers per layer.
* :meth:`KVMemory.from_stacked` -- one buffer per layer holding K then V as its
  two halves (vLLM's ``[2, num_blocks, ...]`` GPU cache).
* :meth:`KVMemory.from_addresses` -- raw base addresses and sizes.

Buffers are torch tensors (CPU or CUDA) or numpy arrays; each must be
contiguous. torch is never imported here: a tensor is recognised by duck typing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from pushkv.protocol.errors import ConfigError
from pushkv.protocol.layout import KVLayout

MemKind = Literal["DRAM", "VRAM"]


def _is_tensor(obj: object) -> bool:
    return type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr")


def buffer_span(buf: Any) -> tuple[int, int, MemKind, int]:
    """(address, size in bytes, memory kind, device id) of one contiguous buffer."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ConfigError("a numpy KV buffer must be C-contiguous")
        return int(buf.ctypes.data), int(buf.nbytes), "DRAM", 0
    if _is_tensor(buf):
        if not buf.is_contiguous():
            raise ConfigError("a torch KV buffer must be contiguous")
        size = int(buf.numel()) * int(buf.element_size())
        if buf.device.type == "cuda":
            return int(buf.data_ptr()), size, "VRAM", int(buf.device.index or 0)
        if buf.device.type != "cpu":
            raise ConfigError(f"unsupported tensor device {buf.device}")
        return int(buf.data_ptr()), size, "DRAM", 0
    raise ConfigError(f"a KV buffer must be a torch tensor or numpy array, not {type(buf)}")


@dataclass(frozen=True, eq=False)
class KVMemory:
    """Base address and size of every region of one rank's KV cache."""

    bases: tuple[int, ...]
    sizes: tuple[int, ...]
    kind: MemKind = "DRAM"
    device: int = 0
    #: The buffers the addresses point into; kept alive with this object.
    owners: tuple[Any, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if len(self.bases) != len(self.sizes) or not self.bases:
            raise ConfigError("KV memory needs one (base, size) per region, at least one")
        if any(b <= 0 for b in self.bases) or any(s <= 0 for s in self.sizes):
            raise ConfigError("region bases and sizes must be positive")
        if self.kind not in ("DRAM", "VRAM"):
            raise ConfigError(f"memory kind must be DRAM or VRAM, not {self.kind!r}")

    # ------------------------------------------------------------ builders

    @classmethod
    def from_addresses(cls, bases: Sequence[int], sizes: Sequence[int] | int,
                       kind: MemKind = "DRAM", device: int = 0) -> KVMemory:
        """Raw addresses; the caller keeps the memory alive."""
        if isinstance(sizes, int):
            sizes = [sizes] * len(bases)
        return cls(tuple(map(int, bases)), tuple(map(int, sizes)), kind, device)

    @classmethod
    def from_regions(cls, buffers: Sequence[Any]) -> KVMemory:
        """One contiguous buffer per region, in region order."""
        spans = [buffer_span(b) for b in buffers]
        if not spans:
            raise ConfigError("no KV buffers given")
        kinds = {(k, d) for _, _, k, d in spans}
        if len(kinds) != 1:
            raise ConfigError(f"KV buffers live on different devices: {sorted(kinds)}")
        ((kind, device),) = kinds
        return cls(tuple(a for a, _, _, _ in spans), tuple(s for _, s, _, _ in spans), kind,
                   device, tuple(buffers))

    @classmethod
    def from_kv(cls, keys: Sequence[Any], values: Sequence[Any]) -> KVMemory:
        """Separate K and V buffers per layer (regions K0, V0, K1, V1, ...)."""
        if len(keys) != len(values):
            raise ConfigError(f"{len(keys)} K buffers but {len(values)} V buffers")
        return cls.from_regions([b for kv in zip(keys, values, strict=True) for b in kv])

    @classmethod
    def from_stacked(cls, layers: Sequence[Any]) -> KVMemory:
        """One buffer per layer whose first half is K and second half V."""
        bases, sizes = [], []
        kinds = set()
        for buf in layers:
            addr, size, kind, dev = buffer_span(buf)
            if size % 2:
                raise ConfigError("a stacked K/V buffer must have an even size")
            bases += [addr, addr + size // 2]
            sizes += [size // 2, size // 2]
            kinds.add((kind, dev))
        if len(kinds) != 1:
            raise ConfigError(f"KV buffers live on different devices: {sorted(kinds)}")
        ((kind, device),) = kinds
        return cls(tuple(bases), tuple(sizes), kind, device, tuple(layers))

    # ------------------------------------------------------------- queries

    @property
    def num_regions(self) -> int:
        return len(self.bases)

    def check(self, layout: KVLayout) -> None:
        """ConfigError unless this memory holds every byte ``layout`` addresses."""
        if self.num_regions != layout.num_regions:
            raise ConfigError(
                f"layout has {layout.num_regions} regions ({layout.num_layers} layers x "
                f"{layout.planes} planes), memory has {self.num_regions}"
            )
        short = [i for i, s in enumerate(self.sizes) if s < layout.region_bytes]
        if short:
            raise ConfigError(
                f"region {short[0]} holds {self.sizes[short[0]]} bytes, the layout addresses "
                f"{layout.region_bytes}"
            )

    def registration(self) -> np.ndarray:
        """Nx3 ``(address, length, device)`` rows for NIXL memory registration."""
        rows = np.empty((self.num_regions, 3), dtype=np.uint64)
        rows[:, 0] = self.bases
        rows[:, 1] = self.sizes
        rows[:, 2] = self.device
        return rows

    def base_array(self) -> np.ndarray:
        """Region base addresses as int64 (what the planner's descriptors take)."""
        return np.asarray(self.bases, dtype=np.int64)

    def view(self, region: int) -> np.ndarray:
        """Host memory only: a uint8 numpy view of one region (tests, checks)."""
        if self.kind != "DRAM":
            raise ConfigError("only host memory can be viewed as numpy")
        import ctypes

        buf = (ctypes.c_uint8 * self.sizes[region]).from_address(self.bases[region])
        return np.frombuffer(buf, dtype=np.uint8)


def region_views(memory: KVMemory) -> list[Any]:
    """Every region as the digest (:mod:`pushkv.integrity`) reads it: uint8 numpy
    views of host memory; for CUDA memory, uint8 torch views into the storage of
    the tensors the memory was built from (``owners``), found by address, so any
    layout (K and V apart, or interleaved per block) is viewed as registered."""
    if memory.kind == "DRAM":
        return [memory.view(i) for i in range(memory.num_regions)]
    import torch

    stores = []
    for o in memory.owners:
        st = o.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=o.device)
        flat.set_(st)
        stores.append((int(st.data_ptr()), int(st.nbytes()), flat))
    out = []
    for base, size in zip(memory.bases, memory.sizes, strict=True):
        for start, n, flat in stores:
            if start <= base and base + size <= start + n:
                out.append(flat[base - start:base - start + size])
                break
        else:
            raise ConfigError(f"the region at {base:#x} lies in no tensor this memory was "
                              "built from: CUDA memory given by address alone cannot be "
                              "digested (give the tensors as owners)")
    return out


def bind_device(memory: KVMemory) -> None:
    """Make ``memory``'s CUDA device current on the calling thread (no-op for DRAM).

    A thread that loads a peer's NIXL metadata or posts writes of CUDA memory
    needs a current CUDA context: UCX otherwise finds none and falls back from
    CUDA IPC (NVLink) to slower paths, or fails.
    """
    if memory.kind != "VRAM":
        return
    import torch

    torch.cuda.set_device(memory.device)
