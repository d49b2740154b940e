"""The checker's staging memory (rule 10): packed writes, scatters, releases.

:class:`Staging` is the part of :class:`~.model.Model` that moves packed
writes: the producer's :class:`~.events.PackedWrite` lands in the consumer's
staging share (never in one released, or lent to another attempt), the
consumer's :class:`~.events.Scatter` copies what landed there into its blocks
(never into blocks released, never from staging released), and a
:class:`~.events.ReleaseStaging` never frees a share a scatter still reads.
The bytes a scatter writes are whatever last landed in the share: a staged
write of another attempt or a failed one shows up at READY as wrong bytes.

A pipelined write (``PackedWrite.bounds`` of several chunks) lands chunk by
chunk, in order, each chunk with its own notification frame (delivered in any
order); a failure stops it at any chunk. The content is kept per chunk (by its
staging position) and each chunk's scatter writes only the cells of its runs.
"""

from __future__ import annotations

import zlib
from typing import Any

from ..events import IssueWrite, Peer, ReleaseStaging, Scatter, SendMessage
from ..messages import Register
from .invariants import Violation
from .owed import touched, written
from .part import ModelPart
from .world import (
    FAILED,
    POSTED,
    SCATTER,
    SWRITE,
    Item,
    World,
    done_item,
    frame_item,
    scatter_item,
    swrite_item,
)


def gather_map(scatter: Any) -> int:
    """A short name for a packed write's byte map (both sides must plan the same)."""
    return zlib.crc32(scatter.tobytes())


class Staging(ModelPart):
    """Packed writes and scatters; :class:`~.model.Model` provides the rest."""

    # -------------------------------------------------------------- lending

    def _lent_by_register(self, w: World, d: int, m: SendMessage) -> None:
        """A Register naming a staging share: the share is this attempt's from now on."""
        msg = m.message
        if not isinstance(msg, Register) or not msg.staging_nbytes:
            return
        k = self._k_of(msg)
        key = (d, msg.staging_offset)
        owner = w.s_owner.get(key)
        if owner is None:
            w.s_owner[key] = (k, msg.attempt)
            hi = msg.staging_offset + msg.staging_nbytes
            for pos in [p for p in w.s_content if p[0] == d and key[1] <= p[1] < hi]:
                del w.s_content[pos]  # a fresh share holds nothing of ours
        elif owner != (k, msg.attempt):
            raise Violation("staging", f"D{d} lent staging at {msg.staging_offset} to t#{k} "
                            f"attempt {msg.attempt}; t#{owner[0]} attempt {owner[1]} holds it")

    def _release_staging(self, w: World, d: int, a: ReleaseStaging) -> None:
        lo, hi = a.offset, a.offset + a.nbytes
        for it in w.flight:
            if it[0] == SCATTER and it[1] == d and lo <= it[5] < hi:
                raise Violation("staging", f"D{d} released staging [{lo}, {hi}) of attempt "
                                f"{a.attempt} while its scatter of P{it[2]}'s write still "
                                "reads it")
        for key in [key for key in w.s_owner if key[0] == d and lo <= key[1] < hi]:
            del w.s_owner[key]

    # -------------------------------------------------------------- writes

    def _issue_packed(self, w: World, p: int, a: IssueWrite, src: tuple[int, ...],
                      data: int, inc: int) -> None:
        pw = a.packed
        assert pw is not None
        n = pw.packed.nbytes
        for it in w.flight:
            if it[0] == SWRITE and it[1] == p and it[10] == POSTED:  # still read
                s0 = it[6][1]
                if s0 < pw.src_offset + n and pw.src_offset < s0 + it[6][2]:
                    raise Violation("staging", f"P{p} gathered into staging at {pw.src_offset}"
                                    f" while its write from {s0} is still in flight")
        if not a.notify.staged or tuple(a.notify.src_block_ids) != src:
            raise Violation("staging", f"P{p}'s packed write is not notified as staged "
                            "with its source blocks")
        bounds = pw.bounds if len(pw.bounds) > 1 else (0, n)
        frames = tuple(self._frame(a.chunk_notify(j)) for j in range(len(bounds) - 1))
        w.add(swrite_item(p, a.peer.rank, a.attempt, inc, src,
                          (pw.dst_offset, pw.src_offset, n, 0, bounds), frames, data,
                          gather_map(pw.packed.scatter), w.now))

    def _land_staged(self, w: World, item: Item, *, ok: bool) -> None:
        """The next chunk lands (eager: then the next, or the completion, follows; weak
        visibility: it lands whatever its producer was told, as garbage if it failed)."""
        _, p, d, attempt, inc, _src, where, frames, k, gmap, status, sent = item
        j, bounds = where[3], where[4]
        ok = ok and status != FAILED
        pos = where[0] + bounds[j]
        owner = w.s_owner.get((d, where[0]))
        if self.log is not None:
            what = f" chunk {j}/{len(frames)}" if len(frames) > 1 else ""
            self._say(f"P{p}'s packed write{what} of t#{k} a{attempt} into D{d} staging "
                      f"{pos} " + ("lands" if ok else "fails (some bytes may land)"))
        if owner != (k, attempt):
            what = "free" if owner is None else f"lent to t#{owner[0]} attempt {owner[1]}"
            raise Violation("staging", f"P{p}'s packed write of t#{k} attempt {attempt} "
                            f"landed in D{d}'s staging at {pos}, which is {what}")
        w.s_content[d, pos] = (k if ok else -1, attempt, gmap)
        if ok:
            w.add(frame_item(("D", d), ("P", p), frames[j], w.now))
        nxt = (*item[:6], (*where[:3], j + 1, bounds), *item[7:10], status, sent)
        if not self.eager:  # the item lives while chunks remain or the producer waits
            if j + 1 < len(frames) or status == POSTED:
                w.add(nxt)
            return
        if ok and j + 1 < len(frames):  # the next chunk is on its way
            w.add(nxt)
            return
        w.add(done_item(p, d, attempt, inc, ok, w.now))

    # ------------------------------------------------------------- scatters

    def _start_scatter(self, w: World, d: int, a: Scatter) -> None:
        plan = a.packed.plan
        start, stop = a.span
        if (start, stop) == (0, a.packed.nbytes):
            dst, cells = touched(plan, self.d_stride, 1), written(plan, self.d_stride)
        else:  # one chunk: the cells of the runs staged in [start, stop)
            got: set[tuple[int, int]] = set()
            for s0, region, off, n in a.packed.scatter.tolist():
                if start <= s0 < stop:
                    got.update((x // self.d_stride, region * self.d_stride + x % self.d_stride)
                               for x in range(off, off + n))
            cells = tuple(sorted(got))
            dst = tuple(sorted({b for b, _ in cells}))
        w.add(scatter_item(d, a.peer.rank, a.attempt, self._k_of(a) + 1, a.offset + start,
                           dst, cells, gather_map(a.packed.scatter), w.now))

    def _scatter(self, w: World, ids: list[int], item: Item, *, ok: bool) -> None:
        _, d, p, attempt, inc, offset, dst, cells, gmap, _sent = item
        w.flight.remove(item)
        if ok is False:
            w.faulted = True
        got = w.s_content.get((d, offset))
        owner = max(((key[1], o) for key, o in w.s_owner.items()
                     if key[0] == d and key[1] <= offset), default=(0, None))[1]
        k = inc - 1  # items name use k as k + 1
        if self.log is not None:
            self._say(f"D{d}'s scatter of P{p}'s a{attempt} write from staging {offset} "
                      + ("finishes" if ok else "fails (some bytes may be written)"))
        if owner != (k, attempt):
            raise Violation("staging", f"D{d} scattered attempt {attempt} out of staging at "
                            f"{offset}, which it already released")
        ci = w.cinc[k]
        for b in dst:
            if w.d_owner[b] != (k, attempt) or (d, attempt) in ci.released:
                raise Violation("reuse", f"D{d}'s scatter of t#{k} attempt {attempt} wrote "
                                f"block {b}, which it already released")
        if got is not None and got[2] != gmap:
            raise Violation("bytes", f"D{d} scattered P{p}'s write by another byte map than "
                            "the one it was packed by")
        mark = (got[0], got[1]) if ok and got is not None else (-1, attempt)
        for b, x in cells:
            w.content[d, b, p, x] = mark
        tid, kw = self._call(k)
        self._run(w, ids, self.np + d, ("s", attempt, inc, p, ok, w.now),
                  lambda ep: ep.scatter_done(tid, attempt, Peer("P", p), ok, w.now, **kw))
