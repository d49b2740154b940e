"""The in-memory network: delivery order, faults, simulated time (see the package)."""


from __future__ import annotations

import heapq
import random
from collections import Counter
from dataclasses import replace
from itertools import pairwise
from typing import Any

import numpy as np

from ... import timeline
from ...integrity import Injector, Integrity, IntegrityConfig, Tag
from ...protocol import (
    Consumer,
    ConsumerConfig,
    Hello,
    IssueRead,
    IssueWrite,
    Peer,
    Producer,
    ProducerConfig,
    RankInfo,
    TransferPlan,
    encode,
)
from ...protocol.packing import PackingConfig
from .flights import DELIVERIES, Flight, Item, Piece
from .landing import Landing
from .memory import read_ahead, region_memory
from .nodes import ConsumerNode, Node, ProducerNode


class InMemoryNetwork(Landing):
    """Producer and consumer ranks of any number of engines, in simulated time.

    By default every item is delivered in time order (ties in the order they
    were sent). With ``hold=True`` nothing moves until a test picks an item
    with :meth:`deliver`, which is how property tests explore interleavings.

    ``delivery`` picks how writes and reads move bytes (module docstring):
    ``"adversarial"`` (default: pieces landing at times drawn from
    ``random.Random(seed)``, local completion decoupled from visibility, failed
    writes landing pieces late, up to ``max_inflight_s`` after they were posted
    -- ``None``: the destination consumer's fence grace) or ``"eager"``.
    ``max_pieces`` bounds the pieces one write or read (or one pipelined chunk)
    is cut into.
    """

    def __init__(
        self,
        *,
        latency: float = 0.001,
        write_latency: float = 0.002,
        detect_s: float = 1.0,
        hold: bool = False,
        keep_log: bool = False,
        max_transit_s: float = float("inf"),
        max_write_s: float = float("inf"),
        packing: PackingConfig | None = None,
        delivery: str = "adversarial",
        seed: int = 0,
        max_inflight_s: float | None = None,
        max_pieces: int = 4,
        integrity: IntegrityConfig | None = None,
        injector: Injector | None = None,
    ) -> None:
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {DELIVERIES}, got {delivery!r}")
        if max_pieces < 1:
            raise ValueError(f"max_pieces must be >= 1, got {max_pieces}")
        if max_inflight_s is not None and not max_inflight_s > 0:
            raise ValueError(f"max_inflight_s must be > 0, got {max_inflight_s}")
        self.now = 0.0
        self.delivery = delivery
        self.adversarial = delivery == "adversarial"
        self.seed = seed
        self.rng = random.Random(seed)  # every adversarial choice, and nothing else
        self.max_inflight_s = max_inflight_s
        self.max_pieces = max_pieces
        # Packed writes: every rank's endpoint gets this (its staging memory, the cost
        # model), unless its own config names one.
        self.packing = packing if packing is not None and packing.mode != "never" else None
        # Rule 11: every producer rank seals its writes' notifications with a digest
        # of the source bytes (as the setting says), every consumer rank checks the
        # landed bytes first; ``injector`` corrupts landed writes before the check.
        self.integrity = integrity or IntegrityConfig("off")
        self.injector = injector
        # The tag of each write in flight, by id() of its IssueWrite (kept with it, so
        # the id cannot be reused while the entry lives).
        self.tags: dict[int, tuple[IssueWrite, Tag]] = {}
        self.latency = latency
        self.write_latency = write_latency
        self.detect_s = detect_s
        self.hold = hold
        self.keep_log = keep_log
        # However a test reorders, a frame older than max_transit_s is lost and a
        # write or read older than max_write_s lands: the timing assumption the
        # protocol's bounded deadlines rest on (transit + write < fence grace).
        # Completions are local: reported within the same bound as the copy itself.
        self.bounds = {"frame": max_transit_s, "write": max_write_s, "read": max_write_s,
                       "scatter": max_write_s, "done": max_write_s}
        self._bounded = any(b != float("inf") for b in self.bounds.values())
        self._nodes: list[Node] = []
        self.producers: dict[Peer, ProducerNode] = {}
        self.consumers: dict[Peer, ConsumerNode] = {}
        self.pending: list[Item] = []  # a heap unless hold
        self.violations: list[str] = []
        self.stats: Counter[str] = Counter()
        self._seq = 0
        # Adversarial delivery: flights by the seq of their "write"/"read" item, the
        # flight each notification waits for (by the frame's seq: (flight, chunk)),
        # the flight of each write's "done" item, and how many pieces are pending.
        self._flights: dict[int, Flight] = {}
        self._waits: dict[int, tuple[Flight, int]] = {}
        self._done_of: dict[int, Flight] = {}
        self._pieces = 0

    # ---------------------------------------------------------------- set-up

    def add_producer(self, info: RankInfo, config: ProducerConfig | None = None,
                     memory: list[np.ndarray] | None = None) -> ProducerNode:
        if self.packing is not None and (config is None or config.packing is None):
            config = replace(config or ProducerConfig(), packing=self.packing)
        node = ProducerNode(self, Producer(info, config),
                            memory if memory is not None else region_memory(info.layout))
        self.producers[node.peer] = node
        self._nodes.append(node)
        return node

    def add_consumer(self, info: RankInfo, config: ConsumerConfig | None = None,
                     memory: list[np.ndarray] | None = None) -> ConsumerNode:
        if self.packing is not None and (config is None or config.packing is None):
            config = replace(config or ConsumerConfig(), packing=self.packing)
        node = ConsumerNode(self, Consumer(info, config),
                            memory if memory is not None else region_memory(info.layout))
        self.consumers[node.peer] = node
        self._nodes.append(node)
        return node

    def handshake(self) -> None:
        """Exchange Hello frames between every producer and consumer rank, at once."""
        for p in self.producers.values():
            for c in self.consumers.values():
                p.frame(encode(Hello(info=c.info)), self.now)
                c.frame(encode(Hello(info=p.info)), self.now)

    def connect(self, consumer: Peer, engine_id: str) -> None:
        """A consumer rank asked for a handshake: Hello frames both ways, on the wire
        (so they take the control latency and obey hold mode). An engine with no
        rank here never answers; the consumer's handshake timeout fails it."""
        node = self.consumers[consumer]
        for p in self.producers.values():
            if p.peer.engine_id == engine_id:
                self.send(p.peer, consumer, encode(Hello(info=p.info)))
                self.send(consumer, p.peer, encode(Hello(info=node.info)))

    def node(self, peer: Peer) -> Node | None:
        return self.producers.get(peer) or self.consumers.get(peer)

    # ------------------------------------------------------------- traffic

    def enqueue(self, kind: str, src: Peer | None, dst: Peer | str, payload: Any,
                delay: float) -> Item:
        return self._enqueue_at(kind, src, dst, payload, self.now + delay, self.now)

    def _enqueue_at(self, kind: str, src: Peer | None, dst: Peer | str, payload: Any,
                    at: float, sent: float) -> Item:
        self._seq += 1
        item = Item(at, self._seq, kind, sent, src, dst, payload)
        if self.hold:
            self.pending.append(item)
        else:
            heapq.heappush(self.pending, item)
        if kind == "piece":
            self._pieces += 1
        return item

    def _unqueue(self, piece: Piece) -> None:
        """Take ``piece``'s item off the wire: out of the pending items in hold mode
        (tests pick items by index), left in the heap as a no-op otherwise."""
        item, piece.item = piece.item, None
        if item is None:
            return
        self._pieces -= 1
        if self.hold:
            self.pending.remove(item)

    def send(self, src: Peer, dst: Peer, frame: bytes) -> None:
        self.stats["frames"] += 1
        self.enqueue("frame", src, dst, frame, self.latency)

    def inject(self, dst: Peer, frame: bytes) -> None:
        """Put raw bytes on ``dst``'s control channel (garbage, forgeries)."""
        self.enqueue("frame", None, dst, frame, 0.0)

    def post_write(self, src: Peer, a: IssueWrite) -> Item:
        """A producer rank posts a write: its completion is the ``"write"`` item;
        adversarial delivery also puts its pieces on the wire."""
        item = self.enqueue("write", src, a.peer, a, self.write_latency)
        if self.adversarial:
            f = Flight("write", a, src, a.peer, self.now, self.now + self._inflight(a.peer))
            self._flights[item.seq] = f
            if a.packed is not None:  # rule 10: byte ranges of each chunk's image
                for k in range(a.packed.chunks):
                    for span in self._cut(*a.packed.span(k)):
                        self._launch(Piece(f, k, None, span), self._write_piece_at(item.at))
            else:
                for sub in self._split(a.plan):
                    self._launch(Piece(f, 0, sub, None), self._write_piece_at(item.at))
        return item

    def post_read(self, dst: Peer, a: IssueRead) -> Item:
        """A consumer rank posts a read: its completion is the ``"read"`` item;
        adversarial delivery takes its pieces from the source until then."""
        item = self.enqueue("read", dst, a.peer, a, self.write_latency)
        if self.adversarial:
            f = Flight("read", a, a.peer, dst, self.now, self.now + self._inflight(dst))
            self._flights[item.seq] = f
            for sub in self._split(a.plan):
                self._launch(Piece(f, 0, sub, None), self.rng.uniform(self.now, item.at))
        return item

    # Adversarial delivery: how writes and reads are cut, and when pieces land.

    def _inflight(self, consumer: Peer) -> float:
        """The max in-flight time of a write into (or a read by) ``consumer``."""
        if self.max_inflight_s is not None:
            return self.max_inflight_s
        node = self.consumers.get(consumer)
        return (node.endpoint.config if node is not None else ConsumerConfig()).fence_grace_s

    def _cuts(self, n: int, k: int) -> list[tuple[int, int]]:
        """``[0, n)`` cut at ``k - 1`` random points into ``k`` non-empty spans."""
        points = [0, *sorted(self.rng.sample(range(1, n), k - 1)), n]
        return list(pairwise(points))

    def _split(self, plan: TransferPlan) -> list[TransferPlan]:
        """A plan cut into a few sub-plans: groups of region pairs x groups of runs."""
        pairs, runs = int(plan.src_regions.shape[0]), int(plan.runs.shape[0])
        if not pairs or not runs:
            return []
        n = self.rng.randint(1, self.max_pieces)
        a = self.rng.randint(1, min(pairs, n))
        b = max(1, min(runs, n // a))
        return [TransferPlan(runs=plan.runs[r0:r1], src_regions=plan.src_regions[p0:p1],
                             dst_regions=plan.dst_regions[p0:p1])
                for p0, p1 in self._cuts(pairs, a) for r0, r1 in self._cuts(runs, b)]

    def _cut(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Bytes ``[lo, hi)`` of a staging image cut into a few ranges."""
        if hi <= lo:
            return []
        k = self.rng.randint(1, min(self.max_pieces, hi - lo))
        return [(lo + a, lo + b) for a, b in self._cuts(hi - lo, k)]

    def _write_piece_at(self, completion: float) -> float:
        """When a write's piece lands: before its local completion (a quarter of
        them), or after it -- often after the completion was reported."""
        if self.rng.random() < 0.25:
            return self.rng.uniform(self.now, completion)
        return completion + self.rng.uniform(0.0, 4 * self.latency + self.write_latency)

    def _launch(self, piece: Piece, at: float) -> None:
        f = piece.flight
        piece.item = self._enqueue_at("piece", f.src, f.dst, piece, min(at, f.deadline),
                                      f.posted)
        f.pieces.append(piece)

    def _read_source(self, f: Flight) -> None:
        """The source bytes of a write's pieces still on the wire, read now (its
        local completion or failure: the NIC is done reading the source)."""
        if not f.pieces:
            return
        src = self.producers[f.src]
        a: IssueWrite = f.action  # type: ignore[assignment]
        for p in f.pieces:
            if p.data is not None:
                continue
            if p.span is not None:
                assert a.packed is not None
                lo, hi = p.span
                p.data = src.staging[a.packed.src_offset + lo:a.packed.src_offset + hi].copy()
            else:
                assert p.plan is not None
                p.plan, p.data = read_ahead(p.plan, src.memory)

    def _discard(self, f: Flight) -> None:
        """Every piece of ``f`` still on the wire is lost."""
        for p in f.pieces:
            self._unqueue(p)
            p.state = "lost"
            self.stats["pieces_lost"] += 1
        f.pieces.clear()

    def _tag(self, a: IssueWrite) -> Tag | None:
        if not self.tags:
            return None
        got = self.tags.get(id(a))
        return got[1] if got is not None and got[0] is a else None

    def _fail(self, f: Flight, until: float | None = None) -> None:
        """A write failed: no notification, but each piece still on the wire may land
        (about half do), up to its max in-flight time after the write was posted
        (and before ``until``)."""
        f.failed = True
        self.tags.pop(id(f.action), None)
        dst = self.consumers.get(f.dst)
        if dst is None or not dst.alive:
            self._discard(f)
            return
        self._read_source(f)
        end = f.deadline if until is None else min(f.deadline, until)
        keep = []
        for p in f.pieces:
            self._unqueue(p)
            if end < self.now or self.rng.random() < 0.5:
                p.state = "lost"
                self.stats["pieces_lost"] += 1
            else:
                keep.append((p, self.rng.uniform(self.now, end)))
        f.pieces.clear()
        for p, at in keep:
            self._launch(p, at)

    def _land_all(self, f: Flight, chunk: int | None = None) -> None:
        """Land what is left of ``f`` (of one chunk) now."""
        for p in [p for p in f.pieces if chunk is None or p.chunk == chunk]:
            self._unqueue(p)
            self._land_piece(p)

    def deliver(self, index: int = 0) -> Item:
        """Deliver pending item ``index`` (hold mode: in list order) now."""
        item = self.pending.pop(index) if self.hold else heapq.heappop(self.pending)
        self._advance_to(item.at)
        self._execute(item)
        return item

    def _due(self, item: Item) -> float:
        if item.kind == "piece":
            return item.payload.deadline  # type: ignore[no-any-return]
        return item.sent + self.bounds.get(item.kind, float("inf"))

    def _may_be_overdue(self, t: float) -> bool:
        """Whether an item may be past its bound at ``t`` (cheap: a piece is due no
        earlier than it lands, so in time order it is overdue only if it is next)."""
        if self._bounded:
            return True
        if not self._pieces:
            return False
        # In time order a piece is overdue only if the clock passed it undelivered (tick).
        return self.hold or (bool(self.pending) and self.pending[0].at < t)

    def _advance_to(self, t: float, *, force: bool = False) -> None:
        """Move the clock to ``t``, enforcing the transit and write bounds on the way."""
        while self._may_be_overdue(t):
            overdue = [i for i in self.pending if self._due(i) <= t]
            if not overdue:
                break
            item = min(overdue, key=self._due)
            self.pending.remove(item)
            if not self.hold:
                heapq.heapify(self.pending)
            self.now = max(self.now, self._due(item))
            self.fire_timers()
            if item.kind == "frame":
                self.stats["frames_expired"] += 1
                self._waits.pop(item.seq, None)  # its write's pieces land on their own
            else:
                self._execute(item)
        if t > self.now or force:
            self.now = max(self.now, t)
            self.fire_timers()

    def duplicate(self, index: int) -> None:
        """Send a copy of a pending frame (writes and completions are not duplicated)."""
        item = self.pending[index]
        if item.kind == "frame":
            copy = self.enqueue("frame", item.src, item.dst, item.payload, 0.0)
            if item.seq in self._waits:  # a notification: it too comes after the bytes
                self._waits[copy.seq] = self._waits[item.seq]

    def drop(self, index: int) -> Item | None:
        """Lose a pending frame. A write, read or scatter dropped here *fails* instead
        (eager delivery: its bytes never land; adversarial: a write's pieces already
        on the wire may still land, late). Local events (completions, death notices)
        and pieces are never lost: nothing is dropped for them and None is returned."""
        item = self.pending[index]
        if item.kind not in ("frame", "write", "read", "scatter"):
            return None
        self.pending.pop(index)
        if not self.hold:
            heapq.heapify(self.pending)
        f = self._flights.pop(item.seq, None)
        if item.kind == "write":
            if f is not None:
                self._fail(f)
            self._complete(item, ok=False)
        elif item.kind == "read":
            if f is not None:
                self._discard(f)
            self._complete(item, ok=False)
        elif item.kind == "scatter":
            self._scattered(item.src, item.payload, ok=False)
        else:
            self._waits.pop(item.seq, None)
        return item

    def _execute(self, item: Item) -> None:
        if item.kind == "frame":
            wait = self._waits.pop(item.seq, None)
            if wait is not None:  # a notification: its write's bytes are all there first
                self._land_all(*wait)
            node = self.node(item.dst)  # type: ignore[arg-type]
            if node is not None and node.alive:
                node.frame(item.payload, self.now)
            else:
                self.stats["frames_lost"] += 1
        elif item.kind == "piece":
            piece = item.payload
            if piece.item is item:  # else: taken off the wire (landed, lost, re-timed)
                piece.item = None
                self._pieces -= 1
                self._land_piece(piece)
        elif item.kind == "write":
            f = self._flights.pop(item.seq, None)
            if f is None:
                self._land_write(item)
            else:
                self._complete_write(item, f)
        elif item.kind == "read":
            f = self._flights.pop(item.seq, None)
            if f is None:
                self._land_read(item)
            else:
                self._complete_read(item, f)
        elif item.kind == "scatter":
            self._scatter(item)
        elif item.kind == "done":
            f = self._done_of.pop(item.seq, None)
            if f is not None and f.pieces:
                self.stats["completed_before_landed"] += 1
            node = self.node(item.dst)  # type: ignore[arg-type]
            if node is not None and node.alive:
                action, ok = item.payload
                if isinstance(action, IssueWrite):
                    assert isinstance(node, ProducerNode)
                    if timeline.enabled():
                        timeline.completed(node.name, action.transfer_id, action.incarnation,
                                           action.attempt, action.peer, ok, self.now)
                    node.apply(node.endpoint.write_completed(
                        action.transfer_id, action.attempt, action.peer, ok, self.now,
                        incarnation=action.incarnation))
                else:
                    assert isinstance(node, ConsumerNode)
                    node.read_done(action, ok, self.now)
        elif item.kind == "death":
            node = self.node(item.dst)  # type: ignore[arg-type]
            if node is not None and node.alive:
                engine = item.payload
                # Its death is known here. Eager: nothing of its writes lands here any
                # more. Adversarial: what it posted may still land, within its bound
                # (the consumer fences a dead producer only after the fence grace).
                for f in self._flights_with_pieces() if self.delivery == "eager" else ():
                    if f.kind == "write" and f.src.engine_id == engine and f.dst == node.peer:
                        self._discard(f)
                if isinstance(node, ProducerNode):
                    node.apply(node.endpoint.peer_died(engine, self.now))
                else:
                    assert isinstance(node, ConsumerNode)
                    node.apply(node.endpoint.peer_died(engine, self.now))

    def _flights_with_pieces(self) -> list[Flight]:
        seen: dict[int, Flight] = {}
        for i in self.pending:
            if i.kind == "piece" and i.payload.item is i:
                seen.setdefault(id(i.payload.flight), i.payload.flight)
        return list(seen.values())

    def _complete(self, item: Item, ok: bool) -> None:
        assert item.src is not None
        self.enqueue("done", None, item.src, (item.payload, ok), self.latency)

    def _complete_write(self, item: Item, f: Flight) -> None:
        """Adversarial: a write's local completion. Its notification (each chunk's)
        follows its own pieces; the completion itself does not wait for them."""
        a: IssueWrite = item.payload
        src = self.producers.get(item.src)  # type: ignore[arg-type]
        dst = self.consumers.get(a.peer)
        if src is None or not src.alive:
            self.stats["writes_lost"] += 1  # the producer died with it (see kill)
            return
        if dst is None or not dst.alive:
            self._fail(f)
            self._complete(item, ok=False)
            return
        if (a.transfer_id, a.incarnation) in src.released_at:
            self.violations.append(
                f"write of {a.transfer_id}#{a.attempt} reads a released source")
        f.completed = True
        self._read_source(f)
        if a.notify.part != 0 or a.notify.parts != 1:
            self.stats["part_writes"] += 1
        self.stats["writes"] += 1
        self.stats["bytes"] += a.plan.nbytes
        if a.packed is not None:
            self.stats["packed_writes"] += 1
        for k in range(a.packed.chunks if a.packed is not None else 1):  # rule 10: per chunk
            last = max([self.now, *(p.item.at for p in f.pieces
                                    if p.chunk == k and p.item is not None)])
            at = last + self.latency * self.rng.uniform(0.5, 1.5)
            note = self._enqueue_at("frame", src.peer, dst.peer,
                                    Integrity.notification(a, k, self._tag(a)),
                                    at, self.now)
            self._waits[note.seq] = (f, k)
        self.tags.pop(id(a), None)
        done = self.enqueue("done", None, src.peer, (a, True),
                            self.latency * self.rng.uniform(0.0, 2.0))
        self._done_of[done.seq] = f

    def _complete_read(self, item: Item, f: Flight) -> None:
        """Adversarial: a read's completion takes what is left of it from the source
        now, whatever the producer did with it meanwhile."""
        a: IssueRead = item.payload
        dst = self.consumers.get(item.src)  # type: ignore[arg-type]
        src = self.producers.get(a.peer)
        if dst is None or not dst.alive:
            self._discard(f)
            return
        if src is None or not src.alive:
            self._discard(f)
            self._complete(item, ok=False)
            return
        self._land_all(f)
        self.stats["reads"] += 1
        self.stats["bytes"] += a.plan.nbytes
        self._complete(item, ok=True)

    # ---------------------------------------------------------------- time

    def fire_timers(self) -> None:
        now = self.now
        for node in self._nodes:
            if node.alive:
                # A call may arm timers that are already due (a deadline expired
                # late arms the next one); they must run out in a few rounds, or the
                # endpoint re-arms without progress and a real driver would spin.
                for _ in range(32):
                    d = node.endpoint.next_deadline()  # type: ignore[attr-defined]
                    if d is None or d > now:
                        break
                    node.apply(node.endpoint.handle_timer(now))  # type: ignore[attr-defined]
                else:
                    self.violations.append(f"{node.peer}: timers keep firing at {now}")

    def next_deadline(self) -> float | None:
        ds = [
            d for n in self._nodes if n.alive
            if (d := n.endpoint.next_deadline()) is not None  # type: ignore[attr-defined]
        ]
        return min(ds) if ds else None

    def run(self, until: float | None = None, max_items: int = 1_000_000) -> None:
        """Deliver items in time order, firing timers, until idle or ``until``."""
        pending = self.pending
        for _ in range(max_items):
            if not self.hold and pending and pending[0].at <= self.now:
                self._execute(heapq.heappop(pending))  # due now: no clock move, no timer
                continue
            nxt_item = min(self.pending).at if self.hold and self.pending else (
                self.pending[0].at if self.pending else None)
            nxt_timer = self.next_deadline()
            cands = [x for x in (nxt_item, nxt_timer) if x is not None]
            if not cands:
                break
            t = max(self.now, min(cands))
            if until is not None and t > until:
                break
            if nxt_item is not None and nxt_item <= t:
                idx = self.pending.index(min(self.pending)) if self.hold else 0
                self.deliver(idx)
            else:
                self._advance_to(t, force=True)
        if until is not None:
            self._advance_to(until, force=True)

    def advance(self, dt: float) -> None:
        """Run for ``dt`` of simulated time, delivering what falls due."""
        self.run(until=self.now + dt)

    def tick(self, dt: float) -> None:
        """Let ``dt`` pass firing timers (hold mode: only overdue items move)."""
        self._advance_to(self.now + dt)

    # --------------------------------------------------------------- faults

    def kill(self, engine_id: str) -> None:
        """Kill every rank of ``engine_id``; the others learn it after ``detect_s``."""
        for node in (*self.producers.values(), *self.consumers.values()):
            if node.peer.engine_id == engine_id:
                node.alive = False
        # Adversarial: a dead producer's writes not yet complete land what they land
        # before its death is detected; whatever a dead rank would read or receive is
        # gone with it. (A completed write's pieces land as they would: its
        # notification may still be on the wire, and it comes after them.)
        for f in self._flights_with_pieces():
            if f.src.engine_id == engine_id and f.kind == "write" and not f.completed:
                self._fail(f, until=self.now + self.detect_s)
            elif f.dst.engine_id == engine_id or (
                    f.kind == "read" and f.src.engine_id == engine_id):
                self._discard(f)
        for node in (*self.producers.values(), *self.consumers.values()):
            if node.alive:
                self.enqueue("death", None, node.peer, engine_id, self.detect_s)
