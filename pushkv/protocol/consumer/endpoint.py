"""The consumer (decode) rank endpoint.

One :class:`Consumer` per consumer rank. For each transfer it registers its
destination blocks with the producer ranks the mapping assigns (push) or reads
the published blocks (pull), counts one notification per producer rank for the
current attempt, and never lets a block go back to the engine while a write of
any attempt may still land in it. The transitions live in :mod:`.states`.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy.typing as npt

from ..config import ConsumerConfig
from ..endpoint import Endpoint, Step
from ..errors import (
    ConfigError,
    LocalProtocolError,
)
from ..events import (
    Action,
    Connect,
    Mode,
    Peer,
    ReleaseDestination,
    SendMessage,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)
from ..layout import RankInfo
from ..lending import StagingLedger
from ..messages import (
    MAX_TARGET,
    CancelAck,
    Consumed,
    Fail,
    FailReason,
    Notify,
    ReadDone,
)
from ..planner import block_tuple
from ..records import Attempt as _Attempt
from ..records import Key
from ..records import Transfer as _Transfer
from ..states import (
    CONSUMER_FENCING,
    CONSUMER_TABLE,
    CONSUMER_TERMINAL,
    ZOMBIE_TABLE,
    ConsumerEffect,
    ConsumerInput,
    ConsumerState,
    ZombieState,
    consumer_step,
)
from . import staging as staging
from .outcomes import ConsumerOutcomes
from .parts import written_blocks as _written
from .peers import Producers
from .requests import cancels, final_cancels, heartbeats, reads, registers

CS, CI, CE = ConsumerState, ConsumerInput, ConsumerEffect


class Consumer(ConsumerOutcomes, Endpoint):
    """Sans-IO endpoint of one consumer rank. Every method takes ``now``."""

    role = "consumer"

    def __init__(self, info: RankInfo, config: ConsumerConfig | None = None) -> None:
        super().__init__(info)
        self.config = config or ConsumerConfig()
        self._handlers.update({
            Notify: lambda m, now: self._from_producer(m, CI.NOTIFY, now),
            CancelAck: lambda m, now: self._from_producer(m, CI.CANCEL_ACK, now),
            Fail: lambda m, now: self._from_producer(m, CI.FAIL, now),
        })
        self.producers = Producers()  # the producer engines handshaken (rule 8)
        self._transfers: dict[str, _Transfer] = {}  # the live use of each id
        # Ended uses of an id that came back while their old attempts may still be
        # written (zombies): they keep their fences, by (id, incarnation).
        self._retired: dict[Key, _Transfer] = {}
        self._lent: dict[int, Key] = {}  # block id -> transfer that may still be written
        self._next_heartbeat: float | None = None
        # Rule 10: who holds which range of this rank's staging memory.
        pk = self.config.packing
        self._staging = StagingLedger(pk.staging_bytes if pk is not None else 0)
        # Rule 11: why the landing being fed as CORRUPT failed its check (for t.why).
        self._corrupt_detail = ""
        # Rule 12: push transfers READY here whose first decode step is not reported
        # yet: id -> (producer engine, ranks that wrote, incarnation), oldest first.
        self._unconsumed: OrderedDict[str, tuple[str, tuple[int, ...], int]] = OrderedDict()

    # ------------------------------------------------------------------ peers

    def add_peer(self, info: RankInfo, *, now: float | None = None) -> list[Action]:
        """Accept a producer rank's handshake. Raises ConfigError if incompatible.

        Then the ranks it was owed Skips by are told, and once its engine is usable
        (rule 8) the registrations held for it go out and it learns of the transfers
        that ended while they waited."""
        p = self.producers
        p.add(self.info, info)
        eid = info.engine_id
        when = self._now if now is None else now
        out = self._run_timers(when) if now is not None else []
        out += p.told_late(self.peer, info, self.config.max_untold)
        if not p.usable(eid):
            return out
        for key in p.connected(eid):
            out += p.abandons(self.peer, key, eid, self.config.max_untold)
        for t in list(self._transfers.values()):
            if t.state is CS.CONNECTING and t.producer == eid:
                out += self._input(t, CI.CONNECTED, max(when, 0.0))
        return out

    def _connect(self, engine_id: str, now: float) -> list[Action]:
        """Ask the driver for a handshake, once per engine; a core timer bounds it."""
        deadline = now + self.config.handshake_timeout_s
        if not self.producers.ask(engine_id, deadline):
            return []
        self._schedule(deadline, engine_id)
        self.stats["connects"] += 1
        return [Connect(engine_id=engine_id)]

    def _abandon_later(self, t: _Transfer) -> None:
        """A transfer cancelled before any registration went out (it waited for the
        handshake): tell the producer when the engine becomes usable."""
        if not t.skipped and t.mode is Mode.PUSH:
            self.producers.abandon_later(t.producer, t.key)

    def handshake_failed(self, engine_id: str, reason: str, now: float) -> list[Action]:
        """The driver could not handshake with ``engine_id``: every transfer waiting
        for it fails (HANDSHAKE_FAILED) and releases its blocks. A later
        registration asks for the engine again."""
        out = self._run_timers(now)
        return out + self._handshake_failed(engine_id, reason, now)

    def _handshake_failed(self, engine_id: str, reason: str, now: float) -> list[Action]:
        self.producers.failed(engine_id)
        self.stats["handshakes_failed"] += 1
        out: list[Action] = []
        for t in list(self._transfers.values()):
            if t.state is CS.CONNECTING and t.producer == engine_id:
                t.why(FailReason.HANDSHAKE_FAILED,
                      f"handshake with producer engine {engine_id!r} failed: {reason}")
                out += self._input(t, CI.HANDSHAKE_FAILED, now)
        return out

    def peer_died(self, engine_id: str, now: float) -> list[Action]:
        """The transport confirmed ``engine_id`` dead: it fences every attempt it owed."""
        out = self._run_timers(now)
        self.producers.drop(engine_id)
        for t in [*self._transfers.values(), *self._retired.values()]:
            if t.producer != engine_id:
                continue
            # Push: the dead producer posts nothing more, but what it posted may still
            # land stray bytes: each rank not fenced yet is, once the fence grace passed
            # (rule 7). Pull: our own reads are still in flight and only their
            # completions fence them.
            dead = t.mode is Mode.PUSH
            if dead:
                for a in (t.cur, *t.zombies.values()):
                    for r in a.expected - a.fenced:
                        a.stray.setdefault(r, now + self.config.fence_grace_s)
                self._schedule(now + self.config.fence_grace_s, t.key)
            for z in list(t.zombies.values()):
                if dead:
                    out += self._zombie(t, z, CI.PEER_DIED, now, z.expected)
            if t.state not in CONSUMER_TERMINAL:
                out += self._input(t, CI.PEER_DIED, now,
                                   ranks=t.cur.expected if dead else frozenset())
            self._maybe_forget(t)
        return out

    # ----------------------------------------------------------- local input

    def _check_blocks(self, transfer_id: str, block_ids: npt.ArrayLike, num_tokens: int,
                      first_token: int) -> tuple[int, ...]:
        ids = block_tuple(block_ids)
        lo = self.info.layout
        if ids and (min(ids) < 0 or max(ids) >= lo.num_blocks):
            raise ConfigError(f"block id outside [0, {lo.num_blocks})", transfer_id=transfer_id)
        if len(set(ids)) != len(ids):
            raise ConfigError("a block id appears twice", transfer_id=transfer_id)
        if not 0 <= first_token <= num_tokens or len(ids) * lo.block_size < num_tokens:
            raise ConfigError(
                f"{len(ids)} blocks of {lo.block_size} tokens cannot hold tokens "
                f"[{first_token}, {num_tokens})",
                transfer_id=transfer_id,
            )
        written = _written(ids, lo.block_size, first_token, num_tokens)
        if not self._lent.keys().isdisjoint(written):  # invariant 2: never lend twice
            b = next(b for b in written if b in self._lent)
            raise LocalProtocolError(
                f"block {b} may still be written by transfer {self._lent[b][0]!r}",
                transfer_id=transfer_id,
            )
        return ids

    def register(
        self,
        transfer_id: str,
        producer_engine_id: str,
        block_ids: npt.ArrayLike,
        num_tokens: int,
        now: float,
        first_token: int = 0,
        *,
        incarnation: int = 0,
        target: int = 0,
    ) -> list[Action]:
        """Push: have the producer write tokens ``[first_token, num_tokens)`` into ``block_ids``.

        ``incarnation`` tells this use of ``transfer_id`` from any other: give
        every rank of both engines the same one (see :mod:`.incarnation`).
        ``target`` (rule 12): this engine's turn at the source -- 0 for the engine
        chosen first; a router that re-targets a held source to this engine after
        losing the one before gives each later engine a higher turn."""
        if not 0 <= target <= MAX_TARGET:
            raise ConfigError(f"target must be in [0, {MAX_TARGET}], got {target}",
                              transfer_id=transfer_id)
        return self._open(
            transfer_id, producer_engine_id, Mode.PUSH, (), block_ids, num_tokens, now,
            first_token, incarnation, target,
        )

    def start_pull(
        self,
        transfer_id: str,
        producer_engine_id: str,
        src_block_ids: npt.ArrayLike,
        block_ids: npt.ArrayLike,
        num_tokens: int,
        now: float,
        first_token: int = 0,
        *,
        incarnation: int = 0,
        lease_s: float | None = None,
    ) -> list[Action]:
        """Pull: read the producer's published ``src_block_ids`` into ``block_ids``.

        ``lease_s``: how long from now the source is known to stay held (the
        :class:`~.events.Publish`'s ``lease_s`` less the relay's delay bound). A read
        takes the source's bytes until it completes, so one that completes later
        fails closed (``LEASE_EXPIRED``), and none starts once it is 0 or less.
        None: no bound is known (the driver vouches for the source)."""
        src = block_tuple(src_block_ids)
        if lease_s is not None and lease_s <= 0:
            self.producers.engine(producer_engine_id)
            ids = self._check_blocks(transfer_id, block_ids, num_tokens, first_token)
            out = self._run_timers(now)
            self.stats["failed"] += 1
            # Nothing is read; the producer is told (final Cancel) to drop the source,
            # and the blocks go back as from any other failure (none was written).
            return [*out, *self.producers.abandons(self.peer, (transfer_id, incarnation),
                                                   producer_engine_id, self.config.max_untold),
                    ReleaseDestination(transfer_id=transfer_id, attempt=0,
                                       block_ids=ids,
                                       incarnation=incarnation),
                    TransferFailed(
                        transfer_id=transfer_id, attempt=0, code=FailReason.LEASE_EXPIRED,
                        reason="the source's lease ended before the read could start",
                        policy=self.config.policy, incarnation=incarnation)]
        out = self._open(
            transfer_id, producer_engine_id, Mode.PULL, src, block_ids, num_tokens, now,
            first_token, incarnation,
        )
        if lease_s is not None:
            self._transfers[transfer_id].lease_until = now + lease_s
        return out

    def abandon(
        self, transfer_id: str, producer_engine_id: str, now: float, *, incarnation: int = 0
    ) -> list[Action]:
        """The request ended before this rank registered it: tell every producer
        rank it would have registered with (final Cancel), and the ranks that write
        nothing (Skip), so the source is released now rather than at lease expiry."""
        t = self._find(transfer_id, incarnation)
        if t is not None and t.state not in CONSUMER_TERMINAL:
            # Only this use of the id matters: another one live here is another request.
            raise LocalProtocolError("transfer is live on this rank: abort it",
                                     transfer_id=transfer_id, state=t.state.value)
        out = self._run_timers(now)
        if producer_engine_id not in self.producers.writers:
            # never handshaken: nothing went out anywhere
            self.stats["abandoned_unknown_engine"] += 1
            return out
        self.stats["abandoned"] += 1
        key = (transfer_id, incarnation)
        return out + self.producers.abandons(self.peer, key, producer_engine_id,
                                             self.config.max_untold)

    def _open(
        self,
        transfer_id: str,
        producer: str,
        mode: Mode,
        src: tuple[int, ...],
        block_ids: npt.ArrayLike,
        num_tokens: int,
        now: float,
        first_token: int,
        inc: int,
        target: int = 0,
    ) -> list[Action]:
        old = self._transfers.get(transfer_id)
        if (old is not None and (old.state not in CONSUMER_TERMINAL or old.inc == inc)) or (
                (transfer_id, inc) in self._retired):
            # One live use of an id per rank; a use still remembered (live, or ended
            # with old attempts that may still be written) is never taken up again:
            # another request must come with another incarnation.
            raise LocalProtocolError("transfer id and incarnation already in use here",
                                     transfer_id=transfer_id, incarnation=inc)
        if mode is Mode.PULL:
            self.producers.engine(producer)  # pull reads are planned now: they need the handshake
        ids = self._check_blocks(transfer_id, block_ids, num_tokens, first_token)
        if mode is Mode.PULL:  # plan first: a plan that cannot be made changes nothing
            reads(self.info, self.producers, transfer_id, producer, src, ids, num_tokens,
                  first_token, 0)
        out = self._run_timers(now)
        old = self._transfers.pop(transfer_id, None)
        if old is not None:  # (the timers may have ended it meanwhile)
            self._retired[old.key] = old
        usable = self.producers.usable(producer)
        cur = self._attempt(0, ids, producer, now)
        t = _Transfer(
            transfer_id=transfer_id, inc=inc, producer=producer, mode=mode,
            state=CS.REGISTERED if usable else CS.CONNECTING, cur=cur, num_tokens=num_tokens,
            first_token=first_token, src_ids=src, target=target,
        )
        self._transfers[transfer_id] = t
        self._lend(t, cur)
        self.stats["registered"] += 1
        if not usable:  # rule 8: wait in CONNECTING for the handshake
            return out + self._connect(producer, now)
        t.skipped = True
        out += self._start_attempt(t, now)
        if not self.producers.silent[producer]:
            return out
        return out + self.producers.skips(self.peer, t.key, producer, self.config.max_untold,
                                          target=t.target)

    def reissue(self, transfer_id: str, block_ids: npt.ArrayLike, now: float) -> list[Action]:
        """Register a preempted transfer again, with a new attempt, into ``block_ids``."""
        t = self._get(transfer_id)
        inp = CI.REISSUE if self.producers.usable(t.producer) else CI.REISSUE_CONNECTING
        if (t.state, inp) not in CONSUMER_TABLE:
            raise LocalProtocolError(
                "reissue needs a preempted transfer", transfer_id=transfer_id,
                state=t.state.value, input=inp.value,
            )
        ids = self._check_blocks(transfer_id, block_ids, t.num_tokens, t.first_token)
        out = self._run_timers(now)
        if self._transfers.get(transfer_id) is not t or t.state in CONSUMER_TERMINAL:
            return out  # a timer ended it first
        self.stats["reissued"] += 1
        return out + self._input(t, inp, now, block_ids=ids)

    def preempt(self, transfer_id: str, now: float) -> list[Action]:
        """The engine preempted the waiting request: fence, release, await a reissue."""
        return self._local(transfer_id, CI.PREEMPT, now)

    def abort(self, transfer_id: str, now: float) -> list[Action]:
        """The engine aborted the request: fence and end the transfer."""
        return self._local(transfer_id, CI.ABORT, now)

    def consumed(self, transfer_id: str, now: float) -> list[Action]:
        """The engine took its first decode step from ``transfer_id``'s KV (READY
        before), or ended the request after READY without one: nothing here will
        want the source again. Rule 12: tell every producer rank that wrote it
        (``Consumed``), so a source kept for a re-target goes now. A transfer not
        READY here, a pull, or one reported already (or forgotten past
        ``max_unconsumed``) sends nothing and is counted: the producer's
        ``retarget_hold_s`` bounds it."""
        out = self._run_timers(now)
        known = self._unconsumed.pop(transfer_id, None)
        if known is None:
            self.stats["consumed_unknown"] += 1
            return out
        producer, ranks, inc = known
        self.stats["consumed"] += 1
        me = self.peer
        return out + [SendMessage(peer=Peer(producer, r), message=Consumed(
            transfer_id=transfer_id, engine_id=me.engine_id, rank=me.rank,
            producer_engine_id=producer, incarnation=inc)) for r in ranks]

    def unconsumed(self) -> tuple[tuple[str, int], ...]:
        """Rule 12: the push transfers (id, incarnation) READY here whose first decode
        step is not reported yet (:meth:`consumed`), oldest first."""
        return tuple((tid, inc) for tid, (_p, _r, inc) in self._unconsumed.items())

    def _local(self, transfer_id: str, inp: ConsumerInput, now: float) -> list[Action]:
        t = self._get(transfer_id)
        if t.state in CONSUMER_TERMINAL:
            raise LocalProtocolError(
                "transfer already over", transfer_id=transfer_id, state=t.state.value,
                input=inp.value,
            )
        out = self._run_timers(now)
        if self._transfers.get(transfer_id) is not t or t.state in CONSUMER_TERMINAL:
            return out  # a deadline ended it first
        return out + self._input(t, inp, now)

    def _get(self, transfer_id: str) -> _Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            raise LocalProtocolError("unknown transfer", transfer_id=transfer_id)
        return t

    # ----------------------------------------------------------- peer input

    # ---------------------------------------------------------- transitions

    def _input(
        self,
        t: _Transfer,
        inp: ConsumerInput,
        now: float,
        *,
        ranks: frozenset[int] = frozenset(),
        block_ids: tuple[int, ...] = (),
        packed: staging.StagedChunk | None = None,
    ) -> list[Action]:
        try:
            effect, nxt = CONSUMER_TABLE[t.state, inp]
        except KeyError:
            consumer_step(t.state, inp)  # raises the typed error
            raise
        before, t.state = t.state, nxt
        if nxt in CONSUMER_FENCING and before not in CONSUMER_FENCING:
            self._schedule(t.cur.hard, t.key)
        out = self._effect(t, effect, inp, now, ranks, block_ids, packed)
        if self.trace is not None:
            self.trace.append(Step(t.key, None, before, inp, effect, nxt, tuple(out)))
        # Derived inputs (rules 6 and 7), fed whichever input completed them.
        if t.state is CS.REGISTERED and t.cur.notified >= t.cur.expected:
            out += self._input(t, CI.ALL_NOTIFIED, now)
        elif t.state in CONSUMER_FENCING and t.cur.all_fenced():
            out += self._input(t, CI.FENCED, now)
        self._maybe_forget(t)
        return out

    def _effect(
        self,
        t: _Transfer,
        effect: ConsumerEffect,
        inp: ConsumerInput,
        now: float,
        ranks: frozenset[int],
        block_ids: tuple[int, ...],
        packed: staging.StagedChunk | None = None,
    ) -> list[Action]:
        cur, tid, inc = t.cur, t.transfer_id, t.inc
        if effect in (CE.NONE, CE.DROP):
            return []
        if effect is CE.SCATTER:  # rule 10: the rank counts once its scatter is done
            assert packed is not None
            self.stats["scatters"] += 1
            return [staging.scatter(t, cur, next(iter(ranks)), packed)]
        if effect is CE.FENCE_REMOTE:  # rule 10: the producers are fenced; the scatter is not
            self.stats["forced_release"] += 1
            cur.fenced |= cur.expected
            return []
        if effect is CE.COUNT:
            cur.notified |= ranks
            cur.fenced |= ranks  # a finished write is its own fence
            return []
        if effect is CE.PART:  # rule 9: counted in the attempt's parts already
            return []
        if effect is CE.READY:
            out: list[Action] = self._unlend(t, cur)
            self.stats["ready"] += 1
            out.append(TransferReady(transfer_id=tid, attempt=cur.attempt, incarnation=inc))
            if t.mode is Mode.PUSH and self.config.max_unconsumed:
                waiting = self._unconsumed
                waiting[tid] = (t.producer, tuple(sorted(cur.expected)), inc)
                waiting.move_to_end(tid)
                while len(waiting) > self.config.max_unconsumed:
                    waiting.popitem(last=False)
                    self.stats["unconsumed_dropped"] += 1
            if t.mode is Mode.PULL:
                out += [
                    SendMessage(peer=Peer(t.producer, r), message=ReadDone(
                        transfer_id=tid, attempt=cur.attempt, engine_id=self.peer.engine_id,
                        rank=self.peer.rank, producer_engine_id=t.producer, incarnation=inc))
                    for r in sorted(cur.expected)
                ]
            return out
        if effect is CE.FENCE:
            cur.fenced |= {r for r in ranks if cur.settled(r)}
            return []
        if effect is CE.FAIL_REST:
            # A corrupt part whose rank's count is not known yet (more parts to come)
            # does not settle its rank: it is cancelled like the others (rule 11).
            cur.fenced |= {r for r in ranks if cur.settled(r)
                           and (inp is not CI.CORRUPT or r in cur.need)}
            if inp is CI.CORRUPT:
                t.why(FailReason.CORRUPT, self._corrupt_detail or "a landed range failed "
                      "its digest check")
            if inp is CI.PEER_DIED:  # nobody is left to cancel: the grace fences (rule 7)
                t.why(FailReason.PEER_DIED, f"producer engine {t.producer!r} died")
                return []
            return cancels(self.peer, t, final=True, skip=ranks if inp is CI.FAIL else frozenset())
        if effect is CE.CANCEL_ALL:
            if inp is CI.DEADLINE:
                t.why(FailReason.DEADLINE, "no write within the registration window")
            return cancels(self.peer, t, final=True)
        if effect is CE.PREEMPT_ALL:
            return cancels(self.peer, t, final=False)
        if effect in (CE.RELEASE, CE.RELEASE_CANCELLED, CE.RELEASE_FAILED):
            if inp is CI.PEER_DIED:
                t.why(FailReason.PEER_DIED, f"producer engine {t.producer!r} died")
            if inp is CI.HARD_DEADLINE:
                self.stats["forced_release"] += 1
            out = self._release(t, cur)
            if effect is not CE.RELEASE and t.mode is Mode.PULL:
                out += final_cancels(self.peer, t)
            if effect is CE.RELEASE_CANCELLED:
                self._abandon_later(t)
                self.stats["cancelled"] += 1
                out.append(TransferCancelled(transfer_id=tid, attempt=cur.attempt,
                                             incarnation=inc))
            elif effect is CE.RELEASE_FAILED:
                self.stats["failed"] += 1
                out.append(TransferFailed(transfer_id=tid, attempt=cur.attempt,
                                          reason=t.reason or "failed",
                                          policy=self.config.policy, code=t.code,
                                          incarnation=inc))
            return out
        if effect is CE.SEND_HELD:  # rule 8: the engine is usable now
            t.cur = self._attempt(cur.attempt, cur.block_ids, t.producer, now)
            t.cur.staging = cur.staging
            out = self._start_attempt(t, now)
            if t.skipped:
                return out
            t.skipped = True
            return out + self.producers.skips(self.peer, t.key, t.producer, self.config.max_untold,
                                          target=t.target)
        if effect is CE.HOLD:
            t.cur = self._attempt(cur.attempt + 1, block_ids, t.producer, now)
            t.reason, t.code = "", FailReason.WRITE_FAILED
            self._lend(t, t.cur)
            return self._connect(t.producer, now)
        if effect in (CE.REGISTER, CE.ZOMBIFY_AND_REGISTER):
            spec = self.producers.engines.get(t.producer)
            if spec is None:  # the producer left while we were preempted
                raise LocalProtocolError("producer engine is gone", transfer_id=tid)
            if effect is CE.ZOMBIFY_AND_REGISTER:
                t.zombies[cur.attempt] = cur
                self._schedule(cur.hard, t.key)
            t.cur = self._attempt(cur.attempt + 1, block_ids, t.producer, now)
            t.reason, t.code = "", FailReason.WRITE_FAILED
            self._lend(t, t.cur)
            return self._start_attempt(t, now)
        if effect is CE.REPORT_FAILED:
            self.stats["failed"] += 1
            t.why(FailReason.PEER_DIED, f"producer engine {t.producer!r} died")
            return [TransferFailed(transfer_id=tid, attempt=cur.attempt, reason=t.reason,
                                   policy=self.config.policy, code=t.code, incarnation=inc)]
        if effect is CE.FINAL_CANCEL_RELEASED:
            self._abandon_later(t)
            self.stats["cancelled"] += 1
            return [*final_cancels(self.peer, t),
                    TransferCancelled(transfer_id=tid, attempt=cur.attempt, incarnation=inc)]
        raise AssertionError(f"unhandled effect {effect}")  # pragma: no cover

    def _attempt(self, attempt: int, ids: tuple[int, ...], producer: str, now: float) -> _Attempt:
        writers = self.producers.writers.get(producer)
        if writers is None or not self.producers.usable(producer):
            # Waiting for the handshake: no writer known, no window running yet.
            return _Attempt(attempt=attempt, block_ids=ids, expected=frozenset(),
                            deadline=float("inf"), hard=float("inf"))
        deadline = now + self.config.window_s
        return _Attempt(
            attempt=attempt, block_ids=ids, expected=writers,
            deadline=deadline, hard=deadline + self.config.fence_grace_s,
        )

    def _start_attempt(self, t: _Transfer, now: float) -> list[Action]:
        cur = t.cur
        self._schedule(cur.deadline, t.key)  # the hard deadline is armed on fencing
        if self._next_heartbeat is None:
            self._next_heartbeat = now + self.config.heartbeat_s
        if t.mode is Mode.PUSH:
            return registers(self.peer, t, self.config.window_s)
        return list(reads(self.info, self.producers, t.transfer_id, t.producer, t.src_ids,
                          cur.block_ids, t.num_tokens, t.first_token, cur.attempt, t.inc))

    def _release(self, t: _Transfer, a: _Attempt) -> list[Action]:
        out = self._unlend(t, a)
        self.stats["released"] += 1
        out.append(ReleaseDestination(transfer_id=t.transfer_id, attempt=a.attempt,
                                      block_ids=a.block_ids, incarnation=t.inc))
        return out

    def _zombie(
        self, t: _Transfer, z: _Attempt, inp: ConsumerInput, now: float,
        ranks: frozenset[int] = frozenset(),
    ) -> list[Action]:
        """Feed one input to an abandoned attempt (rule 7, :data:`ZOMBIE_TABLE`)."""
        try:
            effect, nxt = ZOMBIE_TABLE[ZombieState.FENCING, inp]
        except KeyError:
            raise LocalProtocolError("no zombie transition", transfer_id=t.transfer_id,
                                     attempt=z.attempt, input=inp.value) from None
        out: list[Action] = []
        if effect is CE.FENCE:
            # A rank's word (or its death) fences only once its writes landed or their
            # grace passed (rules 7, 9); the hard deadline fences regardless.
            word = inp is not CI.HARD_DEADLINE
            z.fenced |= {r for r in ranks if not word or z.settled(r)}
        elif effect is CE.RELEASE:
            del t.zombies[z.attempt]
            out += self._release(t, z)
        if self.trace is not None:
            self.trace.append(Step(t.key, None, ZombieState.FENCING, inp, effect, nxt,
                                   tuple(out)))
        if effect is CE.FENCE and z.all_fenced():
            out += self._zombie(t, z, CI.FENCED, now)
        elif effect is CE.RELEASE:
            self._maybe_forget(t)
        return out

    def _lend(self, t: _Transfer, a: _Attempt) -> None:
        key = t.key
        written = _written(a.block_ids, self.info.layout.block_size, t.first_token,
                           t.num_tokens)
        for b in written:
            self._lent[b] = key
        # Rule 10: staging lent with the blocks, and fenced with them.
        book = staging.ledger(self.config.packing, self._staging)
        writers = len(self.producers.writers.get(t.producer) or ())
        if not staging.lend(book, self.info.layout, writers, t, a, len(written)):
            self.stats["staging_unavailable"] += 1

    def _unlend(self, t: _Transfer, a: _Attempt) -> list[Action]:
        key, lent = t.key, self._lent
        for b in a.block_ids:
            if lent.get(b) == key:  # only what this transfer lent
                del lent[b]
        return staging.unlend(self._staging, t, a)

    def _maybe_forget(self, t: _Transfer) -> None:
        if t.state in CONSUMER_TERMINAL and not t.zombies:
            if self._transfers.get(t.transfer_id) is t:
                del self._transfers[t.transfer_id]
            else:
                self._retired.pop(t.key, None)

    # ---------------------------------------------------------------- timers

    def next_deadline(self) -> float | None:
        """Earliest time at which :meth:`handle_timer` may have work (maybe spurious)."""
        hb = self._next_heartbeat
        if self._timers:
            first = self._timers[0][0]
            return first if hb is None or first < hb else hb
        return hb

    def _run_timers(self, now: float) -> list[Action]:
        out = super()._run_timers(now)
        if self._next_heartbeat is not None and self._next_heartbeat <= now:
            out += heartbeats(self.peer, self._transfers.values())
            live = any(t.state not in CONSUMER_TERMINAL for t in self._transfers.values())
            self._next_heartbeat = now + self.config.heartbeat_s if live else None
        return out

    def _expire(self, key: Key | str, now: float) -> list[Action]:
        if isinstance(key, str):  # a producer engine's handshake deadline
            due = self.producers.connecting.get(key)
            if due is None or due > now:
                return []
            return self._handshake_failed(key, "handshake timed out", now)
        t = self._find(*key)
        if t is None:
            return []
        out: list[Action] = []
        for a in (t.cur, *t.zombies.values()):  # rule 7: a failed write's grace passed
            for r, until in list(a.stray.items()):
                if until is None or until > now:
                    continue
                a.stray[r] = None
                if a is not t.cur:
                    out += self._zombie(t, a, CI.GRACE, now, frozenset((r,)))
                elif t.state in CONSUMER_FENCING:
                    out += self._input(t, CI.GRACE, now, ranks=frozenset((r,)))
        for z in list(t.zombies.values()):
            if z.hard <= now:
                self.stats["forced_release"] += 1
                out += self._zombie(t, z, CI.HARD_DEADLINE, now, z.expected)
        if t.state is CS.REGISTERED and t.cur.deadline <= now:
            cur = t.cur  # rule 10: every write landed, a scatter still runs
            landed = cur.scattering and cur.notified | {
                r for r in cur.scattering if cur.landed(r)} >= cur.expected
            out += self._input(t, CI.DEADLINE_SCATTERING if landed else CI.DEADLINE, now)
        if t.state in CONSUMER_FENCING and t.cur.hard <= now:
            # Rule 10: a scatter still writing the blocks is its own fence.
            out += self._input(t, CI.HARD_DEADLINE_SCATTERING if t.cur.scattering
                               else CI.HARD_DEADLINE, now)
        self._maybe_forget(t)
        return out


