"""The worker half of ``PushKVConnector`` (runs in each vLLM worker process).

It owns this rank's :class:`~pushkv.transports.nixl.NixlRuntime`: the KV tensors
are registered with NIXL in :meth:`WorkerSide.register_kv_caches`; each step,
:meth:`WorkerSide.apply` hands the scheduler's orders to the runtime and
:meth:`WorkerSide.results` turns the runtime's events into vLLM's
``finished_sending`` / ``finished_recving`` / ``failed_recving`` sets. Both are
called on vLLM's engine thread and never block: the runtime does its network
work on its own threads.

Units. The protocol counts tokens; with vLLM's CPU cache a protocol token is a
whole vLLM block (see :mod:`.layout`), so token counts are converted here, on
both sides alike, by :meth:`~.layout.KVRegions.units`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import timeline
from ..integrity import IntegrityConfig
from ..protocol.errors import ConfigError
from ..protocol.events import (
    FailurePolicy,
    Mode,
    Publish,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)
from ..protocol.layout import EngineSpec
from .config import ConnectorConfigError, PushKVSettings, parse_cpus
from .layout import KVRegions, describe_kv_caches, layer_index
from .metadata import (
    PublishedSeals,
    PushKVMetadata,
    RangeOrder,
    RankAddress,
    RecvOrder,
    SendOrder,
)
from .stats import EARLY_BYTES, FAILED_REASON, FROM_RUNTIME, REFUSED_FRAMES, PushKVStats

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from ..transports.nixl import NixlRuntime

logger = logging.getLogger(__name__)


def transport_cpus(setting: str) -> frozenset[int] | None:
    """The CPUs the transport's threads should run on; None: leave them be.

    vLLM's CPU backend pins each worker -- and so every thread it starts -- to
    its OpenMP cores. Measured on two cores with a prefill and a decode server,
    leaving the transport there ('inherit') beat letting it roam ('auto'): the
    engine loop that spins meanwhile yields its core, while the other core is
    the other server's. Spare cores, where a machine has them, can be named.
    """
    if setting == "inherit" or not hasattr(os, "sched_getaffinity"):
        return None
    if setting == "auto":
        try:
            parent = frozenset(os.sched_getaffinity(os.getppid()))
        except OSError:
            return None
        return parent if parent != frozenset(os.sched_getaffinity(0)) else None
    return parse_cpus(setting)


@contextlib.contextmanager
def threads_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started inside run on ``cpus`` (Linux threads inherit their creator's)."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("pushkv: cannot run transport threads on CPUs %s: %s", sorted(cpus), exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineFacts:
    """What the worker needs to know about its engine and model."""

    engine_id: str
    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    mla: bool
    #: Layers per pipeline stage as vLLM split them (VLLM_PP_LAYER_PARTITION or its
    #: default); empty means pushkv's default, which is vLLM's.
    pp_layers: tuple[int, ...] = ()

    def spec(self) -> EngineSpec:
        spec = EngineSpec(engine_id=self.engine_id, tp_size=self.tp_size, pp_size=self.pp_size,
                          num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                          mla=self.mla, pp_layers=self.pp_layers)
        spec.validate()
        return spec

    @property
    def rank(self) -> int:
        """The protocol's global rank: ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank


@dataclass(slots=True)
class _Recv:
    req_id: str
    blocks: int  # blocks the transfer writes
    registered: float = 0.0  # time.monotonic() when the registration was handed over
    pull: bool = False  # read by the runtime's reader thread


#: The longest a step that runs no forward (vLLM's ``kv_connector_no_forward``: nothing
#: but transfers to wait for) waits, in :meth:`WorkerSide.results`, for the first
#: outcome of the pulls still being read: the read's completion then reaches vLLM in
#: this step, not the next idle step's (its ~1 ms sleep plus a scheduler-to-worker
#: round trip, 2.5 ms median behind vllm-router on a loaded 2-core machine), and the
#: waiting engine thread leaves the GIL and the core to the reader and I/O threads
#: meanwhile. Short, because requests arriving meanwhile are admitted only after the
#: step (a pull's read and hand-offs took 1.3 ms median there). A step with a forward
#: never waits.
IDLE_STEP_WAIT_S = 0.002

#: The longest the step that published a pulled source (a router's one-token prefill
#: leg, finished as the step saved its KV) waits for the runtime's ``Publish``, whose
#: seal (rule 11) must go out in the prefill's answer, at the step's end. The runtime
#: publishes as soon as its thread takes the order (a hand-off, and a digest of the
#: prompt's KV); past this bound the answer leaves unsealed and the pull is not
#: checked (counted ``seals_late``, logged). Only a source the ``integrity`` setting
#: seals waits (``off``, or a transfer ``sample`` skips: none).
SEAL_WAIT_S = 0.5


class WorkerSide:
    """Worker-process state of one ``PushKVConnector``."""

    def __init__(self, facts: EngineFacts, *, settings: PushKVSettings,
                 policy: FailurePolicy, role: str) -> None:
        if role not in ("producer", "consumer"):
            raise ConfigError(f"role must be producer or consumer, not {role!r}")
        self.facts = facts
        self.settings = settings
        self.policy = policy
        self.role = role
        self.regions: KVRegions | None = None
        self.runtime: NixlRuntime | None = None
        self._recv: dict[str, _Recv] = {}  # consumer: transfer id -> request
        self._send: dict[str, str] = {}  # producer: transfer id -> request
        self._send_since: dict[str, float] = {}  # producer: when its prefill finished
        self._block_bytes = 0
        self._done: set[str] = set()  # consumer: requests to report finished
        self._failed: set[str] = set()
        self._sent: set[str] = set()
        #: producer, pull: sources this step published, until their seal came (None);
        #: only those the integrity setting seals (nothing to wait for otherwise)
        self._sealing: dict[str, bytes | None] = {}
        self._seals = IntegrityConfig.parse(settings.integrity)
        self._stats = PushKVStats()
        self._seen: Counter[str] = Counter()
        self._refused = 0  # the runtime's refused frames, as last counted
        self._early = 0  # the runtime's bytes written before prefill finished, as counted
        self._counted: Counter[str] = Counter()  # packed writes: the runtime's, as reported
        self._layers: dict[str, int] = {}  # layer name -> model layer index
        self._cuda = False  # KV on a GPU: a range is final once its CUDA event completed

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, *, settings: PushKVSettings,
                  policy: FailurePolicy, engine_id: str, is_producer: bool,
                  is_consumer: bool) -> WorkerSide:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group
        from vllm.distributed.utils import get_pp_indices

        if is_producer and is_consumer:
            raise ConfigError("kv_both is not supported by PushKVConnector: run separate "
                              "kv_producer and kv_consumer instances")
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        layers, pp = model.get_total_num_hidden_layers(), parallel.pipeline_parallel_size
        stages = [get_pp_indices(layers, r, pp) for r in range(pp)]
        facts = EngineFacts(
            engine_id=engine_id,
            tp_size=parallel.tensor_parallel_size,
            pp_size=parallel.pipeline_parallel_size,
            tp_rank=get_tp_group().rank_in_group,
            pp_rank=get_pp_group().rank_in_group,
            num_layers=model.get_total_num_hidden_layers(),
            num_kv_heads=1 if model.use_mla else model.get_total_num_kv_heads(),
            head_dim=model.get_head_size(),
            block_size=vllm_config.cache_config.block_size,
            mla=model.use_mla,
            pp_layers=tuple(end - start for start, end in stages),
        )
        return cls(facts, settings=settings, policy=policy,
                   role="producer" if is_producer else "consumer")

    # ------------------------------------------------------------ set-up

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the KV tensors and register them with a new NIXL runtime."""
        from ..transports.nixl import KVMemory, NixlConfig, NixlRuntime, SideChannelBindError

        f = self.facts
        regions = describe_kv_caches(kv_caches, engine=f.spec(), rank=f.rank,
                                     block_size=f.block_size, head_dim=f.head_dim)
        first = next(iter(kv_caches.values()))
        kind = "VRAM" if first.device.type == "cuda" else "DRAM"
        self._cuda = kind == "VRAM"
        device = int(first.device.index or 0) if kind == "VRAM" else 0
        memory = KVMemory.from_addresses(regions.bases, regions.layout.region_bytes,
                                         kind=kind, device=device)
        # The tensors the regions lie in: packed writes gather and scatter through them.
        memory = dataclasses.replace(memory, owners=tuple(kv_caches.values()))
        s = self.settings
        config = NixlConfig(
            backend=s.backend,  # type: ignore[arg-type]  # checked by PushKVSettings
            backend_params=dict(s.backend_options),
            host=s.side_channel_host,
            port=s.side_channel_port + f.rank if s.side_channel_port else 0,
            key_file=s.key_file,
            key_env=s.key_env,
            progress_delay_us=s.progress_delay_us,
            write_timeout_s=s.write_timeout_s,
            peer_confirm_s=s.peer_confirm_s,
            integrity=s.integrity,
            inject=s.integrity_inject if self.role == "consumer" else "",
        )
        if self.role == "consumer":
            # While a transfer is live; a new registration switches the runtime to this
            # period at once, and with none live nothing wakes the decode core.
            config = dataclasses.replace(config, active_poll_s=s.notify_poll_ms / 1000)
        try:
            with threads_on(transport_cpus(s.transport_cpus)):
                self.runtime = NixlRuntime(
                    regions.info, memory, role=self.role,  # type: ignore[arg-type]
                    config=config,
                    producer_config=s.producer_config(),
                    consumer_config=s.consumer_config(self.policy),
                )
        except SideChannelBindError as exc:
            setting = "side_channel_port" if exc.setting == "port" else "side_channel_host"
            raise ConnectorConfigError(
                f"pushkv rank {f.rank} of {f.engine_id}: side channel cannot bind "
                f"tcp://{exc.host}:{exc.port} (kv_connector_extra_config.{setting}="
                f"{getattr(s, setting)!r}; side_channel_port 0 picks free ports)") from None
        self.regions = regions
        # Bytes of one vLLM block on this rank, every layer and plane.
        self._block_bytes = (regions.units(f.block_size) * regions.layout.token_bytes
                             * regions.layout.num_regions)
        lo = regions.layout
        logger.info(
            "pushkv %s rank %d of %s: %d layers x %d planes, %d blocks of %d B, side channel %s",
            self.role, f.rank, f.engine_id, lo.num_layers, lo.planes, lo.num_blocks,
            lo.block_bytes, self.runtime.address)

    def handshake(self) -> RankAddress | None:
        """This rank's side-channel address, for the scheduler's discovery answers."""
        if self.runtime is None:
            return None
        return RankAddress(rank=self.facts.rank, address=self.runtime.address)

    def _rt(self) -> tuple[NixlRuntime, KVRegions]:
        if self.runtime is None or self.regions is None:
            raise RuntimeError("register_kv_caches has not run")
        return self.runtime, self.regions

    # ------------------------------------------------------------ orders

    def apply(self, meta: PushKVMetadata) -> None:
        """Hand one step's orders to the runtime (non-blocking)."""
        if meta.is_empty():
            return
        rt, regions = self._rt()
        for order in meta.recv:
            self._register(rt, regions, order)
        for ab in meta.recv_abort:
            if ab.transfer_id in self._recv:
                rt.abort(ab.transfer_id)
        self._done.update(meta.recv_drop)
        self._done.update(meta.recv_fail)
        self._failed.update(meta.recv_fail)
        for gone in meta.recv_abandon:
            try:
                rt.connect(gone.producer.engine_id, gone.producer.addresses())
            except ConfigError as exc:
                logger.warning("transfer %s: cannot tell its producer: %s", gone.transfer_id,
                               exc)
                continue
            rt.abandon(gone.transfer_id, gone.producer.engine_id,
                       incarnation=gone.incarnation)
            self._stats.add("transfers_abandoned")
        for send in meta.send:
            self._finish(rt, regions, send)
        for ab in meta.send_abort:
            rt.prefill_aborted(ab.transfer_id, incarnation=ab.incarnation)
            self._stats.add("pushes_aborted")
        # Rule 12: after the step's work is posted (vLLM starts its connector's loads
        # after the forward launch): the KV these requests decode from is in place
        # already; the producer may now free the source it kept for a re-target.
        for tid in meta.consumed:
            rt.consumed(tid)
        self._stats.add("transfers_consumed", len(meta.consumed))

    def _finish(self, rt: NixlRuntime, regions: KVRegions, send: SendOrder) -> None:
        """The prefill of ``send`` finished: its KV goes out (or is published)."""
        self._send[send.transfer_id] = send.req_id
        timeline.mark(send.transfer_id, "write_handed")
        self._send_since[send.transfer_id] = time.monotonic()
        pull = send.direction == "pull"
        rt.prefill_finished(send.transfer_id, send.block_ids, regions.units(send.num_tokens),
                            incarnation=send.incarnation, mode=Mode.PULL if pull else Mode.PUSH)
        self._stats.add("sources_published" if pull else "pushes_started")

    def finish_saved(self, sends: list[SendOrder]) -> None:
        """After the step's forward: the prefills it completed (and that end with it) are
        finished now, not one engine step later. On a GPU the runtime waits for an event
        recorded here, as for a progressive range."""
        rt, regions = self._rt()
        ready = self._event()
        for send in sends:
            timeline.mark(send.transfer_id, "prefill_finished")
            # the stream's last range carries the event; a published source is read
            # only once the leg's answer is out, so after the step's forward completed
            if ready is not None and send.direction != "pull":
                rt.range_ready(send.transfer_id, send.block_ids,
                               (0, regions.units(send.num_tokens)), incarnation=send.incarnation,
                               ready=ready)
            if send.direction == "pull" and self._seals.checks(send.transfer_id,
                                                               send.incarnation):
                self._sealing[send.transfer_id] = None  # its answer leaves with this step
            self._finish(rt, regions, send)

    def published_seals(self) -> PublishedSeals | None:
        """Rule 11, pull: the seal of each source this step published, for its answer
        (vLLM asks at the step's end). Waits up to :data:`SEAL_WAIT_S` for the
        runtime's publications (only those the integrity setting seals are waited
        for); ``b""``: no seal in time, or none could be taken."""
        if not self._sealing:
            return None
        rt, end = self.runtime, time.monotonic() + SEAL_WAIT_S
        while rt is not None and None in self._sealing.values():
            left = end - time.monotonic()
            if left <= 0:
                break
            rt.wait(left)
            for event in rt.poll():
                self._on_event(event)
        late = [tid for tid, seal in self._sealing.items() if seal is None]
        if late:
            self._stats.add("seals_late", len(late))
            logger.warning("pushkv: no publication of %s within %.0f ms: answered "
                           "unsealed (read unchecked)", late[:4], SEAL_WAIT_S * 1000)
        seals, self._sealing = self._sealing, {}
        rank = self.facts.rank
        return PublishedSeals(seals={tid: {rank: seal or b""} for tid, seal in seals.items()})

    def _event(self) -> Any:
        """On a GPU, an event recorded on the current stream now: it completes once the
        kernels that wrote this step's KV did. None on CPU (the forward is done)."""
        if not self._cuda:
            return None
        import torch

        ready = torch.cuda.Event()
        ready.record()
        return ready

    # ------------------------------------------------- progressive push

    def layer_saved(self, ranges: list[RangeOrder], layer_name: str) -> None:
        """push_granularity 'layer' (inside the forward, after the layer's attention):
        the step's ranges are final in this layer."""
        if self.settings.push_granularity != "layer":
            return
        layer = self._layers.get(layer_name)
        if layer is None:
            layer = self._layers[layer_name] = layer_index(layer_name)
        self._hand_ranges(ranges, (layer, layer + 1))

    def step_saved(self, ranges: list[RangeOrder]) -> None:
        """push_granularity 'chunk' (after the step's forward): the step's ranges are
        final in every layer."""
        if self.settings.push_granularity == "chunk":
            self._hand_ranges(ranges, None)

    def _hand_ranges(self, ranges: list[RangeOrder], layers: tuple[int, int] | None) -> None:
        """Queue the ranges on the runtime; the engine thread never waits. On a GPU the
        kernels that wrote them may still run: an event recorded on the current stream
        now completes after them, and the runtime feeds each range once it did."""
        rt, regions = self._rt()
        ready = self._event()
        for r in ranges:
            # start begins a vLLM block; end ends one or is the prompt's end (rounded up).
            rt.range_ready(r.transfer_id, r.block_ids,
                           (regions.first_unit(r.start), regions.units(r.end)),
                           layers=layers, incarnation=r.incarnation, ready=ready)
        self._stats.add("ranges_reported", len(ranges))

    # ------------------------------------------------------------ orders

    def _register(self, rt: NixlRuntime, regions: KVRegions, order: RecvOrder) -> None:
        bs = self.facts.block_size
        written = -(-order.num_tokens // bs) - order.first_token // bs
        try:
            first = regions.first_unit(order.first_token)
            rt.connect(order.producer.engine_id, order.producer.addresses())
        except ConfigError as exc:
            self._transfer_failed(order.transfer_id, order.req_id, "CANNOT_START", str(exc))
            return
        self._recv[order.transfer_id] = _Recv(order.req_id, written, time.monotonic(),
                                              pull=order.direction == "pull")
        timeline.mark(order.transfer_id, "registration_handed")
        if order.direction == "pull":  # read by the runtime's reader thread
            rt.start_pull(order.transfer_id, order.producer.engine_id, order.src_block_ids,
                          order.block_ids, regions.units(order.num_tokens), first,
                          incarnation=order.incarnation,
                          lease_s=None if order.lease_until is None
                          else order.lease_until - time.time(),
                          seals=order.seals, every_rank=True)
            self._stats.add("transfers_pulled")
            return
        rt.register(order.transfer_id, order.producer.engine_id, order.block_ids,
                    regions.units(order.num_tokens), first, incarnation=order.incarnation,
                    target=order.target)
        self._stats.add("transfers_registered")

    # ----------------------------------------------------------- results

    def results(self, idle: bool = False) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last call.
        ``idle``: the step ran no forward; while pulls are being read it waits up to
        :data:`IDLE_STEP_WAIT_S` for the runtime's next events."""
        rt = self.runtime
        if rt is not None:
            events = rt.poll()
            if (idle and not events and any(r.pull for r in self._recv.values())
                    and rt.wait(IDLE_STEP_WAIT_S)):
                events = rt.poll()
            for event in events:
                self._on_event(event)
        sending, self._sent = self._sent, set()
        recving, self._done = self._done, set()
        failed, self._failed = self._failed, set()
        return sending, recving, failed

    def _on_event(self, event: Any) -> None:
        from ..transports.nixl import CallFailed, PeerLost, WritesDone

        if isinstance(event, TransferReady):
            rec = self._recv.pop(event.transfer_id, None)
            if rec is not None:
                timeline.mark(event.transfer_id, "ready")
                self._done.add(rec.req_id)
                self._stats.add("transfers_ready")
                self._stats.add("blocks_received", rec.blocks)
                self._stats.observe("registration_to_ready_seconds",
                                    time.monotonic() - rec.registered)
                self._stats.observe("transfer_bytes", float(rec.blocks * self._block_bytes))
        elif isinstance(event, TransferFailed):
            rec = self._recv.pop(event.transfer_id, None)
            if rec is not None:
                self._transfer_failed(event.transfer_id, rec.req_id, event.code.name,
                                      event.reason, attempt=event.attempt,
                                      incarnation=event.incarnation)
        elif isinstance(event, TransferCancelled):
            rec = self._recv.pop(event.transfer_id, None)
            if rec is not None:
                self._done.add(rec.req_id)
                self._stats.add("transfers_cancelled")
        elif isinstance(event, ReleaseSource):
            req_id = self._send.pop(event.transfer_id, None)
            since = self._send_since.pop(event.transfer_id, None)
            if since is not None:
                self._stats.observe("transfer_seconds", time.monotonic() - since)
            if req_id is not None:
                self._sent.add(req_id)
                self._stats.add("sources_released")
                self._stats.add("blocks_sent", len(event.block_ids))
        elif isinstance(event, WritesDone):
            if event.transfer_id in self._send:
                self._stats.observe("descriptors_per_transfer", float(event.descriptors))
        elif isinstance(event, Publish):
            # a pull's blocks are in the answer; its seal goes with them (published_seals)
            if event.transfer_id in self._sealing:
                self._sealing[event.transfer_id] = event.seal
        elif isinstance(event, ReleaseDestination):
            pass  # the transfer's terminal event follows
        elif isinstance(event, CallFailed):
            self._on_call_failed(event)
        elif isinstance(event, PeerLost):
            logger.warning("pushkv: engine %s is gone; its transfers were fenced",
                           event.engine_id)
        elif isinstance(event, Rejected):
            self._seen["rejected"] += 1
            logger.debug("pushkv: refused a frame from %s: %s", event.peer, event.error)

    def _transfer_failed(self, transfer_id: str, req_id: str, code: str, reason: str, *,
                         attempt: int = 0, incarnation: int = 0) -> None:
        """Report a failed transfer to vLLM, count it by reason, log one JSON line."""
        self._done.add(req_id)
        self._failed.add(req_id)
        self._stats.add("transfers_failed")
        self._stats.add(FAILED_REASON + code)
        logger.warning("pushkv transfer failed %s", json.dumps({
            "transfer_id": transfer_id, "incarnation": incarnation, "attempt": attempt,
            "request_id": req_id, "reason": code, "detail": reason,
            "engine_id": self.facts.engine_id, "rank": self.facts.rank,
            "policy": self.policy.value}, sort_keys=True))

    def _on_call_failed(self, event: Any) -> None:
        tid = event.transfer_id
        if event.operation in ("register", "start_pull") and tid in self._recv:
            # Nothing was lent: the request fails and its blocks go back at once.
            rec = self._recv.pop(tid)
            self._transfer_failed(tid, rec.req_id, "REGISTER_REFUSED", event.error)
        elif event.operation == "prefill_finished" and tid in self._send:
            logger.error("transfer %s could not be pushed: %s", tid, event.error)
            self._sent.add(self._send.pop(tid))
            self._send_since.pop(tid, None)
        elif event.operation == "range_ready":  # the transfer still ends at prefill end
            logger.warning("transfer %s: a progressive range was refused: %s", tid,
                           event.error)
        else:  # e.g. an abort racing the transfer's own end: that end is reported
            logger.debug("pushkv: %s(%s) refused: %s", event.operation, tid, event.error)

    # ------------------------------------------------------------- misc

    def take_stats(self) -> PushKVStats | None:
        if self.runtime is not None:
            counts = self.runtime.stats()
            refused = sum(counts.get(k, 0) for k in REFUSED_FRAMES)
            self._stats.add("frames_refused", refused - self._refused)
            self._refused = refused
            early = counts.get("bytes_written_early", 0)
            self._stats.add(EARLY_BYTES, early - self._early)
            self._early = early
            for name, key in FROM_RUNTIME.items():  # reported as changes
                now = counts.get(key, 0)
                self._stats.add(name, now - self._counted[name])
                self._counted[name] = now
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, PushKVStats()
        return stats

    def shutdown(self) -> None:
        rt, self.runtime = self.runtime, None
        if rt is not None:
            rt.close()
