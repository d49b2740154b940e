"""Prefill and decode instances: vLLM-style engine loops with continuous batching.

Both loops repeat *schedule, then run one step*. A step's duration comes from
:func:`~pushkv.sim.costs.step_s`; whatever arrives during a step (a request,
a finished transfer) is seen at the next schedule, as in vLLM.

**Prefill** admits waiting requests while fewer than ``max_num_seqs`` run and
the step's token budget lasts (chunked prefill: a long prompt takes several
steps); a prefix-cache hit skips that part of the prompt's compute. When a
prompt is done its blocks stay held for the transfer until the producer
endpoint releases them.

**Decode** follows vLLM's scheduler: requests whose KV is ready are admitted
first, then new requests get blocks -- but only while fewer than
``max_num_seqs`` are running, so when the slots are full no new transfer
starts. A new request's blocks are registered (push) or read (pull) at once;
in ``pull`` the descriptors are prepared and posted **inside this step**,
which stalls every running sequence: the step lasts ``max(forward,
posting)`` when the loop posts after launching the forward (vLLM >= 0.29,
``inline_post = "after-forward"``), ``forward + posting`` when it posts
first. A request produces its first token in the step that admits it with
its KV in place, then one token per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from ..protocol import FailurePolicy, Mode
from .blocks import BlockPool, blocks_for
from .costs import step_s
from .feed import Layers, step_end
from .host.model import HostModel
from .profile import EngineProfile, Profile
from .request import Outcome, SimRequest
from .scenario import TransferMode
from .trace import PrefixCache, cached_tokens
from .transport import SimTransport


class Recorder:
    """Counts requests that ended; fires ``done`` when all have."""

    def __init__(self, env: simpy.Environment, total: int) -> None:
        self.env = env
        self.total = total
        self.ended: list[SimRequest] = []
        self.done = env.event()
        #: called with each request as it ends (closed-loop load frees its slot)
        self.listeners: list[Callable[[SimRequest], None]] = []

    def finish(self, req: SimRequest, error: str = "") -> None:
        if req.parent is not None:  # a retry's leg: the client request it stands for ends
            parent, req.outcome, req.error = req.parent, Outcome.FAILED if error else (
                Outcome.OK), error
            for name in ("prefill", "decode", "prefill_done_at", "kv_ready_at", "token_times",
                         "client_times", "recomputed", "preempted", "failovers"):
                setattr(parent, name, getattr(req, name))
            req = parent
        if req.outcome is not Outcome.PENDING:
            raise AssertionError(f"request {req.transfer_id} ended twice")
        req.outcome = Outcome.FAILED if error else Outcome.OK
        req.error = error
        self.ended.append(req)
        for listener in self.listeners:
            listener(req)
        if len(self.ended) == self.total:
            self.done.succeed()


class _Loop:
    """A wakeable engine loop, behind its instance's API server, on its ``host``."""

    def __init__(self, env: simpy.Environment, engine_id: str, transport: SimTransport,
                 side: str, eng: EngineProfile, host: HostModel) -> None:
        self.env = env
        self.eng = eng
        self.transport = transport
        self.host = host
        self.side = side
        self._arrived = f"{side}_arrived"  #: the timeline mark of a leg its API server takes
        self.engine_id = engine_id
        self.alive = True
        self.busy_s = 0.0
        self.steps = 0
        self.spun_s = 0.0  #: how long it stepped empty, holding (``steps_while_holding``)
        self._wake: simpy.Event | None = None
        self.ingest_s = eng.ingest_s

    def ingest(self, then: Callable[[SimRequest], None], req: SimRequest) -> None:
        """A leg reaches this instance's API server: ``then(req)`` (submit) once it has
        spent ``ingest_s`` there, as the host queues it behind the legs (or all the
        frontends' work) ahead of it; at once without it."""
        work_s, wait_s = self.host.split(self.ingest_s)

        def arrived() -> None:  # the API server gets to it (vLLM's ``arrival_time``)
            self.transport.mark(req.transfer_id, self._arrived)

        if not self.ingest_s:
            arrived()
            then(req)
            return
        self.host.ingest(self.engine_id, work_s, wait_s, started=arrived,
                         then=lambda: then(req))  # this instance's API server

    def _idle(self, holding: bool) -> Generator[Any, Any, None]:
        """Nothing to compute: sleep until poked; ``holding``: a request of this engine
        waits on a transfer (the host may keep the loop stepping empty meanwhile)."""
        self.spun_s += yield from self.host.idle(self.side, holding, self._sleep)

    def poke(self) -> None:
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _sleep(self) -> simpy.Event:
        self._wake = self.env.event()
        return self._wake


@dataclass(slots=True, eq=False)
class _Prefill:
    req: SimRequest
    blocks: list[int]
    computed: int
    reported: int = 0  #: progressive push: prompt tokens [0, reported) reported final


class PrefillEngine(_Loop):
    """A prefill instance: computes prompts, then holds their KV for the transfer."""

    def __init__(
        self,
        env: simpy.Environment,
        engine_id: str,
        profile: Profile,
        pool: BlockPool,
        transport: SimTransport,
        mode: TransferMode,
        on_done: Callable[[SimRequest, tuple[int, ...] | None], None],
        host: HostModel,
    ) -> None:
        super().__init__(env, engine_id, transport, "prefill", profile.prefill, host)
        self.profile = profile
        self.pool = pool
        self.mode = mode
        #: what the loop reports before a prompt ends (TransferMode.granularity):
        #: "request" (nothing), "chunk" (each step's tokens), "layer" (each layer's)
        self.granularity = "request"
        self.on_done = on_done  #: the prefill leg answers the router
        self.waiting: deque[SimRequest] = deque()
        self.running: list[_Prefill] = []
        self.held: dict[str, list[int]] = {}
        self._by_tid: dict[str, SimRequest] = {}
        self.cached_tokens = 0
        self.computed_tokens = 0
        #: with a trace: the prefix cache its block hashes play (else the profile's
        #: prefix_hit_fraction of every prompt)
        self.prefix_cache: PrefixCache | None = None
        env.process(self._loop())

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def submit(self, req: SimRequest) -> None:
        if not self.alive:
            return  # lost with the instance; the router learns of the death
        self.waiting.append(req)
        self.poke()

    def cached_prefix(self, input_len: int) -> int:
        """Prompt tokens served from the prefix cache (whole blocks, never the last token)."""
        bs = self.eng.block_size
        hit = int(self.eng.prefix_hit_fraction * input_len) // bs * bs
        return min(hit, input_len - 1)

    def _loop(self) -> Generator[Any, Any, None]:
        eng = self.eng
        while self.alive:
            budget = eng.max_num_batched_tokens
            chunks: list[tuple[_Prefill, int]] = []
            for p in self.running:
                if budget <= 0:
                    break
                n = min(p.req.input_len - p.computed, budget)
                chunks.append((p, n))
                budget -= n
            while self.waiting and len(self.running) < eng.max_num_seqs and budget > 0:
                req = self.waiting[0]
                self.transport.mark(req.transfer_id, "prefill_seen")
                need = blocks_for(req.input_len, eng.block_size)
                if not self.pool.can_allocate(need):
                    break
                self.waiting.popleft()
                if self.prefix_cache is None:
                    cached = self.cached_prefix(req.input_len)
                else:
                    cached = cached_tokens(self.prefix_cache.admit(req.spec.block_hashes),
                                           req.input_len, eng.block_size)
                self.cached_tokens += cached
                p = _Prefill(req, self.pool.allocate(need), cached)
                self.running.append(p)
                n = min(req.input_len - cached, budget)
                chunks.append((p, n))
                budget -= n
            if not chunks:  # holding: finished prompts' KV kept for their transfers
                yield from self._idle(bool(self.held))
                continue
            dt = step_s(self.profile, eng, prefill_chunks=tuple((n, p.computed) for p, n in chunks))
            ranges = self._ranges(chunks) if self.granularity != "request" else []
            layers = self._layers(dt, ranges) if self.granularity == "layer" else None
            dt = yield from self.transport.run_step(self.engine_id, eng.step_python_s, dt,
                                                    layers)
            if not self.alive:
                return
            self.busy_s += dt
            self.steps += 1
            final = {p: (a, b) for p, a, b in ranges}
            for p, n in chunks:
                p.computed += n
                self.computed_tokens += n
                if p.computed >= p.req.input_len:
                    self.running.remove(p)
                    self._finished(p)  # ends the stream: every token final
                elif p in final:
                    a, b = final[p]
                    if self.granularity == "chunk":
                        self._report(p, a, b, None)
                    p.reported = b

    # ------------------------------------------------------ progressive push

    def _ranges(self, chunks: list[tuple[_Prefill, int]]) -> list[tuple[_Prefill, int, int]]:
        """What this step makes final, per prompt: ``(p, start, end)``, from what earlier
        steps reported (a prefix-cache hit goes with the first step) to :func:`step_end`."""
        bs = self.eng.block_size
        return [(p, p.reported, end) for p, n in chunks
                if (end := step_end(p.computed, n, p.req.input_len, bs)) > p.reported]

    def _report(self, p: _Prefill, a: int, b: int, layers: tuple[int, int] | None) -> None:
        """Tokens ``[a, b)`` of ``p`` are final in ``layers`` (None: every layer)."""
        self.transport.range_ready(
            self.engine_id, p.req.transfer_id, p.blocks[:blocks_for(b, self.eng.block_size)],
            (a, b), layers=layers, incarnation=p.req.incarnation)

    def _layers(self, dt: float, ranges: list[tuple[_Prefill, int, int]]) -> Layers:
        """The step cut at each layer's end (its roofline compute / layers), where the
        step's ranges of every prompt in the batch are reported in that layer."""
        eng, num = self.eng, self.profile.model.num_layers
        head = min(eng.prefill_step_overhead_s, dt)

        def done(layer: int) -> None:
            if self.alive:
                for p, a, b in ranges:
                    self._report(p, a, b, (layer, layer + 1))

        return Layers(head, (dt - head) / num, num, done)

    def _finished(self, p: _Prefill) -> None:
        req = p.req
        tid = req.transfer_id
        self.transport.mark(tid, "prefill_finished")
        self.held[tid] = p.blocks
        self._by_tid[tid] = req
        mode = Mode.PUSH if self.mode is TransferMode.PUSH else Mode.PULL
        self.transport.prefill_finished(self.engine_id, tid, p.blocks, req.input_len, mode,
                                        incarnation=req.incarnation)
        if mode is Mode.PUSH:
            self.on_done(req, None)

    # ---------------------------------------------------------- endpoint outputs

    def published(self, transfer_id: str, block_ids: tuple[int, ...], num_tokens: int) -> None:
        self.on_done(self._by_tid[transfer_id], block_ids)

    def release_source(self, transfer_id: str, block_ids: tuple[int, ...]) -> None:
        blocks = self.held.pop(transfer_id)
        self._by_tid.pop(transfer_id, None)
        if tuple(blocks) != tuple(block_ids):
            raise AssertionError(f"{transfer_id}: released blocks differ from held ones")
        self.pool.free(blocks)
        self.poke()  # freed blocks may admit a prompt that waits for room

    def kill(self) -> list[SimRequest]:
        """Die now; return the requests that were queued or prefilling here."""
        self.alive = False
        self.poke()
        lost = [*self.waiting, *(p.req for p in self.running)]
        self.waiting.clear()
        self.running.clear()
        return lost


class DecodeEngine(_Loop):
    """A decode instance: receives KV, then generates tokens with continuous batching."""

    def __init__(
        self,
        env: simpy.Environment,
        engine_id: str,
        profile: Profile,
        pool: BlockPool,
        transport: SimTransport,
        mode: TransferMode,
        recorder: Recorder,
        host: HostModel,
    ) -> None:
        super().__init__(env, engine_id, transport, "decode", profile.decode, host)
        self.profile = profile
        self.pool = pool
        self.mode = mode
        self.recorder = recorder
        self.waiting: deque[SimRequest] = deque()
        self.holding: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self._by_tid: dict[str, SimRequest] = {}
        self.stall_s = 0.0
        self.stalled_steps = 0
        self.recomputed = 0
        self.preempted = 0  #: requests preempted under memory pressure
        self.failed_transfers = 0
        #: the router's failover for requests this instance can no longer serve
        self._hand_over: Callable[[SimRequest], bool] | None = None
        self._queued = env.event()  #: fires when a request is queued (heartbeats)
        #: orders shipped this step, for its forward (``orders_at_forward``)
        self._orders: list[Callable[[], None]] = []
        env.process(self._loop())
        if self.eng.heartbeat_queued:
            env.process(self._heartbeat_queued())

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.holding) + len(self.running)

    def submit(self, req: SimRequest) -> None:
        req.decode = self.engine_id
        if not self.alive:  # the connection is refused
            if self._hand_over is None or not self._hand_over(req):
                self.recorder.finish(req, error=f"decode instance {self.engine_id} is down")
            return
        self._by_tid[req.transfer_id] = req
        self.waiting.append(req)
        if not self._queued.triggered:
            self._queued.succeed()
        self.poke()

    def submit_local(self, req: SimRequest) -> None:
        """Compute the prompt here (no prefill instance, or the recompute policy)."""
        req.local_prefill = True
        req.recomputed = True
        self.submit(req)

    def _heartbeat_queued(self) -> Generator[Any, Any, None]:
        """vLLM's scheduler renews the lease of every queued request every lease/6."""
        period = self.transport.settings.heartbeat_s
        while self.alive:
            by_producer: dict[str, list[tuple[str, int]]] = {}
            for r in self.waiting:
                if not r.local_prefill and r.prefill is not None:
                    by_producer.setdefault(r.prefill, []).append(
                        (r.transfer_id, r.incarnation))
            if not by_producer:
                self._queued = self.env.event()
                yield self._queued
                yield self.env.timeout(period)  # the first beat is a period after arrival
                continue
            for producer, tids in sorted(by_producer.items()):
                if producer not in self.transport.known_dead:
                    self.transport.heartbeat_queued(self.engine_id, producer, tids)
            yield self.env.timeout(period)

    # ------------------------------------------------------------------- loop

    def _admit_new(self, req: SimRequest, stall: float) -> float:
        """Give a new request its blocks and start its transfer; return posting stall."""
        eng = self.eng
        producer = req.prefill
        assert producer is not None
        if producer in self.transport.known_dead:
            # The transport has reported the producer dead: no transfer can start.
            self._transfer_failed_now(req, f"prefill instance {producer} is down")
            return 0.0
        req.dst_blocks = self.pool.allocate(blocks_for(req.input_len, eng.block_size))
        self.holding.append(req)
        return self._start_transfer(req, stall)

    def _start_transfer(self, req: SimRequest, stall: float) -> float:
        tid, producer = req.transfer_id, req.prefill
        assert producer is not None
        if self.mode.is_pull and not self.transport.knows(self.engine_id, producer):
            # A pull is planned against the producer's layout: handshake first (vLLM's
            # _ensure_handshake); the read goes out in the step after it completes.
            req.awaiting_handshake = True
            self.transport.connect(self.engine_id, producer)
            return 0.0
        req.awaiting_handshake = False
        if self.mode is TransferMode.PUSH:
            self.transport.mark(tid, "registration_shipped")
            if self.eng.orders_at_forward:  # the worker takes it with the step's forward
                req.handing_off = True
                self._orders.append(lambda: self._register(req))
            elif self.eng.order_handoff_s:  # the worker takes the order with the step
                req.handing_off = True
                self.env.timeout(self.host.spread(self.eng.order_handoff_s)).callbacks.append(
                    lambda _: self._register(req))
            else:
                self._register(req)
            return 0.0
        if self.eng.orders_at_forward:
            req.handing_off = True
            self._orders.append(lambda: self._read(req))
            return 0.0
        if self.eng.order_handoff_s:  # the worker reads when it takes the step's orders
            req.handing_off = True
            self.env.timeout(self.host.spread(self.eng.order_handoff_s)).callbacks.append(
                lambda _: self._read(req))
            return 0.0
        inline = stall if self.mode is TransferMode.PULL else None
        return self.transport.start_pull(
            self.engine_id, tid, producer, req.src_blocks, req.dst_blocks, req.input_len,
            inline_after=inline, incarnation=req.incarnation,
        )

    def _read(self, req: SimRequest) -> None:
        """Pull with ``order_handoff_s``: the read order reaches the worker, which posts it
        (vLLM's NixlConnector reads in the worker's ``start_load_kv``, at the step whose
        connector metadata carries the request; the posting is the worker's, not the
        scheduler's step)."""
        producer = self._handed_off(req)
        if producer is None:
            return
        self.transport.start_pull(self.engine_id, req.transfer_id, producer, req.src_blocks,
                                  req.dst_blocks, req.input_len, inline_after=None,
                                  incarnation=req.incarnation)

    def _handed_off(self, req: SimRequest) -> str | None:
        """An order (register or read) reached the transport after its hand-off: the
        producer to send it to, or None when the request is gone or its producer died
        meanwhile (then its blocks are freed and the transfer failed)."""
        req.handing_off = False
        if not self.alive or req.outcome is not Outcome.PENDING or req not in self.holding:
            return None
        producer = req.prefill
        assert producer is not None
        if producer in self.transport.known_dead:  # it died while the order waited
            self.holding.remove(req)
            self.pool.free(req.dst_blocks)
            req.dst_blocks = []
            self._transfer_failed_now(req, f"prefill instance {producer} is down")
            return None
        return producer

    def _register(self, req: SimRequest) -> None:
        """Push: the registration order reaches the transport."""
        producer = self._handed_off(req)
        if producer is None:
            return
        self.transport.mark(req.transfer_id, "registration_handed")
        self.transport.register(self.engine_id, req.transfer_id, producer, req.dst_blocks,
                                req.input_len, incarnation=req.incarnation, target=req.target)

    def connected(self, producer: str) -> None:
        """A handshake finished: held pulls to ``producer`` start at the next step."""
        self.poke()

    def _schedule(self, *, admit_waiting: bool = True) -> float:
        eng = self.eng
        stall = 0.0
        for req in self.holding:
            if req.awaiting_handshake and self.transport.knows(self.engine_id, req.prefill or ""):
                stall += self._start_transfer(req, stall)
        for req in list(self.holding):  # KV-holding requests first, as vLLM does
            if req.kv_ready:
                self.transport.mark(req.transfer_id, "ready_scheduled")
            if len(self.running) >= eng.max_num_seqs:
                break
            if req.kv_ready and self._grow(req):
                self.holding.remove(req)
                self.running.append(req)
                self.transport.mark(req.transfer_id, "decode_scheduled")
        while admit_waiting and self.waiting and len(self.running) < eng.max_num_seqs:
            req = self.waiting[0]
            self.transport.mark(req.transfer_id, "decode_seen")
            off = eng.preemption == "off"  # reserve every output block up front
            if req.local_prefill:
                upto = req.input_len + req.output_len if off else req.prefill_target + 1
            else:
                upto = req.input_len
            need = blocks_for(upto, eng.block_size)
            full = blocks_for(req.input_len + req.output_len, eng.block_size) if off else need
            if not self.pool.can_allocate(full):
                break
            if not req.local_prefill and full > need:
                req.reserved = self.pool.allocate(full - need)
            self.waiting.popleft()
            if req.local_prefill:
                req.dst_blocks = self.pool.allocate(need)
                req.prefilled = 0
                self.running.append(req)
            elif req.reissue:  # a new attempt of its transfer, into new blocks
                req.reissue = False
                req.dst_blocks = self.pool.allocate(need)
                self.holding.append(req)
                self.transport.reissue(self.engine_id, req.transfer_id, req.dst_blocks)
            else:
                stall += self._admit_new(req, stall)
        return stall

    def _grow(self, req: SimRequest) -> bool:
        """Blocks for the generated tokens when the request starts running: all of them
        without preemption, else those of its next token (more come one at a time)."""
        if req.reserved:  # no preemption: taken at admission
            req.dst_blocks += req.reserved
            req.reserved = []
        upto = req.input_len + (req.output_len if self.eng.preemption == "off" else 1)
        extra = blocks_for(upto, self.eng.block_size) - len(req.dst_blocks)
        if extra <= 0:
            return True
        if not self.pool.can_allocate(extra):
            return False
        req.dst_blocks += self.pool.allocate(extra)
        return True

    def _make_room(self) -> bool:
        """Give every running request the block its next token needs, preempting under
        pressure as vLLM does (the newest running request first); True if it preempted
        or waits for a preempted transfer's blocks."""
        if self.eng.preemption == "off":
            return False
        if any(v.reissue for v in self.holding):
            return True  # a preempted transfer's fence is pending: its blocks will come
        bs = self.eng.block_size
        preempted = False
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted for an earlier one
            upto = r.prefill_target + 1 if r.local_prefill and r.prefilled < r.prefill_target \
                else r.context + 1
            need = blocks_for(upto, bs) - len(r.dst_blocks)
            while need > 0 and not self.pool.can_allocate(need):
                preempted = True
                if not self._preempt_one(r):
                    return True
                if r not in self.running:
                    break
            if r in self.running and need > 0:
                r.dst_blocks += self.pool.allocate(need)
        return preempted

    def _preempt_one(self, needy: SimRequest) -> bool:
        """Free memory for ``needy``; False when nothing can be freed now."""
        if self.eng.preemption == "reissue" and self.mode is TransferMode.PUSH:
            for v in reversed(self.holding):
                if (not v.kv_ready and not v.awaiting_handshake and not v.reissue
                        and not v.handing_off):
                    v.reissue = True  # blocks come back after the fence (release_destination)
                    v.preempted += 1
                    self.preempted += 1
                    self.transport.preempt(self.engine_id, v.transfer_id)
                    return False  # this step waits for the fence
        victim = self.running[-1]
        self.running.remove(victim)
        self.pool.free(victim.dst_blocks)
        victim.dst_blocks = []
        victim.preempted += 1
        self.preempted += 1
        # Its KV is gone and the producer has released the source: compute it again.
        victim.local_prefill = True
        victim.recomputed = True
        victim.prefilled = 0
        victim.recompute_len = victim.context
        self.waiting.appendleft(victim)
        return victim is not needy

    def _loop(self) -> Generator[Any, Any, None]:
        eng = self.eng
        while self.alive:
            # Running requests get their next token's block first (preempting under
            # pressure); a step that preempted admits no waiting request (as vLLM).
            preempted = self._make_room()
            stall = self._schedule(admit_waiting=not preempted)
            bs = eng.block_size
            decodes = [r for r in self.running
                       if (not r.local_prefill or r.prefilled >= r.prefill_target)
                       and len(r.dst_blocks) * bs > r.context]
            budget = eng.max_num_batched_tokens - len(decodes)
            chunks: list[tuple[SimRequest, int]] = []
            for r in self.running:
                if r.local_prefill and r.prefilled < r.prefill_target and budget > 0:
                    n = min(r.prefill_target - r.prefilled, budget)
                    chunks.append((r, n))
                    budget -= n
            if not decodes and not chunks:
                if self._orders:  # no forward to take them: a lone hand-off each
                    self._hand_orders(None)
                if stall > 0:  # a step that only posted reads
                    yield self.env.timeout(stall)
                    self._account(stall, stall)
                else:  # holding: requests that wait for their KV, or for room
                    yield from self._idle(bool(self.holding or self.waiting))
                continue
            work = step_s(
                self.profile, eng,
                decode_contexts=sum(r.context for r in decodes), num_decodes=len(decodes),
                prefill_chunks=tuple((n, r.prefilled) for r, n in chunks),
            )
            # Posting after the forward launch overlaps it (the GPU computes while the
            # CPU posts); posting before the forward delays it.
            dt = max(work, stall) if eng.inline_post == "after-forward" else stall + work
            orders = self._orders
            if orders:  # this step's forward takes them
                self._orders = []
            yield from self.transport.run_step(
                self.engine_id, eng.step_python_s, dt,
                at_forward=(lambda orders=orders: self._hand_orders(orders)) if orders else None)
            if not self.alive:
                return
            self._account(dt, dt - work if stall > 0 else 0.0)
            now = self.env.now
            for r, n in chunks:
                r.prefilled += n
                if r.prefilled >= r.prefill_target:
                    decodes.append(r)  # the prompt's last chunk yields the next token
            for r in decodes:
                r.token_times.append(now)
                if len(r.token_times) == 1 and r.kv_ready and self.mode is TransferMode.PUSH:
                    self.transport.consumed(self.engine_id, r.transfer_id)
                self.host.token(r)
                if len(r.token_times) >= r.output_len:
                    self._complete(r)

    def _hand_orders(self, orders: list[Callable[[], None]] | None) -> None:
        """``orders`` (``decode.orders_at_forward``) reach the transport: at the forward of
        the step that shipped them, now; None -- the orders shipped while the loop
        computes nothing -- each ``order_handoff_s`` from now (a lone request's)."""
        if orders is not None:
            for order in orders:
                order()
            return
        orders, self._orders = self._orders, []
        for order in orders:
            self.env.timeout(self.host.spread(self.eng.order_handoff_s)).callbacks.append(
                lambda _, order=order: order())

    def _account(self, dt: float, stall: float) -> None:
        """``stall``: how much inline posting lengthened this step."""
        self.busy_s += dt
        self.steps += 1
        if stall > 0:
            self.stall_s += stall
            self.stalled_steps += 1

    def _complete(self, req: SimRequest, error: str = "") -> None:
        if req in self.running:
            self.running.remove(req)
        self.pool.free(req.dst_blocks + req.reserved)
        req.dst_blocks, req.reserved = [], []
        self._by_tid.pop(req.transfer_id, None)
        self.recorder.finish(req, error)

    # ---------------------------------------------------------- endpoint outputs

    def transfer_ready(self, transfer_id: str) -> None:
        """The consumer endpoint's TransferReady: the worker takes it ``event_handoff_s``
        later, the scheduler can admit the request ``admit_lag_s`` after that."""
        req = self._by_tid[transfer_id]
        handoff = self.host.spread(self.eng.event_handoff_s)
        lag = self.host.spread(self.eng.admit_lag_s)
        if not handoff and not lag:
            self.transport.mark(transfer_id, "ready")
            self._ready(req)
            return

        def worker_has_it(_: Any) -> None:
            if self.alive and self._by_tid.get(transfer_id) is req:
                self.transport.mark(transfer_id, "ready")
                self.env.timeout(lag).callbacks.append(lambda _: self._ready(req))

        self.env.timeout(handoff).callbacks.append(worker_has_it)

    def _ready(self, req: SimRequest) -> None:
        if not self.alive or self._by_tid.get(req.transfer_id) is not req:
            return
        req.kv_ready = True
        req.kv_ready_at = self.env.now
        self.poke()

    def transfer_failed(self, transfer_id: str, reason: str, policy: FailurePolicy) -> None:
        req = self._by_tid[transfer_id]
        self.failed_transfers += 1
        if req in self.holding:
            self.holding.remove(req)
        self._apply_policy(req, reason, policy)

    def _transfer_failed_now(self, req: SimRequest, reason: str) -> None:
        self.failed_transfers += 1
        self._apply_policy(req, reason, self.transport.settings.policy)

    def _apply_policy(self, req: SimRequest, reason: str, policy: FailurePolicy) -> None:
        if req.dst_blocks:  # the protocol released them before reporting the failure
            raise AssertionError(f"{req.transfer_id}: blocks not released before failure")
        if req.reserved:  # output blocks the engine held ahead
            self.pool.free(req.reserved)
            req.reserved = []
        if policy is FailurePolicy.RECOMPUTE:
            self.recomputed += 1
            req.local_prefill = True
            req.recomputed = True
            self.waiting.appendleft(req)
            self.poke()
        else:
            self._by_tid.pop(req.transfer_id, None)
            self.recorder.finish(req, error=f"KV transfer failed: {reason}")

    def transfer_cancelled(self, transfer_id: str) -> None:  # pragma: no cover - no aborts
        raise AssertionError(f"{transfer_id}: the simulator never aborts a transfer")

    def release_destination(self, transfer_id: str, block_ids: tuple[int, ...]) -> None:
        req = self._by_tid[transfer_id]
        if tuple(req.dst_blocks) != tuple(block_ids):
            raise AssertionError(f"{transfer_id}: released blocks differ from lent ones")
        self.pool.free(req.dst_blocks)
        req.dst_blocks = []
        if req.reissue and req in self.holding:  # preempted: back in line for a new attempt
            self.holding.remove(req)
            self.waiting.appendleft(req)
        self.poke()  # freed blocks may admit a request that waits for room

    def kill(self, hand_over: Callable[[SimRequest], bool] | None = None) -> None:
        """Die now: every request here fails (the client's connection drops), unless
        ``hand_over`` (the router's failover) takes it elsewhere."""
        self.alive = False
        self._hand_over = hand_over
        self.poke()
        for req in [*self.waiting, *self.holding, *self.running]:
            if hand_over is not None and hand_over(req):
                continue
            self.recorder.finish(req, error=f"decode instance {self.engine_id} died")
        self.waiting.clear()
        self.holding.clear()
        self.running.clear()
        self._by_tid.clear()
