"""The producer (prefill) rank endpoint.

One :class:`Producer` per producer rank. It keeps, per transfer, the source
KV (once prefill finished) and one leg per consumer rank it writes into, and
turns inputs -- peer messages, prefill completion, write completions, the
clock -- into actions for its driver. The transitions live in :mod:`.states`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

import numpy.typing as npt

from ..config import ProducerConfig
from ..endpoint import Endpoint, Step
from ..errors import (
    ConfigError,
    LocalProtocolError,
    PlanError,
)
from ..events import (
    Action,
    IssueWrite,
    Mode,
    Peer,
    Publish,
    ReleaseSource,
    WriteScope,
)
from ..layout import RankInfo
from ..lending import StagingLedger
from ..messages import (
    Cancel,
    Consumed,
    FailReason,
    Heartbeat,
    Notify,
    ReadDone,
    Register,
    Skip,
)
from ..planner import block_tuple, plan_transfer
from ..ranges import mark, next_rect, todo
from ..records import Key
from ..records import Leg as _Leg
from ..records import Registration as _Registration
from ..records import Source as _Transfer
from ..states import (
    EARLY_PULL_LEGS,
    PRODUCER_TABLE,
    PRODUCER_TERMINAL,
    PRODUCER_WRITING,
    SOURCE_TABLE,
    ProducerEffect,
    ProducerInput,
    ProducerState,
    SourceEffect,
    SourceInput,
    SourceState,
    producer_step,
)
from .answers import ProducerAnswers
from .staging import pack, staged_fields
from .targets import Targets

PS, PI, PE = ProducerState, ProducerInput, ProducerEffect

#: The Fail reason an input implies, for effects that send Fail.
_REASON = {
    PI.DEADLINE: FailReason.DEADLINE,
    PI.KV_ABORTED: FailReason.PREFILL_ABORTED,
    PI.WRITE_ERROR: FailReason.WRITE_FAILED,
    PI.LEASE_EXPIRED: FailReason.LEASE_EXPIRED,
    PI.SOURCE_GONE: FailReason.SOURCE_RELEASED,
    PI.RETARGET: FailReason.RETARGETED,
}
Kv = SourceState
_COMPLETIONS = frozenset((PI.WRITE_OK, PI.WRITE_ERROR, PI.PART_OK))
_PARKED = frozenset((PS.EMPTY, PS.KV_READY, PS.GONE))
_FROM_RANGES = frozenset((PI.RANGE_READY, PI.NOTHING_READY))
#: Rule 12: the legs a source lingers after: written, or their write failed.
_LINGER = frozenset((PS.DONE, PS.FAILED))
SI, SE = SourceInput, SourceEffect


class Producer(ProducerAnswers, Endpoint):
    """Sans-IO endpoint of one producer rank. Every method takes ``now``."""

    role = "producer"

    def __init__(self, info: RankInfo, config: ProducerConfig | None = None) -> None:
        super().__init__(info)
        self.config = config or ProducerConfig()
        self._handlers.update({
            Register: lambda m, now: self._on_register(m, now),
            Cancel: lambda m, now: self._on_cancel(m, now),
            Heartbeat: lambda m, now: self._on_heartbeat(m, now),
            ReadDone: lambda m, now: self._on_read_done(m, now),
            Skip: lambda m, now: self._on_skip(m, now),
            Consumed: lambda m, now: self._on_consumed(m, now),
        })
        self.targets = Targets()  # the consumer ranks handshaken, the legs to write
        self._transfers: dict[Key, _Transfer] = {}
        # Forgotten transfers, per incarnation, with their legs in GONE: late
        # messages are answered by the same table rows as live ones.
        self._tombstones: OrderedDict[Key, _Transfer] = OrderedDict()
        self._pending_regs = 0  # legs in REGISTERED
        self._orphans = 0  # transfers created by a peer, prefill not finished
        # Rule 10: who holds which range of this rank's staging memory.
        pk = self.config.packing
        self._staging = StagingLedger(pk.staging_bytes if pk is not None else 0)

    # ------------------------------------------------------------------ peers

    def add_peer(self, info: RankInfo, *, now: float | None = None) -> list[Action]:
        """Accept a consumer rank's handshake. Raises ConfigError if incompatible."""
        self.targets.add(self.info, info)
        return []

    def peer_died(self, engine_id: str, now: float) -> list[Action]:
        """The transport lost ``engine_id``: its legs end, its writes fence themselves."""
        out = self._run_timers(now)
        self.targets.drop(engine_id)
        hold = self.config.retarget_hold_s
        for t in list(self._transfers.values()):
            if hold and t.consumer_engine == engine_id:
                t.hold_until = now + hold  # rule 12: a router may re-target it meanwhile
            for leg in list(t.legs.values()):
                if leg.peer.engine_id == engine_id:
                    out += self._input(t, leg, PI.PEER_DIED, now)
            out += self._settle(t, now)
        return out

    # ---------------------------------------------------------- local input

    def prefill_finished(
        self,
        transfer_id: str,
        block_ids: npt.ArrayLike,
        num_tokens: int,
        now: float,
        mode: Mode = Mode.PUSH,
        *,
        incarnation: int = 0,
    ) -> list[Action]:
        """Prefill of ``transfer_id`` (this ``incarnation`` of it) finished; its KV
        is in ``block_ids``."""
        ids = block_tuple(block_ids)
        lo = self.info.layout
        if ids and (min(ids) < 0 or max(ids) >= lo.num_blocks):
            raise ConfigError(f"source block id outside [0, {lo.num_blocks})")
        if num_tokens < 0 or len(ids) * lo.block_size < num_tokens:
            raise ConfigError(f"{len(ids)} blocks cannot hold {num_tokens} tokens")
        key = (transfer_id, incarnation)
        t = self._transfers.get(key)
        if t is not None and t.kv not in (Kv.PENDING, Kv.PARTIAL):
            raise LocalProtocolError(
                "prefill already reported", transfer_id=transfer_id, state=t.kv.value
            )
        self._refuse_reuse(key)
        if t is not None and mode is Mode.PULL and (t.kv is Kv.PARTIAL or any(
                leg.state not in EARLY_PULL_LEGS for leg in t.legs.values())):
            raise LocalProtocolError(
                "pull transfer has push registrations", transfer_id=transfer_id
            )
        out = self._run_timers(now)
        t = self._transfers.get(key)
        tomb = self._tombstones.get(key) if t is None else None
        if tomb is not None and mode is Mode.PUSH and tomb.mode is Mode.PULL and not tomb.final:
            # Rule 13: early read reports, forgotten, for a use finished as a push: void.
            del self._tombstones[key]
            self.stats["early_void"] += 1
        if t is None and key in self._tombstones:
            # Already concluded here (cancelled, expired): nobody will read it.
            self._tombstones[key].late = ()  # released now, with every block
            self.stats["released"] += 1
            return [*out, ReleaseSource(transfer_id=transfer_id, block_ids=ids,
                                        incarnation=incarnation)]
        if t is None:
            t = self._transfers[key] = _Transfer(transfer_id, incarnation)
        elif t.kv is Kv.PENDING:
            self._orphans -= 1
            if mode is Mode.PUSH and t.mode is Mode.PULL:
                self._void_early_reads(t)
        t.mode, t.src_ids, t.num_tokens, t.reported = mode, ids, num_tokens, True
        out += self._source(t, SI.PREFILL_DONE, now)
        return out + self._settle(t, now)

    def range_ready(
        self,
        transfer_id: str,
        block_ids: npt.ArrayLike,
        tokens: tuple[int, int],
        now: float,
        *,
        layers: tuple[int, int] | None = None,
        incarnation: int = 0,
    ) -> list[Action]:
        """Before prefill finished: tokens ``[a, b)`` of ``transfer_id`` are final
        for layers ``[l0, l1)`` (global layer indices; None: every layer), in
        ``block_ids`` (the request's blocks so far). Rule 9: registered legs write
        them at once. Ranges may overlap, repeat and come in any order; prefill
        completion (:meth:`prefill_finished`) still ends the stream and makes every
        token final. Push only."""
        ids = block_tuple(block_ids)
        lo, eng = self.info.layout, self.info.engine
        a, b = tokens
        l0, l1 = (0, eng.num_layers) if layers is None else layers
        if not 0 <= a < b or len(ids) * lo.block_size < b:
            raise ConfigError(f"{len(ids)} blocks cannot hold tokens [{a}, {b})")
        if ids and (min(ids) < 0 or max(ids) >= lo.num_blocks):
            raise ConfigError(f"source block id outside [0, {lo.num_blocks})")
        if not 0 <= l0 < l1 <= eng.num_layers:
            raise ConfigError(f"layers [{l0}, {l1}) outside [0, {eng.num_layers})")
        key = (transfer_id, incarnation)
        t = self._transfers.get(key)
        if t is not None and t.kv not in (Kv.PENDING, Kv.PARTIAL):
            raise LocalProtocolError(
                "range after prefill was reported", transfer_id=transfer_id, state=t.kv.value
            )
        self._refuse_reuse(key)
        out = self._run_timers(now)
        t = self._transfers.get(key)
        if t is None and key in self._tombstones:
            # Already concluded here: nobody will read it, but the blocks are the
            # source's from the first range on: released when the request ends.
            tomb = self._tombstones[key]
            if len(ids) > len(tomb.late):
                tomb.late = ids
            return out
        if t is None:
            t = self._transfers[key] = _Transfer(transfer_id, incarnation)
        elif t.kv is Kv.PENDING:
            self._orphans -= 1
        if t.kv is Kv.PENDING:
            t.orphan = float("inf")  # the local engine is prefilling it
        t.reported = True
        if len(ids) > len(t.src_ids):
            t.src_ids = ids
        if lo.order == "BLOCK":  # opaque blocks move whole: only whole blocks are final
            a, b = -(-a // lo.block_size) * lo.block_size, b - b % lo.block_size
        mark(t.ready, (a, b, max(l0, lo.layer_start), min(l1, lo.layer_end)))
        out += self._source(t, SI.RANGE_READY, now)
        return out + self._settle(t, now)

    def _void_early_reads(self, t: _Transfer) -> None:
        """Rule 13: reads reported early for a use this rank finishes as a push never
        happened (a push source is released by its own legs only): their legs go."""
        for peer in [p for p, leg in t.legs.items() if leg.state is PS.DONE]:
            del t.legs[peer]
            self.stats["early_void"] += 1
        if not t.legs:
            t.consumer_engine = None

    def _refuse_reuse(self, key: Key) -> None:
        """A use of an id whose KV this rank already had (remembered as a tombstone)
        is never taken up again: a new request must come with a new incarnation."""
        tomb = self._tombstones.get(key)
        if tomb is not None and tomb.reported:
            raise LocalProtocolError("transfer id and incarnation already used here",
                                     transfer_id=key[0], incarnation=key[1])

    def prefill_aborted(
        self, transfer_id: str, now: float, *, incarnation: int = 0
    ) -> list[Action]:
        """The local engine aborted ``transfer_id`` (before or after its prefill)."""
        out = self._run_timers(now)
        key = (transfer_id, incarnation)
        t = self._transfers.get(key)
        if t is None:
            tomb = self._tombstones.get(key)
            if tomb is None:
                dead = _Transfer(transfer_id, incarnation, kv=Kv.ABORTED, final=True,
                                 aborted=True, dead=True)
                self._tombstone(dead)
            elif tomb.late:  # ranges handed after it concluded here (see range_ready)
                late, tomb.late = tomb.late, ()
                self.stats["released"] += 1
                out.append(ReleaseSource(transfer_id=transfer_id, block_ids=late,
                                         incarnation=incarnation))
            return out
        out += self._source(t, SI.PREFILL_ABORTED, now)
        return out + self._settle(t, now)

    def write_completed(
        self, transfer_id: str, attempt: int, peer: Peer, ok: bool, now: float, *,
        incarnation: int = 0,
    ) -> list[Action]:
        """The transport finished (``ok``) or failed a write issued by IssueWrite
        for ``(transfer_id, incarnation)`` (the IssueWrite's; 0: the default use)."""
        t = self._writing(transfer_id, attempt, peer, incarnation)
        leg = t.legs[peer] if t is not None else None
        if t is None or leg is None:
            raise LocalProtocolError(
                "completion for a write that is not in flight",
                transfer_id=transfer_id,
                attempt=attempt,
            )
        out = self._run_timers(now)
        self.stats["writes_ok" if ok else "writes_failed"] += 1
        if leg.staging_at is not None:  # rule 10: the gathered bytes are sent (or lost)
            self._staging.give_back(leg.staging_at)
            leg.staging_at = None
        # Rule 9: a part that is not the leg's last is PART_OK.
        done = PI.WRITE_OK if leg.last else PI.PART_OK
        out += self._input(t, leg, done if ok else PI.WRITE_ERROR, now)
        return out + self._settle(t, now)

    def _writing(self, transfer_id: str, attempt: int, peer: Peer, inc: int) -> _Transfer | None:
        t = self._transfers.get((transfer_id, inc))
        leg = t.legs.get(peer) if t is not None else None
        return t if leg is not None and leg.writing == attempt else None

    # ---------------------------------------------------------------- timers

    def _expire(self, key: Key, now: float) -> list[Action]:
        t = self._transfers.get(key)
        if t is None:
            return []
        out: list[Action] = []
        for leg in list(t.legs.values()):
            reg = leg.stash if leg.state is PS.SUPERSEDED else leg.reg
            if reg is not None and reg.deadline <= now and leg.state in (
                PS.REGISTERED,
                PS.SUPERSEDED,
            ):
                out += self._input(t, leg, PI.DEADLINE, now)
        if t.kv is Kv.HELD and t.lease_armed <= now:
            t.lease_armed = float("inf")  # fired; _settle re-arms for a renewed lease
        if t.kv is Kv.HELD and t.lease <= now and not t.expired:
            out += self._source(t, SI.LEASE_EXPIRED, now)
        waiting = any(leg.state in (PS.REGISTERED, PS.SUPERSEDED) for leg in t.legs.values())
        if t.kv is Kv.PENDING and not waiting:
            if t.orphan > now:  # nobody is registered: keep it only until the orphan TTL
                self._schedule(t.orphan, key)
                return out
            return out + self._source(t, SI.ORPHAN_EXPIRED, now)
        return out + self._settle(t, now)

    def _source(self, t: _Transfer, inp: SourceInput, now: float) -> list[Action]:
        """Feed one input to the transfer's source (:data:`SOURCE_TABLE`)."""
        try:
            effect, nxt = SOURCE_TABLE[t.kv, inp]
        except KeyError:
            raise LocalProtocolError("no source transition", transfer_id=t.transfer_id,
                                     state=t.kv.value, input=inp.value) from None
        before, t.kv = t.kv, nxt
        own: list[Action] = []
        leg_input: ProducerInput | None = None
        if effect is SE.HOLD:
            t.orphan = float("inf")
            t.lease = now + self.config.lease_s  # armed by _settle while the source is held
            if t.mode is Mode.PULL:
                lo = self.info.layout
                own.append(Publish(transfer_id=t.transfer_id, block_ids=t.src_ids,
                                   num_tokens=t.num_tokens, incarnation=t.inc,
                                   lease_s=self.config.lease_s, scope=WriteScope(
                                       t.src_ids, 0, t.num_tokens,
                                       range(lo.layer_start, lo.layer_end),
                                       ((0, 0, lo.num_heads),))))
            leg_input = PI.KV_READY
        elif effect is SE.ABORT:
            t.aborted = True
            if before is Kv.PENDING:
                self._orphans -= 1
            # Rule 4: a published pull source may be under a READ, which takes its
            # bytes any time until it completes: it stays held until it is read
            # (ReadDone), given up (final Cancel) or its lease ends.
            leg_input = None if t.mode is Mode.PULL and t.kv is Kv.HELD else PI.KV_ABORTED
        elif effect is SE.EXPIRE:
            t.expired = True
            self.stats["lease_expired"] += 1
            leg_input = PI.LEASE_EXPIRED
        elif effect is SE.STREAM:
            leg_input = PI.RANGE_READY
        elif effect is SE.RELEASE:
            self.stats["released"] += 1
            own.append(ReleaseSource(transfer_id=t.transfer_id, block_ids=t.src_ids,
                                     incarnation=t.inc))
        if self.trace is not None:
            self.trace.append(Step(t.key, None, before, inp, effect, nxt, tuple(own)))
        out = own
        if leg_input is not None:
            for leg in list(t.legs.values()):
                out += self._input(t, leg, leg_input, now)
        if effect is SE.FORGET:  # an orphan nobody registered: its waiting legs expire
            self._orphans -= 1
            if t.mode is Mode.PULL:  # rule 13: early reports, past the orphan TTL
                self.stats["early_expired"] += 1
            for leg in list(t.legs.values()):
                if leg.state is PS.EMPTY:
                    out += self._input(t, leg, PI.DEADLINE, now)
            out += self._forget(t, now)
        return out

    def _new_orphan(self, key: Key, now: float, *, arm: bool = True) -> _Transfer | None:
        """A transfer a peer speaks of before prefill finished; None when full."""
        limit = self.config.max_pending_registrations
        if self._orphans >= limit or self._pending_regs >= limit:
            self.stats["overloaded"] += 1
            return None
        t = self._transfers[key] = _Transfer(key[0], key[1])
        self._orphans += 1
        t.orphan = now + self.config.orphan_ttl_s
        if arm:
            self._schedule(t.orphan, key)
        return t

    # ---------------------------------------------------------- transitions

    def _leg(self, t: _Transfer, peer: Peer) -> _Leg:
        leg = t.legs.get(peer)
        if leg is None:
            kv = t.kv
            state = (PS.KV_READY if kv in (Kv.HELD, Kv.PARTIAL) else
                     PS.EMPTY if kv is Kv.PENDING else PS.GONE)
            leg = t.legs[peer] = _Leg(peer=peer, state=state)
        return leg

    def _input(
        self,
        t: _Transfer,
        leg: _Leg,
        inp: ProducerInput,
        now: float,
        *,
        reg: _Registration | None = None,
        cancel: int | None = None,
        fail: tuple[FailReason, str] | None = None,
    ) -> list[Action]:
        try:
            effect, nxt = PRODUCER_TABLE[leg.state, inp]
        except KeyError:
            producer_step(leg.state, inp)  # raises the typed error
            raise
        before = leg.state
        finished = None
        if inp in _COMPLETIONS:
            finished, leg.writing = leg.writing, None
            if inp is not PI.WRITE_ERROR:
                leg.parts += 1
            elif finished is not None:  # its bytes may still land, in part: say so
                posted, failed = leg.history[finished]
                leg.history[finished] = (posted, failed + 1)
        leg.state = nxt
        if nxt in _PARKED:
            leg.reg = None  # parked: no registration held
        out = [] if effect is PE.NONE else self._effect(
            t, leg, effect, now, fail or _REASON.get(inp), reg, cancel, finished)
        if before is PS.REGISTERED or nxt is PS.REGISTERED:
            self._count_pending(before, leg.state)
        if self.trace is not None:
            self.trace.append(Step(t.key, leg.peer, before, inp, effect, nxt, tuple(out)))
        if leg.refused is not None:  # the write may not start (rule 5) or waits (rule 9)
            refusal, leg.refused = leg.refused, None
            out += self._input(t, leg, refusal[0], now, fail=refusal[1:])
        elif (t.kv is Kv.PARTIAL and t.ready and inp not in _FROM_RANGES
              and (nxt is PS.EMPTY or (nxt is PS.REGISTERED and not leg.written))):
            # Rule 9, derived: a leg left without a registration, or given a fresh
            # one, while ranges are ready is told so, as a new leg starts in KV_READY.
            out += self._input(t, leg, PI.RANGE_READY, now)
        return out

    def _count_pending(self, before: ProducerState, after: ProducerState) -> None:
        self._pending_regs += (after is PS.REGISTERED) - (before is PS.REGISTERED)

    def _effect(
        self,
        t: _Transfer,
        leg: _Leg,
        effect: ProducerEffect,
        now: float,
        reason: FailReason | tuple[FailReason, str] | None,
        reg: _Registration | None,
        cancel: int | None,
        finished: int | None,
    ) -> list[Action]:
        key = t.key
        detail = ""
        if isinstance(reason, tuple):
            reason, detail = reason
        if effect is PE.NONE:
            return []
        if effect is PE.STALE:  # counted by the caller, as stale or duplicate
            return []
        if effect in (PE.ADOPT, PE.ADOPT_AND_WRITE, PE.ACK_AND_ADOPT):
            assert reg is not None
            old, leg.reg, leg.attempt = leg.reg, reg, reg.attempt
            self._fresh(leg)
            if effect is PE.ADOPT_AND_WRITE:
                return self._write(t, leg, now)
            if effect is PE.ACK_AND_ADOPT and old is not None:
                return [self._ack(leg.peer, key, old.attempt, leg)]
            return []
        if effect is PE.WRITE:
            return self._write(t, leg, now)
        if effect is PE.ACK:
            assert cancel is not None
            attempts = {cancel}
            if leg.stash is not None:
                attempts.add(leg.stash.attempt)
                leg.stash = None
            if leg.writing is not None:
                attempts.discard(leg.writing)  # its completion is its fence
            elif leg.reg is not None:  # the registration dropped is fenced too
                attempts.add(leg.reg.attempt)
                leg.reg = None
            return [self._ack(leg.peer, key, a, leg) for a in sorted(attempts)]
        if effect in (PE.ACK_PARTS, PE.ACK_PARTS_AND_WRITE_STASHED):
            assert finished is not None  # rule 9: the writes posted are the fence
            acks: list[Action] = [self._ack(leg.peer, key, finished, leg)]
            if effect is PE.ACK_PARTS:
                return acks
            assert leg.stash is not None
            leg.reg, leg.stash = leg.stash, None
            self._fresh(leg)
            return acks + self._write(t, leg, now)
        if effect is PE.ACK_STALE:
            assert cancel is not None
            return [] if cancel == leg.writing else [self._ack(leg.peer, key, cancel, leg)]
        if effect is PE.FAIL:
            assert reason is not None
            failed = finished if finished is not None else leg.attempt
            return [self._fail(leg.peer, key, failed, reason, detail, leg)]
        if effect is PE.FAIL_GONE:
            assert reg is not None
            leg.attempt = reg.attempt
            why = FailReason.PREFILL_ABORTED if t.kv is Kv.ABORTED else FailReason.SOURCE_RELEASED
            return [self._fail(leg.peer, key, reg.attempt, why,
                               "the source was released before this registration arrived"
                               if why is FailReason.SOURCE_RELEASED else "", leg)]
        if effect in (PE.STASH, PE.ACK_STASHED_AND_STASH):
            assert reg is not None
            old, leg.stash, leg.attempt = leg.stash, reg, reg.attempt
            return [self._ack(leg.peer, key, old.attempt, leg)] if old is not None else []
        if effect is PE.FAIL_STASHED:
            assert leg.stash is not None and reason is not None
            stash, leg.stash = leg.stash, None
            return [self._fail(leg.peer, key, stash.attempt, reason, "", leg)]
        if effect in (PE.WRITE_STASHED, PE.FAIL_AND_WRITE_STASHED):
            assert leg.stash is not None
            out: list[Action] = []
            if effect is PE.FAIL_AND_WRITE_STASHED:
                assert finished is not None
                out.append(self._fail(leg.peer, key, finished, FailReason.WRITE_FAILED, "",
                                      leg))
            leg.reg, leg.stash = leg.stash, None
            self._fresh(leg)
            return out + self._write(t, leg, now)
        raise AssertionError(f"unhandled effect {effect}")  # pragma: no cover

    def _write(self, t: _Transfer, leg: _Leg, now: float) -> list[Action]:
        """Rendezvous reached (rule 1): plan and issue the write of ``leg.reg``."""
        reg = leg.reg
        assert reg is not None and t.kv in (Kv.HELD, Kv.PARTIAL)
        info = self.targets.peers.get(leg.peer)
        if now > reg.deadline or t.expired or now >= t.lease or t.aborted:
            # Rule 5: never start after the window, nor after the source's lease
            # (or the local request) ended: the endpoint feeds WRITE_REFUSED.
            self.stats["write_refused_deadline"] += 1
            why = (FailReason.PREFILL_ABORTED if t.aborted else FailReason.DEADLINE
                   if now > reg.deadline else FailReason.LEASE_EXPIRED)
            leg.refused = (PI.WRITE_REFUSED, why, "")
            return []
        try:
            if info is None:
                raise PlanError("consumer rank left")
            if t.kv is Kv.HELD and reg.num_tokens > t.num_tokens:
                raise PlanError(
                    f"registration wants {reg.num_tokens} tokens, prefill produced {t.num_tokens}"
                )
            assigned = self.targets.assigned[leg.peer]
            if leg.parts_of != reg.attempt:
                self._fresh(leg)
            if not leg.written and t.kv is Kv.HELD:
                rect = None  # the whole request in one write: the common case
            else:
                ready = None if t.kv is Kv.HELD else t.ready
                pending = todo(ready, leg.written, assigned.layers, reg.first_token,
                               reg.num_tokens)
                rect = next_rect(pending)
                if rect is None:
                    # Rule 9: nothing new is ready yet; the next range writes it.
                    leg.refused = (PI.NOTHING_READY, FailReason.INVALID, "")
                    return []
                mark(leg.written, rect)
                after = todo(None, leg.written, assigned.layers, reg.first_token,
                             reg.num_tokens)
                leg.last = not after
                assigned = replace(assigned, layers=range(rect[2], rect[3]))
            plan = plan_transfer(
                self.info.layout,
                info.layout,
                assigned,
                t.src_ids,
                reg.block_ids,
                reg.num_tokens if rect is None else rect[1],
                reg.first_token if rect is None else rect[0],
            )
        except (PlanError, ConfigError) as exc:
            self.stats["plan_failed"] += 1
            leg.refused = (PI.PLAN_FAILED, FailReason.INVALID, exc.message)
            return []
        self.stats["writes_issued"] += 1
        leg.writing = reg.attempt
        posted, failed = leg.history.get(reg.attempt, (0, 0))
        leg.history[reg.attempt] = (posted + 1, failed)
        if rect is None:
            leg.last = True
            mark(leg.written, (reg.first_token, reg.num_tokens, assigned.layers.start,
                               assigned.layers.stop))
        packed = pack(self.config.packing, self._staging, self.stats, leg, reg,
                      plan) if rect is None and leg.parts == 0 else None
        notify = Notify(
            transfer_id=t.transfer_id,
            attempt=reg.attempt,
            engine_id=self.peer.engine_id,
            rank=self.peer.rank,
            incarnation=t.inc,
            part=leg.parts,
            parts=leg.parts + 1 if leg.last else 0,
            **staged_fields(packed, t.src_ids),
        )
        return [
            IssueWrite(
                transfer_id=t.transfer_id, attempt=reg.attempt, peer=leg.peer, plan=plan,
                notify=notify, incarnation=t.inc, packed=packed,
                scope=WriteScope(
                    t.src_ids, reg.first_token if rect is None else rect[0],
                    reg.num_tokens if rect is None else rect[1], assigned.layers,
                    assigned.heads),
            )
        ]

    def _settle(self, t: _Transfer, now: float) -> list[Action]:
        """Rule 4 (release exactly once) and forgetting finished transfers."""
        kv = t.kv
        if kv in (Kv.PENDING, Kv.PARTIAL) or t.dead:
            return []
        out: list[Action] = []
        legs = t.legs
        if kv is Kv.HELD:
            if t.lease < t.lease_armed and not t.expired:
                # Rule 5: a lease timer while the source is held, writing or not.
                t.lease_armed = t.lease
                self._schedule(t.lease, t.key)
            for leg in legs.values():
                if leg.state in PRODUCER_WRITING:
                    return out  # settled again when the write completes
            if t.final or t.expired or (t.aborted and t.mode is not Mode.PULL):
                finished = True
            elif t.consumer_engine is None:
                finished = False
            else:
                targets = self.targets.legs(t.consumer_engine)
                alive = targets is not None
                if targets is None:  # the consumer engine is gone
                    if now < min(t.hold_until, t.lease):  # rule 12: wait for a re-target
                        self._schedule(min(t.hold_until, t.lease), t.key)
                        return out
                    targets = tuple(legs)
                finished = True
                for p in targets:
                    target = legs.get(p)
                    if target is None or target.state not in PRODUCER_TERMINAL:
                        finished = False
                        break
                if finished and alive and self._lingers(t, targets, now):
                    return out
            if not finished:
                return out
            out += self._source(t, SI.SETTLED, now)
        for leg in legs.values():
            if leg.state in PRODUCER_WRITING:
                return out
        out += self._forget(t, now)
        return out

    def _lingers(self, t: _Transfer, targets: tuple[Peer, ...], now: float) -> bool:
        """Rule 12: a push source written to the live engine it is bound to (its legs
        there ``targets``) -- or whose write there failed, as it does when that engine
        just died -- stays held for a re-target until that engine's Consumed,
        ``retarget_hold_s`` or the lease, whichever comes first (the engine may be lost
        between READY and its first token: the source is then written again, not
        computed again)."""
        hold = self.config.retarget_hold_s
        if not hold or t.consumed or t.mode is not Mode.PUSH or not targets or any(
                t.legs[p].state not in _LINGER for p in targets):
            return False  # (cancelled or expired there: the consumer gave it up)
        if t.linger_until is None:
            t.linger_until = now + hold
            self.stats["lingered"] += 1
        until = min(t.linger_until, t.lease)
        if now >= until:
            return False
        self._schedule(until, t.key)
        return True

    @staticmethod
    def _fresh(leg: _Leg) -> None:
        """A new registration on the leg: nothing of it written yet (rule 9)."""
        leg.written, leg.parts, leg.last = {}, 0, True
        leg.parts_of = leg.reg.attempt if leg.reg is not None else -1

    def _forget(self, t: _Transfer, now: float) -> list[Action]:
        out: list[Action] = []
        quiet = self.trace is None
        for leg in t.legs.values():  # rule 4: every leg ends with the source
            if leg.state is PS.GONE:
                continue
            row = PRODUCER_TABLE.get((leg.state, PI.SOURCE_GONE))
            if quiet and row is not None and row[0] is PE.NONE:
                leg.state, leg.reg = row[1], None  # the row's move, nothing to carry out
            else:
                out += self._input(t, leg, PI.SOURCE_GONE, now)
        t.final = t.final or t.aborted
        del self._transfers[t.key]
        self._tombstone(t)
        return out

    def _tombstone(self, t: _Transfer) -> None:
        t.dead = True
        if self.config.max_tombstones == 0:
            return
        key = t.key
        self._tombstones[key] = t
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > self.config.max_tombstones:
            self._tombstones.popitem(last=False)
