"""The scheduler half of ``PushKVConnector`` (runs in vLLM's engine-core process).

It sees vLLM's requests and blocks, decides what each transfer needs, and
writes it into the step's :class:`~.metadata.PushKVMetadata`; the worker half
carries it out and reports back through ``finished_sending`` /
``finished_recving`` / ``failed_recving``, which reach
:meth:`SchedulerSide.update_connector_output`. Nothing here touches the
network or waits.

Consumer (decode) requests live through::

    FRESH --admitted with blocks--> WAITING --KV landed / failed / fenced--> DONE
      |                               (deferred while a cached prefix block it shares
      |                                is still lent to another transfer)
      +--admitted without a load (vLLM forced a local prefill)--> DONE

Producer (prefill) requests are seen when they finish (and, with
``push_granularity`` chunk or layer, at admission and at every step, whose
newly final prompt KV goes out in the metadata: :mod:`.progressive`): a
prefill that stopped or hit its length (or streamed its whole prompt) holds
its blocks (``delay_free``) until the worker reports the push completed, was
cancelled or its lease expired; any other end (abort, error, ignored...)
tells the producer endpoint, which fails the consumer's registration so the
consumer can apply its failure policy.

Direction. The producer chooses, per request, from how the request was
dispatched (:func:`leg_direction`): a leg of pushkv's proxy has its decode
leg dispatched at the same time (concurrent dispatch), so its KV is pushed
into the registration that is on its way; a leg of vLLM's NIXL PD flow comes
from a router that waits for this prefill's answer before it even sends the
decode leg (sequential dispatch), so the KV is published and the decode side
reads it with its background reader -- no registration round trip on the
critical path. The answer's ``transfer_mode`` tells the consumer which.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import random
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from .. import timeline
from ..direction import SETTINGS, choose_direction
from ..integrity import IntegrityConfig
from ..protocol.incarnation import new_incarnation
from .metadata import Abandon, Abort, PublishedSeals, PushKVMetadata, RecvOrder, SendOrder
from .params import (
    ENDPOINT_KEY,
    MAX_ID_LEN,
    NIXL_SIGNED,
    POLICY_KEY,
    RELAY_BOUND_S,
    SEALS_KEY,
    VOCAB_KEY,
    DecodeLeg,
    Discover,
    Endpoint,
    Leg,
    NixlPrefillLeg,
    ParamsError,
    PrefillLeg,
    nixl_answer,
    parse_params,
    seals_json,
)
from .progressive import ProgressiveFeed
from .signing import ReplayGuard, sign, verify

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

def _lease_until(request: Request, leg: DecodeLeg) -> float | None:
    """Pull: until when (wall clock) the producer is known to hold the source: from
    the request's arrival here, the lease its answer announced less the relay's
    bound (RELAY_BOUND_S). None: the answer announced none."""
    if leg.direction != "pull" or leg.lease_s is None:
        return None
    arrival = getattr(request, "arrival_time", None) or time.time()
    return float(arrival) + leg.lease_s - RELAY_BOUND_S


def leg_direction(leg: PrefillLeg | NixlPrefillLeg, setting: str = "auto") -> str:
    """How a prefill's KV moves (:func:`pushkv.direction.choose_direction`): a leg of
    pushkv's proxy was dispatched with its decode leg (concurrent); a leg of vLLM's
    NIXL flow comes from a router that waits for its answer (sequential)."""
    dispatch = "concurrent" if isinstance(leg, PrefillLeg) else "sequential"
    return choose_direction(dispatch, setting)


def producer_transfer_id(engine_id: str, request_id: str) -> str:
    """The transfer id a producer mints for a NIXL-flow request: its engine and
    request id (unique on the engine), hashed when too long for the wire."""
    tid = f"nixl:{engine_id}:{request_id}"
    if len(tid) <= MAX_ID_LEN:
        return tid
    return "nixl:" + hashlib.sha256(tid.encode()).hexdigest()


#: Ends of a producer request after which its prompt KV is complete.
_PREFILL_COMPLETE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class Phase(enum.Enum):
    __hash__ = object.__hash__

    DEFERRED = "deferred"  #: blocks allocated, registration waits for a shared block
    WAITING = "waiting"  #: registration shipped, transfer in flight
    LOADED = "loaded"  #: KV landed
    LOCAL = "local"  #: no transfer (failed, or vLLM computes the prompt itself)


@dataclass(slots=True)
class _Recv:
    leg: DecodeLeg | None  #: None: the parameters were malformed
    phase: Phase
    order: RecvOrder | None = None
    finished: bool = False  #: vLLM finished the request (abort while waiting)
    told: bool = False  #: its producer was told the engine is done with the source


class SchedulerSide:
    """Scheduler-process state of one ``PushKVConnector``."""

    def __init__(self, *, endpoint: Endpoint, block_size: int, is_producer: bool,
                 is_consumer: bool, policy: str = "fail", key: bytes | None = None,
                 direction: str = "auto", granularity: str = "request",
                 vocab_size: int = 0, lease_s: float | None = None,
                 integrity: str = "off") -> None:
        if direction not in SETTINGS:
            raise ParamsError(f"direction must be one of {SETTINGS}, got {direction!r}")
        self.direction = direction
        #: producer, push_granularity chunk or layer: the prompt KV each step makes final
        #: producer: when each prefill's KV is final (progressive ranges; the step
        #: that ends a one-token prefill leg)
        self.granularity = granularity
        self.feed = (ProgressiveFeed(block_size, ranges=granularity != "request")
                     if is_producer else None)
        self._early: set[str] = set()  # finished as their last step saved its KV
        #: a router's one-token prefill legs that pull: (transfer id, incarnation)
        #: minted when admitted, so the source is published as the step computing the
        #: prompt ends, before vLLM can answer the leg (see :meth:`_stream`)
        self._minted: dict[str, tuple[str, int]] = {}
        #: rule 11, pull: answers of the engine step being processed, by transfer id,
        #: that the step's worker output seals before they leave (:meth:`_seal`)
        self._to_seal: dict[str, dict[str, Any]] = {}
        self._seals = IntegrityConfig.parse(integrity)  #: which pull sources are sealed
        self.unsealed = 0  #: producer: pull answers that left without their seals
        self._rng = random.SystemRandom()
        self.endpoint = endpoint
        self.block_size = block_size
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        self.policy = policy
        self.vocab_size = vocab_size  #: the model's, told to the proxy (0: not known)
        self.lease_s = lease_s  #: producer: the source lease its pull answers announce
        self._key = key
        self._replays = ReplayGuard()
        self.refused = 0  #: requests whose kv_transfer_params were refused
        self._recv: dict[str, _Recv] = {}
        self._lent: dict[int, str] = {}  # block -> request whose registration holds it
        self._sending: dict[str, str] = {}  # request -> transfer id, blocks held
        self._meta = PushKVMetadata()

    # ------------------------------------------------------------ consumer

    def _leg(self, request: Request) -> Leg | None:
        """The pushkv leg of a request; ParamsError if malformed or, with a shared key,
        not signed by a proxy holding it (or replayed)."""
        params = request.kv_transfer_params
        if self._key is not None and params:
            if not isinstance(params, dict):
                raise ParamsError("kv_transfer_params must be an object")
            try:
                params = verify(params, self._key)
            except ParamsError:
                # A router's NIXL prefill leg is never signed; it names nothing to trust
                # (the producer mints the transfer and signs its answer).
                if not isinstance(parse_params(params), NixlPrefillLeg):
                    raise
        leg = parse_params(params)
        if self._key is not None and isinstance(leg, PrefillLeg | DecodeLeg):
            self._replays.check(type(leg).__name__, leg.transfer_id, request.request_id)
        return leg

    def _decode_leg(self, request: Request) -> DecodeLeg | ParamsError | None:
        """The request's decode leg; a ParamsError if it claims one but is refused."""
        try:
            leg = self._leg(request)
        except ParamsError as exc:
            return exc
        return leg if isinstance(leg, DecodeLeg) else None

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the producer will push, beyond the local prefix hit. No side effects."""
        if timeline.enabled():
            self._mark_seen(request)
        if not self.is_consumer or request.request_id in self._recv:
            return 0, False  # not ours, or a re-admission after the transfer ended
        if self._decode_leg(request) is None:
            return 0, False
        remaining = request.num_prompt_tokens - num_computed_tokens
        return (remaining, True) if remaining > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        """The registration is born here, with the blocks vLLM just allocated (on a
        producer streaming its KV: the prefill's stream)."""
        req_id = request.request_id
        if self.feed is not None and req_id not in self._recv:
            self._stream(request)
        if not self.is_consumer or req_id in self._recv:
            rec = self._recv.get(req_id)
            if rec is not None and rec.phase is Phase.LOADED and rec.leg is not None:
                timeline.mark(rec.leg.transfer_id, "decode_scheduled")
                self._consumed(rec)  # admitted for its first decode step
            return  # second call after the load, or not a consumer request
        leg = self._decode_leg(request)
        if leg is None:
            return
        if isinstance(leg, ParamsError):
            # Blocks are allocated but nothing can land: a failed transfer, so
            # vLLM applies kv_load_failure_policy (error, or compute locally).
            logger.error("request %s: kv_transfer_params refused: %s", req_id, leg)
            self.refused += 1
            if num_external_tokens:
                self._recv[req_id] = _Recv(leg=None, phase=Phase.WAITING)
                self._meta.recv_fail.append(req_id)
            return
        if num_external_tokens == 0:
            # vLLM decided to compute the prompt itself (e.g. prompt logprobs): the
            # producer is told at once that nothing will be registered.
            self._recv[req_id] = _Recv(leg=leg, phase=Phase.LOCAL)
            self._abandon(leg)
            return
        (block_ids,) = blocks.get_block_ids()
        num_tokens = request.num_prompt_tokens
        first = num_tokens - num_external_tokens  # the local prefix hit, block aligned
        order = RecvOrder(req_id=req_id, transfer_id=leg.transfer_id, producer=leg.producer,
                          block_ids=tuple(block_ids), num_tokens=num_tokens, first_token=first,
                          incarnation=leg.incarnation, target=leg.target,
                          direction=leg.direction, src_block_ids=leg.src_block_ids,
                          lease_until=_lease_until(request, leg), seals=leg.seals)
        rec = self._recv[req_id] = _Recv(leg=leg, phase=Phase.DEFERRED, order=order)
        self._try_ship(req_id, rec)

    def _stream(self, request: Request) -> None:
        """Producer: stream a prefill leg of pushkv's proxy (its decode side registers
        while the prefill runs); other legs, and malformed ones, push when it ends."""
        assert self.feed is not None
        try:
            leg = self._leg(request)
        except ParamsError:
            return  # refused when the request ends
        if isinstance(leg, PrefillLeg) and leg_direction(leg, self.direction) == "push":
            ends = request.max_tokens == 1  # so nothing can touch its blocks after that step
            if ends or self.granularity != "request":
                self.feed.track(request.request_id, leg.transfer_id, leg.incarnation,
                                request.num_prompt_tokens, ends=ends)
        elif (isinstance(leg, NixlPrefillLeg) and request.max_tokens == 1
              and request.request_id not in self._minted
              and leg_direction(leg, self.direction) == "pull"):
            # Published as the step that computes the prompt ends (the worker's
            # wait_for_save), so before the answer exists, and sealed in that step's
            # output: published one engine step later, the answer would leave without
            # its seal (a decode side quick enough to read first is fine: its
            # ReadDone waits for the publication, rule 13). Whatever the
            # push_granularity: a published source is read whole, never streamed.
            req_id = request.request_id
            tid = producer_transfer_id(self.endpoint.engine_id, req_id)
            self._minted[req_id] = (tid, new_incarnation(self._rng))
            self.feed.track(req_id, tid, self._minted[req_id][1], request.num_prompt_tokens,
                            ends=True, whole=True)

    def _try_ship(self, req_id: str, rec: _Recv) -> bool:
        """Ship a registration unless a block of it is still lent to another one.

        Blocks below ``first_token`` are a cached prefix that other requests may
        share; a registration lends all its blocks, so two in-flight transfers
        sharing a prefix are serialised here instead of colliding.
        """
        order = rec.order
        assert order is not None
        if any(b in self._lent for b in order.block_ids):
            return False
        for b in order.block_ids:
            self._lent[b] = req_id
        rec.phase = Phase.WAITING
        self._meta.recv.append(order)
        timeline.mark(order.transfer_id, "registration_shipped")
        return True

    def _abandon(self, leg: DecodeLeg) -> None:
        timeline.mark(leg.transfer_id, "abandoned")
        self._meta.recv_abandon.append(Abandon(transfer_id=leg.transfer_id,
                                               producer=leg.producer,
                                               incarnation=leg.incarnation))

    def _end_recv(self, req_id: str, rec: _Recv, phase: Phase) -> None:
        if rec.order is not None and rec.phase is Phase.WAITING:
            for b in rec.order.block_ids:
                if self._lent.get(b) == req_id:
                    del self._lent[b]
        rec.phase = phase
        if rec.finished:
            del self._recv[req_id]

    # ------------------------------------------------------------ both

    def build_connector_meta(self, out: SchedulerOutput | None = None) -> PushKVMetadata:
        for req_id, rec in self._recv.items():
            if rec.phase is Phase.DEFERRED and not rec.finished:
                self._try_ship(req_id, rec)
        if self.feed is not None and out is not None:
            ranges, aborts, finishes = self.feed.step(out)
            self._meta.send_ranges.extend(ranges)
            self._meta.send_abort.extend(aborts)
            self._meta.send_at_save.extend(
                replace(f, direction="pull") if f.req_id in self._minted else f
                for f in finishes)
            self._early.update(f.req_id for f in finishes)
            for ab in aborts:
                logger.warning("request %s (transfer %s) was preempted while its KV streamed "
                               "out; failing the transfer", ab.req_id, ab.transfer_id)
        meta, self._meta = self._meta, PushKVMetadata()
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        rec = self._recv.get(req_id)
        if rec is not None:
            return self._consumer_finished(req_id, rec), None
        try:
            leg = self._leg(request)
        except ParamsError as exc:
            logger.error("request %s: kv_transfer_params refused: %s", req_id, exc)
            self.refused += 1
            return False, None
        if isinstance(leg, DecodeLeg):
            # Ended before vLLM admitted it (aborted while queued): never registered.
            if self.is_consumer:
                self._abandon(leg)
            return False, None
        if isinstance(leg, Discover):
            answer: dict[str, Any] = {ENDPOINT_KEY: self.endpoint.to_json(),
                                      POLICY_KEY: self.policy}
            if self.vocab_size:
                answer[VOCAB_KEY] = self.vocab_size
            return False, answer
        if not isinstance(leg, PrefillLeg | NixlPrefillLeg):
            return False, None
        if not self.is_producer:
            logger.error("request %s asks a consumer-only instance to push its KV", req_id)
            return False, None
        return self._producer_finished(request, leg, block_ids)

    def _consumer_finished(self, req_id: str, rec: _Recv) -> bool:
        rec.finished = True
        if rec.phase is Phase.WAITING:
            # Aborted while the transfer is in flight: cancel and fence it. vLLM
            # already keeps the blocks until the worker reports the request.
            if rec.leg is not None:
                timeline.mark(rec.leg.transfer_id, "decode_aborted")
                self._meta.recv_abort.append(Abort(
                    req_id=req_id, transfer_id=rec.leg.transfer_id,
                    incarnation=rec.leg.incarnation))
        elif rec.phase is Phase.DEFERRED:
            # Never registered: nothing can land, the worker reports it at once, and the
            # producer is told so that it releases the prefilled KV now.
            self._meta.recv_drop.append(req_id)
            if rec.leg is not None:
                self._abandon(rec.leg)
        else:
            self._consumed(rec)  # READY, ended before its first step: nothing to keep
            del self._recv[req_id]
        return False

    def _consumed(self, rec: _Recv) -> None:
        """Rule 12: a pushed transfer whose KV landed is taken by its first decode step
        (or its request ended first): the workers tell the producer ranks that wrote
        it (``Consumed``), which keep the source for a re-target until then. Once per
        transfer; not for a pull (its source goes at the read's ``ReadDone``) nor a
        transfer that failed."""
        leg = rec.leg
        if rec.told or leg is None or rec.phase is not Phase.LOADED or leg.direction != "push":
            return
        rec.told = True
        self._meta.consumed.append(leg.transfer_id)

    def _producer_finished(self, request: Request, leg: PrefillLeg | NixlPrefillLeg,
                           block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        if isinstance(leg, NixlPrefillLeg):
            minted = self._minted.pop(req_id, None)
            tid, incarnation = minted or (producer_transfer_id(self.endpoint.engine_id, req_id),
                                          new_incarnation(self._rng))
        else:
            tid, incarnation = leg.transfer_id, leg.incarnation
        early = req_id in self._early  # the worker finished it as its last step ended
        self._early.discard(req_id)
        streamed = self.feed.finished(req_id) if self.feed is not None else 0
        if streamed is None:
            return False, None  # aborted when it was preempted mid-stream
        n = request.num_prompt_tokens
        complete = (
            ((request.status in _PREFILL_COMPLETE and request.num_computed_tokens >= n)
             or streamed >= n)  # every token reported final: it may have landed already
            and len(block_ids) * self.block_size >= n
        )
        if not complete:
            logger.warning("request %s (transfer %s) ended %s before its KV was complete; "
                           "failing the transfer", req_id, tid, request.status.name)
            if isinstance(leg, PrefillLeg) or early:  # else: never announced nor published
                self._meta.send_abort.append(Abort(req_id=req_id, transfer_id=tid,
                                                   incarnation=incarnation))
            return False, None
        direction = leg_direction(leg, self.direction)
        self._sending[req_id] = tid
        if not early:
            timeline.mark(tid, "prefill_finished")
            self._meta.send.append(SendOrder(req_id=req_id, transfer_id=tid,
                                             block_ids=tuple(block_ids), num_tokens=n,
                                             incarnation=incarnation, direction=direction))
        if isinstance(leg, PrefillLeg):
            return True, {"transfer_id": tid, "num_tokens": n,
                          ENDPOINT_KEY: self.endpoint.to_json()}
        answer = nixl_answer(endpoint=self.endpoint, transfer_id=tid, incarnation=incarnation,
                             request_id=req_id, block_ids=block_ids, num_tokens=n,
                             direction=direction,
                             lease_s=self.lease_s if direction == "pull" else None)
        if self._key is not None:
            answer = sign(answer, self._key, fields=NIXL_SIGNED)
        if direction == "pull" and early and self._seals.checks(tid, incarnation):
            # Published as this step saved its KV: the workers' seals come in this
            # step's output, which vLLM hands over after this call, before it sends
            # the answer (the answer is sealed in place then: :meth:`_seal`).
            self._to_seal[tid] = answer
        elif direction == "pull":
            timeline.mark(tid, "answered")
        return True, answer

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if isinstance(output.kv_connector_worker_meta, PublishedSeals):
            self._seal(output.kv_connector_worker_meta)
        failed = output.failed_recving
        for req_id in output.finished_recving or ():
            rec = self._recv.get(req_id)
            if rec is not None:
                if rec.leg is not None:
                    timeline.mark(rec.leg.transfer_id, "ready_scheduled")
                self._end_recv(req_id, rec, Phase.LOCAL if req_id in failed else Phase.LOADED)
        for req_id in output.finished_sending or ():
            self._sending.pop(req_id, None)

    def _seal(self, meta: PublishedSeals) -> None:
        """Rule 11, pull: add every producer rank's seal to the answers this step made
        (one seal from each rank, else the answer leaves unsealed: read unchecked)."""
        ranks = set(range(self.endpoint.world_size))
        for tid, seals in meta.seals.items():
            answer = self._to_seal.pop(tid, None)
            if answer is None:
                continue  # the request did not end with this step (aborted, preempted)
            timeline.mark(tid, "answered")
            if set(seals) != ranks or not all(seals.values()):
                if any(seals.values()):  # some rank sealed, another not (in time)
                    logger.warning("transfer %s: seals from ranks %s of %s; its answer "
                                   "leaves unsealed", tid,
                                   sorted(r for r, v in seals.items() if v), sorted(ranks))
                    self.unsealed += 1
                continue
            answer[SEALS_KEY] = seals_json(seals)
            if self._key is not None:
                signed = sign(answer, self._key, fields=NIXL_SIGNED)
                answer.clear()
                answer.update(signed)

    def step_output_done(self) -> None:
        """vLLM is done with this step's output (it asks for the scheduler's stats
        last): answers not sealed by now leave unsealed, and are never touched again
        (vLLM serialises them on another thread)."""
        if self._to_seal:
            for tid in self._to_seal:
                timeline.mark(tid, "answered")
            self.unsealed += len(self._to_seal)
            logger.warning("pushkv: %d pull answer(s) left without their seals (read "
                           "unchecked): %s", len(self._to_seal), sorted(self._to_seal)[:4])
            self._to_seal.clear()

    def _mark_seen(self, request: Request) -> None:
        """Timeline: the first time a scheduler considers a request of a transfer."""
        if request.request_id in self._recv or request.request_id in self._sending:
            return
        params = request.kv_transfer_params
        try:  # no replay check here: that is the real parse's
            if self._key is not None and isinstance(params, dict):
                params = verify(params, self._key)
            leg = parse_params(params)
        except ParamsError:
            return
        if isinstance(leg, DecodeLeg | PrefillLeg):
            side, tid = ("decode" if isinstance(leg, DecodeLeg) else "prefill"), leg.transfer_id
        elif isinstance(leg, NixlPrefillLeg):  # a router's leg: the id the answer will carry
            side, tid = "prefill", producer_transfer_id(self.endpoint.engine_id,
                                                        request.request_id)
        else:
            return
        # when the API server took it, and when the scheduler does
        if (arrived := getattr(request, "arrival_time", None)) is not None:
            timeline.mark(tid, f"{side}_arrived", timeline.from_wall(arrived))
        timeline.mark(tid, f"{side}_seen")

    # ------------------------------------------------------ introspection

    def lent_blocks(self) -> dict[int, str]:
        """Blocks registered to in-flight transfers, by request."""
        return dict(self._lent)

    def transfers_in_flight(self) -> dict[str, str]:
        """Consumer requests whose transfer is not over, with their phase."""
        return {k: r.phase.value for k, r in self._recv.items()
                if r.phase in (Phase.DEFERRED, Phase.WAITING)}

    def sends_held(self) -> dict[str, str]:
        """Producer requests whose blocks are held for a push, with their transfer id."""
        return dict(self._sending)
