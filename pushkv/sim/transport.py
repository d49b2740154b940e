"""A simulated transport that drives the real :mod:`pushkv.protocol` endpoints.

Engines call the endpoints through this class (``register``,
``start_pull``, ``prefill_finished``); every list of actions the endpoints
return is carried out here, in simulated time:

* ``SendMessage`` -- the message is encoded with the real wire codec and
  handed to the peer's ``receive_bytes`` after the control latency (or lost,
  when a fault says so);
* ``IssueWrite`` -- queued on the prefill node's **background writer thread**,
  which pays the posting cost (fixed + per descriptor of the real plan) while
  the bytes cross the fabric (the NIC starts on each descriptor as it is
  posted); then the notification reaches the consumer and the producer learns
  the write completed;
* ``IssueRead`` -- pull: posted **inline** by the decode engine loop (the cost
  is returned to the engine, which stalls its step by it) or, in pull-async, by
  a decode background thread; the bytes cross while it posts; then
  ``read_completed``;
* ``Publish``, ``ReleaseSource``, ``ReleaseDestination``, ``TransferReady``,
  ``TransferFailed``, ``TransferCancelled`` -- handed to the engine that owns
  the endpoint;
* timers -- each endpoint's ``next_deadline()`` is armed as a SimPy timeout
  that calls ``handle_timer``.

Only one rank per engine is driven: all TP ranks of an engine are symmetric
(same block ids, same plan shape, same timings), so rank 0 of a TP-``n``
producer and rank 0 of a TP-``n`` consumer stand for the whole engine.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol

import numpy as np
import simpy

from ..protocol import (
    Action,
    Connect,
    Consumer,
    FailurePolicy,
    Heartbeat,
    IssueRead,
    IssueWrite,
    Mode,
    Peer,
    Producer,
    Publish,
    RankInfo,
    Register,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    SendMessage,
    TransferCancelled,
    TransferFailed,
    TransferReady,
    encode,
    expected_writers,
)
from ..protocol.messages import MAX_HEARTBEAT_ITEMS
from ..protocol.packing import PackingConfig
from .costs import post_s
from .feed import Layers
from .host.model import HostModel
from .marks import Timeline
from .network import Network
from .packing import SIM_PACKING, StagingLedger
from .profile import Profile
from .scenario import FaultConfig, ProtocolSettings


class ProducerHost(Protocol):
    """What the prefill engine does with its endpoint's outputs."""

    def published(self, transfer_id: str, block_ids: tuple[int, ...], num_tokens: int) -> None: ...
    def release_source(self, transfer_id: str, block_ids: tuple[int, ...]) -> None: ...


class ConsumerHost(Protocol):
    """What the decode engine does with its endpoint's outputs."""

    def transfer_ready(self, transfer_id: str) -> None: ...
    def transfer_failed(self, transfer_id: str, reason: str, policy: FailurePolicy) -> None: ...
    def transfer_cancelled(self, transfer_id: str) -> None: ...
    def release_destination(self, transfer_id: str, block_ids: tuple[int, ...]) -> None: ...
    def connected(self, producer: str) -> None: ...


class SimTransport:
    """Endpoints of every engine, the control plane, the writer/reader threads and timers,
    their processes on ``host`` (:mod:`pushkv.sim.host`)."""

    def __init__(
        self,
        env: simpy.Environment,
        profile: Profile,
        network: Network,
        settings: ProtocolSettings,
        faults: FaultConfig,
        fault_rng: random.Random,
        host: HostModel,
        skew_rng: np.random.Generator | None = None,
        packing: PackingConfig = SIM_PACKING,
    ) -> None:
        self.env = env
        self.host = host
        self.staging = StagingLedger(packing, profile.network)
        self.profile = profile
        self.net = network
        self.settings = settings
        self.faults = faults
        self._rng = fault_rng
        self._skew_rng = skew_rng or np.random.default_rng(0)
        self.skews: list[float] = []  #: the slowest rank's X of every transfer
        self.producers: dict[str, Producer] = {}
        self.consumers: dict[str, Consumer] = {}
        self._producer_hosts: dict[str, ProducerHost] = {}
        self._consumer_hosts: dict[str, ConsumerHost] = {}
        self._writer: dict[str, simpy.Resource] = {}  # prefill background thread
        self._reader: dict[str, simpy.Resource] = {}  # decode background thread (pull-async)
        #: each engine process's interpreter lock: its loop and its posting thread share it
        self.gil: dict[str, simpy.Resource] = {}
        self._loop_holds_until: defaultdict[str, float] = defaultdict(float)
        self.gil_wait_s: defaultdict[str, float] = defaultdict(float)
        self._connecting: set[tuple[str, str]] = set()
        ctl = profile.control
        self._gil_contended = bool(profile.network.post_gil_fraction > 0
                                   or ctl.message_send_s > 0 or ctl.message_recv_s > 0)
        self.alive: set[str] = set()
        self.known_dead: set[str] = set()  #: deaths already reported to the endpoints
        self.death_listeners: list[Callable[[str], None]] = []
        self._armed: dict[str, set[float]] = {}
        self.inflight = 0  #: messages, posts and transfers not yet finished
        self.stats: Counter[str] = Counter()
        self.rejected: list[Rejected] = []
        self.descriptors: list[int] = []  #: descriptor count of every transfer issued
        #: per transfer id: (time, bytes) of each write whose notification left
        self.writes_done: defaultdict[str, list[tuple[float, int]]] = defaultdict(list)
        #: posting seconds by thread: "decode-loop", "decode-bg", "prefill-bg"
        self.post_s_by_thread: defaultdict[str, float] = defaultdict(float)
        self.timeline: Timeline | None = None  #: per-request marks, when recording

    def mark(self, transfer_id: str, event: str) -> None:
        """A timeline mark of ``transfer_id`` now (nothing unless recording)."""
        if self.timeline is not None:
            self.timeline.mark(transfer_id, event, self.env.now)

    # ------------------------------------------------------------------ set-up

    def add_producer(self, info: RankInfo, host: ProducerHost) -> None:
        eid = info.engine_id
        self.producers[eid] = Producer(info, self.settings.producer_config())
        self._producer_hosts[eid] = host
        self._writer[eid] = simpy.Resource(self.env, capacity=1)
        self._add_node(eid)

    def add_consumer(self, info: RankInfo, host: ConsumerHost) -> None:
        eid = info.engine_id
        self.consumers[eid] = Consumer(info, self.settings.consumer_config())
        self._consumer_hosts[eid] = host
        self._reader[eid] = simpy.Resource(self.env, capacity=1)
        self._add_node(eid)

    def _add_node(self, eid: str) -> None:
        self.net.add_node(eid)
        self.gil[eid] = simpy.Resource(self.env, capacity=1)
        self.alive.add(eid)
        self._armed[eid] = set()

    def handshake(self) -> None:
        """Every producer meets every consumer (the NIXL handshake, before the run), unless
        ``control.handshake_before_run`` is off: then a consumer's first transfer to a
        producer emits the core's ``Connect`` and waits ``control.handshake_s``."""
        for p in self.producers.values():
            for c in self.consumers.values():
                writers = expected_writers(p.info.engine, c.info.engine, c.info.rank)
                if writers != {p.info.rank}:  # pragma: no cover - guarded by SimConfig
                    raise AssertionError(f"rank {c.info.rank} expects writers {set(writers)}")
                if self.profile.control.handshake_before_run:
                    p.add_peer(c.info)
                    c.add_peer(p.info)

    def knows(self, decode: str, producer: str) -> bool:
        """Whether ``decode`` has handshaken with ``producer`` (pull plans need it)."""
        return self.consumers[decode].knows(producer)

    def connect(self, decode: str, producer: str) -> None:
        """Pull: handshake before the read can be planned (vLLM's ``_ensure_handshake``);
        the decode engine is poked when it is done."""
        if (decode, producer) not in self._connecting:
            self._connect(decode, producer)

    def _connect(self, decode: str, producer: str) -> None:
        """The NIXL handshake of ``decode`` with ``producer``'s ranks, then ``add_peer``."""
        self._connecting.add((decode, producer))
        self.stats["handshakes"] += 1

        def done(_: Any) -> None:
            self._connecting.discard((decode, producer))
            if decode not in self.alive:
                return
            c = self.consumers[decode]
            if producer not in self.alive:
                self._apply(decode, c.handshake_failed(producer, "producer is down",
                                                       self.env.now))
                return
            p = self.producers[producer]
            self._apply(producer, p.add_peer(c.info, now=self.env.now))
            self._apply(decode, c.add_peer(p.info, now=self.env.now))
            self._consumer_hosts[decode].connected(producer)

        self.env.timeout(self.profile.control.handshake_s).callbacks.append(done)

    # ------------------------------------------------------ calls from engines

    def register(
        self, decode: str, transfer_id: str, producer: str, block_ids: Sequence[int],
        num_tokens: int, *, incarnation: int = 0, target: int = 0,
    ) -> None:
        """Push: the decode engine allocated blocks; the registration is born."""
        c = self.consumers[decode]
        self._apply(decode, c.register(transfer_id, producer, block_ids, num_tokens,
                                       self.env.now, incarnation=incarnation, target=target))

    def consumed(self, decode: str, transfer_id: str) -> None:
        """Push: the decode engine took its first step from ``transfer_id``'s KV. With
        a producer hold (``retarget_hold_s``), its ``Consumed`` lets a source kept for
        a re-target go (protocol rule 12); with none, nothing lingers and nothing is
        sent (as a deployment without holds need not)."""
        if self.settings.retarget_hold_s and decode in self.alive:
            self._apply(decode, self.consumers[decode].consumed(transfer_id, self.env.now))

    def preempt(self, decode: str, transfer_id: str) -> None:
        """Decode preempted a request whose transfer is in flight: fence, then release."""
        self.stats["preempted_transfers"] += 1
        self._apply(decode, self.consumers[decode].preempt(transfer_id, self.env.now))

    def reissue(self, decode: str, transfer_id: str, block_ids: Sequence[int]) -> None:
        """A preempted transfer registers again into new blocks: a new attempt."""
        self.stats["reissued"] += 1
        self._apply(decode, self.consumers[decode].reissue(transfer_id, block_ids,
                                                           self.env.now))

    def start_pull(
        self, decode: str, transfer_id: str, producer: str, src_ids: Sequence[int],
        dst_ids: Sequence[int], num_tokens: int, *, inline_after: float | None,
        incarnation: int = 0,
    ) -> float:
        """Pull: read ``src_ids`` into ``dst_ids``.

        With ``inline_after`` set, the decode engine loop posts the read itself,
        after ``inline_after`` seconds of other posting in the same step; the
        posting seconds are returned so the engine stalls its step by them.
        With ``None`` a decode background thread posts and 0 is returned.
        """
        c = self.consumers[decode]
        actions = c.start_pull(transfer_id, producer, src_ids, dst_ids, num_tokens, self.env.now,
                               incarnation=incarnation)
        return self._apply(decode, actions, inline_after=inline_after)

    def prefill_finished(
        self, prefill: str, transfer_id: str, block_ids: Sequence[int], num_tokens: int,
        mode: Mode, *, incarnation: int = 0,
    ) -> None:
        p = self.producers[prefill]
        if mode is Mode.PUSH:
            self.mark(transfer_id, "write_handed")
        self._apply(prefill, p.prefill_finished(transfer_id, block_ids, num_tokens,
                                                self.env.now, mode=mode,
                                                incarnation=incarnation))

    def range_ready(
        self, prefill: str, transfer_id: str, block_ids: Sequence[int], tokens: tuple[int, int],
        *, layers: tuple[int, int] | None = None, incarnation: int = 0,
    ) -> None:
        """Progressive push: tokens ``[a, b)`` of a prompt still prefilling are final in
        ``layers`` (None: every layer); the producer endpoint writes them to registered
        legs (one write in flight per leg; what comes meanwhile joins the next)."""
        if prefill not in self.alive:
            return
        self.stats["ranges_reported"] += 1
        self._apply(prefill, self.producers[prefill].range_ready(
            transfer_id, block_ids, tokens, self.env.now, layers=layers,
            incarnation=incarnation))

    def heartbeat_queued(
        self, decode: str, producer: str, transfers: Sequence[tuple[str, int]]
    ) -> None:
        """vLLM's decode scheduler renews the leases of requests still queued on it.

        Its connector tracks every request with remote KV from ``on_new_request``
        on and heartbeats them all, scheduled or not (``nixl_kv_cache_lease.md``);
        the consumer endpoint only knows transfers once they started, so the
        engine sends these itself, as vLLM's scheduler does beside its worker.
        """
        c = self.consumers[decode].info
        peer = Peer(producer, 0)  # rank 0 stands for every rank
        for i in range(0, len(transfers), MAX_HEARTBEAT_ITEMS):
            msg = Heartbeat(engine_id=c.engine_id, rank=c.rank, transfers=tuple(
                (tid, 0, inc) for tid, inc in transfers[i:i + MAX_HEARTBEAT_ITEMS]))
            self.stats["sent_queued_Heartbeat"] += 1
            self._deliver_later(peer, encode(msg), self.profile.network.control_latency_s,
                                src=decode)

    def prefill_aborted(self, prefill: str, transfer_id: str) -> None:
        self._apply(prefill, self.producers[prefill].prefill_aborted(transfer_id, self.env.now))

    def _slowest_rank(self, tp: int) -> float:
        """X of the slowest of ``tp`` ranks: it takes (1 + X) times the representative's."""
        net = self.profile.network
        if net.rank_skew == 0 or tp <= 1:
            return 0.0
        if net.rank_skew_dist == "fixed":
            x = 2.0 * net.rank_skew
        else:
            x = float(self._skew_rng.exponential(net.rank_skew, size=tp).max())
        self.skews.append(x)
        return x

    def _post_holding_gil(self, eid: str, cost: float) -> Generator[Any, Any, None]:
        """A background thread posts for ``cost`` seconds, holding ``eid``'s interpreter
        lock for ``post_gil_fraction`` of them (measured: NIXL's transfer() releases the
        lock; preparing the request holds it, about 0.3% of a post in all)."""
        held = cost * self.profile.network.post_gil_fraction
        if held > 0:
            yield from self._hold_gil(eid, held)
        if cost > held:
            yield self.env.timeout(cost - held)

    def run_step(self, eid: str, python_s: float, dt: float, layers: Layers | None = None,
                 at_forward: Callable[[], None] | None = None
                 ) -> Generator[Any, Any, float]:
        """An engine step of ``dt`` seconds whose first ``python_s`` need the interpreter
        lock: it waits while a posting thread of the same process holds it. The step is
        work on the host, which also runs what the processes around it do meanwhile
        (:meth:`HostModel.beside`). With ``layers`` (layer-wise push) the step's compute
        is cut at each layer's end, where ``layers.done(l)`` is called. ``at_forward()``
        is called once the step's first ``python_s`` has run, where its forward starts.
        Returns the seconds the step took."""
        if layers is not None and at_forward is not None:
            raise ValueError("a step's forward is cut by its layers or called back at its "
                             "start, not both")
        start = self.env.now
        host = self.host
        side = self._side(eid)
        host.beside(side, dt)
        lock = self.gil[eid]
        if python_s > 0 and self._gil_contended and (lock.count or lock.queue):
            with lock.request() as req:
                yield req
                self.gil_wait_s[eid] += self.env.now - start
                yield host.work(min(python_s, dt), side)
            if at_forward is not None:
                at_forward()
            if layers is not None:
                yield from layers.run(host, min(python_s, dt), side)
            elif dt > python_s:
                yield host.work(dt - python_s, side)
        else:  # the lock is free: hold it for python_s without queueing (the fast path)
            self._loop_holds_until[eid] = start + min(python_s, dt)
            if at_forward is not None:  # the interpreter part, then the forward
                if python_s > 0:
                    yield host.work(min(python_s, dt), side)
                at_forward()
                if dt > python_s:
                    yield host.work(dt - python_s, side)
            elif layers is not None:
                yield from layers.run(host, 0.0, side)
            else:
                yield host.work(dt, side)
        return self.env.now - start

    def _side(self, eid: str) -> str:
        """The side engine ``eid`` is on: "prefill" or "decode"."""
        return "prefill" if eid in self.producers else "decode"

    # ------------------------------------------------------------------ deaths

    def kill(self, engine_id: str) -> None:
        """``engine_id`` dies now; every live endpoint learns after ``detect_s``."""
        if engine_id not in self.alive:
            return
        self.alive.discard(engine_id)
        self.stats["deaths"] += 1
        delay = self.faults.detect_s

        def tell(_: Any) -> None:
            self.known_dead.add(engine_id)
            for eid in sorted(self.alive):
                ep = self.producers.get(eid) or self.consumers[eid]
                self._apply(eid, ep.peer_died(engine_id, self.env.now))
            for listener in self.death_listeners:
                listener(engine_id)

        self.env.timeout(delay).callbacks.append(tell)

    # ----------------------------------------------------------------- actions

    def _apply(
        self, eid: str, actions: list[Action], *, inline_after: float | None = None
    ) -> float:
        """Carry out ``actions`` of engine ``eid``'s endpoint; return inline posting seconds."""
        stall = 0.0
        for a in actions:
            if isinstance(a, SendMessage):
                self._send(eid, a.peer, a)
            elif isinstance(a, Connect):
                self._connect(eid, a.engine_id)
            elif isinstance(a, IssueWrite):
                self.mark(a.transfer_id, "write_posted")
                self.descriptors.append(a.plan.descriptor_count)
                self._spawn(self._write(eid, a))
            elif isinstance(a, IssueRead):
                self.descriptors.append(a.plan.descriptor_count)
                if inline_after is None:
                    self._spawn(self._read(eid, a, None))
                else:
                    cost = post_s(self.profile.network, a.plan.descriptor_count)
                    self.post_s_by_thread["decode-loop"] += cost
                    x = self._slowest_rank(self.profile.decode.tp)
                    self._spawn(self._read(eid, a, (inline_after + stall, cost), x))
                    stall += cost * (1.0 + x)  # the step waits for the slowest poster
            elif isinstance(a, Publish):
                self._producer_hosts[eid].published(a.transfer_id, a.block_ids, a.num_tokens)
            elif isinstance(a, ReleaseSource):
                self.stats["release_source"] += 1
                self._producer_hosts[eid].release_source(a.transfer_id, a.block_ids)
            elif isinstance(a, ReleaseDestination):
                self.stats["release_destination"] += 1
                self._consumer_hosts[eid].release_destination(a.transfer_id, a.block_ids)
            elif isinstance(a, TransferReady):
                self.stats["ready"] += 1
                self._consumer_hosts[eid].transfer_ready(a.transfer_id)
            elif isinstance(a, TransferFailed):
                self.stats["failed"] += 1
                self._consumer_hosts[eid].transfer_failed(a.transfer_id, a.reason, a.policy)
            elif isinstance(a, TransferCancelled):
                self.stats["cancelled"] += 1
                self._consumer_hosts[eid].transfer_cancelled(a.transfer_id)
            elif isinstance(a, Rejected):
                self.stats["rejected"] += 1
                self.rejected.append(a)
            else:  # pragma: no cover
                raise AssertionError(f"unknown action {a!r}")
        self._arm(eid)
        return stall

    def _spawn(self, gen: Generator[Any, Any, None]) -> None:
        self.inflight += 1

        def run() -> Generator[Any, Any, None]:
            try:
                yield from gen
            finally:
                self.inflight -= 1

        self.env.process(run())

    def _send(self, src: str, peer: Peer, action: SendMessage) -> None:
        msg = action.message
        kind = type(msg).__name__
        self.stats[f"sent_{kind}"] += 1
        if isinstance(msg, Register) and self._lose(self.faults.drop_register):
            self.stats["lost_Register"] += 1
            return
        arrival = None
        if isinstance(msg, Register) and self.timeline is not None:
            self.mark(msg.transfer_id, "registration_sent")
            tid = msg.transfer_id
            arrival = lambda: self.mark(tid, "registration_received")  # noqa: E731
        self._deliver_later(peer, encode(msg), self.profile.network.control_latency_s, src=src,
                            on_arrival=arrival)

    def _lose(self, p: float) -> bool:
        return p > 0 and self._rng.random() < p

    def _deliver_later(
        self, peer: Peer, frame: bytes, delay: float, *, src: str | None = None,
        on_arrival: Callable[[], None] | None = None,
    ) -> None:
        """``frame`` reaches ``peer``'s endpoint after the sender's time (``src``; none for
        a notification riding on a write), ``delay`` in flight and the receiver's time;
        both hold their process's interpreter lock. ``on_arrival`` (a timeline mark) is
        called as it reaches a live endpoint."""
        ctl = self.profile.control
        delay += self.host.wake_s(self._side(peer.engine_id))  # its receiving thread wakes
        send = ctl.message_send_s if src is not None else 0.0
        if send == 0 and ctl.message_recv_s == 0:
            self.inflight += 1

            def deliver(_: Any) -> None:
                self.inflight -= 1
                if on_arrival is not None and peer.engine_id in self.alive:
                    on_arrival()
                self._receive(peer.engine_id, frame)

            self.env.timeout(delay).callbacks.append(deliver)
            return

        def carry() -> Generator[Any, Any, None]:
            if send > 0 and src is not None and src in self.alive:
                yield from self._hold_gil(src, send)
            yield self.env.timeout(delay)
            if ctl.message_recv_s > 0 and peer.engine_id in self.alive:
                yield from self._hold_gil(peer.engine_id, ctl.message_recv_s)
            if on_arrival is not None and peer.engine_id in self.alive:
                on_arrival()
            self._receive(peer.engine_id, frame)

        self._spawn(carry())

    def _receive(self, eid: str, frame: bytes) -> None:
        if eid not in self.alive:
            self.stats["frames_to_dead"] += 1
            return
        ep = self.producers.get(eid) or self.consumers[eid]
        self._apply(eid, ep.receive_bytes(frame, self.env.now))

    def _hold_gil(self, eid: str, seconds: float) -> Generator[Any, Any, None]:
        """A posting or message thread holds ``eid``'s interpreter lock for ``seconds``,
        after the engine loop's current hold, if any."""
        wait = self._loop_holds_until[eid] - self.env.now
        if wait > 0:
            yield self.env.timeout(wait)
        with self.gil[eid].request() as lock:
            yield lock
            yield self.env.timeout(seconds)

    def _write(self, eid: str, a: IssueWrite) -> Generator[Any, Any, None]:
        """The prefill background thread posts while the fabric moves; the consumer is told."""
        net = self.profile.network
        dst = a.peer.engine_id
        nbytes = a.plan.nbytes
        with self._writer[eid].request() as slot:
            yield slot
            yield from self.host.thread_wake("prefill")  # the writer thread wakes
            started = self.env.now
            pack = self.staging.decide(eid, dst, a.plan.descriptor_count, nbytes)
            if pack.packed:  # the gather runs on the device, issued by this thread
                yield self.env.timeout(self.staging.gather_s(nbytes))
            cost = post_s(net, pack.wire_descriptors)
            self.post_s_by_thread["prefill-bg"] += cost
            wire = self.env.process(self.net.transfer(
                eid, dst, nbytes, pack.wire_descriptors, read=False,
                posted_at=self.env.now + cost, poster=f"{eid}/writer"))
            yield from self._post_holding_gil(eid, cost)
        if eid not in self.alive:
            if pack.packed:
                self.staging.give_back(eid, dst, nbytes)
            return
        yield wire
        if pack.packed:  # the consumer scatters before the notification counts
            yield self.env.timeout(self.staging.scatter_s(nbytes))
            self.staging.give_back(eid, dst, nbytes)
        yield self.env.timeout(  # READY waits for the slowest rank's write
            self._slowest_rank(self.profile.prefill.tp) * (self.env.now - started))
        if net.notify_wait_s:  # the progress threads' polls on busy cores
            yield self.env.timeout(self.host.spread(net.notify_wait_s))
        if eid not in self.alive:
            self.stats["writes_lost"] += 1  # the producer died with its write
            return
        ok = dst in self.alive
        if ok:
            if self._lose(self.faults.drop_notify):
                self.stats["lost_Notify"] += 1
            else:
                tid = a.transfer_id
                self.writes_done[tid].append((self.env.now, nbytes))
                arrival = (None if self.timeline is None else
                           lambda: self.mark(tid, "notify_received"))
                self._deliver_later(a.peer, encode(a.notify), net.control_latency_s,
                                    on_arrival=arrival)
        self.mark(a.transfer_id, "write_completed")
        p = self.producers[eid]
        self._apply(eid, p.write_completed(a.transfer_id, a.attempt, a.peer, ok, self.env.now,
                                           incarnation=a.incarnation))

    def _read(
        self, eid: str, a: IssueRead, inline: tuple[float, float] | None, skew: float = 0.0,
    ) -> Generator[Any, Any, None]:
        """Pull: posted inline (``(start offset, seconds)`` within the engine's step, the
        slowest rank ``skew`` late) or by the decode background thread; the fabric moves
        while posting goes on."""
        src = a.peer.engine_id
        net = self.profile.network

        def wire(posted_at: float) -> simpy.Process:
            return self.env.process(self.net.transfer(
                src, eid, a.plan.nbytes, a.plan.descriptor_count, read=True,
                posted_at=posted_at, poster=f"{eid}/reader"))

        if inline is None:
            with self._reader[eid].request() as slot:
                yield slot
                yield from self.host.thread_wake("decode")  # the reader thread wakes
                started = self.env.now
                skew = self._slowest_rank(self.profile.decode.tp)
                cost = post_s(net, a.plan.descriptor_count)
                self.post_s_by_thread["decode-bg"] += cost
                moving = src in self.alive and eid in self.alive
                xfer = wire(self.env.now + cost) if moving else None
                yield from self._post_holding_gil(eid, cost)
        else:
            start, cost = inline
            if start > 0:
                yield self.env.timeout(start)
            started = self.env.now
            moving = src in self.alive and eid in self.alive
            xfer = wire(self.env.now + cost) if moving else None
            yield self.env.timeout(cost)
        if xfer is not None:
            yield xfer
        yield self.env.timeout(skew * (self.env.now - started))  # the slowest rank's read
        if eid not in self.alive:
            return
        held = self.producers[src].held_blocks() if src in self.alive else {}
        ok = (a.transfer_id, a.incarnation) in held
        c = self.consumers[eid]
        self._apply(eid, c.read_completed(a.transfer_id, a.attempt, a.peer, ok, self.env.now,
                                          incarnation=a.incarnation))

    # ------------------------------------------------------------------ timers

    def _arm(self, eid: str) -> None:
        if eid not in self.alive:
            return
        ep = self.producers.get(eid) or self.consumers[eid]
        when = ep.next_deadline()
        armed = self._armed[eid]
        if when is None or when in armed:
            return
        armed.add(when)

        def fire(_: Any) -> None:
            armed.discard(when)
            if eid in self.alive:
                self._apply(eid, ep.handle_timer(self.env.now))

        self.env.timeout(max(0.0, when - self.env.now)).callbacks.append(fire)

    # ----------------------------------------------------------- leak checks

    def leaks(self) -> dict[str, int]:
        """Blocks still held (producers) or lent (consumers) by live endpoints."""
        out: dict[str, int] = {}
        for eid, p in self.producers.items():
            if eid in self.alive:
                out[eid] = sum(len(b) for b in p.held_blocks().values())
        for eid, c in self.consumers.items():
            if eid in self.alive:
                out[eid] = len(c.lent_blocks())
        return out
