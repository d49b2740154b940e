"""Pull in the checker's world: published sources and the consumer's reads.

As behind vllm-router, the consumer engine learns the source block ids from the
prefill's own answer: it may start the pull as soon as the prefill's bytes are
final, with the lease counted from then, before any producer rank's core was
told (``publish``, a later step of its own) and published the source
(:class:`~.events.Publish`) -- so a ReadDone or final Cancel may reach a rank
that has not published yet. Each planned read
(:class:`~.events.IssueRead`) becomes a :func:`~.world.read_item` in
flight, which, as a one-sided READ does, takes the source's bytes at any time
until it completes: a piece copied after the producer released its source (its
lease ended, a ReadDone or a final Cancel arrived, its engine died) copies
whatever the blocks hold then, marked as garbage. A read completes only once all
its pieces landed; it may fail at any time, and a failed read's remaining
pieces may still land (garbage) until it vanishes. READY must therefore never
follow a read that may have copied a released source: the bytes check of
:meth:`~.model.Model._outcome` finds it if it does.
"""

from __future__ import annotations

from typing import Any

from ..events import IssueRead, Peer, Publish
from .invariants import Violation
from .owed import touched, written
from .part import ModelPart
from .world import FAILED, P_HELD, P_OVER, POSTED, Item, World, read_item


class Pull(ModelPart):
    """Published sources and reads; :class:`~.model.Model` provides the rest."""

    # ------------------------------------------------------------ publishing

    def _publish(self, w: World, p: int, a: Publish) -> None:
        k = self._k_of(a)
        if any(r == p and j == k for r, j, _ in w.published):
            raise Violation("action", f"P{p} published t#{k} twice")
        w.published = w.published | {(p, k, w.now + a.lease_s)}

    @staticmethod
    def relayed(pi: tuple[Any, ...]) -> bool:
        """Whether the block ids of use ``pi`` may have reached the consumer engine (the
        pull may start): as soon as the prefill's bytes are final, before any producer
        rank's core published them (a router relays the prefill's own answer)."""
        return bool(pi[1]) and pi[0] in (P_HELD, P_OVER)

    def _start_pull(self, w: World, k: int, blocks: tuple[int, ...], ids: list[int],
                    c: int) -> None:
        """Consumer rank ``c`` starts the pull of use ``k`` into ``blocks``, with the lease
        counted from the end of the prefill, less the time since (the relay is instant
        here): no later than any producer rank's own lease, which starts when its core
        is told."""
        ends = [until for _, j, until in w.published if j == k]
        ends += [w.leases[r, k] for r in range(self.np) if (r, k) in w.leases]
        lease_s = min(ends, default=w.now) - w.now
        src = w.pinc[k].blocks
        tid, kw = self._call(k)
        n = self.scope.tokens
        self._run(w, ids, self.np + c, ("pull", k, blocks, lease_s, w.now),
                  lambda ep: ep.start_pull(tid, "P", src, blocks, n, w.now, lease_s=lease_s,
                                           **kw))

    # ----------------------------------------------------------------- reads

    def _issue_read(self, w: World, d: int, a: IssueRead) -> None:
        k = self._k_of(a)
        p = a.peer.rank
        src = touched(a.plan, self.p_stride, 0)
        dst = touched(a.plan, self.d_stride, 1)
        cells = written(a.plan, self.d_stride)
        if src != w.pinc[k].blocks:
            raise Violation("source", f"D{d} reads t#{k} from P{p} blocks {list(src)}, which "
                            "its producer never published")
        half = len(cells) // 2
        pieces = (cells,) if len(cells) < 2 else (cells[:half], cells[half:])
        w.add(read_item(p, d, a.attempt, k + 1, src, dst, k, pieces, w.now))

    def read_steps(self, item: Item, errors: bool) -> list[tuple[Any, ...]]:
        """What may happen next to a read in flight."""
        out: list[tuple[Any, ...]] = [("read", item, j) for j in range(len(item[9]))]
        if item[10] == POSTED:
            if not item[9]:
                out.append(("readdone", item))
            if errors:
                out.append(("readfail", item))
        else:
            out.append(("vanish", item))
        return out

    def _read(self, w: World, ids: list[int], step: tuple[Any, ...]) -> None:
        kind, item = step[0], step[1]
        w.flight.remove(item)
        p, d, attempt, inc, src, k = item[1], item[2], item[3], item[4], item[5], item[8]
        if kind == "read":
            j = step[2]
            piece, rest = item[9][j], (*item[9][:j], *item[9][j + 1:])
            pi = w.pinc[k]
            held = (w.dead != "P" and p not in pi.released
                    and all(w.p_owner[b] == k for b in src))
            if self.log is not None:
                self._say(f"a piece of D{d}'s read of t#{k} a{attempt} from P{p} lands in "
                          f"blocks {sorted({b for b, _ in piece})}"
                          + ("" if held else " (its source was released: garbage)"))
            self._check_dest(w, item)
            for b, x in piece:
                w.content[d, b, p, x] = (k, attempt) if held and item[10] == POSTED else (
                    -1, attempt)
            if rest or item[10] == POSTED:
                w.add((*item[:9], rest, *item[10:]))
            return
        ok = kind == "readdone"
        if not ok:
            w.faulted = True
            if item[9]:  # its other pieces may still land, as garbage
                w.add((*item[:10], FAILED, item[-1]))
        if self.log is not None:
            self._say(f"D{d}'s read of t#{k} a{attempt} from P{p} "
                      + ("completes" if ok else "fails (its bytes may still land)"))
        tid, kw = self._call(inc - 1)
        self._run(w, ids, self.np + d, ("r", attempt, inc, p, ok, w.now),
                  lambda ep: ep.read_completed(tid, attempt, Peer("P", p), ok, w.now, **kw))

