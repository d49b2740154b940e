"""One rank's push-transfer runtime: endpoint, NIXL agent, side channel, threads.

:class:`NixlRuntime` is what an engine (a vLLM worker, a test, a benchmark)
holds per rank. Its public methods are called from the **engine thread** and
never block: each one appends a command to a queue and wakes the runtime's
**I/O thread**, which alone owns the protocol endpoint
(:class:`~pushkv.protocol.Producer` or :class:`~pushkv.protocol.Consumer`),
the side channel and the peer table. On a producer a third thread, the
**writer** (:mod:`.nixl_writer`), prepares descriptors and posts the NIXL
WRITEs. Outcomes come back to the engine thread through :meth:`NixlRuntime.poll`.

::

    engine thread --commands--> I/O thread --WriteJob--> writer thread
         ^                      |  endpoint (sans-IO)        |  NIXL WRITE + notif
         +------- events -------+  side channel (zmq)  <-----+  completions
                                   NIXL notifications

Handshake. A consumer learns producer addresses with :meth:`NixlRuntime.connect`
(cheap, idempotent). On first use -- or at once with ``eager=True`` -- it sends
its :class:`~.sidechannel.PeerCard` (pushkv ``Hello``, NIXL metadata, region
addresses) to every rank of the producer engine; each answers with its own
card. Transfers registered before the handshake completes wait for it and
fail (``TransferFailed`` + ``ReleaseDestination``: nothing was written) if it
does not complete within ``handshake_timeout_s``. A producer answers cards; it
never needs to be told about consumers.

Liveness. A peer is *confirmed dead* when it said goodbye, or when its side
channel dropped and stayed unreachable for ``peer_confirm_s``; when every rank
of an engine is confirmed dead the endpoint gets ``peer_died`` and the
protocol's fence rules apply. A peer that hangs without dying is covered by
the protocol's own deadlines.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import numpy as np

from ..protocol import (
    Action,
    Consumer,
    ConsumerConfig,
    DecodeError,
    Hello,
    IssueRead,
    IssueWrite,
    Peer,
    Producer,
    ProducerConfig,
    PushKVError,
    RankInfo,
    Rejected,
    ReleaseDestination,
    SendMessage,
    TransferCancelled,
    TransferFailed,
    TransferReady,
    ValidationError,
    decode,
    encode,
)
from ..protocol.errors import ConfigError, RemoteProtocolError
from ..protocol.events import Publish, sender_of
from . import sidechannel as sc
from .nixl_agent import Agent, nixl_status
from .nixl_config import NixlConfig
from .nixl_memory import KVMemory, bind_device
from .nixl_writer import WriteJob, Writer, WriteResult
from .peers import Link, PeerTable, Pending, RemoteEngine, card_problem, parse_addresses
from .runtime_events import CallFailed, Event, PeerLost, RuntimeView

log = logging.getLogger(__name__)

#: Commands whose first argument is a transfer id (reported on CallFailed).
_TRANSFER_COMMANDS = frozenset(
    {"prefill_finished", "prefill_aborted", "register", "preempt", "reissue", "abort"}
)

Role = Literal["producer", "consumer"]


# --------------------------------------------------------------------- runtime


class NixlRuntime:
    """One rank's runtime. Engine-thread methods never block; see the module docs.

    Args:
        info: this rank (engine spec, global rank, KV layout).
        memory: the KV cache: a :class:`KVMemory`, or one tensor/array per region
            (``KVMemory.from_regions``).
        role: ``"producer"`` (prefill) or ``"consumer"`` (decode).
        config: transport settings; :class:`NixlConfig` defaults otherwise.
        producer_config / consumer_config: the endpoint's timeouts and bounds.
        name: NIXL agent name (unique per cluster); generated if None.
    """

    def __init__(
        self,
        info: RankInfo,
        memory: KVMemory | Sequence[Any],
        *,
        role: Role,
        config: NixlConfig | None = None,
        producer_config: ProducerConfig | None = None,
        consumer_config: ConsumerConfig | None = None,
        name: str | None = None,
    ) -> None:
        if role not in ("producer", "consumer"):
            raise ConfigError(f"role must be producer or consumer, not {role!r}")
        info.validate()
        mem = memory if isinstance(memory, KVMemory) else KVMemory.from_regions(memory)
        mem.check(info.layout)
        self.info = info
        self.role: Role = role
        self.memory = mem
        self.config = cfg = config or NixlConfig()
        self.peer = Peer(info.engine_id, info.rank)
        self.agent_name = name or f"{info.engine_id}/{info.rank}/{uuid.uuid4().hex[:12]}"
        self._endpoint: Producer | Consumer = (
            Producer(info, producer_config) if role == "producer"
            else Consumer(info, consumer_config)
        )
        self._agent = Agent(self.agent_name, cfg, progress_thread=role == "consumer")
        self._writer: Writer | None = None
        self._side: sc.SideChannel | None = None
        try:
            self._agent.register(mem)
            self._side = sc.SideChannel(cfg.host, cfg.port)
            #: This rank's side-channel address, to advertise to peers.
            self.address: str = self._side.address
            self._card = sc.PeerCard(
                hello=encode(Hello(info=info)), address=self.address,
                agent_name=self.agent_name, agent_metadata=self._agent.metadata(),
                bases=mem.bases, sizes=mem.sizes, kind=mem.kind, device=mem.device,
            )
            if role == "producer":
                self._writer = Writer(self._agent, mem, poll_s=cfg.write_poll_s,
                                      timeout_s=cfg.write_timeout_s, on_done=self._write_done,
                                      name=f"pushkv-writer-{info.rank}")
        except BaseException:
            if self._side is not None:
                self._side.close(0)
            self._agent.close()
            raise
        # engine thread -> I/O thread
        self._commands: deque[tuple[Any, ...]] = deque()
        self._completions: deque[WriteResult] = deque()
        self._recent: deque[WriteResult] = deque(maxlen=256)
        # I/O thread -> engine thread
        self._events: deque[Event] = deque()
        self._events_cv = threading.Condition()
        self._closing = False
        self._idle = False  # the I/O thread is (about to be) waiting
        self._woken = False  # a wake-up byte is on its way
        self._closed = threading.Event()
        # I/O thread state
        self._stats: Counter[str] = Counter()
        self._stats_view: dict[str, int] = {}
        self._peers = PeerTable(self._side, self._agent, cfg.peer_confirm_s)
        self._engines: dict[str, RemoteEngine] = {}
        self._parked: dict[str, tuple[str, Pending]] = {}  # preempted before handshake
        self._ready: set[str] = set()  # read by the engine thread (membership only)
        self._writes = 0
        self._next_notif = 0.0
        self._thread = threading.Thread(target=self._run, name=f"pushkv-io-{info.rank}",
                                        daemon=True)
        self._thread.start()

    # ================================================= engine-thread API

    def connect(self, engine_id: str, addresses: Mapping[int, str] | Sequence[str],
                *, eager: bool = False) -> None:
        """Learn a producer engine's side-channel addresses (by global rank).

        Idempotent. The handshake starts on the first ``register`` for the
        engine, or now with ``eager=True``.
        """
        self._submit("connect", engine_id, parse_addresses(addresses), eager)

    def connected(self, engine_id: str) -> bool:
        """True once the handshake with every rank of ``engine_id`` completed."""
        return engine_id in self._ready

    # producer
    def prefill_finished(self, transfer_id: str, block_ids: Sequence[int] | np.ndarray,
                         num_tokens: int) -> None:
        """Prefill of ``transfer_id`` finished; its KV is in ``block_ids`` (not to be
        reused until ``ReleaseSource``; do not mutate the sequence after the call)."""
        self._submit("prefill_finished", transfer_id, block_ids, num_tokens)

    def prefill_aborted(self, transfer_id: str) -> None:
        """The engine aborted ``transfer_id`` before or after its prefill."""
        self._submit("prefill_aborted", transfer_id)

    # consumer
    def register(self, transfer_id: str, producer_engine_id: str,
                 block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                 first_token: int = 0) -> None:
        """Have ``producer_engine_id`` push tokens ``[first_token, num_tokens)`` into
        ``block_ids``. The blocks stay lent until ``ReleaseDestination``."""
        self._submit("register", transfer_id, producer_engine_id, block_ids, num_tokens,
                     first_token)

    def preempt(self, transfer_id: str) -> None:
        """The engine preempted the waiting request; blocks come back via
        ``ReleaseDestination``, then :meth:`reissue` may register it again."""
        self._submit("preempt", transfer_id)

    def reissue(self, transfer_id: str, block_ids: Sequence[int] | np.ndarray) -> None:
        """Register a preempted transfer again into new ``block_ids``."""
        self._submit("reissue", transfer_id, block_ids)

    def abort(self, transfer_id: str) -> None:
        """The engine gave the request up: fence, then ``TransferCancelled``."""
        self._submit("abort", transfer_id)

    # both
    def poll(self) -> list[Event]:
        """Events since the last call (never blocks)."""
        events = self._events
        out = []
        while events:
            out.append(events.popleft())
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until an event is pending or ``timeout_s`` passes (not for engine loops)."""
        with self._events_cv:
            return self._events_cv.wait_for(lambda: bool(self._events) or self._closed.is_set(),
                                            timeout_s)

    def stats(self) -> dict[str, int]:
        """Counters (rejected frames, writes, bytes, handshakes...), as last published."""
        return dict(self._stats_view)

    def inspect(self, timeout_s: float = 5.0) -> RuntimeView:
        """A consistent view of the endpoint's state, taken on the I/O thread (blocks)."""
        fut: Future[RuntimeView] = Future()
        self._submit("inspect", fut)
        return fut.result(timeout_s)

    def inject(self, peer: Peer, frame: bytes, channel: Literal["control", "notify"]) -> None:
        """Fault injection: send raw ``frame`` to a known peer rank on a channel."""
        self._submit("inject", peer, frame, channel)

    def close(self, timeout_s: float | None = None) -> None:
        """Stop: finish writes in flight, say goodbye, release the agent. Idempotent."""
        if not self._closing:
            self._closing = True
            self._commands.append(("close",))
            self._wake()
        self._thread.join(timeout_s if timeout_s is not None
                          else self.config.close_timeout_s + 10.0)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __enter__(self) -> NixlRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, *command: Any) -> None:
        if self._closing:
            raise RuntimeError("runtime is closed")
        self._commands.append(command)
        self._wake()

    def _wake(self) -> None:
        """Interrupt the I/O thread's wait, only if it waits and nobody woke it yet.

        The I/O thread sets ``_idle`` *before* it looks at its queues one last
        time, and callers append *before* they read ``_idle``, so either the
        caller sees it idle and wakes it, or the I/O thread sees the new item.
        """
        if self._idle and not self._woken:
            self._woken = True
            side = self._side
            assert side is not None
            side.wake()

    # ======================================================== I/O thread

    def _run(self) -> None:
        side = self._side
        assert side is not None
        try:
            try:
                bind_device(self.memory)  # peers' metadata is loaded on this thread
            except Exception:
                log.exception("cannot make the CUDA device current on the I/O thread")
            while True:
                self._idle = True
                frames, links = side.poll(self._timeout(time.monotonic()))
                self._idle = self._woken = False
                now = time.monotonic()
                had_commands = bool(self._commands)
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
                    if not (self._writer is not None and self._writes):
                        self._guard(self._poll_notifications, now)
                    self._next_notif = now + (self.config.active_poll_s if self._live()
                                              else self.config.idle_poll_s)
                deadline = self._endpoint.next_deadline()
                if deadline is not None and deadline <= now:
                    self._guard(self._timers, now)
                self._guard(self._check_engines, now)
                self._publish_stats()
        except BaseException:  # pragma: no cover - a bug; never die silently
            log.exception("pushkv I/O thread crashed")
            self._stats["crashed"] += 1
        finally:
            self._shutdown()

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
        until = self._next_notif
        d = self._endpoint.next_deadline()
        if d is not None:
            until = min(until, d)
        for eng in self._engines.values():
            if eng.state == "handshaking":
                until = min(until, eng.deadline)
        until = min(until, self._peers.next_deadline())
        if self._completions or self._commands:
            return 0.0
        return max(0.0, until - now)

    def _live(self) -> bool:
        return (self._endpoint.num_transfers > 0 or self._writes > 0
                or any(e.pending for e in self._engines.values()))

    def _emit(self, event: Event) -> None:
        with self._events_cv:
            self._events.append(event)
            self._events_cv.notify_all()

    def _publish_stats(self) -> None:
        stats = self._stats
        stats["dropped_frames"] = self._side.dropped if self._side else 0
        self._stats_view = dict(stats)

    # ------------------------------------------------------------ commands

    def _drain_commands(self, now: float) -> bool:
        """Run queued engine-thread commands; True when asked to close."""
        commands = self._commands
        while commands:
            cmd = commands.popleft()
            op = cmd[0]
            if op == "close":
                return True
            try:
                getattr(self, "_cmd_" + op)(now, *cmd[1:])
            except PushKVError as exc:
                tid = cmd[1] if op in _TRANSFER_COMMANDS else None
                self._emit(CallFailed(operation=op, transfer_id=tid, error=str(exc)))
            except Exception as exc:
                self._stats["internal_errors"] += 1
                log.exception("pushkv command %s failed", op)
                self._emit(CallFailed(operation=op, transfer_id=None, error=repr(exc)))
        return False

    def _producer(self) -> Producer:
        if not isinstance(self._endpoint, Producer):
            raise ConfigError("this runtime is a consumer")
        return self._endpoint

    def _consumer(self) -> Consumer:
        if not isinstance(self._endpoint, Consumer):
            raise ConfigError("this runtime is a producer")
        return self._endpoint

    def _cmd_prefill_finished(self, now: float, tid: str, ids: Any, n: int) -> None:
        self._apply(self._producer().prefill_finished(tid, ids, n, now), now)

    def _cmd_prefill_aborted(self, now: float, tid: str) -> None:
        self._apply(self._producer().prefill_aborted(tid, now), now)

    def _cmd_connect(self, now: float, engine_id: str, addresses: dict[int, str],
                     eager: bool) -> None:
        eng = self._engines.get(engine_id)
        if eng is None or (eng.addresses != addresses and eng.state in ("failed", "dead")):
            pending = eng.pending if eng is not None else {}
            eng = self._engines[engine_id] = RemoteEngine(engine_id, addresses, pending=pending)
        elif eng.addresses != addresses:
            raise ConfigError(f"engine {engine_id!r} is live with other addresses")
        if eager and eng.state in ("new", "failed", "dead"):
            self._handshake(eng, now)

    def _cmd_register(self, now: float, tid: str, engine_id: str, ids: Any, n: int,
                      first: int) -> None:
        consumer = self._consumer()
        eng = self._engines.get(engine_id)
        if eng is None:
            raise ConfigError(f"no address for producer engine {engine_id!r}: call connect()",
                              transfer_id=tid)
        if eng.state == "ready":
            self._apply(consumer.register(tid, engine_id, ids, n, now, first), now)
            return
        if tid in eng.pending or tid in self._parked or consumer.state_of(tid) is not None:
            raise ConfigError("transfer already registered", transfer_id=tid)
        eng.pending[tid] = Pending(tuple(int(b) for b in ids), n, first)
        if eng.state in ("new", "failed", "dead"):
            self._handshake(eng, now)

    def _find_pending(self, tid: str) -> tuple[RemoteEngine, Pending] | None:
        for eng in self._engines.values():
            p = eng.pending.get(tid)
            if p is not None:
                return eng, p
        return None

    def _cmd_preempt(self, now: float, tid: str) -> None:
        found = self._find_pending(tid)
        if found is None:
            self._apply(self._consumer().preempt(tid, now), now)
            return
        _eng, p = found
        if not p.preempted:
            self._emit(ReleaseDestination(transfer_id=tid, attempt=0, block_ids=p.block_ids))
            p.preempted, p.block_ids = True, ()

    def _cmd_reissue(self, now: float, tid: str, ids: Any) -> None:
        blocks = tuple(int(b) for b in ids)
        parked = self._parked.pop(tid, None)
        if parked is not None:
            engine_id, p = parked
            self._apply(self._consumer().register(tid, engine_id, blocks, p.num_tokens, now,
                                                  p.first_token), now)
            return
        found = self._find_pending(tid)
        if found is None:
            self._apply(self._consumer().reissue(tid, ids, now), now)
            return
        _, p = found
        if not p.preempted:
            raise ConfigError("reissue needs a preempted transfer", transfer_id=tid)
        p.preempted, p.block_ids = False, blocks

    def _cmd_abort(self, now: float, tid: str) -> None:
        parked = self._parked.pop(tid, None)
        found = self._find_pending(tid)
        if parked is None and found is None:
            self._apply(self._consumer().abort(tid, now), now)
            return
        if found is not None:
            eng, p = found
            del eng.pending[tid]
            if not p.preempted:
                self._emit(ReleaseDestination(transfer_id=tid, attempt=0, block_ids=p.block_ids))
        self._emit(TransferCancelled(transfer_id=tid, attempt=0))

    def _cmd_inspect(self, now: float, fut: Future[RuntimeView]) -> None:
        ep = self._endpoint
        pending = {tid: p.block_ids for e in self._engines.values()
                   for tid, p in e.pending.items()}
        self._publish_stats()
        fut.set_result(RuntimeView(
            lent=dict(ep.lent_blocks()) if isinstance(ep, Consumer) else {},
            held=ep.held_blocks() if isinstance(ep, Producer) else {},
            pending=pending,
            ready_engines=tuple(sorted(self._ready)),
            writes_in_flight=self._writes,
            stats=dict(self._stats_view),
            recent_writes=tuple(self._recent),
        ))

    def _cmd_inject(self, now: float, peer: Peer, frame: bytes, channel: str) -> None:
        link = self._peers.by_peer.get(peer)
        if link is None:
            raise ConfigError(f"no handshake with {peer}")
        if channel == "notify":
            assert link.agent_name is not None
            self._agent.notify(link.agent_name, frame)
        else:
            assert self._side is not None
            self._side.send(link.address, sc.CONTROL, frame)

    # ------------------------------------------------------------- actions

    def _apply(self, actions: list[Action], now: float) -> None:
        for a in actions:
            if isinstance(a, SendMessage):
                self._send(a.peer, encode(a.message))
            elif isinstance(a, IssueWrite):
                self._issue(a, now)
            elif isinstance(a, Rejected):
                self._stats["rejected"] += 1
                self._emit(a)
            elif isinstance(a, IssueRead | Publish):  # pragma: no cover - pull is not wired
                raise ConfigError("this runtime moves KV by push only")
            else:
                if isinstance(a, TransferFailed):
                    self._stats["failed"] += 1
                elif isinstance(a, TransferReady):
                    self._stats["ready"] += 1
                self._emit(a)

    def _send(self, peer: Peer, frame: bytes) -> None:
        link = self._peers.by_peer.get(peer)
        if link is None or link.dead:
            self._stats["unroutable"] += 1
            return
        if self.config.control_channel == "nixl" and link.agent_name is not None:
            try:
                self._agent.notify(link.agent_name, frame)
                return
            except Exception:
                self._stats["notif_send_failed"] += 1
        assert self._side is not None
        self._side.send(link.address, sc.CONTROL, frame)

    def _issue(self, a: IssueWrite, now: float) -> None:
        link = self._peers.by_peer.get(a.peer)
        writer = self._writer
        self._writes += 1
        if link is None or link.dead or link.bases is None or writer is None:
            self._completions.append(WriteResult(
                transfer_id=a.transfer_id, attempt=a.attempt, peer=a.peer, ok=False,
                error="peer unknown or gone"))
            return
        assert link.agent_name is not None
        writer.submit(WriteJob(
            transfer_id=a.transfer_id, attempt=a.attempt, peer=a.peer, plan=a.plan,
            notif=encode(a.notify), remote_agent=link.agent_name, remote_bases=link.bases,
            remote_kind="VRAM" if link.kind == "VRAM" else "DRAM", remote_device=link.device,
        ))

    def _write_done(self, result: WriteResult) -> None:  # writer thread
        self._completions.append(result)
        self._wake()

    def _drain_completions(self, now: float) -> None:
        producer = self._endpoint
        while self._completions:
            r = self._completions.popleft()
            self._writes -= 1
            self._recent.append(r)
            if r.ok:
                self._stats["writes_ok"] += 1
                self._stats["bytes_written"] += r.nbytes
            else:
                self._stats["writes_failed"] += 1
                log.info("write of %s#%d to %s failed: %s", r.transfer_id, r.attempt, r.peer,
                         r.error)
            assert isinstance(producer, Producer)
            self._guard(lambda r=r: self._apply(
                producer.write_completed(r.transfer_id, r.attempt, r.peer, r.ok, now), now))

    # --------------------------------------------------- incoming traffic

    def _on_frame(self, kind: bytes, body: bytes, now: float) -> None:
        if kind == sc.CONTROL:
            self._stats["control_frames"] += 1
            self._receive(body, None, now)
        elif kind == sc.HELLO:
            self._on_card(body, now)
        elif kind == sc.BYE:
            if not self._peers.goodbye(body.decode("utf-8", "replace"), now):
                self._reject(None, "goodbye from an unknown address")
        else:
            self._reject(None, "malformed side-channel message")

    def _reject(self, peer: Peer | None, why: str, cls: type[RemoteProtocolError] = DecodeError
                ) -> None:
        self._stats["rejected"] += 1
        self._emit(Rejected(peer=peer, error=cls(why)))

    def _poll_notifications(self, now: float) -> None:
        for sender, frame in self._agent.notifications():
            self._stats["notifications"] += 1
            self._receive(frame, sender, now)

    def _receive(self, frame: bytes, agent: str | None, now: float) -> None:
        """One control frame or notification for the endpoint.

        ``Hello`` is refused here: peers are introduced only by their card,
        which carries the memory and NIXL metadata the transport checks. A
        NIXL notification must come from the agent of the rank it names.
        """
        try:
            msg = decode(frame)
        except DecodeError:
            self._apply(self._endpoint.receive_bytes(frame, now), now)  # counts and rejects
            return
        claimed = sender_of(msg)
        if isinstance(msg, Hello):
            self._reject(claimed, "Hello outside a handshake card", ValidationError)
            return
        if agent is not None:
            link = self._peers.by_agent.get(agent)
            if link is None or link.peer != claimed:
                self._reject(claimed, f"notification from agent {agent!r} claims to be "
                             f"{claimed}", ValidationError)
                return
        self._apply(self._endpoint.receive(msg, now), now)

    # ----------------------------------------------------------- handshake

    def _handshake(self, eng: RemoteEngine, now: float) -> None:
        eng.state, eng.error = "handshaking", ""
        eng.deadline = now + self.config.handshake_timeout_s
        eng.answered.clear()
        self._stats["handshakes_started"] += 1
        body = sc.encode_card(self._card)
        assert self._side is not None
        for address in eng.addresses.values():
            link = self._peers.link(address)
            if link.dead:  # a fresh attempt at an address that died: reconnect
                self._peers.forget(link)
                link = self._peers.link(address)
            self._side.send(address, sc.HELLO, body)

    def _on_card(self, body: bytes, now: float) -> None:
        try:
            card = sc.decode_card(body)
            hello = decode(card.hello)
            if not isinstance(hello, Hello):
                raise DecodeError("handshake card without a Hello")
        except DecodeError as exc:
            self._reject(None, exc.message)
            return
        info = hello.info
        peer = Peer(info.engine_id, info.rank)
        error = card.error or self._accept(card, info)
        if error:
            self._reject(peer, f"handshake with {peer} failed: {error}", ValidationError)
        if not card.reply:  # answer, with our refusal if any
            link = self._peers.link(card.address)
            reply = sc.encode_card(_replace_card(self._card, reply=True, error=error))
            assert self._side is not None
            self._side.send(link.address, sc.HELLO, reply)
            return
        eng = self._engines.get(info.engine_id)
        if (eng is None or eng.state != "handshaking"
                or eng.addresses.get(info.rank) != card.address):
            self._stats["stale_cards"] += 1
            return
        if error:
            self._fail_engine(eng, f"handshake with {peer} refused: {error}", now)
            return
        eng.answered.add(info.rank)
        if eng.answered >= set(eng.addresses):
            self._engine_ready(eng, now)

    def _accept(self, card: sc.PeerCard, info: RankInfo) -> str:
        """Validate and install a peer's card; returns an error text or ''."""
        # Order matters: the endpoint learns the peer last, once everything else
        # accepted it, so a refused card never lets the peer's messages through.
        problem = card_problem(card, info)
        if problem:
            return problem
        if (self.role == "producer") == card.reply:
            return f"a {self.role} does not pair with this peer"
        try:
            name = self._agent.add_peer(card.agent_metadata)
        except Exception as exc:
            return f"NIXL refused the agent metadata ({nixl_status(exc)})"
        try:
            if name != card.agent_name:
                raise ConfigError(f"NIXL metadata names agent {name!r}, card {card.agent_name!r}")
            self._endpoint.add_peer(info)
        except PushKVError as exc:
            if self._peers.by_agent.get(name) is None:
                with contextlib.suppress(Exception):
                    self._agent.remove_peer(name)
            return exc.message
        self._peers.install(self._peers.link(card.address), Peer(info.engine_id, info.rank), card)
        self._stats["peers_accepted"] += 1
        if self.role == "producer":
            with contextlib.suppress(Exception):
                self._agent.connect(card.agent_name)
        return ""

    def _engine_ready(self, eng: RemoteEngine, now: float) -> None:
        eng.state = "ready"
        self._ready.add(eng.engine_id)
        self._stats["handshakes_done"] += 1
        pending, eng.pending = eng.pending, {}
        consumer = self._consumer()
        for tid, p in pending.items():
            if p.preempted:
                self._parked[tid] = (eng.engine_id, p)
                continue
            try:
                self._apply(consumer.register(tid, eng.engine_id, p.block_ids, p.num_tokens, now,
                                              p.first_token), now)
            except PushKVError as exc:
                self._emit(CallFailed(operation="register", transfer_id=tid, error=str(exc)))
                self._emit(ReleaseDestination(transfer_id=tid, attempt=0, block_ids=p.block_ids))

    def _fail_engine(self, eng: RemoteEngine, why: str, now: float) -> None:
        eng.state, eng.error = "failed", why
        self._ready.discard(eng.engine_id)
        self._stats["handshakes_failed"] += 1
        log.warning("%s", why)
        policy = self._consumer().config.policy
        pending, eng.pending = eng.pending, {}
        for tid, p in pending.items():
            if not p.preempted:
                self._emit(ReleaseDestination(transfer_id=tid, attempt=0, block_ids=p.block_ids))
            self._emit(TransferFailed(transfer_id=tid, attempt=0, reason=why, policy=policy))

    # ------------------------------------------------------------ liveness

    def _check_engines(self, now: float) -> None:
        for eng in list(self._engines.values()):
            if eng.state == "handshaking" and now >= eng.deadline:
                missing = sorted(set(eng.addresses) - eng.answered)
                self._fail_engine(eng, f"handshake with {eng.engine_id!r} timed out "
                                  f"(ranks {missing} did not answer)", now)
        for engine_id, links in self._peers.dead_engines(now).items():
            self._peer_died(engine_id, links, now)

    def _peer_died(self, engine_id: str, links: list[Link], now: float) -> None:
        self._stats["peers_lost"] += 1
        if all(link.said_goodbye for link in links):
            log.info("peer engine %r closed", engine_id)
        else:
            log.warning("peer engine %r confirmed dead", engine_id)
        for link in links:
            self._peers.forget(link)
        eng = self._engines.get(engine_id)
        if eng is not None:
            eng.state = "dead"
            self._ready.discard(engine_id)
        self._apply(self._endpoint.peer_died(engine_id, now), now)
        self._emit(PeerLost(engine_id=engine_id))

    # ------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        try:
            if self._writer is not None:
                self._writer.stop(self.config.close_timeout_s)
                self._drain_completions(time.monotonic())
            side = self._side
            if side is not None:
                for link in self._peers.links.values():
                    if link.peer is not None and not link.dead:
                        side.send(link.address, sc.BYE, self.address.encode())
                self._publish_stats()
                side.close(linger_s=0.5)
        except Exception:  # pragma: no cover
            log.exception("pushkv runtime shutdown failed")
        finally:
            self._agent.close()
            self._closed.set()
            with self._events_cv:
                self._events_cv.notify_all()


def _replace_card(card: sc.PeerCard, **changes: Any) -> sc.PeerCard:
    import msgspec

    return msgspec.structs.replace(card, **changes)
