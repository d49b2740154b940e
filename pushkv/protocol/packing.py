"""Packed (staged) writes: the cost model that chooses them, and their byte maps.

A fragmented cache turns one request into about one descriptor per block per
region, and whoever posts pays a fixed cost per descriptor. A *packed* write
instead gathers the source runs into a contiguous staging region, moves it in
a handful of large descriptors (one per ``chunk_bytes``), and scatters it into
the destination blocks on the consumer. It trades posting for two memory
passes, so it pays off only when a plan has many descriptors, posting is
expensive (EFA) and gather/scatter are fast (device memory); not for a
contiguous cache or a cheap fabric (NVLink).

:func:`choose` is the one decision, used by the transports and by the
simulator with the same :class:`PackingConfig`. :class:`PackedPlan` turns a
:class:`~pushkv.protocol.planner.TransferPlan` into the three byte maps of a
packed write: gather (source region -> staging), wire (staging -> staging) and
scatter (staging -> destination region). The staging image is the plan's runs
in order, region pair after region pair, so both sides compute the same
offsets from the same plan and nothing extra travels.

Pure: no I/O, no clock; numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final, Literal, NamedTuple

import numpy as np
import numpy.typing as npt

from .errors import ConfigError
from .planner import TransferPlan

PackMode = Literal["auto", "never", "always"]
IntArray = npt.NDArray[np.int64]


#: The cost of preparing and posting one descriptor on NIXL's LIBFABRIC backend over
#: EFA, paid by the posting thread: NIXL issue 1514 measured 18,880 descriptors in
#: about 46 ms (2.4 us each, with the fixed part); 2.7 us is the value inside that
#: range the simulator's default profile fits to the vLLM blog's figures
#: (docs/sim.md). The one definition: the packing cost model and the simulator's
#: network profile both default to it.
POST_PER_DESCRIPTOR_S: Final = 2.7e-6


@dataclass(frozen=True, slots=True, kw_only=True)
class PackingConfig:
    """When to pack a write, and the costs the choice weighs. The one definition:
    the NIXL settings, the vLLM connector and the simulator take it from here."""

    mode: PackMode = field(
        default="auto",
        metadata={"help": "auto: pack when the cost model says it is cheaper and the plan "
                  "exceeds descriptor_budget; never: always direct descriptors; always: "
                  "pack whenever staging is available"},
    )
    descriptor_budget: int = field(
        default=4096,
        metadata={"help": "plans with at most this many descriptors are always written "
                  "directly (auto mode)"},
    )
    post_per_descriptor_s: float = field(
        default=POST_PER_DESCRIPTOR_S,
        metadata={"help": "cost of preparing and posting one descriptor (EFA: 2.7 us, "
                  "see POST_PER_DESCRIPTOR_S)"},
    )
    gather_bytes_per_s: float = field(
        default=10e9,
        metadata={"help": "producer gather bandwidth into staging (host numpy: ~10 GB/s; "
                  "GPU index_select: hundreds of GB/s)"},
    )
    scatter_bytes_per_s: float = field(
        default=10e9,
        metadata={"help": "consumer scatter bandwidth out of staging"},
    )
    staging_bytes: int = field(
        default=1 << 30,
        metadata={"help": "size of the staging pool on each side, registered once"},
    )
    chunk_bytes: int = field(
        default=16 << 20,
        metadata={"help": "bytes per wire descriptor of a packed write"},
    )
    pipeline_bytes: int = field(
        default=4 << 20,
        metadata={"help": "bytes per chunk of a pipelined packed write: each chunk is "
                  "gathered, written with a notification of its own and scattered as soon "
                  "as it lands, so the three overlap (0: the whole write as one chunk)"},
    )

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "never", "always"):
            raise ConfigError(f"pack mode must be auto, never or always, not {self.mode!r}")
        if self.descriptor_budget < 0 or self.staging_bytes < 0:
            raise ConfigError("descriptor_budget and staging_bytes must be >= 0")
        if self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        if self.pipeline_bytes < 0:
            raise ConfigError(f"pipeline_bytes must be >= 0, got {self.pipeline_bytes}")
        for name in ("gather_bytes_per_s", "scatter_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.post_per_descriptor_s >= 0:
            raise ConfigError("post_per_descriptor_s must be >= 0")


class PackChoice(NamedTuple):
    """The decision for one write and what it weighed (seconds of posting thread time)."""

    packed: bool
    reason: str
    direct_s: float
    packed_s: float
    wire_descriptors: int


def packed_descriptors(nbytes: int, chunk_bytes: int) -> int:
    """Wire descriptors of a packed write of ``nbytes``."""
    return -(-nbytes // chunk_bytes) if nbytes > 0 else 0


def direct_cost_s(config: PackingConfig, descriptors: int) -> float:
    """Posting a plan's descriptors directly."""
    return descriptors * config.post_per_descriptor_s


def packed_cost_s(config: PackingConfig, nbytes: int) -> float:
    """Gather + posting the chunks + scatter, unpipelined (an upper bound)."""
    return (nbytes / config.gather_bytes_per_s + nbytes / config.scatter_bytes_per_s
            + packed_descriptors(nbytes, config.chunk_bytes) * config.post_per_descriptor_s)


def choose(config: PackingConfig, *, descriptors: int, nbytes: int,
           staging_free: int) -> PackChoice:
    """Direct or packed, for a write of ``nbytes`` in ``descriptors`` descriptors when
    ``staging_free`` bytes of staging can be lent on both sides."""
    direct = direct_cost_s(config, descriptors)
    packed = packed_cost_s(config, nbytes)
    wire = packed_descriptors(nbytes, config.chunk_bytes)

    def out(ok: bool, why: str) -> PackChoice:
        return PackChoice(ok, why, direct, packed, wire if ok else descriptors)

    if config.mode == "never" or nbytes <= 0:
        return out(False, "never" if nbytes > 0 else "empty")
    if nbytes > staging_free:
        return out(False, "staging")
    if config.mode == "always":
        return out(True, "always")
    if descriptors <= config.descriptor_budget:
        return out(False, "budget")
    if packed >= direct:
        return out(False, "cost")
    return out(True, "cost")


class PackedPlan:
    """The byte maps of one packed write of ``plan``.

    ``gather[i] = (src_region, src_offset, staging_offset, length)`` and
    ``scatter[i] = (staging_offset, dst_region, dst_offset, length)`` list every run
    of every region pair; ``wire[j] = (staging_offset, length)`` are the wire
    descriptors, staging relative. Staging offsets start at 0 (add the lent
    region's base)."""

    __slots__ = ("gather", "nbytes", "plan", "scatter", "wire")

    def __init__(self, plan: TransferPlan, chunk_bytes: int) -> None:
        if chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        runs = plan.runs
        pairs = int(plan.src_regions.shape[0])
        r = int(runs.shape[0])
        lengths = runs[:, 2]
        per_region = int(lengths.sum())
        within = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) if r else \
            np.empty(0, np.int64)
        staging = (np.arange(pairs, dtype=np.int64)[:, None] * per_region
                   + within[None, :]).ravel()
        gather = np.empty((pairs * r, 4), dtype=np.int64)
        gather[:, 0] = np.repeat(plan.src_regions, r)
        gather[:, 1] = np.tile(runs[:, 0], pairs)
        gather[:, 2] = staging
        gather[:, 3] = np.tile(lengths, pairs)
        scatter = np.empty((pairs * r, 4), dtype=np.int64)
        scatter[:, 0] = staging
        scatter[:, 1] = np.repeat(plan.dst_regions, r)
        scatter[:, 2] = np.tile(runs[:, 1], pairs)
        scatter[:, 3] = gather[:, 3]
        self.plan = plan
        self.nbytes = per_region * pairs
        self.gather = gather
        self.scatter = scatter
        starts = np.arange(0, self.nbytes, chunk_bytes, dtype=np.int64)
        self.wire = np.stack([starts, np.minimum(chunk_bytes, self.nbytes - starts)], axis=1) \
            if self.nbytes else np.empty((0, 2), dtype=np.int64)

    @property
    def wire_descriptors(self) -> int:
        return int(self.wire.shape[0])

    def wire_between(self, start: int, stop: int) -> IntArray:
        """The wire descriptors of staging image bytes ``[start, stop)`` (one chunk of a
        pipelined write), cut at ``start`` and ``stop``."""
        w = self.wire
        lo = np.maximum(w[:, 0], start)
        hi = np.minimum(w[:, 0] + w[:, 1], stop)
        keep = hi > lo
        return np.stack([lo[keep], (hi - lo)[keep]], axis=1).astype(np.int64)

    def __repr__(self) -> str:
        return (f"PackedPlan(runs={self.gather.shape[0]}, nbytes={self.nbytes}, "
                f"wire_descriptors={self.wire_descriptors})")


#: Below this run unit (bytes) a pipelined write is cut at run starts only.
MIN_ROW_UNIT = 64
#: A pipelined write has at most about this many chunks (smaller chunks are widened).
MAX_CHUNKS = 1 << 16


def run_unit(packed: PackedPlan) -> int:
    """The greatest common divisor of every run offset and length (0: no runs)."""
    runs = packed.plan.runs
    return math.gcd(*(int(g) for g in np.gcd.reduce(runs, axis=0))) if runs.size else 0


def chunk_bounds(packed: PackedPlan, chunk_bytes: int,
                 min_unit: int = MIN_ROW_UNIT) -> tuple[int, ...]:
    """Cut points ``0 = b0 < b1 < ... = nbytes`` of the staging image into the chunks of
    a pipelined write of at most about ``chunk_bytes`` (0: one chunk): multiples of the
    plan's run unit when it is at least ``min_unit`` bytes, else run starts (a single
    run longer than a chunk stays whole; chunks are widened to keep at most about
    :data:`MAX_CHUNKS`). Producer and consumer cut the same image at
    the same points from the same plan and ``chunk_bytes`` (rule 10)."""
    if chunk_bytes < 0:
        raise ConfigError(f"chunk_bytes must be >= 0, got {chunk_bytes}")
    n = packed.nbytes
    if n == 0:
        return (0,)
    if chunk_bytes == 0 or chunk_bytes >= n:
        return (0, n)
    chunk_bytes = max(chunk_bytes, -(-n // MAX_CHUNKS))  # bounded work for any input
    unit = run_unit(packed)
    if unit >= min_unit and unit:
        step = max(unit, chunk_bytes // unit * unit)
        return (*range(0, n, step), n)
    starts = packed.gather[:, 2]
    cuts = starts[np.searchsorted(starts, np.arange(0, n, chunk_bytes), side="right") - 1]
    return (*(int(c) for c in np.unique(cuts)), n)


__all__ = ["MAX_CHUNKS", "MIN_ROW_UNIT", "PackChoice", "PackMode", "PackedPlan",
           "PackingConfig", "choose", "chunk_bounds", "direct_cost_s", "packed_cost_s",
           "packed_descriptors", "run_unit"]
