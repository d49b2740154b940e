"""Rule 10 on a producer rank: whether a write is packed, into which staging."""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..events import PackedWrite
from ..lending import StagingLedger
from ..packing import PackedPlan, PackingConfig, choose, chunk_bounds
from ..planner import TransferPlan
from ..records import Leg, Registration


def pack(pk: PackingConfig | None, staging: StagingLedger, stats: Counter[str], leg: Leg,
         reg: Registration, plan: TransferPlan) -> PackedWrite | None:
    """Pack a whole-request write when its registration lent staging, this rank has
    as much free (in ``staging``), and :func:`~.packing.choose` says so; lend this
    rank's staging to it until the write completes."""
    if pk is None or pk.mode == "never":
        return None
    if reg.staging is None:
        stats["pack_unlent"] += 1
        return None
    nbytes = plan.nbytes
    choice = choose(pk, descriptors=plan.descriptor_count, nbytes=nbytes,
                    staging_free=min(reg.staging[1], staging.largest_free()))
    stats[f"pack_{choice.reason}"] += 1
    if not choice.packed:
        return None
    at = staging.lend(nbytes, leg.peer)
    if at is None:  # pragma: no cover - largest_free said it fits
        return None
    leg.staging_at = at
    stats["writes_packed"] += 1
    packed = PackedPlan(plan, pk.chunk_bytes)
    bounds = chunk_bounds(packed, pk.pipeline_bytes)
    if len(bounds) > 2:
        stats["writes_pipelined"] += 1
    return PackedWrite(packed=packed, src_offset=at, dst_offset=reg.staging[0],
                       bounds=bounds, chunk_bytes=pk.pipeline_bytes if len(bounds) > 2 else 0)


def staged_fields(pw: PackedWrite | None, src: tuple[int, ...]) -> dict[str, Any]:
    """The :class:`~.messages.Notify` fields of a packed write (chunk 0 of its chunks;
    the driver sends ``IssueWrite.chunk_notify(k)`` for the others)."""
    if pw is None:
        return {}
    return {"staged": True, "src_block_ids": src, "chunks": pw.chunks,
            "chunk_bytes": pw.chunk_bytes}


__all__ = ["pack", "staged_fields"]
