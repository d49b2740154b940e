"""Packed writes in the simulator: the transports' cost model decides, per write.

:func:`pushkv.protocol.packing.choose` is called with the simulated plan's
descriptor count and bytes, the profile's per-descriptor posting cost (so the
simulator and the transport weigh the same numbers) and the staging the
engine has free. A packed write then costs, on the prefill side's writer
thread, a gather (bytes / ``gather_bytes_per_s``) and the posting of its few
chunk descriptors; its bytes cross in chunk-sized descriptors; the consumer
scatters (bytes / ``scatter_bytes_per_s``) before the notification counts.
Staging is lent per engine for the write's life (gather to scatter).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from ..protocol.packing import PackChoice, PackingConfig, choose
from .sections import NetworkProfile

#: The simulator's default: never pack (what every earlier result assumed).
#: On GPUs gather and scatter run as device kernels; 1 TB/s is assumed for an
#: H200 ``index_select`` of 4 KiB rows (about a fifth of HBM bandwidth: read + write).
SIM_PACKING = PackingConfig(mode="never", gather_bytes_per_s=1e12, scatter_bytes_per_s=1e12,
                            staging_bytes=2 << 30)


class StagingLedger:
    """Staging bytes in use per engine, for the cost model's availability input."""

    def __init__(self, config: PackingConfig, network: NetworkProfile) -> None:
        # One posting cost for both the model and the simulated writer thread.
        self.config = dataclasses.replace(
            config, post_per_descriptor_s=network.post_per_descriptor_s)
        self.used: defaultdict[str, int] = defaultdict(int)
        self.packed_writes = 0

    def decide(self, src: str, dst: str, descriptors: int, nbytes: int) -> PackChoice:
        free = self.config.staging_bytes - max(self.used[src], self.used[dst])
        choice = choose(self.config, descriptors=descriptors, nbytes=nbytes, staging_free=free)
        if choice.packed:
            self.used[src] += nbytes
            self.used[dst] += nbytes
            self.packed_writes += 1
        return choice

    def give_back(self, src: str, dst: str, nbytes: int) -> None:
        self.used[src] -= nbytes
        self.used[dst] -= nbytes

    def gather_s(self, nbytes: int) -> float:
        return nbytes / self.config.gather_bytes_per_s

    def scatter_s(self, nbytes: int) -> float:
        return nbytes / self.config.scatter_bytes_per_s


__all__ = ["SIM_PACKING", "StagingLedger"]
