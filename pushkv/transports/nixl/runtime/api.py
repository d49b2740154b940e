"""One rank's push-transfer runtime: the engine-thread API.

:class:`NixlRuntime` is what an engine (a vLLM worker, a test, a benchmark)
holds per rank. Its public methods are called from the **engine thread** and
never block: each one appends a typed command (:mod:`.commands`) to a
queue and wakes the runtime's **I/O thread** (:mod:`.loop`), which
alone owns the protocol endpoint (:class:`~pushkv.protocol.Producer` or
:class:`~pushkv.protocol.Consumer`), the side channel and the peer table. On a
producer a third thread, the **writer** (:mod:`..writer`), prepares
descriptors and posts the NIXL WRITEs (push); on a consumer the **reader**
(:mod:`..reader`) prepares and posts the READs of a pull. Outcomes come
back to the engine thread through :meth:`NixlRuntime.poll`.

::

    engine thread --commands--> I/O thread --WriteJob--> writer thread
         ^                      |  endpoint (sans-IO)        |  NIXL WRITE + notif
         +------- events -------+  side channel (zmq)  <-----+  completions
                                   NIXL notifications

Handshake. A consumer learns producer addresses with :meth:`NixlRuntime.connect`
(cheap, idempotent). When the endpoint needs the engine (its ``Connect``
action, on the first registration) -- or at once with ``eager=True`` -- the
runtime sends its :class:`~..sidechannel.channel.PeerCard` (pushkv ``Hello``, NIXL
metadata, region addresses) to every rank of the producer engine; each answers
with its own card (the table of :mod:`.handshake`), which goes to the
endpoint (``add_peer``). What waits for a handshake, and what a failed one
means, is the endpoint's business. A producer answers cards; it never needs to
be told about consumers.

Ports and key. The side channel binds ``NixlConfig.port``, or a free port when
it is 0 (the default); :attr:`NixlRuntime.address` is what peers must be told.
With a shared key (``key_file`` or ``key_env``) every side-channel frame is
authenticated (:mod:`..sidechannel.auth`).

Liveness. A peer is *confirmed dead* when it said goodbye, or when its side
channel dropped and stayed unreachable for ``peer_confirm_s``; when every rank
of an engine is confirmed dead the endpoint gets ``peer_died`` and the
protocol's fence rules apply. A peer that hangs without dying is covered by
the protocol's own deadlines.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Literal

import numpy as np

from pushkv.protocol import (
    Consumer,
    ConsumerConfig,
    Hello,
    Mode,
    Peer,
    Producer,
    ProducerConfig,
    RankInfo,
    encode,
)
from pushkv.protocol.errors import ConfigError

from ..agent import Agent
from ..config import NixlConfig
from ..memory import KVMemory
from ..sidechannel import channel as sc
from ..sidechannel.auth import SideKey, identity, load_key
from ..staging import StagingMemory
from . import commands as cmd
from .events import Event, RuntimeView
from .loop import IOLoop
from .peers import parse_addresses

Role = Literal["producer", "consumer"]


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

    Raises:
        ConfigError: bad settings or memory; :class:`~..sidechannel.channel.SideChannelBindError`
            (a ConfigError) when the configured side-channel port is taken.
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
        key = load_key(cfg.key_file, cfg.key_env)
        if key is not None and cfg.control_channel == "nixl":
            raise ConfigError("with a side-channel key, control messages must use the "
                              "(authenticated) side channel: control_channel='side'")
        self.peer = Peer(info.engine_id, info.rank)
        self.agent_name = name or f"{info.engine_id}/{info.rank}/{uuid.uuid4().hex[:12]}"
        endpoint: Producer | Consumer = (
            Producer(info, producer_config) if role == "producer"
            else Consumer(info, consumer_config)
        )
        # Host memory: the I/O thread's notification poll progresses the agent while
        # transfers are live, so nothing needs to wake while idle (a progress thread
        # on a decode core takes time from every decode step). Device memory keeps it
        # on consumers (not measured here). ``progress_thread`` overrides both.
        # Packed writes (rule 10): staging memory of the size the endpoint lends from,
        # registered with NIXL once, with the KV regions.
        pk = endpoint.config.packing
        staging = (StagingMemory(pk.staging_bytes, mem) if pk is not None
                   and pk.mode != "never" and pk.staging_bytes > 0 else None)
        #: this rank's staging memory (None: every write is direct)
        self.staging = staging
        agent = Agent(self.agent_name, cfg,
                      progress_thread=role == "consumer" and mem.kind == "VRAM")
        #: whether NIXL's progress thread runs for this rank's agent
        self.progress_thread: bool = agent.progress_thread
        side: sc.SideChannel | None = None
        try:
            agent.register(staging.with_kv(mem) if staging is not None else mem)
            side = sc.SideChannel(
                cfg.host, cfg.port, advertise_host=cfg.advertise_host,
                key=SideKey(key, cfg.key_window_s) if key is not None else None,
                me=identity(info.engine_id, info.rank))
            #: This rank's side-channel address, to advertise to peers.
            self.address: str = side.address
            #: The side-channel port bound (the configured one, or the free one picked).
            self.port: int = side.port
            card = sc.PeerCard(
                hello=encode(Hello(info=info)), address=self.address,
                agent_name=self.agent_name, agent_metadata=agent.metadata(),
                bases=mem.bases, sizes=mem.sizes, kind=mem.kind, device=mem.device,
                staging_base=staging.base if staging is not None else 0,
                staging_size=staging.nbytes if staging is not None else 0,
            )
            self._loop = IOLoop(endpoint, agent, side, mem, card, cfg,
                                authenticated=key is not None, name=str(info.rank),
                                staging=staging)
        except BaseException:
            if side is not None:
                side.close(0)
            agent.close()
            raise
        self._closing = False
        self._enqueue = self._loop.submit

    # ------------------------------------------------------------ consumer

    def connect(self, engine_id: str, addresses: Mapping[int, str] | Sequence[str],
                *, eager: bool = False) -> None:
        """Learn a producer engine's side-channel addresses (by global rank, or a
        rank-ordered list of what each rank's :attr:`address` says).

        Idempotent. The handshake starts on the first ``register`` for the
        engine, or now with ``eager=True``.
        """
        self._submit(cmd.Connect(engine_id=engine_id, addresses=parse_addresses(addresses),
                                 eager=eager))

    def connected(self, engine_id: str) -> bool:
        """True once the handshake with every rank of ``engine_id`` completed."""
        return engine_id in self._loop.handshakes.ready

    def register(self, transfer_id: str, producer_engine_id: str,
                 block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                 first_token: int = 0, *, incarnation: int = 0, target: int = 0) -> None:
        """Have ``producer_engine_id`` push tokens ``[first_token, num_tokens)`` into
        ``block_ids``. The blocks stay lent until ``ReleaseDestination``.

        ``incarnation`` tells this use of ``transfer_id`` from any other; every rank
        of both engines must be given the same one (see
        :func:`pushkv.protocol.new_incarnation`). ``target``: this engine's turn at
        the source (rule 12; 0 unless a router re-targeted the source here)."""
        # Commands are built positionally: keywords triple the cost on this hot path.
        self._submit(cmd.Register(transfer_id, producer_engine_id, block_ids, num_tokens,
                                  first_token, incarnation, target))

    def start_pull(self, transfer_id: str, producer_engine_id: str,
                   src_block_ids: Sequence[int] | np.ndarray,
                   block_ids: Sequence[int] | np.ndarray, num_tokens: int,
                   first_token: int = 0, *, incarnation: int = 0,
                   lease_s: float | None = None,
                   seals: Mapping[int, bytes] | None = None,
                   every_rank: bool = False) -> None:
        """Pull: read tokens ``[first_token, num_tokens)`` of the producer's published
        ``src_block_ids`` into ``block_ids``. The reads are prepared and posted by this
        rank's reader thread; ``TransferReady`` (or ``TransferFailed``) and
        ``ReleaseDestination`` come back as for a push. Waits for the producer
        engine's handshake if it has not completed (starting it). ``lease_s``: how
        long from now the source is known held (the ``Publish``'s lease less the
        relay's bound); a read that would complete later fails (``LEASE_EXPIRED``).
        ``seals``: each producer rank's ``Publish.seal``, relayed (rule 11: every read's
        landed bytes are checked against it before it counts; a missing or malformed
        one refuses the pull, ``CallFailed``; None: the publication was not sealed).
        ``every_rank``: ``seals`` relays every producer rank's seal (one answer passed
        to every consumer rank, as behind a router); this rank takes those it reads."""
        until = None if lease_s is None else time.monotonic() + lease_s
        self._submit(cmd.StartPull(transfer_id, producer_engine_id, src_block_ids, block_ids,
                                   num_tokens, first_token, incarnation, until,
                                   None if seals is None else dict(seals), every_rank))

    def abandon(self, transfer_id: str, producer_engine_id: str, *,
                incarnation: int = 0) -> None:
        """The request ended before :meth:`register` was called for it: tell the
        producer (final cancel) so it releases its source now, not at lease expiry."""
        self._submit(cmd.Abandon(transfer_id=transfer_id, producer_engine_id=producer_engine_id,
                                 incarnation=incarnation))

    def preempt(self, transfer_id: str) -> None:
        """The engine preempted the waiting request; blocks come back via
        ``ReleaseDestination``, then :meth:`reissue` may register it again."""
        self._submit(cmd.Preempt(transfer_id))

    def reissue(self, transfer_id: str, block_ids: Sequence[int] | np.ndarray) -> None:
        """Register a preempted transfer again into new ``block_ids``."""
        self._submit(cmd.Reissue(transfer_id, block_ids))

    def abort(self, transfer_id: str) -> None:
        """The engine gave the request up: fence, then ``TransferCancelled``."""
        self._submit(cmd.Abort(transfer_id))

    def consumed(self, transfer_id: str) -> None:
        """The engine took its first decode step from ``transfer_id``'s pushed KV
        (READY before): tell the producer ranks that wrote it (``Consumed``, rule
        12), so a source they keep for a re-target (``retarget_hold_s``) goes now.
        Call it once per rank; a pull, a transfer not READY here or one told
        already sends nothing (counted ``consumed_unknown``)."""
        self._submit(cmd.Consumed(transfer_id))

    # ------------------------------------------------------------ producer

    def prefill_finished(self, transfer_id: str, block_ids: Sequence[int] | np.ndarray,
                         num_tokens: int, *, incarnation: int = 0,
                         mode: Mode = Mode.PUSH) -> None:
        """Prefill of ``transfer_id`` finished; its KV is in ``block_ids`` (not to be
        reused until ``ReleaseSource``; do not mutate the sequence after the call).

        ``mode=Mode.PULL``: publish the blocks (a ``Publish`` event) for a consumer
        to read with :meth:`start_pull`; they are released when every reading rank
        reported (``ReadDone``) or the lease ends."""
        self._submit(cmd.PrefillFinished(transfer_id, block_ids, num_tokens, incarnation, mode))

    def range_ready(self, transfer_id: str, block_ids: Sequence[int] | np.ndarray,
                    tokens: tuple[int, int], *, layers: tuple[int, int] | None = None,
                    incarnation: int = 0, ready: Any = None) -> None:
        """Progressive push: tokens ``[a, b)`` of ``transfer_id`` are final for layers
        ``[l0, l1)`` (None: all) in ``block_ids`` -- once ``ready.query()`` is true
        when given (a CUDA event recorded after the layer: the I/O thread polls it,
        the engine thread never waits). Registered legs write the range at once;
        :meth:`prefill_finished` still ends the stream."""
        self._submit(cmd.RangeReady(transfer_id, block_ids, tokens, layers, incarnation,
                                    ready))

    def prefill_aborted(self, transfer_id: str, *, incarnation: int = 0) -> None:
        """The engine aborted ``transfer_id`` before or after its prefill."""
        self._submit(cmd.PrefillAborted(transfer_id, incarnation))

    # ---------------------------------------------------------------- both

    def poll(self) -> list[Event]:
        """Events since the last call (never blocks)."""
        return self._loop.take_events()

    def wait(self, timeout_s: float) -> bool:
        """Block until an event is pending or ``timeout_s`` passes (not for engine loops)."""
        return self._loop.wait_events(timeout_s)

    def stats(self) -> dict[str, int]:
        """Counters (rejected frames, writes, bytes, handshakes, frames dropped by
        authentication...), as last published by the I/O thread."""
        return self._loop.stats()

    def inspect(self, timeout_s: float = 5.0) -> RuntimeView:
        """A consistent view of the endpoint's state, taken on the I/O thread (blocks)."""
        fut: Future[RuntimeView] = Future()
        self._submit(cmd.Inspect(reply=fut))
        return fut.result(timeout_s)

    def inject(self, peer: Peer, frame: bytes, channel: Literal["control", "notify"]) -> None:
        """Fault injection: send raw ``frame`` to a known peer rank on a channel."""
        self._submit(cmd.Inject(peer=peer, frame=frame, channel=channel))

    def close(self, timeout_s: float | None = None) -> None:
        """Stop: finish writes in flight, say goodbye, release the agent. Idempotent."""
        if not self._closing:
            self._closing = True
            self._loop.submit(cmd.Close())
        self._loop.thread.join(timeout_s if timeout_s is not None
                               else self.config.close_timeout_s + 10.0)

    @property
    def closed(self) -> bool:
        return self._loop.closed.is_set()

    def __enter__(self) -> NixlRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, command: cmd.Command) -> None:
        if self._closing:
            raise RuntimeError("runtime is closed")
        self._enqueue(command)
