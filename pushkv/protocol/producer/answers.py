"""The producer's answers to peer messages: each message becomes table inputs.

Rule 2's stale and repeated filtering, rule 3's reopen and the tombstones
that answer late messages are decided here and fed to :data:`~.states.PRODUCER_TABLE`
as inputs; nothing here changes a leg's state directly.

A mixin of :class:`~.endpoint.Producer` holding no state: what it needs of the
endpoint is declared on :class:`ProducerAnswers` (the table driver, the source
book, the targets), so this module imports nothing above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import ProducerConfig
from ..errors import ValidationError
from ..events import Action, Mode, Peer
from ..layout import RankInfo
from ..messages import Cancel, Consumed, FailReason, Heartbeat, ReadDone, Register, Skip
from ..records import Key, Kv, Leg, Source
from ..records import Registration as _Registration
from ..states import (
    EARLY_PULL_LEGS,
    PRODUCER_FINISHED,
    PRODUCER_TERMINAL,
    ProducerInput,
    ProducerState,
)
from .targets import Targets
from .view import ProducerView

PS, PI = ProducerState, ProducerInput


class ProducerAnswers(ProducerView):
    """The message handlers of a :class:`~.endpoint.Producer`."""

    info: RankInfo
    config: ProducerConfig
    targets: Targets
    _transfers: dict[Key, Source]

    if TYPE_CHECKING:  # provided by the endpoint
        def _input(self, t: Source, leg: Leg, inp: ProducerInput, now: float, *,
                   reg: _Registration | None = None, cancel: int | None = None,
                   fail: tuple[FailReason, str] | None = None) -> list[Action]: ...
        def _settle(self, t: Source, now: float) -> list[Action]: ...
        def _leg(self, t: Source, peer: Peer) -> Leg: ...
        def _new_orphan(self, key: Key, now: float, *, arm: bool = True) -> Source | None: ...
        def _schedule(self, when: float, key: object) -> None: ...


    def _on_register(self, msg: Register, now: float) -> list[Action]:
        peer = Peer(msg.engine_id, msg.rank)
        info = self.targets.known(msg.engine_id, msg.rank)

        def invalid(why: str) -> ValidationError:
            return ValidationError(why, transfer_id=msg.transfer_id, attempt=msg.attempt)

        if msg.producer_engine_id != self.info.engine_id:
            raise invalid("registration addressed to another engine")
        if not self.targets.writes_into(peer):
            raise invalid(f"rank {self.peer.rank} does not write into {peer}")
        lo = info.layout
        ids = msg.block_ids  # each >= 0, checked by the decoder
        if ids and max(ids) >= lo.num_blocks:
            raise invalid(f"block id {max(ids)} outside the {lo.num_blocks} registered blocks")
        if len(ids) * lo.block_size < msg.num_tokens or msg.first_token > msg.num_tokens:
            raise invalid(
                f"{len(ids)} blocks of {lo.block_size} tokens cannot hold tokens "
                f"[{msg.first_token}, {msg.num_tokens})"
            )
        key = (msg.transfer_id, msg.incarnation)
        t = self._find(key)
        if t is None:
            # The registration's own deadline bounds this entry, so no orphan timer.
            t = self._new_orphan(key, now, arm=False)
            if t is None:
                return [self._fail(peer, key, msg.attempt, FailReason.OVERLOADED)]
        if t.mode is Mode.PULL:
            raise invalid("registration for a pull transfer")
        retarget: list[Action] = []
        bound = t.consumer_engine
        if t.dead:
            pass  # a tombstone answers every engine from its GONE legs (rule 3)
        elif bound is None:
            t.target = msg.target
        elif bound == msg.engine_id:
            if msg.target != t.target:
                raise invalid(f"turn {msg.target} from the engine bound at turn {t.target}")
        elif msg.target <= t.target:  # rule 12: an engine the source left (or never had)
            self.stats["stale"] += 1
            return [self._fail(peer, key, msg.attempt, FailReason.RETARGETED,
                               f"the source went to {bound!r} (turn {t.target})",
                               t.legs.get(peer))]
        elif any(p.engine_id == msg.engine_id for p in t.legs):
            raise invalid("re-target to an engine the source was bound to before")
        else:
            retarget = self._retarget(t, msg.target, now)
        if not t.dead:
            t.consumer_engine = msg.engine_id
        leg = self._leg(t, peer)
        if msg.attempt <= leg.attempt:  # rule 2
            self.stats["stale" if msg.attempt < leg.attempt else "duplicate"] += 1
            return self._input(t, leg, PI.REGISTER_STALE, now)
        reg = _Registration(
            attempt=msg.attempt,
            block_ids=ids,
            num_tokens=msg.num_tokens,
            first_token=msg.first_token,
            deadline=now + msg.window_ms / 1000.0,
            staging=(msg.staging_offset, msg.staging_nbytes) if msg.staging_nbytes else None,
        )
        out: list[Action] = retarget
        if leg.state in PRODUCER_FINISHED:  # rule 3: reopen as a new leg would start
            if t.kv in (Kv.PENDING, Kv.PARTIAL, Kv.HELD):
                out += self._input(t, leg, PI.REOPEN, now)
                if t.kv is not Kv.PENDING:
                    ready = PI.KV_READY if t.kv is Kv.HELD else PI.RANGE_READY
                    out += self._input(t, leg, ready, now)
            else:
                out += self._input(t, leg, PI.SOURCE_GONE, now)
        out += self._input(t, leg, PI.REGISTER, now, reg=reg)
        if not t.dead:
            self._schedule(reg.deadline, t.key)
            out += self._settle(t, now)
        return out

    def _on_cancel(self, msg: Cancel, now: float) -> list[Action]:
        peer = Peer(msg.engine_id, msg.rank)
        self.targets.known(msg.engine_id, msg.rank)
        key = (msg.transfer_id, msg.incarnation)
        t = self._find(key)
        if t is None:
            # A cancel overtook its registration: remember it, bounded in time.
            t = self._new_orphan(key, now)
            if t is None:
                return [self._ack(peer, key, msg.attempt)]
        if t.consumer_engine is not None and t.consumer_engine != msg.engine_id:
            # Rule 12: not the engine the source is bound to (re-targeted away, or a
            # stranger): answered from the leg's history; nothing reopens or releases.
            self.stats["stale"] += 1
            return [self._ack(peer, key, msg.attempt, t.legs.get(peer))]
        leg = self._leg(t, peer)
        # A repeat of a cancel already taken; a final cancel after a preempt of the
        # same attempt is not a repeat: it ends the transfer (the source goes).
        repeat = leg.state in (PS.CANCELLING, *PRODUCER_TERMINAL) or (
            leg.state is PS.PREEMPTING and not msg.final)
        # The consumer gives the transfer up: the source may go (rule 4), also when this
        # leg has finished already (written, then aborted: rule 12's linger ends).
        gave_up = msg.final and msg.attempt >= leg.attempt and not (t.dead or t.final)
        if gave_up:
            t.final = True
        if msg.attempt < leg.attempt or (msg.attempt == leg.attempt and repeat):
            self.stats["stale" if msg.attempt < leg.attempt else "duplicate"] += 1
            out = self._input(t, leg, PI.CANCEL_STALE, now, cancel=msg.attempt)
            return out + self._settle(t, now) if gave_up else out
        out = self._input(t, leg, PI.CANCEL if msg.final else PI.PREEMPT, now, cancel=msg.attempt)
        leg.attempt = max(leg.attempt, msg.attempt)
        return out if t.dead else out + self._settle(t, now)

    def _on_skip(self, msg: Skip, now: float) -> list[Action]:
        self.targets.known(msg.engine_id, msg.rank)
        if msg.producer_engine_id != self.info.engine_id:
            raise ValidationError("skip addressed to another engine", transfer_id=msg.transfer_id)
        if self.targets.legs(msg.engine_id):
            raise ValidationError(f"rank {self.peer.rank} writes into {msg.engine_id!r}",
                                  transfer_id=msg.transfer_id)
        key = (msg.transfer_id, msg.incarnation)
        t = self._find(key)
        if t is None:
            t = self._new_orphan(key, now)
            if t is None:
                return []
        bound = t.consumer_engine
        out: list[Action] = []
        if bound is None:
            t.target = msg.target
        elif bound != msg.engine_id and msg.target > t.target and not t.dead:
            out = self._retarget(t, msg.target, now)  # rule 12: the new engine skips too
        elif t.dead or bound != msg.engine_id or msg.target != t.target:
            self.stats["stale"] += 1
            return []
        # This rank writes nothing for the transfer: the source is not needed.
        t.consumer_engine, t.final = msg.engine_id, True
        self.stats["skipped"] += 1
        return out + self._settle(t, now)

    def _on_heartbeat(self, msg: Heartbeat, now: float) -> list[Action]:
        self.targets.known(msg.engine_id, msg.rank)
        for transfer_id, _attempt, inc in msg.transfers:
            t = self._transfers.get((transfer_id, inc))
            if t is None or t.consumer_engine not in (None, msg.engine_id):
                continue
            self.stats["renewed"] += 1
            if t.kv is Kv.HELD:  # the armed timer finds the later lease and re-arms
                if not t.expired:
                    t.lease = max(t.lease, now + self.config.lease_s * self.config.renew_fraction)
            elif t.kv is Kv.PENDING:
                t.orphan = max(t.orphan, now + self.config.orphan_ttl_s)
        return []

    def _on_read_done(self, msg: ReadDone, now: float) -> list[Action]:
        """A consumer rank read its slice (pull). Rule 13: the report may overtake this
        rank's own ``prefill_finished`` (a router relays the prefill's answer while the
        rank's core has not published yet): it is then kept on an orphan, bounded like
        one (``max_pending_registrations``, ``orphan_ttl_s``), as a leg already DONE,
        and the source is released as soon as it is published and every reading rank's
        report is in. Validated first, like any: bad input changes nothing."""
        peer = Peer(msg.engine_id, msg.rank)
        self.targets.known(msg.engine_id, msg.rank)
        if msg.producer_engine_id != self.info.engine_id:
            raise ValidationError("read report addressed to another engine",
                                  transfer_id=msg.transfer_id, attempt=msg.attempt)
        if not self.targets.writes_into(peer):
            raise ValidationError(f"{peer} does not read from rank {self.peer.rank}",
                                  transfer_id=msg.transfer_id, attempt=msg.attempt)
        key = (msg.transfer_id, msg.incarnation)
        t = self._find(key)
        if t is not None and not self._readable(t):
            self.stats["stale"] += 1
            return []
        if t is not None and t.consumer_engine not in (None, msg.engine_id):
            raise ValidationError("pull transfer already bound to another consumer engine",
                                  transfer_id=msg.transfer_id, attempt=msg.attempt)
        if t is None:  # rule 13: early, before this rank's prefill_finished
            t = self._new_orphan(key, now)
            if t is None:  # over the bound: dropped (counted overloaded); its lease decides
                self.stats["early_dropped"] += 1
                return []
        if t.kv is Kv.PENDING:
            t.mode = Mode.PULL  # a Register for it is refused; a push publish voids it
        t.consumer_engine = msg.engine_id
        leg = self._leg(t, peer)
        if leg.state not in (PS.KV_READY, PS.EMPTY):
            self.stats["duplicate"] += 1
            return []
        if t.kv is Kv.PENDING:
            self.stats["early_reports"] += 1
        leg.attempt = max(leg.attempt, msg.attempt)
        return self._input(t, leg, PI.READ_DONE, now) + self._settle(t, now)

    def _on_consumed(self, msg: Consumed, now: float) -> list[Action]:
        """Rule 12: the engine a push source was written to took its first decode step
        from it: a source lingering for a re-target may go. Validated like a ReadDone;
        one for a source bound to another engine (re-targeted away), not known here,
        a pull or already told changes nothing (counted)."""
        peer = Peer(msg.engine_id, msg.rank)
        self.targets.known(msg.engine_id, msg.rank)
        if msg.producer_engine_id != self.info.engine_id:
            raise ValidationError("consumed report addressed to another engine",
                                  transfer_id=msg.transfer_id)
        if not self.targets.writes_into(peer):
            raise ValidationError(f"rank {self.peer.rank} does not write into {peer}",
                                  transfer_id=msg.transfer_id)
        t = self._transfers.get((msg.transfer_id, msg.incarnation))
        if (t is None or t.dead or t.mode is not Mode.PUSH
                or t.consumer_engine != msg.engine_id):
            self.stats["stale"] += 1
            return []
        if t.consumed:
            self.stats["duplicate"] += 1
            return []
        t.consumed = True
        self.stats["consumed"] += 1
        return self._settle(t, now)

    @staticmethod
    def _readable(t: Source) -> bool:
        """Whether a ReadDone may still count for ``t``: a published pull source held
        here, or (rule 13) an orphan no push registration was ever adopted for."""
        if t.dead:
            return False
        if t.kv is Kv.HELD:
            return t.mode is Mode.PULL
        return t.kv is Kv.PENDING and all(
            leg.state in EARLY_PULL_LEGS for leg in t.legs.values())

    def _retarget(self, t: Source, target: int, now: float) -> list[Action]:
        """Rule 12: the legs of the engine ``t`` was bound to take RETARGET; the source
        is wanted again, by the engine at turn ``target``."""
        old = t.consumer_engine
        out: list[Action] = []
        for leg in [g for g in t.legs.values() if g.peer.engine_id == old]:
            out += self._input(t, leg, PI.RETARGET, now)
        t.target, t.final = target, False
        t.consumed, t.linger_until = False, None  # the new engine's own linger
        self.stats["retargeted"] += 1
        return out
