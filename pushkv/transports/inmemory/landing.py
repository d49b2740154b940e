"""Where and when bytes land on the in-memory network, checked against what the
consumer lent and the producer holds (invariants 2, 3 and 6)."""


from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from ... import timeline
from ...integrity import Integrity, Tag
from ...protocol import (
    IssueRead,
    IssueWrite,
    Peer,
    Scatter,
    TransferPlan,
)
from ..staging import copy_staging, scatter_host
from .flights import Flight, Item, Piece
from .memory import copy_plan, touched_blocks
from .nodes import ConsumerNode, ProducerNode


class Landing:
    """How a write's or read's bytes land (weak visibility), checked as they do.

    A mixin of :class:`~.network.InMemoryNetwork`; what it needs of it is declared here."""

    now: float
    latency: float
    producers: dict[Peer, ProducerNode]
    consumers: dict[Peer, ConsumerNode]
    stats: Counter[str]
    violations: list[str]
    tags: dict[int, tuple[Any, Tag]]

    if TYPE_CHECKING:  # provided by the network
        def enqueue(self, kind: str, src: Peer | None, dst: Peer | str, payload: Any,
                    delay: float) -> Item: ...
        def _complete(self, item: Item, ok: bool) -> None: ...
        def _tag(self, a: IssueWrite) -> Tag | None: ...

    def _land_piece(self, p: Piece) -> None:
        if p.state != "wire":
            return
        p.state = "landed"
        f = p.flight
        f.pieces.remove(p)
        src, dst = self.producers.get(f.src), self.consumers.get(f.dst)
        if dst is None or not dst.alive or src is None:
            return  # the destination's memory went with it
        self.stats["pieces"] += 1
        if f.kind == "read":
            self._take_read_piece(p, f, src, dst)
            return
        a: IssueWrite = f.action  # type: ignore[assignment]
        key = (a.transfer_id, a.incarnation)
        if f.failed:
            self.stats["pieces_after_failure"] += 1
        elif f.completed:
            self.stats["pieces_after_completion"] += 1
        if not f.completed and not f.failed and key in src.released_at:
            self.violations.append(
                f"write of {a.transfer_id}#{a.attempt} reads a released source")
        if a.packed is not None:
            assert p.span is not None
            pw, (lo, hi) = a.packed, p.span
            if dst.endpoint.staging_holder(pw.dst_offset + lo) != (key, a.attempt):
                self.violations.append(f"packed write of {a.transfer_id}#{a.attempt} lands in "
                                       f"staging at {pw.dst_offset + lo} not lent to it")
            self._check_destination(dst, a.transfer_id, a.incarnation, a.attempt, a.plan)
            data = p.data if p.data is not None else \
                src.staging[pw.src_offset + lo:pw.src_offset + hi]
            dst.staging[pw.dst_offset + lo:pw.dst_offset + hi] = data
        else:
            assert p.plan is not None
            self._check_destination(dst, a.transfer_id, a.incarnation, a.attempt, p.plan)
            copy_plan(p.plan, p.data if p.data is not None else src.memory, dst.memory)

    def _take_read_piece(self, p: Piece, f: Flight, src: ProducerNode,
                         dst: ConsumerNode) -> None:
        """A read's piece is copied: its source blocks must still be held for it."""
        a: IssueRead = f.action  # type: ignore[assignment]
        assert p.plan is not None
        if not src.alive:
            return  # nothing to read from: the read fails at its completion
        held = set(src.endpoint.held_blocks().get((a.transfer_id, a.incarnation), ()))
        for b in sorted(touched_blocks(p.plan, src.info.layout.stride, 0) - held):
            self.violations.append(f"read of {a.transfer_id}#{a.attempt} takes source block "
                                   f"{b} of {src.peer} after it was released")
        self._check_destination(dst, a.transfer_id, a.incarnation, a.attempt, p.plan)
        copy_plan(p.plan, src.memory, dst.memory)

    def _land_write(self, item: Item) -> None:
        a: IssueWrite = item.payload
        src = self.producers.get(item.src)  # type: ignore[arg-type]
        dst = self.consumers.get(a.peer)
        if src is None or not src.alive:
            self.stats["writes_lost"] += 1  # the producer died with it
            return
        if dst is None or not dst.alive:
            self._complete(item, ok=False)
            return
        self._check_destination(dst, a.transfer_id, a.incarnation, a.attempt, a.plan)
        if (a.transfer_id, a.incarnation) in src.released_at:
            self.violations.append(
                f"write of {a.transfer_id}#{a.attempt} reads a released source")
        if a.packed is not None:
            self._land_packed(a, src, dst)
        else:
            copy_plan(a.plan, src.memory, dst.memory)
        if a.notify.part != 0 or a.notify.parts != 1:
            self.stats["part_writes"] += 1
        self.stats["writes"] += 1
        self.stats["bytes"] += a.plan.nbytes
        for k in range(a.packed.chunks if a.packed is not None else 1):  # rule 10: per chunk
            self.enqueue("frame", src.peer, dst.peer,
                         Integrity.notification(a, k, self._tag(a)), self.latency)
        self.tags.pop(id(a), None)
        self._complete(item, ok=True)

    def _land_packed(self, a: IssueWrite, src: ProducerNode, dst: ConsumerNode) -> None:
        """Rule 10: the wire chunks of a packed write land in the consumer's staging,
        in the range its registration lent to this attempt."""
        pw = a.packed
        assert pw is not None
        n = pw.packed.nbytes
        if dst.endpoint.staging_holder(pw.dst_offset) != ((a.transfer_id, a.incarnation),
                                                          a.attempt):
            self.violations.append(f"packed write of {a.transfer_id}#{a.attempt} lands in "
                                   f"staging at {pw.dst_offset} not lent to it")
        copy_staging(src.staging[pw.src_offset:pw.src_offset + n],
                     dst.staging[pw.dst_offset:pw.dst_offset + n], pw.packed.wire)
        self.stats["packed_writes"] += 1

    def _scatter(self, item: Item) -> None:
        a: Scatter = item.payload
        node = self.consumers.get(item.src)  # type: ignore[arg-type]
        if node is None or not node.alive:
            return  # the engine died with its scatter
        self._check_destination(node, a.transfer_id, a.incarnation, a.attempt, a.packed.plan)
        if node.endpoint.staging_holder(a.offset) != ((a.transfer_id, a.incarnation),
                                                      a.attempt):
            self.violations.append(f"scatter of {a.transfer_id}#{a.attempt} reads staging at "
                                   f"{a.offset} not lent to it")
        lo, hi = a.span  # one chunk of a pipelined write, or the whole image
        scatter_host(a.packed, node.staging[a.offset + lo:a.offset + hi], node.memory, lo, hi)
        self.stats["scatters"] += 1
        self._scattered(node.peer, a, ok=True)

    def _scattered(self, consumer: Peer | None, a: Scatter, ok: bool) -> None:
        node = self.consumers.get(consumer) if consumer is not None else None
        if node is not None and node.alive:
            # Rule 11: a staged write is checked once its last chunk is scattered.
            checked = node.integrity.stats["checked"]
            bad = node.integrity.scattered(node.endpoint, a) if ok else ""
            if timeline.enabled() and node.integrity.stats["checked"] > checked:
                timeline.checked(node.name, a.transfer_id, a.incarnation, a.attempt, a.peer,
                                 not bad, self.now)
            node.apply(node.endpoint.scatter_done(a.transfer_id, a.attempt, a.peer, ok,
                                                  self.now, incarnation=a.incarnation,
                                                  corrupt=bad))

    def _land_read(self, item: Item) -> None:
        a: IssueRead = item.payload
        dst = self.consumers.get(item.src)  # type: ignore[arg-type]
        src = self.producers.get(a.peer)
        if dst is None or not dst.alive:
            return
        if src is None or not src.alive or (
                (a.transfer_id, a.incarnation) not in src.endpoint.held_blocks()):
            self._complete(item, ok=False)
            return
        self._check_destination(dst, a.transfer_id, a.incarnation, a.attempt, a.plan)
        copy_plan(a.plan, src.memory, dst.memory)
        self.stats["reads"] += 1
        self.stats["bytes"] += a.plan.nbytes
        self._complete(item, ok=True)

    def _check_destination(self, dst: ConsumerNode, transfer_id: str, inc: int, attempt: int,
                           plan: TransferPlan) -> None:
        lo = dst.info.layout
        allowed = dst.endpoint.blocks_of(transfer_id, attempt, incarnation=inc)
        key, lender = (transfer_id, inc), dst.endpoint.lent_to
        for b in touched_blocks(plan, lo.stride, 1):
            if lender(b) != key:
                self.violations.append(
                    f"write of {transfer_id}#{attempt} lands in block {b} not lent to it")
            elif b not in allowed:
                self.violations.append(
                    f"write of {transfer_id}#{attempt} lands in block {b} outside its registration")
