"""Partial readiness: which (token, layer) cells of a request's KV are final.

Progressive push reports the KV as it becomes final: "tokens ``[a, b)`` are
ready for layers ``[l0, l1)``" (a *range*: one chunked-prefill step is all
layers of its tokens, one layer's attention is one layer of them). Readiness
is kept per layer as sorted, disjoint token intervals, so ranges may arrive
in any order, overlap, or repeat: merging is idempotent and commutative.

A leg's next write is one rectangle (a token interval times a run of layers)
of what is ready and not yet written: :func:`next_rect` picks the lowest
layer with something to write, its first interval, and extends the layer run
as far as that interval is ready and unwritten -- so ranges ready together
(adjacent layers, or a whole chunk) coalesce into one write, and one write is
one planned rectangle with the planner's minimal descriptors.

Pure functions on plain tuples; no state.
"""

from __future__ import annotations

from collections.abc import Mapping

Interval = tuple[int, int]
Intervals = tuple[Interval, ...]
#: Per layer (global index), the token intervals ready (or written).
Grid = dict[int, Intervals]
#: One write: tokens [t0, t1) of layers [l0, l1).
Rect = tuple[int, int, int, int]


def add(ivs: Intervals, a: int, b: int) -> Intervals:
    """``ivs`` with ``[a, b)`` merged in (adjacent intervals join)."""
    if a >= b:
        return ivs
    out: list[Interval] = []
    for lo, hi in ivs:
        if hi < a or lo > b:
            out.append((lo, hi))
        else:
            a, b = min(a, lo), max(b, hi)
    out.append((a, b))
    out.sort()
    return tuple(out)


def clip(ivs: Intervals, a: int, b: int) -> Intervals:
    """The part of ``ivs`` inside ``[a, b)``."""
    out = tuple((max(lo, a), min(hi, b)) for lo, hi in ivs if min(hi, b) > max(lo, a))
    return out


def subtract(ivs: Intervals, cut: Intervals) -> Intervals:
    """``ivs`` minus ``cut``."""
    out: list[Interval] = []
    for lo, hi in ivs:
        pieces = [(lo, hi)]
        for c0, c1 in cut:
            nxt: list[Interval] = []
            for p0, p1 in pieces:
                if c1 <= p0 or c0 >= p1:
                    nxt.append((p0, p1))
                    continue
                if p0 < c0:
                    nxt.append((p0, c0))
                if c1 < p1:
                    nxt.append((c1, p1))
            pieces = nxt
        out.extend(pieces)
    return tuple(out)


def covers(ivs: Intervals, a: int, b: int) -> bool:
    """True when ``[a, b)`` lies inside one interval of ``ivs`` (or is empty)."""
    return a >= b or any(lo <= a and b <= hi for lo, hi in ivs)


def mark(grid: Grid, rect: Rect) -> None:
    """Record ``rect`` in ``grid`` (in place)."""
    t0, t1, l0, l1 = rect
    for layer in range(l0, l1):
        grid[layer] = add(grid.get(layer, ()), t0, t1)


def todo(
    ready: Mapping[int, Intervals] | None, written: Mapping[int, Intervals],
    layers: range, first: int, end: int,
) -> Grid:
    """What of tokens ``[first, end)`` x ``layers`` is ready (``None``: all of it)
    and not written yet."""
    out: Grid = {}
    for layer in layers:
        have = ((first, end),) if ready is None else clip(ready.get(layer, ()), first, end)
        rest = subtract(have, written.get(layer, ()))
        if rest:
            out[layer] = rest
    return out


def next_rect(pending: Mapping[int, Intervals]) -> Rect | None:
    """The next write: the lowest layer's first interval, over the longest run of
    following layers that have all of it pending. None when nothing is pending."""
    if not pending:
        return None
    l0 = min(pending)
    t0, t1 = pending[l0][0]
    l1 = l0 + 1
    while covers(pending.get(l1, ()), t0, t1):
        l1 += 1
    return (t0, t1, l0, l1)
