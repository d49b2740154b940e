"""The proxy in front of the instances: picks them and sequences the two legs.

* ``pull`` / ``pull-async`` and sequential ``push``: the router sends the
  prefill leg, waits for its answer (in pull, the answer carries the prefill
  block ids from the producer's ``Publish``), then picks a decode instance
  and sends the decode leg.
* concurrent ``push``: both legs leave at arrival with one transfer id; the
  decode instance registers its blocks while prefill computes.

Every leg costs one proxy hop (``network.router_hop_s``), then its instance's
API-server time (``ingest_s``, one leg at a time); a prefill answer costs the
prefill instance's ``return_s`` (a frontend job with ``host.frontend_cores``) and
a hop. The router learns
of an instance's death when the transport reports it; prefill legs that were
lost with an instance and whose decode leg was not sent yet are re-sent to a
live prefill instance under a new transfer id, or -- with none left -- sent
to decode to compute locally (``recompute`` policy) or failed.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import simpy

from ..protocol import FailurePolicy, new_incarnation
from .engine import DecodeEngine, PrefillEngine, Recorder
from .host.model import HostModel
from .request import Outcome, SimRequest
from .scenario import Dispatch, RouterPolicy, SimConfig
from .transport import SimTransport

E = TypeVar("E", PrefillEngine, DecodeEngine)

#: the router's process, as the frontends' wake-ups name it
ROUTER = "router"


class Router:
    """Dispatches requests to prefill and decode instances."""

    def __init__(
        self,
        env: simpy.Environment,
        cfg: SimConfig,
        transport: SimTransport,
        prefills: Sequence[PrefillEngine],
        decodes: Sequence[DecodeEngine],
        recorder: Recorder,
        host: HostModel,
        rng: random.Random | None = None,
    ) -> None:
        self.env = env
        self.cfg = cfg
        self.host = host
        self.transport = transport
        self.prefills = list(prefills)
        self.decodes = list(decodes)
        self.recorder = recorder
        self._rng = rng or random.Random(0)  #: draws each transfer's incarnation
        #: a hop, with the wake-ups of the relay and the receiving API server
        self.hop = cfg.profile.network.router_hop_s + host.hop_wake_s
        self.concurrent = cfg.effective_dispatch is Dispatch.CONCURRENT
        self._rr: dict[str, itertools.count[int]] = {"p": itertools.count(), "d": itertools.count()}
        self._awaiting: dict[str, SimRequest] = {}  # prefill legs not answered yet
        self._retries: dict[str, int] = {}
        self.rerouted = 0
        self.sent_local = 0
        #: decode failover (``faults.decode_failover``): requests moved, prompt tokens
        #: sent to prefill again, instances whose connections reset (not picked again)
        self.failovers = 0
        self.prompt_tokens_recomputed = 0
        self._down: set[str] = set()
        transport.death_listeners.append(self._engine_died)

    # ---------------------------------------------------------------- helpers

    def _later(self, fn: Callable[..., None], *args: Any, extra: float = 0.0) -> None:
        self.env.timeout(self.hop + extra if extra else self.hop).callbacks.append(
            lambda _: fn(*args))

    def _send(self, engine: PrefillEngine | DecodeEngine,
              submit: Callable[[SimRequest], None], req: SimRequest) -> None:
        """A leg to ``engine``: the hop, then its API server (``ingest_s``)."""
        self._later(engine.ingest, submit, req)

    def _pick(self, engines: list[E], key: str) -> E | None:
        live = [e for e in engines if e.engine_id not in self.transport.known_dead
                and e.engine_id not in self._down]
        if not live:
            return None
        if self.cfg.router_policy is RouterPolicy.ROUND_ROBIN:
            return live[next(self._rr[key]) % len(live)]
        return min(live, key=lambda e: e.load)  # ties: the lowest index

    def _fail(self, req: SimRequest, error: str) -> None:
        if req.outcome is Outcome.PENDING:
            self.recorder.finish(req, error=error)

    # --------------------------------------------------------------- requests

    def arrive(self, req: SimRequest) -> None:
        """A client request reaches the proxy, which takes it up once awake: woken while
        another request is in flight, it may first wait for a core
        (:meth:`HostModel.intake_wait`, ``host.wake_beside_s``)."""
        wait = self.host.intake_wait(ROUTER)
        if wait > 0:
            self.env.timeout(wait).callbacks.append(lambda _: self._take(req))
        else:
            self._take(req)

    def _take(self, req: SimRequest) -> None:
        p = self._pick(self.prefills, "p")
        if p is None:
            self._no_prefill(req)
            return
        req.prefill = p.engine_id
        req.incarnation = new_incarnation(self._rng)  # one per use of the id, both legs
        self._awaiting[req.transfer_id] = req
        self.transport.mark(req.transfer_id, "received")
        self.transport.mark(req.transfer_id, "legs_sent")
        self._send(p, p.submit, req)
        if self.concurrent:
            d = self._pick(self.decodes, "d")
            if d is None:
                self._fail(req, "no decode instance")
                return
            req.decode = d.engine_id
            self._send(d, d.submit, req)

    def prefill_done(self, req: SimRequest, block_ids: tuple[int, ...] | None) -> None:
        """A prefill instance answers: its API server passes the answer out
        (``prefill.return_s``; on a host with a frontend queue, a job there behind the
        other frontend work), then the hop back to the proxy."""
        work, wait = self.host.split(self.cfg.profile.prefill.return_s)
        self.host.answer(req.prefill or "", work, wait,  # prefill's API server answers
                         lambda extra: self._later(self._answered, req, block_ids, extra=extra))

    def _answered(self, req: SimRequest, block_ids: tuple[int, ...] | None) -> None:
        if req.prefill not in self.transport.alive or req.outcome is not Outcome.PENDING:
            return  # the answer was lost with the instance, or the request is over
        self._awaiting.pop(req.transfer_id, None)
        req.prefill_done_at = self.env.now
        if self.concurrent:
            return
        d = self._pick(self.decodes, "d")
        if d is None:
            self._fail(req, "no decode instance")
            return
        req.src_blocks = block_ids or ()
        self._send(d, d.submit, req)

    def _no_prefill(self, req: SimRequest) -> None:
        d = self._pick(self.decodes, "d")
        if d is None:
            self._fail(req, "no instance left")
        elif self.cfg.protocol.policy is FailurePolicy.RECOMPUTE:
            self.sent_local += 1
            self._send(d, d.submit_local, req)
        else:
            self._fail(req, "no prefill instance")

    # ----------------------------------------------------------------- deaths

    def hand_over(self, req: SimRequest) -> bool:
        """The decode instance of ``req`` died under it (its connection reset, so the
        router knows at once): the failover policy. True if the request goes on."""
        policy = self.cfg.faults.decode_failover
        if req.decode is not None:
            self._down.add(req.decode)
        if policy == "fail" or req.token_times or req.outcome is not Outcome.PENDING:
            return False  # (a request already streaming is not resumed here)
        d = self._pick(self.decodes, "d")
        if d is None:
            return False
        req.failovers += 1
        self.failovers += 1
        if policy == "retarget":  # rule 12: the held source, to the next engine's turn
            req.target += 1
            _reset_decode_side(req)
            req.decode = d.engine_id
            self._send(d, d.submit, req)
            return True
        # retry: a new transfer for the same client request; prefill computes it again
        base = req.transfer_id.split("~")[0]
        n = self._retries[base] = self._retries.get(base, 0) + 1
        leg = SimRequest(spec=req.spec, transfer_id=f"{base}~{n}", failovers=req.failovers,
                         parent=req.parent or req)
        self.prompt_tokens_recomputed += req.input_len
        self.arrive(leg)
        return True

    def _engine_died(self, engine_id: str) -> None:
        lost = [
            r for r in self._awaiting.values()
            if r.prefill == engine_id and r.decode is None and r.outcome is Outcome.PENDING
        ]
        for req in lost:
            del self._awaiting[req.transfer_id]
            base = req.transfer_id.split("~")[0]
            n = self._retries[base] = self._retries.get(base, 0) + 1
            req.transfer_id = f"{base}~{n}"
            self.rerouted += 1
            self.arrive(req)
        # Concurrent legs already at decode fail through the protocol (peer died).
        for tid, r in list(self._awaiting.items()):
            if r.prefill == engine_id:
                del self._awaiting[tid]


def _reset_decode_side(req: SimRequest) -> None:
    """What a decode instance held of ``req`` went with it."""
    req.dst_blocks, req.reserved = [], []
    req.kv_ready, req.kv_ready_at = False, None
    req.awaiting_handshake = req.handing_off = req.reissue = req.local_prefill = False
    req.prefilled = req.recompute_len = 0
