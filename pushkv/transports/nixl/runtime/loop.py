"""The I/O thread of a :class:`~.api.NixlRuntime`: the only thread that
touches the protocol endpoint, the side channel and the peer table.

It does I/O and nothing else: every protocol decision is the endpoint's
(:class:`~pushkv.protocol.Producer` / :class:`~pushkv.protocol.Consumer`); the
loop feeds it inputs (engine commands, decoded frames, notifications, write
completions, timers, handshake outcomes, peer deaths) and carries out the
actions it returns (send a message, post a write) or passes them to the
engine thread as events. The card exchange with producer engines is the table
of :mod:`.handshake`, carried out by the loop's :mod:`.cards` half.

One pass of the loop: wait in ``zmq.Poller.poll`` (side channel, liveness
monitors, wake-up pipe) until the earliest deadline, then run queued commands,
received frames, link transitions, write completions, the notification poll,
the endpoint's timers and the handshake and liveness deadlines.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pushkv import timeline
from pushkv.integrity import Corruption, Injector, Integrity, IntegrityConfig, unseal
from pushkv.protocol import (
    Action,
    Connect,
    Consumer,
    DecodeError,
    Hello,
    IssueRead,
    IssueWrite,
    Peer,
    Producer,
    PushKVError,
    Rejected,
    ReleaseSource,
    ReleaseStaging,
    Scatter,
    SendMessage,
    TransferFailed,
    TransferReady,
    ValidationError,
    decode,
    encode,
)
from pushkv.protocol.errors import ConfigError, RemoteProtocolError
from pushkv.protocol.events import Publish, sender_of
from pushkv.protocol.messages import Consumed, Notify, Register, Skip

from ..agent import Agent
from ..memory import KVMemory, bind_device, region_views
from ..reader import Reader, ReadJob, ReadResult
from ..sidechannel import channel as sc
from ..staging import Scatterer, ScatterResult, StagingMemory
from ..writer import WriteJob, Writer, WriteResult
from . import commands as cmd
from .cards import CardExchange
from .events import CallFailed, Event, RuntimeView, WritesDone
from .handshake import Handshakes
from .peers import PeerTable
from .seals import SealExchange

if TYPE_CHECKING:
    from ..config import NixlConfig

log = logging.getLogger(__name__)


class IOLoop(CardExchange):
    """Runs one rank's I/O thread. The engine thread only calls :meth:`submit`,
    :meth:`take_events`, :meth:`wait_events` and :meth:`stats`."""

    def __init__(self, endpoint: Producer | Consumer, agent: Agent, side: sc.SideChannel,
                 memory: KVMemory, card: sc.PeerCard, config: NixlConfig, *,
                 authenticated: bool, name: str, staging: StagingMemory | None = None) -> None:
        self.config = config
        self._endpoint = endpoint
        self._agent = agent
        self._side = side
        self._memory = memory
        self._card = card
        self._authenticated = authenticated
        self.role = "producer" if isinstance(endpoint, Producer) else "consumer"
        self._me = timeline.node(endpoint.info.engine_id, endpoint.info.rank)  # its steps
        self._grace = getattr(endpoint.config, "fence_grace_s", None)
        # engine thread -> I/O thread
        self._commands: deque[cmd.Command] = deque()
        self._completions: deque[WriteResult] = deque()
        self._read_completions: deque[ReadResult] = deque()
        self._scattered: deque[ScatterResult] = deque()  # rule 10: scatter thread -> here
        self._scatters = 0
        self._recent: deque[WriteResult] = deque(maxlen=256)
        #: producer: the last registrations taken in, newest last: (transfer id,
        #: incarnation, consumer rank) of each Register or Skip handed to the endpoint
        self._registrations: deque[tuple[str, int, int]] = deque(maxlen=256)
        #: producer: (writes, descriptors, bytes) so far of each transfer with a source
        self._cost: dict[tuple[str, int], tuple[int, int, int]] = {}
        # I/O thread -> engine thread
        self._events: deque[Event] = deque()
        self._events_cv = threading.Condition()
        self._idle = False  # the I/O thread is (about to be) waiting
        # Nudges (sc.NUDGE): writes started towards us whose notification has not
        # come yet, and until when notifications are polled every nudge_poll_s.
        self._nudged = 0
        self._fast_until = 0.0
        self._woken = False  # a wake-up byte is on its way
        self.closed = threading.Event()
        # I/O thread state
        self._stats: Counter[str] = Counter()
        self._noted: set[type[RemoteProtocolError]] = set()  # refusal kinds already logged
        self._stats_view: dict[str, int] = {}
        self._peers = PeerTable(side, agent, config.peer_confirm_s)
        # The card exchange gives up when the endpoint's own handshake timer would.
        self.handshakes = Handshakes(endpoint.config.handshake_timeout_s
                                     if isinstance(endpoint, Consumer) else float("inf"))
        self._writes = 0
        self._reads = 0
        #: rule 11: the IssueRead of each read in flight, by (id, incarnation, attempt, peer)
        self._read_actions: dict[tuple[str, int, int, Peer], IssueRead] = {}
        #: pulls waiting for their producer engine's handshake, by engine
        self._pulls: dict[str, list[cmd.StartPull]] = {}
        self._next_notif = 0.0
        self._writer: Writer | None = None
        #: ranges whose event has not completed, and the prefill_finished of their
        #: transfer (it must not post before they are final), in the engine's order
        self._unready: list[cmd.RangeReady | cmd.PrefillFinished] = []
        #: producer: transfers given a range whose prefill_finished/aborted has not come
        self._streaming: set[tuple[str, int]] = set()
        self._early_bytes = 0  # bytes of writes completed while streaming (writer thread)
        if self.role == "producer":
            self._writer = Writer(agent, memory, poll_s=config.write_poll_s,
                                  timeout_s=config.write_timeout_s, on_done=self._write_done,
                                  name=f"pushkv-writer-{name}", staging=staging)
        self._reader: Reader | None = None
        if self.role == "consumer":
            self._reader = Reader(agent, memory, poll_s=config.write_poll_s,
                                  timeout_s=config.write_timeout_s, on_done=self._read_done,
                                  name=f"pushkv-reader-{name}")
        self._scatterer: Scatterer | None = None
        if self.role == "consumer" and staging is not None:
            self._scatterer = Scatterer(staging, memory, self._scatter_done,
                                        name=f"pushkv-scatter-{name}")
        self._handlers: dict[type[Any], Callable[[Any, float], None]] = {
            cmd.Connect: self._connect,
            cmd.PrefillFinished: self._prefill_finished,
            cmd.RangeReady: self._range_ready,
            cmd.PrefillAborted: self._prefill_aborted,
            cmd.Register: self._register,
            cmd.StartPull: self._start_pull,
            cmd.Abandon: self._abandon,
            cmd.Preempt: self._preempt,
            cmd.Reissue: self._reissue,
            cmd.Abort: self._abort,
            cmd.Consumed: self._consumed,
            cmd.Inspect: self._inspect,
            cmd.Inject: self._inject,
        }
        # Rule 11: digests sealed on the producer, checked on the consumer.
        self._integrity = Integrity(
            IntegrityConfig.parse(config.integrity), endpoint.info.layout,
            lambda: self._regions(), injector=Injector.parse(config.inject)
            if config.inject and self.role == "consumer" else None,
            on_corrupt=self._corrupt, rank=endpoint.info.rank)
        self._seals = SealExchange(self._integrity, role=self.role,
                                   engine_id=endpoint.info.engine_id,
                                   wait_s=config.seal_wait_s, send=self._send_seal,
                                   finish=self._finish_read)
        self._region_cache: list[Any] | None = None
        self.thread = threading.Thread(target=self._run, name=f"pushkv-io-{name}", daemon=True)
        self.thread.start()

    # ================================================ engine-thread side

    def submit(self, command: cmd.Command) -> None:
        self._commands.append(command)
        if self._idle and not self._woken:
            self._wake()

    def _wake(self) -> None:
        """Interrupt the I/O thread's wait, only if it waits and nobody woke it yet.

        The I/O thread sets ``_idle`` *before* it looks at its queues one last
        time, and callers append *before* they read ``_idle``, so either the
        caller sees it idle and wakes it, or the I/O thread sees the new item.
        """
        if self._idle and not self._woken:
            self._woken = True
            self._side.wake()

    def take_events(self) -> list[Event]:
        events = self._events
        out = []
        while events:
            out.append(events.popleft())
        return out

    def wait_events(self, timeout_s: float) -> bool:
        with self._events_cv:
            return self._events_cv.wait_for(lambda: bool(self._events) or self.closed.is_set(),
                                            timeout_s)

    def stats(self) -> dict[str, int]:
        return dict(self._stats_view)

    # ======================================================== the thread

    def _run(self) -> None:
        side = self._side
        try:
            try:
                bind_device(self._memory)  # peers' metadata is loaded on this thread
            except Exception:
                log.exception("cannot make the CUDA device current on the I/O thread")
            while True:
                self._idle = True
                frames, links = side.poll(self._timeout(time.monotonic()))
                self._idle = self._woken = False
                now = time.monotonic()
                had_commands = bool(self._commands)
                if self._unready:
                    self._guard(self._ranges_due, now)
                if self._drain_commands(now):
                    break
                if had_commands and self._live():  # a new transfer: poll at the live rate now
                    self._next_notif = min(self._next_notif, now + self.config.active_poll_s)
                for kind, body in frames:
                    self._guard(self._on_frame, kind, body, now)
                for what, address in links:
                    self._guard(self._peers.transition, what, address, now)
                self._drain_completions(now)
                if now >= self._next_notif:
                    # A producer skips the poll while writing: NIXL's lock is held by
                    # the writer for the whole of a synchronous post, and this thread
                    # must stay free for the side channel.
                    if not self._writes and not self._reads:
                        self._guard(self._poll_notifications, now)
                    self._next_notif = now + self._notif_period(now)
                deadline = self._endpoint.next_deadline()
                if deadline is not None and deadline <= now:
                    self._guard(self._timers, now)
                self._guard(self._check_deadlines, now)
                if self._seals.parked:
                    self._guard(self._seals.expire, now)
                self._publish_stats()
        except BaseException:  # pragma: no cover - a bug; never die silently
            log.exception("pushkv I/O thread crashed")
            self._stats["crashed"] += 1
        finally:
            self._shutdown()

    def _notif_period(self, now: float) -> float:
        if self._nudged and now < self._fast_until:
            return self.config.nudge_poll_s
        self._nudged = 0
        return self.config.active_poll_s if self._live() else self.config.idle_poll_s

    def _nudge(self, now: float) -> None:
        """A producer starts a write to us: poll its notification fast (sc.NUDGE)."""
        self._stats["nudges"] += 1
        if self.config.nudge_window_s > 0:
            self._nudged += 1
            self._fast_until = now + self.config.nudge_window_s
            self._next_notif = min(self._next_notif, now + self.config.nudge_poll_s)

    def _timers(self, now: float) -> None:
        self._apply(self._endpoint.handle_timer(now), now)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        """Run one handler; a bug in it is logged and counted, the loop goes on."""
        try:
            fn(*args)
        except Exception:
            self._stats["internal_errors"] += 1
            log.exception("pushkv runtime handler failed")

    def _timeout(self, now: float) -> float:
        if self._completions or self._commands or self._read_completions or self._scattered:
            return 0.0
        if self._unready:  # a range waits for its event: poll it at the live rate
            return self.config.active_poll_s
        until = min(self._next_notif, self.handshakes.next_deadline(),
                    self._peers.next_deadline())
        for d in (self._endpoint.next_deadline(), self._seals.next_deadline()):
            if d is not None:
                until = min(until, d)
        return max(0.0, until - now)

    def _live(self) -> bool:
        return (self._endpoint.num_transfers > 0 or self._writes > 0 or self._reads > 0
                or self._scatters > 0)

    def _emit(self, event: Event) -> None:
        with self._events_cv:
            self._events.append(event)
            self._events_cv.notify_all()

    def _publish_stats(self) -> None:
        stats = self._stats
        stats["dropped_frames"] = self._side.dropped
        stats["bytes_written_early"] = self._early_bytes
        stats["staging_lent_bytes"] = self._endpoint.staging_lent  # a level, not a count
        for k, n in self._integrity.stats.items():  # rule 11: totals, not increments
            stats[f"integrity_{k}"] = n
        if self._authenticated:
            for reason, n in self._side.auth_dropped.items():  # totals, not increments
                stats[reason] = n
        self._stats_view = dict(stats)

    # ------------------------------------------------------------ commands

    def _drain_commands(self, now: float) -> bool:
        """Run queued engine-thread commands; True when asked to close."""
        commands = self._commands
        while commands:
            command = commands.popleft()
            if type(command) is cmd.Close:
                return True
            try:
                self._handlers[type(command)](command, now)
            except PushKVError as exc:
                self._emit(CallFailed(operation=cmd.operation_of(command),
                                      transfer_id=getattr(command, "transfer_id", None),
                                      error=str(exc)))
            except Exception as exc:
                self._stats["internal_errors"] += 1
                log.exception("pushkv command %s failed", cmd.operation_of(command))
                self._emit(CallFailed(operation=cmd.operation_of(command), transfer_id=None,
                                      error=repr(exc)))
        return False

    def _producer(self) -> Producer:
        if not isinstance(self._endpoint, Producer):
            raise ConfigError("this runtime is a consumer")
        return self._endpoint

    def _consumer(self) -> Consumer:
        if not isinstance(self._endpoint, Consumer):
            raise ConfigError("this runtime is a producer")
        return self._endpoint

    def _forget_ranges(self, tid: str, inc: int) -> None:
        """Prefill aborted (or finished): ranges still waiting for their event are moot."""
        self._unready = [r for r in self._unready
                         if (r.transfer_id, r.incarnation) != (tid, inc)]
        self._streaming.discard((tid, inc))

    def _prefill_finished(self, c: cmd.PrefillFinished, now: float) -> None:
        key = (c.transfer_id, c.incarnation)
        if any((r.transfer_id, r.incarnation) == key for r in self._unready):
            # A range of it waits for its event (a GPU still computing it): the whole
            # prompt is final only after that range is, so finish in order behind it.
            self._unready.append(c)
            return
        self._forget_ranges(c.transfer_id, c.incarnation)
        self._apply(self._producer().prefill_finished(
            c.transfer_id, c.block_ids, c.num_tokens, now, c.mode, incarnation=c.incarnation),
            now)

    def _range_ready(self, c: cmd.RangeReady, now: float) -> None:
        self._streaming.add((c.transfer_id, c.incarnation))
        if self._unready or (c.ready is not None and not c.ready.query()):
            self._unready.append(c)  # in order: later commands of the request wait too
            return
        self._apply(self._producer().range_ready(
            c.transfer_id, c.block_ids, c.tokens, now, layers=c.layers,
            incarnation=c.incarnation), now)

    def _ranges_due(self, now: float) -> None:
        """Feed the ranges whose event completed, in the order they were reported."""
        waiting, self._unready = self._unready, []
        while waiting:
            head = waiting[0]
            if isinstance(head, cmd.PrefillFinished):
                self._prefill_finished(waiting.pop(0), now)
            elif head.ready is None or head.ready.query():
                self._range_ready(waiting.pop(0), now)
            else:
                break
        self._unready = waiting + self._unready

    def _prefill_aborted(self, c: cmd.PrefillAborted, now: float) -> None:
        self._forget_ranges(c.transfer_id, c.incarnation)
        self._apply(self._producer().prefill_aborted(c.transfer_id, now,
                                                     incarnation=c.incarnation), now)

    def _connect(self, c: cmd.Connect, now: float) -> None:
        self._consumer()
        eng = self.handshakes.connect(c.engine_id, c.addresses)
        if c.eager:
            self._start_handshake(eng, now)

    def _register(self, c: cmd.Register, now: float) -> None:
        consumer = self._consumer()
        if c.producer_engine_id not in self.handshakes.engines:  # bad input: nothing changes
            raise ConfigError(f"no address for producer engine {c.producer_engine_id!r}: "
                              "call connect()", transfer_id=c.transfer_id)
        self._apply(consumer.register(c.transfer_id, c.producer_engine_id, c.block_ids,
                                      c.num_tokens, now, c.first_token,
                                      incarnation=c.incarnation, target=c.target), now)

    def _start_pull(self, c: cmd.StartPull, now: float) -> None:
        """Pull: the core plans the reads at once, so it needs the engine handshaken;
        until then the pull waits here (nothing is lent yet)."""
        consumer = self._consumer()
        eng = self.handshakes.engines.get(c.producer_engine_id)
        if eng is None:  # bad input: nothing changes
            raise ConfigError(f"no address for producer engine {c.producer_engine_id!r}: "
                              "call connect()", transfer_id=c.transfer_id)
        if c.producer_engine_id not in self.handshakes.ready:
            self._pulls.setdefault(c.producer_engine_id, []).append(c)
            self._start_handshake(eng, now)
            return
        # Rule 11: the publication's seals, one per producer rank read (bad: nothing changes).
        tags = Integrity.pull_seals(c.seals, consumer.producers.writers.get(
            c.producer_engine_id, ()), every_rank=c.every_rank)
        actions = consumer.start_pull(c.transfer_id, c.producer_engine_id, c.src_block_ids,
                                      c.block_ids, c.num_tokens, now, c.first_token,
                                      incarnation=c.incarnation,
                                      lease_s=None if c.lease_until is None
                                      else c.lease_until - now)
        # kept before the reads are posted: a read of part of a source asks as it goes
        self._integrity.expect_pull(c.transfer_id, c.incarnation, tags)
        self._apply(actions, now)

    def _pulls_settled(self, engine_id: str, now: float, error: str = "") -> None:
        """The handshake with ``engine_id`` ended: run (or refuse) the pulls that waited."""
        for c in self._pulls.pop(engine_id, ()):
            if error:
                self._emit(CallFailed(operation="start_pull", transfer_id=c.transfer_id,
                                      error=error))
            else:
                self._guard_call(c, now)

    def _guard_call(self, c: cmd.StartPull, now: float) -> None:
        try:
            self._start_pull(c, now)
        except PushKVError as exc:
            self._emit(CallFailed(operation="start_pull", transfer_id=c.transfer_id,
                                  error=str(exc)))

    def _abandon(self, c: cmd.Abandon, now: float) -> None:
        self._apply(self._consumer().abandon(c.transfer_id, c.producer_engine_id, now,
                                             incarnation=c.incarnation), now)

    def _preempt(self, c: cmd.Preempt, now: float) -> None:
        self._apply(self._consumer().preempt(c.transfer_id, now), now)

    def _reissue(self, c: cmd.Reissue, now: float) -> None:
        self._apply(self._consumer().reissue(c.transfer_id, c.block_ids, now), now)

    def _abort(self, c: cmd.Abort, now: float) -> None:
        self._apply(self._consumer().abort(c.transfer_id, now), now)

    def _consumed(self, c: cmd.Consumed, now: float) -> None:
        acts = self._consumer().consumed(c.transfer_id, now)
        if timeline.enabled() and any(isinstance(a, SendMessage) for a in acts):
            timeline.mark(c.transfer_id, "consumed_sent")
        self._apply(acts, now)

    def _inspect(self, c: cmd.Inspect, now: float) -> None:
        ep = self._endpoint
        self._publish_stats()
        c.reply.set_result(RuntimeView(
            lent=dict(ep.lent_blocks()) if isinstance(ep, Consumer) else {},
            held=ep.held_blocks() if isinstance(ep, Producer) else {},
            ready_engines=tuple(sorted(self.handshakes.ready)),
            writes_in_flight=self._writes,
            reads_in_flight=self._reads,
            stats=dict(self._stats_view),
            recent_writes=tuple(self._recent),
            recent_registrations=tuple(self._registrations),
            transfers=ep.num_transfers,
            staging_lent=ep.staging_lent,
            endpoint_stats=dict(ep.stats),
        ))

    def _inject(self, c: cmd.Inject, now: float) -> None:
        link = self._peers.by_peer.get(c.peer)
        if link is None:
            raise ConfigError(f"no handshake with {c.peer}")
        if c.channel == "notify":
            assert link.agent_name is not None
            self._agent.notify(link.agent_name, c.frame)
        else:
            self._side.send(link.address, sc.CONTROL, c.frame)

    # ------------------------------------------------------------- actions

    def _apply(self, actions: list[Action], now: float) -> None:
        if actions and timeline.enabled():  # the protocol steps (write_posted, ...)
            timeline.actions(self._me, actions, grace=self._grace)
        for a in actions:
            if isinstance(a, SendMessage):
                self._send(a.peer, encode(a.message))
            elif isinstance(a, IssueWrite):
                self._issue(a)
            elif isinstance(a, Rejected):
                self._stats["rejected"] += 1
                self._emit(a)
            elif isinstance(a, Connect):
                self._handshake_needed(a.engine_id, now)
            elif isinstance(a, IssueRead):
                self._issue_read(a)
            elif isinstance(a, Publish):
                self._stats["published"] += 1
                self._emit(self._sealed(a))
            elif isinstance(a, Scatter):  # rule 10: off this thread; scatter_done on return
                self._scatters += 1
                self._stats["scatter_runs"] += a.packed.plan.runs_per_region * (a.chunk == 0)
                if self._scatterer is None:
                    self._scattered.append(ScatterResult(a, False, "no staging memory"))
                else:
                    self._scatterer.submit(a)
            elif isinstance(a, ReleaseStaging):
                self._stats["staging_released"] += 1
            else:
                if isinstance(a, TransferFailed):
                    self._stats["failed"] += 1
                elif isinstance(a, TransferReady):
                    self._stats["ready"] += 1
                    if (a.transfer_id, a.incarnation, a.attempt) in (
                            self._integrity.injected_keys):
                        self._stats["served_from_corrupt"] += 1  # READY over injected bytes
                elif isinstance(a, ReleaseSource):
                    self._integrity.forget_source(a.transfer_id, a.incarnation)
                    cost = self._cost.pop((a.transfer_id, a.incarnation), None)
                    if cost is not None:
                        self._emit(WritesDone(transfer_id=a.transfer_id,
                                              incarnation=a.incarnation, writes=cost[0],
                                              descriptors=cost[1], nbytes=cost[2]))
                self._emit(a)

    def _link_to(self, peer: Peer) -> Any:
        """``peer``'s live link, or None (counted unroutable)."""
        link = self._peers.by_peer.get(peer)
        if link is None or link.dead:
            self._stats["unroutable"] += 1
            return None
        return link

    def _send_seal(self, peer: Peer, body: bytes) -> bool:
        link = self._link_to(peer)
        if link is not None:
            self._side.send(link.address, sc.SEAL, body)
        return link is not None

    def _send(self, peer: Peer, frame: bytes) -> None:
        link = self._link_to(peer)
        if link is None:
            return
        if self.config.control_channel == "nixl" and link.agent_name is not None:
            try:
                self._agent.notify(link.agent_name, frame)
                return
            except Exception:
                self._stats["notif_send_failed"] += 1
        self._side.send(link.address, sc.CONTROL, frame)

    def _usable_link(self, a: IssueWrite | IssueRead, poster: bool,
                     completions: deque[WriteResult]) -> Any:
        """The peer's link if a request to it can be posted; otherwise its failure is
        queued as the request's completion and None returned."""
        link = self._peers.by_peer.get(a.peer)
        if link is None or link.dead or link.bases is None or not poster:
            completions.append(WriteResult(
                transfer_id=a.transfer_id, attempt=a.attempt, peer=a.peer, ok=False,
                incarnation=a.incarnation, error="peer unknown or gone"))
            return None
        return link

    def _regions(self) -> list[Any]:
        if self._region_cache is None:
            self._region_cache = region_views(self._memory)
        return self._region_cache

    def _corrupt(self, bad: Corruption) -> None:
        """Rule 11: one structured line per landed range that failed its check."""
        self._stats["corrupt"] += 1
        log.info("pushkv integrity: CORRUPT %s transfer=%s incarnation=%d attempt=%d "
                    "producer=%s producer_rank=%d consumer_rank=%d tokens=[%d,%d) "
                    "layers=[%d,%d) expected=%016x got=%016x", bad.kind, bad.transfer_id,
                    bad.incarnation, bad.attempt, bad.producer, bad.producer_rank,
                    bad.consumer_rank, bad.tag.first_token, bad.tag.num_tokens,
                    bad.tag.layers.start, bad.tag.layers.stop, bad.expected, bad.got)

    def _sealed(self, a: Publish) -> Publish:
        """Rule 11 (pull): the publication with its seal, over the source bytes now."""
        if not self._integrity.config.enabled:
            return a
        try:
            seal = self._integrity.publish_seal(a)
        except Exception:  # a digest that cannot be taken must not stop the pull
            self._stats["digest_errors"] += 1
            if self._stats["digest_errors"] == 1:
                log.exception("pushkv integrity: no digest for the publication of %s "
                              "(published unsealed; counted as digest_errors, further ones "
                              "not logged)", a.transfer_id)
            return a
        if not seal:
            return a
        self._stats["sealed"] += 1
        return replace(a, seal=seal)

    def _issue(self, a: IssueWrite) -> None:
        writer = self._writer
        self._writes += 1
        self._stats["writes_issued"] += 1
        link = self._usable_link(a, writer is not None, self._completions)
        if link is None or writer is None:
            return
        try:  # rule 11: over the exact source bytes, before any of them moves
            tag = self._integrity.tag(a)
        except Exception:  # a digest that cannot be taken must not stop the write
            self._stats["digest_errors"] += 1
            if self._stats["digest_errors"] == 1:
                log.exception("pushkv integrity: no digest for %s#%d (sent unsealed; counted "
                              "as digest_errors, further ones not logged)", a.transfer_id,
                              a.attempt)
            tag = None
        if tag is not None:
            self._stats["sealed"] += 1
        assert link.agent_name is not None
        if self.config.nudge_window_s > 0:  # before the post: the consumer wakes meanwhile
            self._side.send(link.address, sc.NUDGE, b"")
        if a.packed is not None:
            self._stats["writes_packed"] += 1
        writer.submit(WriteJob(
            transfer_id=a.transfer_id, attempt=a.attempt, peer=a.peer, plan=a.plan,
            incarnation=a.incarnation, notif=Integrity.notification(a, 0, tag), tag=tag,
            remote_agent=link.agent_name,
            remote_bases=link.bases,
            remote_kind="VRAM" if link.kind == "VRAM" else "DRAM", remote_device=link.device,
            packed=a.packed, remote_staging=link.staging_base,
        ))

    def _issue_read(self, a: IssueRead) -> None:
        reader = self._reader
        self._reads += 1
        self._read_actions[a.transfer_id, a.incarnation, a.attempt, a.peer] = a  # rule 11
        link = self._usable_link(a, reader is not None, self._read_completions)
        if link is None or reader is None:
            return
        assert link.agent_name is not None
        self._seals.posted(a)  # rule 11: the digests of part of a source, asked for now
        reader.submit(ReadJob(
            transfer_id=a.transfer_id, attempt=a.attempt, peer=a.peer, plan=a.plan,
            incarnation=a.incarnation, remote_agent=link.agent_name, remote_bases=link.bases,
            remote_kind="VRAM" if link.kind == "VRAM" else "DRAM", remote_device=link.device,
        ))

    def _scatter_done(self, result: ScatterResult) -> None:  # scatter thread
        self._scattered.append(result)
        self._wake()

    def _drain_scatters(self, now: float) -> None:
        consumer = self._consumer()
        while self._scattered:
            r = self._scattered.popleft()
            a = r.scatter
            self._scatters -= 1
            self._stats["scatters_ok" if r.ok else "scatters_failed"] += 1
            # Rule 11: a staged write is checked once its last chunk is scattered.
            checked = self._integrity.stats["checked"]
            bad = self._integrity.scattered(consumer, a) if r.ok else ""
            if timeline.enabled() and self._integrity.stats["checked"] > checked:
                timeline.checked(self._me, a.transfer_id, a.incarnation, a.attempt, a.peer,
                                 not bad)
            self._guard(lambda a=a, ok=r.ok, bad=bad: self._apply(consumer.scatter_done(
                a.transfer_id, a.attempt, a.peer, ok, now, incarnation=a.incarnation,
                corrupt=bad), now))

    def _read_done(self, result: ReadResult) -> None:  # reader thread
        self._read_completions.append(result)
        self._wake()

    def _write_done(self, result: WriteResult) -> None:  # writer thread
        if result.ok and (result.transfer_id, result.incarnation) in self._streaming:
            self._early_bytes += result.nbytes  # prefill still running; only this thread adds
        self._completions.append(result)
        self._wake()

    def _drain_completions(self, now: float) -> None:
        if self._read_completions:
            self._drain_reads(now)
        if self._scattered:
            self._drain_scatters(now)
        producer = self._endpoint
        while self._completions:
            r = self._completions.popleft()
            if timeline.enabled():
                timeline.completed(self._me, r.transfer_id, r.incarnation, r.attempt, r.peer,
                                   r.ok)
            self._writes -= 1
            self._recent.append(r)
            key = (r.transfer_id, r.incarnation)
            w, d, b = self._cost.get(key, (0, 0, 0))
            self._cost[key] = (w + 1, d + r.descriptors, b + (r.nbytes if r.ok else 0))
            if r.ok:
                self._stats["writes_ok"] += 1
                self._stats["bytes_written"] += r.nbytes
            else:
                self._stats["writes_failed"] += 1
                log.info("write of %s#%d to %s failed: %s", r.transfer_id, r.attempt, r.peer,
                         r.error)
            assert isinstance(producer, Producer)
            self._guard(lambda r=r: self._apply(
                producer.write_completed(r.transfer_id, r.attempt, r.peer, r.ok, now,
                                         incarnation=r.incarnation), now))

    def _drain_reads(self, now: float) -> None:
        while self._read_completions:
            r = self._read_completions.popleft()
            self._reads -= 1
            a = self._read_actions.pop((r.transfer_id, r.incarnation, r.attempt, r.peer), None)
            if a is not None and self._seals.park(r, a, now):
                continue  # its check waits for the producer rank's digests
            self._finish_read(r, a, now)

    def _finish_read(self, r: ReadResult, a: IssueRead | None, now: float) -> None:
        """A read ended (and its check can run): check it, tell the core."""
        consumer = self._endpoint
        assert isinstance(consumer, Consumer)
        bad = self._read_checked(a, r.ok, now) if a is not None else ""
        if r.ok:
            self._stats["reads_ok"] += 1
            self._stats["bytes_read"] += r.nbytes
        else:
            self._stats["reads_failed"] += 1
            log.info("read of %s#%d from %s failed: %s", r.transfer_id, r.attempt, r.peer,
                     r.error)
        self._guard(lambda: self._apply(
            consumer.read_completed(r.transfer_id, r.attempt, r.peer, r.ok, now,
                                    incarnation=r.incarnation, corrupt=bad), now))

    def _read_checked(self, a: IssueRead, ok: bool, now: float) -> str:
        """Rule 11 (pull): a read ended; check the bytes it landed against the
        producer's published digests (read_completed's ``corrupt``: "" if they match
        or nothing is checked)."""
        integrity = self._integrity
        checked, corrupt = integrity.stats["checked"], integrity.stats["corrupt"]
        bad = integrity.read_landed(a) if ok and (
            integrity.config.enabled or integrity.injector is not None) else ""
        if timeline.enabled():
            done = integrity.stats["checked"] > checked
            timeline.read_done(self._me, a.transfer_id, a.incarnation, a.attempt, a.peer, ok,
                               done, now)
            if done:
                timeline.checked(self._me, a.transfer_id, a.incarnation, a.attempt, a.peer,
                                 integrity.stats["corrupt"] == corrupt, now)
        return bad

    # --------------------------------------------------- incoming traffic

    def _on_frame(self, kind: bytes, body: bytes, now: float) -> None:
        if kind == sc.CONTROL:
            self._stats["control_frames"] += 1
            self._receive(body, None, now)
        elif kind == sc.HELLO:
            self._on_card(body, now)
        elif kind == sc.NUDGE:
            self._nudge(now)
        elif kind == sc.SEAL:
            try:
                self._seals.on_frame(body, now)
            except DecodeError as exc:
                self._reject(None, f"seal frame: {exc}")
        elif kind == sc.BYE:
            if not self._peers.goodbye(body.decode("utf-8", "replace"), now):
                self._reject(None, "goodbye from an unknown address")
        else:
            self._reject(None, "malformed side-channel message")

    def _reject(self, peer: Peer | None, why: str, cls: type[RemoteProtocolError] = DecodeError
                ) -> None:
        self._stats["rejected"] += 1
        if cls not in self._noted:  # every one is counted and an event; the first is logged
            self._noted.add(cls)
            log.warning("pushkv %s: refused a side-channel frame from %s: %s (counted as "
                        "rejected; further %s refusals are not logged)", self.role,
                        peer or "an unknown sender", why, cls.__name__)
        self._emit(Rejected(peer=peer, error=cls(why)))

    def _poll_notifications(self, now: float) -> None:
        for sender, frame in self._agent.notifications():
            self._stats["notifications"] += 1
            self._nudged = max(0, self._nudged - 1)
            self._receive(frame, sender, now)

    def _receive(self, frame: bytes, agent: str | None, now: float) -> None:
        """One control frame or notification for the endpoint.

        ``Hello`` is refused here: peers are introduced only by their card,
        which carries the memory and NIXL metadata the transport checks. A
        NIXL notification must come from the agent of the rank it names; with a
        key, only write notifications may come that way (NIXL's channel is
        not authenticated).
        """
        try:
            frame, tag = unseal(frame)  # rule 11: a digest rides in front of a Notify
            msg = decode(frame)
            if tag is not None and not isinstance(msg, Notify):
                raise DecodeError("a digest envelope around a message that is no Notify")
        except DecodeError:
            self._apply(self._endpoint.receive_bytes(frame, now), now)  # counts and rejects
            return
        claimed = sender_of(msg)
        if isinstance(msg, Hello):
            self._reject(claimed, "Hello outside a handshake card", ValidationError)
            return
        if agent is not None:
            if self._authenticated and not isinstance(msg, Notify):
                self._stats["auth_unprotected"] += 1  # dropped: no state change, no event
                return
            link = self._peers.by_agent.get(agent)
            if link is None or link.peer != claimed:
                self._reject(claimed, f"notification from agent {agent!r} claims to be "
                             f"{claimed}", ValidationError)
                return
        if isinstance(msg, Register):
            timeline.mark(msg.transfer_id, "registration_received")
        elif isinstance(msg, Consumed):
            timeline.mark(msg.transfer_id, "consumed_received")
        elif isinstance(msg, Notify) and timeline.enabled():
            timeline.notified(self._me, msg, tag is not None and self._integrity.config.enabled)
        consumer = self._endpoint
        if isinstance(msg, Notify) and isinstance(consumer, Consumer) and (
                self._integrity.config.enabled or self._integrity.injector is not None):
            integrity = self._integrity
            checked, corrupt = integrity.stats["checked"], integrity.stats["corrupt"]
            acts = integrity.deliver_notify(consumer, msg, tag, now)
            if timeline.enabled() and integrity.stats["checked"] > checked:
                timeline.checked(self._me, msg.transfer_id, msg.incarnation, msg.attempt,
                                 (msg.engine_id, msg.rank), integrity.stats["corrupt"] == corrupt)
            self._apply(acts, now)
        else:
            self._apply(self._endpoint.receive(msg, now), now)
        if isinstance(msg, Register | Skip):
            self._registrations.append((msg.transfer_id, msg.incarnation, msg.rank))

    # ------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        try:
            if self._writer is not None:
                self._writer.stop(self.config.close_timeout_s)
                self._drain_completions(time.monotonic())
            if self._reader is not None:
                self._reader.stop(self.config.close_timeout_s)
                self._drain_completions(time.monotonic())
            if self._scatterer is not None:
                self._scatterer.stop(self.config.close_timeout_s)
                self._drain_completions(time.monotonic())
            side = self._side
            for link in self._peers.links.values():
                if link.peer is not None and not link.dead:
                    side.send(link.address, sc.BYE, self._card.address.encode())
            self._publish_stats()
            side.close(linger_s=0.5)
        except Exception:  # pragma: no cover
            log.exception("pushkv runtime shutdown failed")
        finally:
            self._agent.close()
            self.closed.set()
            with self._events_cv:
                self._events_cv.notify_all()
