"""Who writes what into whom: the TP / PP / head mapping.

Every destination slice -- one (layer, KV head) of one consumer rank -- gets
**exactly one** producer rank as its writer:

* the producer stage whose layers contain the layer (pipeline parallelism
  multiplies the writers of a consumer rank by the stages it overlaps);
* among the producer TP ranks holding the head, rank ``holders[j % len(holders)]``
  for consumer TP rank ``j``. When heads are split (heads >= TP) there is one
  holder; when heads are replicated (heads < TP, and MLA's single latent) the
  choice spreads consumer ranks over the replicas.

For producer TP ``p`` >= consumer TP ``d`` with heads split on both sides this
is the familiar rule: producer rank ``r`` writes to consumer rank ``r // (p/d)``
and each consumer rank expects ``p/d`` notifications. For ``p < d`` each
producer rank writes to ``d/p`` consumer ranks, each expecting one.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .errors import ConfigError
from .layout import EngineSpec

#: (source local head, destination local head, number of heads)
HeadRun = tuple[int, int, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """The slice one producer rank writes into one consumer rank."""

    src_rank: int
    dst_rank: int
    layers: range
    heads: tuple[HeadRun, ...]


def check_compatible(src: EngineSpec, dst: EngineSpec) -> None:
    """Raise :class:`ConfigError` unless the two engines serve the same model shape."""
    src.validate()
    dst.validate()
    for name in ("num_layers", "num_kv_heads", "mla"):
        a, b = getattr(src, name), getattr(dst, name)
        if a != b:
            raise ConfigError(f"producer and consumer disagree on {name}: {a} != {b}")


def _writer(src: EngineSpec, head: int, dst_tp_rank: int) -> int:
    holders = src.holders_of(head)
    return holders[dst_tp_rank % len(holders)]


def _head_runs(pairs: list[tuple[int, int]]) -> tuple[HeadRun, ...]:
    """Group (src_local, dst_local) head pairs into runs consecutive on both sides."""
    runs: list[HeadRun] = []
    for s, d in pairs:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            a, b, n = runs[-1]
            runs[-1] = (a, b, n + 1)
        else:
            runs.append((s, d, 1))
    return tuple(runs)


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


@lru_cache(maxsize=4096)
def writers_of(src: EngineSpec, dst: EngineSpec, dst_rank: int) -> tuple[Assignment, ...]:
    """Every producer rank that writes into consumer ``dst_rank``, with its slice."""
    check_compatible(src, dst)
    j, dst_stage = dst.split(dst_rank)
    dst_heads = dst.heads_of(j)
    dst_layers = dst.layers_of(dst_stage)
    by_writer: dict[int, list[tuple[int, int]]] = {}
    for h in dst_heads:
        w = _writer(src, h, j)
        by_writer.setdefault(w, []).append((h - src.heads_of(w).start, h - dst_heads.start))
    out: list[Assignment] = []
    for stage in range(src.pp_size):
        layers = _overlap(src.layers_of(stage), dst_layers)
        if not layers:
            continue
        for w in sorted(by_writer):
            out.append(
                Assignment(
                    src_rank=src.rank_of(w, stage),
                    dst_rank=dst_rank,
                    layers=layers,
                    heads=_head_runs(by_writer[w]),
                )
            )
    return tuple(out)


@lru_cache(maxsize=4096)
def targets_of(src: EngineSpec, dst: EngineSpec, src_rank: int) -> tuple[Assignment, ...]:
    """Every consumer rank producer ``src_rank`` writes into, with its slice."""
    check_compatible(src, dst)
    src.split(src_rank)  # range check
    return tuple(
        a
        for d in range(dst.world_size)
        for a in writers_of(src, dst, d)
        if a.src_rank == src_rank
    )


def expected_writers(src: EngineSpec, dst: EngineSpec, dst_rank: int) -> frozenset[int]:
    """Global producer ranks whose notification consumer ``dst_rank`` must collect."""
    return frozenset(a.src_rank for a in writers_of(src, dst, dst_rank))


def assignment(src: EngineSpec, dst: EngineSpec, src_rank: int, dst_rank: int) -> Assignment:
    """The slice ``src_rank`` writes into ``dst_rank``; ConfigError if it writes none."""
    for a in writers_of(src, dst, dst_rank):
        if a.src_rank == src_rank:
            return a
    raise ConfigError(f"producer rank {src_rank} does not write into consumer rank {dst_rank}")
