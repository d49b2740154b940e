"""Rule 10 on a producer rank: whether a write is packed, into which staging."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .events import PackedWrite
from .packing import PackedPlan, choose
from .planner import TransferPlan
from .records import Leg, Registration

if TYPE_CHECKING:
    from .producer import Producer


def pack(p: Producer, leg: Leg, reg: Registration, plan: TransferPlan) -> PackedWrite | None:
    """Pack a whole-request write when its registration lent staging, this rank has
    as much free, and :func:`~.packing.choose` says so; lend this rank's staging to
    it until the write completes."""
    pk = p.config.packing
    if pk is None or pk.mode == "never":
        return None
    if reg.staging is None:
        p.stats["pack_unlent"] += 1
        return None
    nbytes = plan.nbytes
    choice = choose(pk, descriptors=plan.descriptor_count, nbytes=nbytes,
                    staging_free=min(reg.staging[1], p._staging.largest_free()))
    p.stats[f"pack_{choice.reason}"] += 1
    if not choice.packed:
        return None
    at = p._staging.lend(nbytes, leg.peer)
    if at is None:  # pragma: no cover - largest_free said it fits
        return None
    leg.staging_at = at
    p.stats["writes_packed"] += 1
    return PackedWrite(packed=PackedPlan(plan, pk.chunk_bytes), src_offset=at,
                       dst_offset=reg.staging[0])


__all__ = ["pack"]
