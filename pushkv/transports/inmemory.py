"""A deterministic in-process transport with real byte buffers.

:class:`InMemoryNetwork` holds producer and consumer ranks in one process, each
with its KV memory as numpy byte arrays (one per region). It moves control
frames (really encoded and decoded), executes writes and reads by copying
bytes according to the plan, and delivers write notifications -- in simulated
time, in a deterministic order, and on command out of order: tests can
deliver any pending item next, duplicate or drop a message, fail a write, or
kill an engine. With a :class:`~pushkv.protocol.packing.PackingConfig` every
rank has staging memory and the endpoints pack writes (rule 10): a packed
write is gathered into the producer rank's staging when issued, copied in
wire chunks into the staging range its registration lent when it lands, and
scattered into the destination blocks by the consumer's ``Scatter`` -- an
item of its own, which tests may deliver late, fail or reorder like a write.

Delivery
--------

``delivery="adversarial"`` (the default) is no kinder than what NIXL states,
driven by a ``random.Random(seed)`` the network owns (no wall clock, no global
random: the same seed gives the same run):

* a posted write's bytes become visible at the destination in *pieces* (its
  plan cut into a few sub-plans by region pairs and runs; a packed write's
  staging image cut into byte ranges, per pipelined chunk), each landing at a
  time of its own after the write was posted -- a ``"piece"`` item -- and at
  the latest when the write's notification (a chunk's: its chunk's pieces) is
  delivered: delivering a notification, even by hand, first lands what is left;
* the producer's local completion (the ``"done"`` item that calls
  ``write_completed(ok=True)``) is decoupled from visibility: it is often
  delivered while pieces are still on the wire, and so are the side-channel
  frames the producer sends after it (CancelAck, Fail, ...): they overtake
  the bytes. A piece that lands after the local completion carries the source
  bytes as they were at that completion (the NIC has read them by then);
* a write that fails (dropped by a test with :meth:`InMemoryNetwork.drop`, or
  its destination dead when it completes) sends no notification, but each of
  its pieces still on the wire may land (about half do), at a time drawn up to
  the write's *max in-flight time* after it was posted (``max_inflight_s``;
  default: the destination consumer's ``ConsumerConfig.fence_grace_s``), so
  possibly well after the producer saw the failure. A killed producer's writes
  may likewise land pieces, within the same bound, even after its death is
  known (the consumer fences a dead producer only once its fence grace passed);
* a read (pull, ``IssueRead``) takes its pieces from the source at times
  between its post and its completion (what is left at the completion); a
  read completes whatever the producer did meanwhile, so a source released
  before the read completed hands the consumer whatever is in those blocks;
* control frames still take ``latency`` each, in the order sent.

``delivery="eager"`` is the earlier, kinder model: a write's bytes all land at
once when it completes, together with its notification and its completion,
and a read whose source is no longer held fails.

In both modes tests drive items by hand as before (``hold=True``,
:meth:`~InMemoryNetwork.deliver`, :meth:`~InMemoryNetwork.drop`, ...); in
adversarial mode pieces are items too (never dropped: a piece lands or is
discarded with its failed write), bounded by their write's max in-flight time.

Checks
------

The transport *checks* as it goes: every write's bytes (every piece) that land
record a violation if they hit a destination block that the consumer does not
hold lent to that transfer and attempt (invariants 2 and 3) -- for a packed
write, also a staging range not lent to it; a piece of a read records one if
it takes bytes from a source block the producer no longer holds for that
transfer (released); a write still reading a released source records one; and
so does a source block released twice (invariant 6).
"""

from __future__ import annotations

import heapq
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from itertools import pairwise
from typing import Any, NamedTuple

import numpy as np

from .. import timeline
from ..integrity import Injector, Integrity, IntegrityConfig, Tag, unseal
from ..protocol import (
    Action,
    Connect,
    Consumer,
    ConsumerConfig,
    DecodeError,
    Hello,
    IssueRead,
    IssueWrite,
    Notify,
    Peer,
    Producer,
    ProducerConfig,
    Publish,
    RankInfo,
    Register,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    ReleaseStaging,
    Scatter,
    SendMessage,
    Skip,
    TransferCancelled,
    TransferFailed,
    TransferPlan,
    TransferReady,
    decode,
    encode,
)
from ..protocol.layout import KVLayout
from ..protocol.packing import PackingConfig
from .staging import copy_staging, gather_host, scatter_host


def region_memory(layout: KVLayout, fill: int | None = None,
                  rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """One zeroed (or random, or constant) byte array per region of ``layout``."""
    out = []
    for _ in range(layout.num_regions):
        if rng is not None:
            out.append(rng.integers(0, 256, layout.region_bytes, dtype=np.uint8))
        else:
            out.append(np.full(layout.region_bytes, fill or 0, dtype=np.uint8))
    return out


def copy_plan(plan: TransferPlan, src: Sequence[np.ndarray], dst: Sequence[np.ndarray]) -> None:
    """Execute a plan between two sets of region buffers."""
    runs = plan.runs.tolist()
    for s_reg, d_reg in zip(plan.src_regions.tolist(), plan.dst_regions.tolist(), strict=True):
        s_buf, d_buf = src[s_reg], dst[d_reg]
        for so, do, n in runs:
            d_buf[do:do + n] = s_buf[so:so + n]


def read_ahead(plan: TransferPlan, src: Sequence[np.ndarray]
               ) -> tuple[TransferPlan, list[np.ndarray]]:
    """The source bytes of ``plan`` read now: one buffer per region pair, and the
    plan rebased onto them (``copy_plan(rebased, buffers, dst)`` lands them later)."""
    runs = plan.runs
    lengths = runs[:, 2]
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(runs.dtype)
    pairs = int(plan.src_regions.shape[0])
    rebased = TransferPlan(runs=np.stack([offsets, runs[:, 1], lengths], axis=1),
                           src_regions=np.arange(pairs, dtype=plan.src_regions.dtype),
                           dst_regions=plan.dst_regions)
    buffers = [np.empty(int(lengths.sum()), np.uint8) for _ in range(pairs)]
    spans = list(zip(runs[:, 0].tolist(), offsets.tolist(), lengths.tolist(), strict=True))
    for s_reg, buf in zip(plan.src_regions.tolist(), buffers, strict=True):
        s_buf = src[s_reg]
        for so, o, n in spans:
            buf[o:o + n] = s_buf[so:so + n]
    return rebased, buffers


def touched_blocks(plan: TransferPlan, stride: int, side: int) -> set[int]:
    """Blocks a plan touches on one side (0: source, 1: destination)."""
    out: set[int] = set()
    for off, n in zip(plan.runs[:, side].tolist(), plan.runs[:, 2].tolist(), strict=True):
        out.update(range(off // stride, (off + n - 1) // stride + 1))
    return out


class Item(NamedTuple):
    """Something in flight: a frame, a write, a read or a completion.

    A tuple ordered by (due time, sequence number) -- compared in C, so the
    pending heap stays cheap; the sequence number is unique, so later fields
    are never compared."""

    at: float
    seq: int
    kind: str  # "frame" | "write" | "read" | "piece" | "scatter" | "done" | "death"
    sent: float
    src: Peer | None
    dst: Peer | str
    payload: Any


#: Delivery models of :class:`InMemoryNetwork` (see the module docstring).
DELIVERIES = ("adversarial", "eager")


class Flight:
    """A write or read in flight under adversarial delivery: its pieces not yet landed."""

    __slots__ = ("action", "completed", "deadline", "dst", "failed", "kind", "pieces",
                 "posted", "src")

    def __init__(self, kind: str, action: IssueWrite | IssueRead, src: Peer, dst: Peer,
                 posted: float, deadline: float) -> None:
        self.kind = kind  # "write" | "read"
        self.action = action
        self.src = src  # the rank whose memory the bytes come from
        self.dst = dst  # the rank whose memory they land in
        self.posted = posted
        self.deadline = deadline  # no piece lands later (the max in-flight time)
        self.pieces: list[Piece] = []  # on the wire, in no particular order
        self.completed = False  # the write's local completion happened (ok)
        self.failed = False  # the write failed: its pieces on the wire land late, or never


class Piece:
    """Part of a flight's bytes, landing on its own: a sub-plan (direct writes and
    reads) or a byte range ``span`` of the staging image (packed writes)."""

    __slots__ = ("chunk", "data", "flight", "item", "plan", "span", "state")

    def __init__(self, flight: Flight, chunk: int, plan: TransferPlan | None,
                 span: tuple[int, int] | None) -> None:
        self.flight = flight
        self.chunk = chunk  # the pipelined chunk it belongs to (0: the whole write)
        self.plan = plan
        self.span = span
        #: The source bytes, once read ahead of landing: the image range (packed), or
        #: one buffer per region pair of ``plan``, rebased onto them (direct).
        self.data: Any = None
        self.item: Item | None = None
        self.state = "wire"  # "wire" | "landed" | "lost"

    @property
    def deadline(self) -> float:
        return self.flight.deadline


class Node:
    """One rank: an endpoint, its memory, and what it has seen."""

    def __init__(self, net: InMemoryNetwork, info: RankInfo, memory: list[np.ndarray]) -> None:
        self.net = net
        self.info = info
        self.peer = Peer(info.engine_id, info.rank)
        self.name = timeline.node(info.engine_id, info.rank)  # in its timeline steps
        self.grace: float | None = None  # a consumer's fence_grace_s (timeline steps)
        self.memory = memory
        #: Staging memory (packed writes): ranges of it are lent by the endpoint.
        self.staging = np.zeros(net.packing.staging_bytes if net.packing else 0, np.uint8)
        self.alive = True
        self.rejected: list[Rejected] = []
        self.log: list[tuple[float, Action]] = []
        #: Digests (rule 11): sealed on the producer, checked on the consumer.
        self.integrity = Integrity(net.integrity, info.layout, lambda: self.memory,
                                   injector=net.injector, rank=info.rank)

    def apply(self, actions: list[Action]) -> None:
        if actions and timeline.enabled():  # the protocol steps, at simulated time
            timeline.actions(self.name, actions, self.net.now, self.grace)
        for a in actions:
            if self.net.keep_log:
                self.log.append((self.net.now, a))
            if isinstance(a, SendMessage):
                self.net.send(self.peer, a.peer, encode(a.message))
            elif isinstance(a, Rejected):
                self.rejected.append(a)
            else:
                self.handle(a)

    def handle(self, action: Action) -> None:  # pragma: no cover - overridden
        raise NotImplementedError(action)

    def frame(self, data: bytes, now: float) -> None:
        raise NotImplementedError  # pragma: no cover


class ProducerNode(Node):
    def __init__(self, net: InMemoryNetwork, endpoint: Producer, memory: list[np.ndarray]):
        super().__init__(net, endpoint.info, memory)
        self.endpoint = endpoint
        self.released: Counter[str] = Counter()  # by transfer id (every incarnation)
        self.released_by_key: Counter[tuple[str, int]] = Counter()  # by (id, incarnation)
        self.released_at: dict[tuple[str, int], float] = {}  # when, by (id, incarnation)
        self.published: dict[str, Publish] = {}
        #: (transfer id, incarnation, consumer rank) of each registration taken in: a
        #: Register, or a Skip (nothing to write for that consumer rank)
        self.registrations: set[tuple[str, int, int]] = set()
        self.writes = 0  # writes started (every attempt and part)

    def handle(self, a: Action) -> None:
        if isinstance(a, IssueWrite):
            self.writes += 1
            tag = self.integrity.tag(a) if self.net.integrity.enabled else None
            if tag is not None:  # over the source bytes as they are now
                self.net.tags[id(a)] = (a, tag)
            if a.packed is not None:  # rule 10: gathered now, into the staging lent to it
                pw = a.packed
                gather_host(pw.packed, self.memory,
                            self.staging[pw.src_offset:pw.src_offset + pw.packed.nbytes])
            self.net.post_write(self.peer, a)
        elif isinstance(a, ReleaseSource):
            key = (a.transfer_id, a.incarnation)
            self.released[a.transfer_id] += 1
            self.released_by_key[key] += 1
            self.released_at.setdefault(key, self.net.now)
            if self.released_by_key[key] > 1:
                self.net.violations.append(f"{self.peer}: source of {key} released twice")
        elif isinstance(a, Publish):
            self.published[a.transfer_id] = a
        else:  # pragma: no cover
            raise AssertionError(f"unexpected producer action {a!r}")

    def frame(self, data: bytes, now: float) -> None:
        self.apply(self.endpoint.receive_bytes(data, now))
        try:
            msg = decode(data)
        except DecodeError:
            return
        if isinstance(msg, Register | Skip):
            self.registrations.add((msg.transfer_id, msg.incarnation, msg.rank))


class ConsumerNode(Node):
    def __init__(self, net: InMemoryNetwork, endpoint: Consumer, memory: list[np.ndarray]):
        super().__init__(net, endpoint.info, memory)
        self.endpoint = endpoint
        self.grace = endpoint.config.fence_grace_s
        self.outcomes: dict[str, list[tuple[str, int]]] = {}  # by id (every incarnation)
        self.outcomes_by_key: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self.released: list[ReleaseDestination] = []
        self.staging_released: list[ReleaseStaging] = []
        self.connects: list[str] = []

    def _outcome(self, kind: str, a: TransferReady | TransferFailed | TransferCancelled) -> None:
        self.outcomes.setdefault(a.transfer_id, []).append((kind, a.attempt))
        self.outcomes_by_key.setdefault((a.transfer_id, a.incarnation), []).append(
            (kind, a.attempt))

    def handle(self, a: Action) -> None:
        if isinstance(a, TransferReady):
            self._outcome("ready", a)
            if (a.transfer_id, a.incarnation, a.attempt) in self.integrity.injected_keys:
                self.net.stats["served_from_corrupt"] += 1  # READY over injected bytes
        elif isinstance(a, TransferFailed):
            self._outcome("failed", a)
        elif isinstance(a, TransferCancelled):
            self._outcome("cancelled", a)
        elif isinstance(a, ReleaseDestination):
            self.released.append(a)
        elif isinstance(a, ReleaseStaging):
            self.staging_released.append(a)
        elif isinstance(a, Scatter):
            self.net.enqueue("scatter", self.peer, self.peer, a, self.net.write_latency)
        elif isinstance(a, IssueRead):
            self.net.post_read(self.peer, a)
        elif isinstance(a, Connect):
            self.connects.append(a.engine_id)
            self.net.connect(self.peer, a.engine_id)
        else:  # pragma: no cover
            raise AssertionError(f"unexpected consumer action {a!r}")

    def frame(self, data: bytes, now: float) -> None:
        note = self._notified(data, now) if timeline.enabled() else None
        checked, corrupt = self.integrity.stats["checked"], self.integrity.stats["corrupt"]
        if self.net.integrity.enabled or self.net.injector is not None:
            actions = self.integrity.deliver(self.endpoint, data, now)
        else:
            actions = self.endpoint.receive_bytes(data, now)
        if note is not None and self.integrity.stats["checked"] > checked:
            timeline.checked(self.name, note.transfer_id, note.incarnation, note.attempt,
                             (note.engine_id, note.rank),
                             self.integrity.stats["corrupt"] == corrupt, now)
        self.apply(actions)

    def _notified(self, data: bytes, now: float) -> Notify | None:
        """Record a notification's arrival (timeline steps); the Notify, if it is one."""
        try:
            frame, tag = unseal(data)
            msg = decode(frame)
        except DecodeError:
            return None
        if not isinstance(msg, Notify):
            return None
        timeline.notified(self.name, msg, tag is not None and self.net.integrity.enabled, now)
        return msg

    def outcome(self, transfer_id: str) -> str | None:
        seen = self.outcomes.get(transfer_id)
        return seen[-1][0] if seen else None


class InMemoryNetwork:
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
                    node.apply(node.endpoint.read_completed(
                        action.transfer_id, action.attempt, action.peer, ok, self.now,
                        incarnation=action.incarnation))
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


def pair(
    producer: list[RankInfo],
    consumer: list[RankInfo],
    *,
    seed: int = 0,
    delivery_seed: int | None = None,
    producer_config: ProducerConfig | None = None,
    consumer_config: ConsumerConfig | None = None,
    **net_kwargs: Any,
) -> InMemoryNetwork:
    """A network with one producer and one consumer engine, handshakes done.

    Source memory is filled with random bytes seeded by ``seed``, destination
    memory with zeros; adversarial delivery draws from ``delivery_seed`` (None:
    ``seed`` too). Other keywords go to :class:`InMemoryNetwork`.
    """
    rng = np.random.default_rng(seed)
    net = InMemoryNetwork(seed=seed if delivery_seed is None else delivery_seed, **net_kwargs)
    for info in producer:
        net.add_producer(info, producer_config, region_memory(info.layout, rng=rng))
    for info in consumer:
        net.add_consumer(info, consumer_config)
    net.handshake()
    return net


__all__ = [
    "DELIVERIES", "ConsumerNode", "Flight", "InMemoryNetwork", "Item", "Piece", "ProducerNode",
    "copy_plan",
    "pair", "region_memory", "touched_blocks",
]


class InMemoryCluster:
    """The conformance-suite :class:`~pushkv.transports.conformance.Cluster` over this transport.

    Waits run the network in simulated time, so a 3-second window takes no
    wall-clock time at all. ``delivery`` and ``seed`` (None: the topology's)
    choose the network's delivery model (:class:`InMemoryNetwork`).
    """

    def __init__(self, topology: Any, packing: PackingConfig | None = None, *,
                 delivery: str = "adversarial", seed: int | None = None) -> None:
        self.topology = topology
        self.net = pair(
            topology.producer_ranks(), topology.consumer_ranks(), seed=topology.seed,
            delivery_seed=seed,
            producer_config=topology.producer_config, consumer_config=topology.consumer_config,
            packing=packing, delivery=delivery,
        )

    # Everything an engine-level call does happens on every rank of that engine.
    def _consumers(self) -> list[ConsumerNode]:
        return [n for n in self.net.consumers.values() if n.alive]

    def _producers(self) -> list[ProducerNode]:
        return [n for n in self.net.producers.values() if n.alive]

    def register(self, transfer_id: str, dst_block_ids: Sequence[int], num_tokens: int,
                 first_token: int = 0, *, incarnation: int = 0) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.register(transfer_id, "prefill-0", dst_block_ids, num_tokens,
                                        self.net.now, first_token, incarnation=incarnation))

    def prefill_finished(self, transfer_id: str, src_block_ids: Sequence[int],
                         num_tokens: int, *, incarnation: int = 0) -> None:
        for n in self._producers():
            n.apply(n.endpoint.prefill_finished(transfer_id, src_block_ids, num_tokens,
                                                self.net.now, incarnation=incarnation))

    def range_ready(self, transfer_id: str, src_block_ids: Sequence[int],
                    tokens: tuple[int, int], layers: tuple[int, int] | None = None) -> None:
        """Progressive push: part of the prefill is final (see Producer.range_ready)."""
        for n in self._producers():
            n.apply(n.endpoint.range_ready(transfer_id, src_block_ids, tokens, self.net.now,
                                           layers=layers))

    def preempt(self, transfer_id: str) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.preempt(transfer_id, self.net.now))

    def reissue(self, transfer_id: str, dst_block_ids: Sequence[int]) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.reissue(transfer_id, dst_block_ids, self.net.now))

    def abort(self, transfer_id: str) -> None:
        for n in self._consumers():
            n.apply(n.endpoint.abort(transfer_id, self.net.now))

    def prefill_aborted(self, transfer_id: str) -> None:
        for n in self._producers():
            n.apply(n.endpoint.prefill_aborted(transfer_id, self.net.now))

    def inject(self, side: str, rank: int, channel: str, frame: bytes) -> None:
        engine = "prefill-0" if side == "producer" else "decode-0"
        self.net.inject(Peer(engine, rank), frame)  # one channel carries both here

    def kill_producer(self) -> None:
        self.net.kill("prefill-0")

    def snapshot(self) -> Any:
        from .conformance import Snapshot

        outcomes: dict[tuple[int, str], list[tuple[str, int]]] = {}
        dst_released: Counter[tuple[int, str, int]] = Counter()
        for c in self.net.consumers.values():
            for tid, seen in c.outcomes.items():
                outcomes[c.peer.rank, tid] = list(seen)
            for r in c.released:
                dst_released[c.peer.rank, r.transfer_id, r.attempt] += 1
        src_released = {
            (p.peer.rank, tid): n for p in self.net.producers.values()
            for tid, n in p.released.items()
        }
        rejected = {("producer", p.peer.rank): len(p.rejected)
                    for p in self.net.producers.values()}
        rejected |= {("consumer", c.peer.rank): len(c.rejected)
                     for c in self.net.consumers.values()}
        return Snapshot(
            outcomes=outcomes, src_released=src_released, dst_released=dict(dst_released),
            rejected=rejected,
            lent={c.peer.rank: c.endpoint.lent_blocks() for c in self.net.consumers.values()
                  if c.alive},
            held={p.peer.rank: sorted(p.endpoint.held_blocks())
                  for p in self.net.producers.values() if p.alive},
            registrations={p.peer.rank: sorted(p.registrations)
                           for p in self.net.producers.values()},
            writes={p.peer.rank: p.writes for p in self.net.producers.values()},
            violations=list(self.net.violations),
        )

    def wait(self, predicate: Any, timeout_s: float) -> Any:
        end = self.net.now + timeout_s
        while True:
            snap = self.snapshot()
            if predicate(snap) or self.net.now >= end:
                return snap
            step = min(end, self.net.now + 0.01)
            self.net.run(until=step)

    def source_memory(self, rank: int) -> list[np.ndarray]:
        return self.net.producers[Peer("prefill-0", rank)].memory

    def destination_memory(self, rank: int) -> list[np.ndarray]:
        return self.net.consumers[Peer("decode-0", rank)].memory

    def close(self) -> None:
        pass
