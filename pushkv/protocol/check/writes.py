"""The checker's writes in flight: posting, landing, completing -- and rule 12's engine.

:class:`Writes` is the part of :class:`~.model.Model` that carries a producer's
:class:`~.events.IssueWrite` through the world. It checks the write may start
(a source held for it, within its lease and window, not cancelled, only final
ranges); under *eager* visibility the write lands whole, then completes; under
*adversarial* visibility (the default, as NIXL states it) its bytes land in
pieces at any time before its notification frame, apart from its producer's
completion, and a failed write may still land pieces. Every piece is checked
as it lands: into a destination block still lent to its attempt, from a
source still held. A write to rule 12's engine E (a router's re-target) is
checked against its source the same way; E's memory is not modelled.
"""

from __future__ import annotations

from typing import Any

from ..events import IssueWrite, Peer
from ..layout import RankInfo
from ..mapping import targets_of
from ..messages import Message, Register, Skip
from .invariants import Violation, landing_rule, write_start_rule
from .owed import Owed, touched, written
from .part import ModelPart
from .world import (
    COMPLETED,
    FAILED,
    FRAME,
    HELLO,
    P_HELD,
    P_PARTIAL,
    POSTED,
    READ,
    SCATTER,
    SWRITE,
    WRITE,
    Item,
    World,
    done_item,
    frame_item,
    write_item,
)


class Writes(ModelPart):
    """Writes in flight and where their bytes land (a part of :class:`~.model.Model`)."""

    pinfo: list[RankInfo]
    e_info: RankInfo | None
    owed: Owed

    def _item(self, item: Item) -> str:  # pragma: no cover - provided by Describe
        raise NotImplementedError

    def _land_staged(self, w: World, item: Item, *, ok: bool) -> None:  # pragma: no cover
        raise NotImplementedError  # provided by Staging

    def _issue_packed(self, w: World, p: int, a: IssueWrite, src: tuple[int, ...],
                      data: int, inc: int) -> None:  # pragma: no cover - by Staging
        raise NotImplementedError

    @staticmethod
    def _touches(item: Item, engine: str, eager: bool = True) -> bool:
        if item[0] == FRAME:
            return engine in (item[1], item[3])
        if item[0] == HELLO:
            return True
        if item[0] in (SCATTER, READ):  # the consumer's own copies die with it
            return engine == "D"
        if item[0] in (WRITE, SWRITE) and not eager:
            return False  # stray bytes of a dead producer may still land (see _kill)
        return engine == "P"  # its completions are lost with it (eager: its writes too)

    def _land(self, w: World, item: Item, *, ok: bool) -> None:
        """Eager visibility: the whole write lands (or fails), then completes."""
        _, p, d, attempt, inc, _src, dst, notify, k, pieces, _status, _sent = item
        self._check_source(w, item, POSTED)
        if d < 0:  # rule 12: a write into E (a sink) completes
            w.add(done_item(p, d, attempt, inc, ok, w.now))
            return
        if item[0] == SWRITE:
            self._land_staged(w, item, ok=ok)
            return
        cells = tuple(c for piece in pieces for c in piece)
        if self.log is not None:
            self._say(f"P{p}'s write of t#{k} a{attempt} into D{d} blocks {list(dst)} "
                      + ("lands" if ok else "fails (some bytes may land)"))
        self._check_dest(w, item)
        for b, x in cells:
            w.content[d, b, p, x] = (k, attempt) if ok else (-1, attempt)
        if ok:
            w.add(frame_item(("D", d), ("P", p), notify, w.now))
        w.add(done_item(p, d, attempt, inc, ok, w.now))

    def _weak(self, w: World, ids: list[int], step: tuple[Any, ...]) -> None:
        """One step of a write under weak visibility: a piece of its bytes lands (the
        notification is sent once every piece of a write that did not fail landed),
        its producer learns it completed or failed, or a failed write's stray pieces
        stop landing."""
        kind, item = step[0], step[1]
        w.flight.remove(item)
        status = item[10]
        p, d, attempt, inc, k = item[1], item[2], item[3], item[4], item[8]
        if kind in ("complete", "wfail"):
            ok = kind == "complete"
            if not ok:
                w.faulted = True
            if self.log is not None:
                self._say(f"P{p} learns its write of a{attempt} to {self._peer(d).engine_id}"
                          f"{self._peer(d).rank} "
                          + ("completed" if ok else "failed (its bytes may still land)"))
            more = item[9] if item[0] == WRITE else item[6][3] < len(item[7])
            if more:
                w.add((*item[:10], COMPLETED if ok else FAILED, item[-1]))
            tid, kw = self._call(inc - 1)
            self._run(w, ids, p, ("c", attempt, inc, d, ok, w.now),
                      lambda ep: ep.write_completed(tid, attempt, self._peer(d), ok, w.now,
                                                    **kw))
            return
        if kind == "vanish":
            if self.log is not None:
                self._say(f"the rest of {self._item(item)} never lands")
            return
        if item[0] == SWRITE:  # the next chunk lands (garbage if the write failed)
            self._check_source(w, item, status)
            self._land_staged(w, item, ok=True)
            return
        j = step[2]
        piece, pieces = item[9][j], (*item[9][:j], *item[9][j + 1:])
        self._check_source(w, item, status)
        if self.log is not None:
            what = "a piece" if pieces else "the last piece"
            self._say(f"{what} of P{p}'s write of t#{k} a{attempt} lands in D{d} blocks "
                      f"{sorted({b for b, _ in piece})}"
                      + (" (stray bytes of a failed write)" if status == FAILED else ""))
        self._check_dest(w, item)
        for b, x in piece:
            w.content[d, b, p, x] = (k, attempt) if status != FAILED else (-1, attempt)
        if not pieces and status != FAILED:  # every byte is there: the notification
            w.add(frame_item(("D", d), ("P", p), item[7], w.now))
        if pieces or status == POSTED:
            w.add((*item[:9], pieces, *item[10:]))

    def _check_source(self, w: World, item: Item, status: int) -> None:
        """Until its producer learns it completed, a write may still read its source."""
        p, k, src = item[1], item[8], item[5]
        if status == POSTED and (p in w.pinc[k].released or any(w.p_owner[b] != k
                                                                for b in src)):
            raise Violation("source", f"P{p} wrote t#{k} from source blocks {list(src)} "
                            "after releasing them")

    def _check_dest(self, w: World, item: Item) -> None:
        """Bytes of a write land only in blocks still lent to its attempt."""
        p, d, attempt, k = item[1], item[2], item[3], item[8]
        ci = w.cinc[k] if k < len(w.cinc) else None
        for b in item[6]:
            owner = w.d_owner[b]
            rule = landing_rule(owner == (k, attempt) and ci is not None
                                and (d, attempt) not in ci.released)
            if rule is not None:
                what = ("free" if owner is None else
                        f"released by D{d}" if owner == (k, attempt) else
                        f"now holding t#{owner[0]} attempt {owner[1]}")
                kind = "incarnation" if owner is not None and owner[0] != k else rule
                op = (f"D{d}'s read of t#{k} attempt {attempt} from P{p}" if item[0] == READ
                      else f"P{p}'s write of t#{k} attempt {attempt}")
                raise Violation(kind, f"{op} landed in D{d} block {b}, which is {what}")

    def _issue(self, w: World, p: int, a: IssueWrite) -> None:
        d = -1 if a.peer.engine_id == "E" else a.peer.rank  # (-1: rule 12's engine E)
        src = touched(a.plan, self.p_stride, 0)
        dst = touched(a.plan, self.d_stride, 1)
        data = next((k for k, pi in enumerate(w.pinc) if pi.status in (P_HELD, P_PARTIAL)
                     and pi.blocks == src and p not in pi.released), -1)
        # The shared rule (the auditor's too), in two calls to keep the checks' order:
        # source and cancelled here, lease and window after rule 9's unready check.
        rule = write_start_rule(w.now, held=data >= 0, lease_end=float("inf"),
                                cancelled=(p, d, a.attempt, data) in w.cancelled)
        if rule == "source":
            raise Violation("source", f"P{p} started a write of attempt {a.attempt} from "
                            f"source blocks {list(src)} it does not hold")
        inc = self._k_of(a) + 1  # the use, as items in flight name it
        if rule == "cancelled":
            raise Violation("cancelled", f"P{p} started a write of t#{data} attempt "
                            f"{a.attempt} to D{d} after that attempt's Cancel reached it")
        cells = written(a.plan, self.d_stride)
        pi = w.pinc[data]
        if pi.status == P_PARTIAL:  # rule 9: only what the engine reported final
            final: set[int] = set()
            for j in pi.ready:
                final |= self.owed.pieces[d][p][j]
            early = sorted(x for _, x in cells if x not in final)
            if early:
                raise Violation("unready", f"P{p} started a write of t#{data} with bytes "
                                f"{early} its engine never reported final")
        rule = write_start_rule(w.now, held=True, cancelled=False,
                                lease_end=w.leases.get((p, data), 0.0),
                                window_end=w.windows.get((p, d, a.attempt, data)))
        if rule == "lease":
            raise Violation("lease", f"P{p} started a write of t#{data} attempt {a.attempt} "
                            f"at t={w.now:g}, after its source's lease ended")
        if rule == "window":
            raise Violation("window", f"P{p} started a write of t#{data} attempt {a.attempt} "
                            f"at t={w.now:g}, after the registration's window")
        if d < 0:  # rule 12: into E, whose memory is not modelled: it completes or fails
            w.add(write_item(p, d, a.attempt, inc, src, (), self._frame(a.notify), data, (),
                             w.now))
            return
        if w.dead == "D":
            w.add(done_item(p, d, a.attempt, inc, False, w.now))
            return
        if a.packed is not None:
            self._issue_packed(w, p, a, src, data, inc)
            return
        if self.eager or len(cells) < 2:
            pieces: tuple[tuple[tuple[int, int], ...], ...] = (cells,)
        else:  # weak visibility: the bytes land in two pieces, in either order
            half = len(cells) // 2
            pieces = (cells[:half], cells[half:])
        w.add(write_item(p, d, a.attempt, inc, src, dst, self._frame(a.notify), data, pieces,
                         w.now))

    @staticmethod
    def _peer(d: int) -> Peer:
        """The consumer rank a write goes to: D's rank ``d``, or (-1) rule 12's E."""
        return Peer("E", 0) if d < 0 else Peer("D", d)

    def _retarget(self, w: World, k: int) -> None:
        """Rule 12: a router gives up on D for use ``k`` and sends its decode leg to E,
        turn 1: E registers one block with every producer rank that writes into it
        (a Skip to the others), frames no network loses."""
        assert self.e_info is not None
        w.retargeted = w.retargeted | {k}
        w.faulted = True  # D's attempt fails (RETARGETED): expected now
        if self.log is not None:
            self._say(f"a router re-targets t#{k} to engine E")
        tid, kw = self._call(k)
        src = ("E", 0)
        for r, pinfo in enumerate(self.pinfo):
            if targets_of(pinfo.engine, self.e_info.engine, r):
                msg: Message = Register(
                    transfer_id=tid, attempt=0, engine_id="E", rank=0, producer_engine_id="P",
                    block_ids=(0,), num_tokens=self.scope.tokens,
                    window_ms=int(self.scope.window_s * 1000), target=1, **kw)
            else:
                msg = Skip(transfer_id=tid, engine_id="E", rank=0, producer_engine_id="P",
                           target=1, **kw)
            w.add(frame_item(("P", r), src, self._frame(msg), w.now))
