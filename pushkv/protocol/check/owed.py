"""Which bytes a write touches, and which bytes each writer owes each consumer rank.

The checker's memory is kept per byte of a consumer block (see
:mod:`.world`): a byte is named by its block and by ``region * stride +
offset`` inside the block. :func:`written` reads the bytes a real
:class:`~.planner.TransferPlan` copies; :class:`Owed` computes, once per
scope and with the real planner, the bytes a whole request owes from each
producer rank to each consumer rank, and the bytes of each range the producer
engine may report final (rule 9).
"""

from __future__ import annotations

from dataclasses import replace

from ..layout import RankInfo
from ..mapping import Assignment, assignment, expected_writers
from ..planner import TransferPlan, plan_transfer
from .scope import Scope

#: (block, byte inside the block's regions: region * stride + offset)
Cell = tuple[int, int]


def touched(plan: TransferPlan, stride: int, side: int) -> tuple[int, ...]:
    """Blocks a plan touches on one side (0: source, 1: destination)."""
    out: set[int] = set()
    for off, n in zip(plan.runs[:, side].tolist(), plan.runs[:, 2].tolist(), strict=True):
        out.update(range(off // stride, (off + n - 1) // stride + 1))
    return tuple(sorted(out))


def written(plan: TransferPlan, stride: int) -> tuple[Cell, ...]:
    """Every destination byte a plan copies, as (block, byte in block)."""
    out: set[Cell] = set()
    for region in plan.dst_regions.tolist():
        for off, n in zip(plan.runs[:, 1].tolist(), plan.runs[:, 2].tolist(), strict=True):
            for x in range(off, off + n):
                out.add((x // stride, region * stride + x % stride))
    return tuple(sorted(out))


class Owed:
    """What each producer rank writes into block 0 of each consumer rank.

    ``whole[d][p]``: the bytes of a whole request; ``pieces[d][p][j]``: the
    bytes of range ``j`` of the scope (empty when the rank holds none of it).
    """

    def __init__(self, scope: Scope, pinfo: list[RankInfo], dinfo: list[RankInfo]) -> None:
        n = scope.tokens
        self.whole: list[dict[int, frozenset[int]]] = []
        self.pieces: list[dict[int, tuple[frozenset[int], ...]]] = []
        for d, di in enumerate(dinfo):
            whole: dict[int, frozenset[int]] = {}
            pieces: dict[int, tuple[frozenset[int], ...]] = {}
            for p in sorted(expected_writers(pinfo[0].engine, di.engine, d)):
                a = assignment(pinfo[p].engine, di.engine, p, d)
                whole[p] = _owed(pinfo[p], di, a, 0, n, a.layers)
                got = []
                for j in range(scope.pieces):
                    (t0, t1), ls = scope.piece(j)
                    lr = a.layers if ls is None else range(max(ls[0], a.layers.start),
                                                           min(ls[1], a.layers.stop))
                    got.append(_owed(pinfo[p], di, a, t0, t1, lr))
                pieces[p] = tuple(got)
            self.whole.append(whole)
            self.pieces.append(pieces)


def _owed(src: RankInfo, dst: RankInfo, a: Assignment, first: int, end: int,
          layers: range) -> frozenset[int]:
    """Bytes of block 0 that tokens ``[first, end)`` of ``layers`` of ``a`` fill."""
    if not layers:
        return frozenset()
    plan = plan_transfer(src.layout, dst.layout, replace(a, layers=layers), (0,), (0,), end,
                         first)
    return frozenset(b for _, b in written(plan, dst.layout.stride))
