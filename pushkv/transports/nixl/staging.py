"""Packed writes over NIXL (rule 10): one rank's staging memory and its copies.

A rank whose endpoint has a :class:`~pushkv.protocol.PackingConfig` owns one
staging buffer of ``staging_bytes``, in the memory its KV cache lives in (host
memory, or the same CUDA device), registered with NIXL once, next to the KV
regions, and advertised in the handshake card. Which ranges of it a write may
use is the endpoint's business (:mod:`pushkv.protocol.lending`); this module
only copies:

* the producer's writer thread **gathers** a packed write's runs from the KV
  regions into the range its write was lent (``gather_host``; ``gather_torch``
  for CUDA tensors), then posts one NIXL descriptor per ``wire`` chunk from that
  range into the range the consumer's registration lent;
* the consumer's **scatter thread** (:class:`Scatterer`) copies a landed write
  out of staging into the destination blocks when the endpoint says so
  (``Scatter``) and reports back; the I/O thread feeds ``scatter_done``.

Nothing here decides when a range may be reused: the endpoint's fence does.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pushkv.protocol import PackedPlan, PackedWrite, Scatter
from pushkv.protocol.errors import ConfigError

from ..staging import gather_host, gather_torch, scatter_host, scatter_torch
from .memory import KVMemory, _is_tensor, bind_device

log = logging.getLogger(__name__)


def _region_tensors(memory: KVMemory) -> list[Any]:
    """Flat uint8 torch views of every region, cut out of the tensors they live in."""
    import torch

    owners = [o for o in memory.owners if _is_tensor(o)]
    flats = [(int(o.data_ptr()), o.reshape(-1).view(torch.uint8)) for o in owners]
    out = []
    for base, size in zip(memory.bases, memory.sizes, strict=True):
        for ptr, flat in flats:
            if ptr <= base and base + size <= ptr + flat.numel():
                out.append(flat[base - ptr:base - ptr + size])
                break
        else:
            raise ConfigError("packed writes on device memory need the KV cache as tensors")
    return out


class StagingMemory:
    """One rank's staging buffer and the KV regions it gathers from / scatters into."""

    def __init__(self, nbytes: int, kv: KVMemory) -> None:
        if nbytes <= 0:
            raise ConfigError(f"staging memory must be > 0 bytes, got {nbytes}")
        self.nbytes = nbytes
        self.kind = kv.kind
        self.device = kv.device
        self.buffer: Any
        if kv.kind == "DRAM":
            self.buffer = np.zeros(nbytes, np.uint8)
            self.base = int(self.buffer.ctypes.data)
            self._regions: list[Any] = [kv.view(i) for i in range(kv.num_regions)]
        else:
            import torch

            self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{kv.device}")
            self.base = int(self.buffer.data_ptr())
            self._regions = _region_tensors(kv)

    def with_kv(self, kv: KVMemory) -> KVMemory:
        """The KV regions and this buffer, for one NIXL registration."""
        return KVMemory((*kv.bases, self.base), (*kv.sizes, self.nbytes), kv.kind,
                        kv.device, (*kv.owners, self.buffer))

    def _range(self, offset: int, n: int) -> Any:
        if offset < 0 or offset + n > self.nbytes:
            raise ConfigError(f"staging range [{offset}, {offset + n}) outside the "
                              f"{self.nbytes} bytes registered")
        return self.buffer[offset:offset + n]

    def gather(self, packed: PackedPlan, offset: int, start: int = 0,
               stop: int | None = None) -> None:
        """Copy a packed write's source runs into staging at ``offset`` (only image
        bytes ``[start, stop)``, one chunk of a pipelined write, when given)."""
        stop = packed.nbytes if stop is None else stop
        out = self._range(offset + start, stop - start)
        if self.kind == "DRAM":
            gather_host(packed, self._regions, out, start, stop)
        else:
            import torch

            gather_torch(packed, self._regions, out, start=start, stop=stop)
            torch.cuda.synchronize(self.device)  # the bytes are in place before the post

    def scatter(self, packed: PackedPlan, offset: int, start: int = 0,
                stop: int | None = None) -> None:
        """Copy a landed packed write out of staging at ``offset`` into its blocks (only
        image bytes ``[start, stop)``, one chunk of a pipelined write, when given)."""
        stop = packed.nbytes if stop is None else stop
        src = self._range(offset + start, stop - start)
        if self.kind == "DRAM":
            scatter_host(packed, src, self._regions, start, stop)
        else:
            import torch

            scatter_torch(packed, src, self._regions, start=start, stop=stop)
            torch.cuda.synchronize(self.device)

    def descriptors(self, pw: PackedWrite, remote_base: int, remote_device: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 ``(addr, len, dev)`` rows of the wire chunks, local and remote."""
        return self.chunk_descriptors(pw, pw.packed.wire, remote_base, remote_device)

    def chunk_descriptors(self, pw: PackedWrite, wire: np.ndarray, remote_base: int,
                          remote_device: int) -> tuple[np.ndarray, np.ndarray]:
        """The same for some of the wire rows (``(staging offset, bytes)``, image
        relative): one chunk of a pipelined write."""
        n = int(wire.shape[0])
        local = np.empty((n, 3), dtype=np.uint64)
        remote = np.empty((n, 3), dtype=np.uint64)
        local[:, 0] = self.base + pw.src_offset + wire[:, 0]
        remote[:, 0] = remote_base + pw.dst_offset + wire[:, 0]
        local[:, 1] = remote[:, 1] = wire[:, 1]
        local[:, 2] = self.device
        remote[:, 2] = remote_device
        return local, remote


@dataclass(frozen=True, slots=True)
class ScatterResult:
    scatter: Scatter
    ok: bool
    error: str = ""


_STOP = object()


class Scatterer:
    """The consumer's scatter thread: copies landed packed writes into their blocks
    off the I/O thread, one at a time, and reports each through ``on_done``."""

    def __init__(self, staging: StagingMemory, kv: KVMemory,
                 on_done: Callable[[ScatterResult], None], name: str) -> None:
        self._staging = staging
        self._kv = kv
        self._on_done = on_done
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, scatter: Scatter) -> None:
        self._queue.put(scatter)

    def stop(self, timeout_s: float) -> None:
        """Finish the scatters queued, then end."""
        self._queue.put(_STOP)
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            bind_device(self._kv)
        except Exception:
            log.exception("cannot make the CUDA device current on the scatter thread")
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                self._staging.scatter(item.packed, item.offset, *item.span)
                result = ScatterResult(item, True)
            except Exception as exc:
                log.warning("scatter of %s#%d failed: %r", item.transfer_id, item.attempt, exc)
                result = ScatterResult(item, False, repr(exc))
            try:
                self._on_done(result)
            except Exception:  # pragma: no cover - the callback only queues
                log.exception("scatter completion callback failed")


__all__ = ["ScatterResult", "Scatterer", "StagingMemory"]
