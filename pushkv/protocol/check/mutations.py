# mypy: disable-error-code="no-untyped-def,attr-defined"
# (the mutations are patches: they wrap methods untyped and reach into module internals)
"""Known bugs, injected into the real endpoints: the proof that the checker can fail.

Each mutation patches one table row or one method of the real endpoints (through
a :class:`Patch`, or pytest's ``monkeypatch``: the same two calls) and names the
scope that can reach the bug and the kind of broken promise the checker must
show. ``tests/protocol`` runs each under pytest; ``benchmarks/bench_check.py``
counts how many the checker finds (``mutations_found`` / ``mutations_total``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from .. import records, states
from ..consumer import endpoint as consumer_module
from ..consumer import outcomes as outcomes_module
from ..errors import LocalProtocolError
from ..events import Peer
from ..messages import CancelAck, Fail, FailReason
from ..producer import endpoint as producer_module
from ..producer import view as producer_view_module
from ..states import (
    PRODUCER_FINISHED,
    ConsumerEffect,
    ConsumerInput,
    ConsumerState,
    ProducerEffect,
    ProducerInput,
    ProducerState,
    SourceEffect,
    SourceInput,
    SourceState,
)
from .scope import Scope


class Patch(Protocol):
    """What a mutation needs of a patcher (pytest's ``MonkeyPatch`` is one)."""

    def setattr(self, target: Any, name: str, value: Any) -> None: ...

    def setitem(self, dic: Any, name: Any, value: Any) -> None: ...


class Patcher:
    """A patcher that undoes everything it did on :meth:`undo` (or leaving a ``with``)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        old = target.__dict__[name] if name in vars(target) else getattr(target, name)
        self._undo.append(lambda: setattr(target, name, old))
        setattr(target, name, value)

    def setitem(self, dic: Any, name: Any, value: Any) -> None:
        if name in dic:
            old = dic[name]
            self._undo.append(lambda: dic.__setitem__(name, old))
        else:
            self._undo.append(lambda: dic.pop(name, None))
        dic[name] = value

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> Patcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


C, CI, CE = ConsumerState, ConsumerInput, ConsumerEffect
P, PI, PE = ProducerState, ProducerInput, ProducerEffect
Consumer, Producer = consumer_module.Consumer, producer_module.Producer

ONE = Scope(name="1to1", heartbeats=False, prefill_aborts=True)
TWO_ATTEMPTS = Scope(name="1to1x2", attempts=2, heartbeats=False)
REUSE = Scope(name="reuse", incarnations=2, dups=1, heartbeats=False, aborts=False)
TWO_TO_ONE = Scope(name="2to1", p_tp=2, dups=1, heartbeats=False, aborts=False)
TWO_TO_ONE_ABORTS = Scope(name="2to1-aborts", p_tp=2, heartbeats=False)
REPLICATED = Scope(name="replicated", p_tp=2, kv_heads=1, heartbeats=False, aborts=False)
#: Rule 9: the KV final in two token ranges, in any order, before prefill ends.
PARTIAL = Scope(name="partial-1", pieces=2, heartbeats=False, prefill_aborts=True)


def stale_incarnation_counted(mp: Patch) -> None:
    """The consumer matches producer messages on the transfer id alone."""
    orig = Consumer._from_producer

    def mutated(self, msg, inp, now):
        t = self._transfers.get(msg.transfer_id)
        if t is not None:
            msg = msgspec.structs.replace(msg, incarnation=t.inc)
        return orig(self, msg, inp, now)

    mp.setattr(Consumer, "_from_producer", mutated)


def silent_rank_holds_source(mp: Patch) -> None:
    """A producer rank that writes nothing ignores the consumer's Skip."""
    mp.setattr(Producer, "_on_skip", lambda self, msg, now: [])


def write_after_lease(mp: Patch) -> None:
    """The lease neither ends the source nor stops a write from starting."""
    orig_source, orig_write = Producer._source, Producer._write

    def source(self, t, inp, now):
        return [] if inp is SourceInput.LEASE_EXPIRED else orig_source(self, t, inp, now)

    def write(self, t, leg, now):
        lease, t.lease = t.lease, float("inf")
        try:
            return orig_write(self, t, leg, now)
        finally:
            t.lease = lease

    mp.setattr(Producer, "_source", source)
    mp.setattr(Producer, "_write", write)


def write_after_window(mp: Patch) -> None:
    """The producer forgets a registration's window: no deadline, no check at the start."""
    mp.setitem(states.PRODUCER_TABLE, (P.REGISTERED, PI.DEADLINE), (PE.NONE, P.REGISTERED))
    orig = Producer._write

    def write(self, t, leg, now):
        deadline, leg.reg.deadline = leg.reg.deadline, float("inf")
        try:
            return orig(self, t, leg, now)
        finally:
            if leg.reg is not None:
                leg.reg.deadline = deadline

    mp.setattr(Producer, "_write", write)


def known_answer_waited_out(mp: Patch) -> None:
    """A held registration whose prefill is aborted is not told so."""
    mp.setitem(states.PRODUCER_TABLE, (P.REGISTERED, PI.KV_ABORTED), (PE.NONE, P.FAILED))


def registration_dropped_as_stale(mp: Patch) -> None:
    """A registration reaching a released source is dropped instead of failed."""
    mp.setitem(states.PRODUCER_TABLE, (P.GONE, PI.REGISTER), (PE.STALE, P.GONE))


def dropped_fence(mp: Patch) -> None:
    """The consumer takes one rank's fence for all of them."""
    mp.setattr(records.Attempt, "all_fenced", lambda self: bool(self.fenced))


def double_count(mp: Patch) -> None:
    """A repeated notification is counted for a rank that has not notified yet."""
    orig = Consumer._report

    def report(self, t, attempt, rank, inp, now, *rest):
        a = t.cur
        if inp is CI.NOTIFY and attempt == a.attempt and rank in a.notified:
            rank = next((r for r in sorted(a.expected) if r not in a.notified), rank)
        return orig(self, t, attempt, rank, inp, now, *rest)

    mp.setattr(Consumer, "_report", report)


def write_into_reused_blocks(mp: Patch) -> None:
    """Preemption releases the destination at once, without waiting for the fence."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.PREEMPT), (CE.RELEASE, C.PREEMPTED))


def ready_too_early(mp: Patch) -> None:
    """The first notification of an attempt makes it READY."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.NOTIFY), (CE.READY, C.READY))


def source_released_twice(mp: Patch) -> None:
    """Settling a released source releases it again."""
    orig = Producer._settle

    def settle(self, t, now):
        out = orig(self, t, now)
        return out + [a for a in out if type(a).__name__ == "ReleaseSource"]

    mp.setattr(Producer, "_settle", settle)


def ready_after_the_first_part(mp: Patch) -> None:
    """The consumer takes any part's notification for the rank's last (rule 9)."""
    orig = outcomes_module._parts

    def parts(a, rank, inp, msg):
        got = orig(a, rank, inp, msg)
        return CI.NOTIFY if isinstance(msg, consumer_module.Notify) else got

    mp.setattr(outcomes_module, "_parts", parts)


def range_before_registration_dropped(mp: Patch) -> None:
    """A range reported before any registration is held is lost (not kept in the source)."""
    orig = Producer.range_ready

    def range_ready(self, transfer_id, block_ids, tokens, now, *, layers=None, incarnation=0):
        key = (transfer_id, incarnation)
        t = self._transfers.get(key)
        before = dict(t.ready) if t is not None else {}
        held = t is not None and any(leg.reg is not None for leg in t.legs.values())
        out = orig(self, transfer_id, block_ids, tokens, now, layers=layers,
                   incarnation=incarnation)
        t = self._transfers.get(key)
        if t is not None and not held:
            t.ready = before
        return out

    mp.setattr(Producer, "range_ready", range_ready)


def source_released_with_a_part_in_flight(mp: Patch) -> None:
    """A request aborted mid-stream releases its source at once."""
    mp.setitem(states.SOURCE_TABLE, (SourceState.PARTIAL, SourceInput.PREFILL_ABORTED),
               (SourceEffect.RELEASE, SourceState.RELEASED))


def part_written_after_a_cancel(mp: Patch) -> None:
    """A leg cancelled during a part goes on writing the ranges ready after it."""
    mp.setitem(states.PRODUCER_TABLE, (P.CANCELLING, PI.PART_OK), (PE.WRITE, P.WRITING))


#: Rule 10: every write packed; a scatter may outlast the hard deadline.
PACKED = Scope(name="packed-1", attempts=2, staging_bytes=128, max_scatter_s=4.0,
               heartbeats=False)


def release_during_scatter(mp: Patch) -> None:
    """An attempt counts as fenced while a scatter still writes its blocks."""
    mp.setattr(records.Attempt, "all_fenced", lambda self: self.fenced >= self.expected)


def ready_before_the_scatter(mp: Patch) -> None:
    """A staged write counts as landed when it reaches staging, not the blocks."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.STAGED), (CE.COUNT, C.REGISTERED))


def hard_deadline_cuts_a_scatter(mp: Patch) -> None:
    """The hard deadline releases the blocks of an aborted transfer mid-scatter."""
    mp.setitem(states.CONSUMER_TABLE, (C.CANCELLING, CI.HARD_DEADLINE_SCATTERING),
               (CE.RELEASE_CANCELLED, C.CANCELLED))


def staging_given_back_at_the_notification(mp: Patch) -> None:
    """The consumer frees an attempt's staging as soon as a staged write notified."""
    orig = Consumer._from_producer

    def mutated(self, msg, inp, now):
        out = orig(self, msg, inp, now)
        t = self._transfers.get(msg.transfer_id)
        if t is not None and getattr(msg, "staged", False) and t.cur.staging is not None:
            out += consumer_module.staging.unlend(self._staging, t, t.cur)
        return out

    mp.setattr(Consumer, "_from_producer", mutated)


#: Rule 10, pipelined: every write packed in chunks of one byte.
PACKED_CHUNKED = Scope(name="packed-chunked-1", attempts=2, staging_bytes=128,
                       pipeline_bytes=1, max_scatter_s=4.0, heartbeats=False)


def ready_at_the_first_chunk(mp: Patch) -> None:
    """A rank of a pipelined write counts once any chunk is scattered, not its last."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.CHUNK_SCATTERED),
               (CE.COUNT, C.REGISTERED))


def fenced_at_the_first_chunk(mp: Patch) -> None:
    """A rank's staged write counts as landed (its fence) once its parts notified, while
    later chunks of it are still on their way."""
    mp.setattr(records.Attempt, "landed", records.Attempt.parts_in)




# ------------------------------------------------ weak visibility (rule 7)

#: Weak visibility, the default: a write completes on the producer before its bytes land.
WEAK_ONE = Scope(name="weak-1", heartbeats=False)


def ack_counts_no_write_after_completion(mp: Patch) -> None:
    """A Cancel reaching a leg whose write completed is acknowledged as if nothing was
    posted (the write's completion taken for its landing): the consumer fences while
    the bytes are still on the wire."""
    orig = producer_view_module.ProducerView._ack

    def ack(self, peer, key, attempt, leg=None):
        finished = leg is not None and leg.writing is None and leg.state in (
            states.PRODUCER_TERMINAL)
        return orig(self, peer, key, attempt, None if finished else leg)

    mp.setattr(producer_view_module.ProducerView, "_ack", ack)


def failed_write_fenced_at_once(mp: Patch) -> None:
    """A Fail counts only the writes that completed (a failed one taken for one that
    never landed): the consumer fences at once while its stray bytes may still land."""
    orig = consumer_module.Consumer._from_producer

    def mutated(self, msg, inp, now):
        if isinstance(msg, Fail | CancelAck) and msg.failed:
            msg = msgspec.structs.replace(msg, posted=msg.posted - msg.failed, failed=0)
        return orig(self, msg, inp, now)

    mp.setattr(consumer_module.Consumer, "_from_producer", mutated)


#: A later use of the id ends before it was registered, while the first is live.
ABANDON = Scope(name="abandon-1", incarnations=2, abandons=True, heartbeats=False,
                aborts=False)


def abandon_refused_beside_another_use(mp: Patch) -> None:
    """``abandon`` of one use is refused while any use of the id is live on the rank."""
    orig = consumer_module.Consumer.abandon

    def abandon(self, transfer_id, producer_engine_id, now, *, incarnation=0):
        t = self._transfers.get(transfer_id)
        if t is not None and t.state not in states.CONSUMER_TERMINAL:
            raise LocalProtocolError("transfer is live on this rank",
                                                     transfer_id=transfer_id)
        return orig(self, transfer_id, producer_engine_id, now, incarnation=incarnation)

    mp.setattr(consumer_module.Consumer, "abandon", abandon)


#: Two uses of one id, each preempted and reissued once (eager visibility: the smallest
#: world in which an older use's zombie outlives a newer use of its id).
REUSE_REISSUE = Scope(name="reuse-reissue-1", incarnations=2, attempts=2, aborts=False,
                      heartbeats=False, visibility="eager")


def older_use_forgotten_with_the_newer(mp: Patch) -> None:
    """When a use of an id ends and is forgotten, every other use of the id is forgotten
    with it: an older use's zombie attempt, still owed a notification, is lost, and its
    blocks stay lent until nothing can free them."""
    orig = Consumer._maybe_forget

    def forget(self, t):
        orig(self, t)
        if t.transfer_id not in self._transfers:
            for key in [k for k in self._retired if k[0] == t.transfer_id]:
                del self._retired[key]

    mp.setattr(Consumer, "_maybe_forget", forget)


#: Pull: two attempts, failed reads, prefill aborts.
PULL = Scope(name="pull-1", pull=True, attempts=2, write_errors=True, prefill_aborts=True,
             heartbeats=False)


def read_at_the_lease_end_trusted(mp: Patch) -> None:
    """A read completing at the very moment the source's lease ends counts: the
    producer may have freed the source under it."""
    orig = Consumer.read_completed

    def read_completed(self, transfer_id, attempt, peer, ok, now, *, incarnation=0):
        t = self._find(transfer_id, incarnation)
        if t is not None and t.lease_until == now:
            t.lease_until = now + 1e-9
        return orig(self, transfer_id, attempt, peer, ok, now, incarnation=incarnation)

    mp.setattr(Consumer, "read_completed", read_completed)


def failed_read_fenced_at_once(mp: Patch) -> None:
    """A failed read fences its rank at once: its stray bytes may land in blocks
    released and lent again."""
    orig = Consumer.read_completed

    def read_completed(self, transfer_id, attempt, peer, ok, now, *, incarnation=0):
        t = self._find(transfer_id, incarnation)
        if t is not None and not ok:
            a = t.cur if attempt == t.cur.attempt else t.zombies.get(attempt)
            if a is not None:
                a.stray.setdefault(peer.rank, None)  # as if its grace had passed
        return orig(self, transfer_id, attempt, peer, ok, now, incarnation=incarnation)

    mp.setattr(Consumer, "read_completed", read_completed)


#: Rule 13: one pull, nothing failing: a reader's ReadDone may overtake its source's
#: publication.
PULL_EARLY = Scope(name="pull-early-1", pull=True, heartbeats=False, aborts=False)


def early_read_done_dropped(mp: Patch) -> None:
    """Rule 13 undone: a ReadDone that overtakes the rank's own prefill_finished (the
    router relayed the prefill's answer first) is dropped as stale, so the source it
    reports read is held until its lease ends."""
    orig = producer_module.Producer._on_read_done

    def on_read_done(self, msg, now):
        t = self._transfers.get((msg.transfer_id, msg.incarnation))
        if t is None or t.kv is SourceState.PENDING:
            self.stats["stale"] += 1
            return []
        return orig(self, msg, now)

    mp.setattr(producer_module.Producer, "_on_read_done", on_read_done)


#: Two transfer ids at once and one destination block: the block one frees is the next's.
TWO_IDS = Scope(name="two-ids-1", incarnations=2, distinct_ids=True, d_blocks=1,
                write_errors=True, heartbeats=False, aborts=False)


#: Rule 12: a router may re-target the held source to engine E at any moment.
RETARGET = Scope(name="retarget-1", retarget=True, heartbeats=False)


def retarget_forgets_the_write_in_flight(mp: Patch) -> None:
    """A re-target ends a leg whose write is in flight as if it were finished: the
    source goes while that write still reads it."""
    mp.setitem(states.PRODUCER_TABLE, (P.WRITING, PI.RETARGET), (PE.FAIL, P.FAILED))


def retarget_fail_counts_nothing(mp: Patch) -> None:
    """The Fail a re-target sends the engine left behind counts no write: it fences
    and lends its blocks again while the write in flight may still land in them."""
    orig = producer_view_module.ProducerView._fail

    def fail(self, peer, key, attempt, reason, detail="", leg=None):
        drop = reason is FailReason.RETARGETED
        return orig(self, peer, key, attempt, reason, detail, None if drop else leg)

    mp.setattr(producer_view_module.ProducerView, "_fail", fail)


#: Rule 12 after READY: a written source lingers until D's first decode step.
RETARGET_LINGER = Scope(name="retarget-linger-1", retarget=True, linger=True,
                        heartbeats=False)


def linger_ignores_consumed(mp: Patch) -> None:
    """D's report of its first decode step changes nothing: a written source stays
    held until the hold ends, though nothing will want it again."""
    mp.setattr(producer_module.Producer, "_on_consumed", lambda self, msg, now: [])


def linger_outlives_a_final_cancel(mp: Patch) -> None:
    """A final cancel of an attempt already written is taken as a repeat: its linger
    does not end, though the consumer gave the transfer up, and the source waits for
    the hold anyway."""
    orig = producer_module.Producer._on_cancel

    def on_cancel(self, msg, now):
        t = self._transfers.get((msg.transfer_id, msg.incarnation))
        leg = t.legs.get(Peer(msg.engine_id, msg.rank)) if t is not None else None
        if msg.final and leg is not None and leg.state in PRODUCER_FINISHED:
            msg = msgspec.structs.replace(msg, final=False)
        return orig(self, msg, now)

    mp.setattr(producer_module.Producer, "_on_cancel", on_cancel)


#: How far a search for a mutation's violation may go (breadth-first: the deepest one,
#: an older use forgotten with the newer, is found at 1,091,259 states; 528,587 before a
#: consumer giving a transfer up told the ranks that wrote it, rule 12's Consumed).
MAX_STATES = 1_200_000

MUTATIONS: list[tuple[Callable[[Patch], None], Scope, str]] = [
    (stale_incarnation_counted, REUSE, "bytes"),
    (silent_rank_holds_source, REPLICATED, "prompt"),
    (write_after_lease, ONE, "lease"),
    (write_after_window, ONE, "window"),
    (known_answer_waited_out, ONE, "prompt"),
    (registration_dropped_as_stale, ONE, "prompt"),
    (dropped_fence, TWO_TO_ONE_ABORTS, "reuse"),
    (double_count, TWO_TO_ONE, "bytes"),
    (write_into_reused_blocks, TWO_ATTEMPTS, "reuse"),
    (ready_too_early, TWO_TO_ONE, "bytes"),
    (source_released_twice, ONE, "source"),
    (ready_after_the_first_part, PARTIAL, "bytes"),
    (range_before_registration_dropped, PARTIAL, "prompt"),
    (source_released_with_a_part_in_flight, PARTIAL, "source"),
    (part_written_after_a_cancel, PARTIAL, "cancelled"),
    (release_during_scatter, PACKED, "staging"),
    (ready_before_the_scatter, PACKED, "bytes"),
    (hard_deadline_cuts_a_scatter, PACKED, "staging"),
    (staging_given_back_at_the_notification, PACKED, "staging"),
    (ready_at_the_first_chunk, PACKED_CHUNKED, "bytes"),
    (fenced_at_the_first_chunk, PACKED_CHUNKED, "staging"),
    (ack_counts_no_write_after_completion, WEAK_ONE, "reuse"),
    (failed_write_fenced_at_once, Scope(name="weak-faults-1", write_errors=True,
                                        heartbeats=False, aborts=False), "reuse"),
    (abandon_refused_beside_another_use, ABANDON, "refused"),
    (older_use_forgotten_with_the_newer, REUSE_REISSUE, "prompt"),
    (read_at_the_lease_end_trusted, PULL, "bytes"),
    (failed_read_fenced_at_once, PULL, "reuse"),
    (early_read_done_dropped, PULL_EARLY, "prompt"),
    # The same early fence, across transfer ids: the stray bytes land in the block the
    # engine lent to the next id.
    (failed_write_fenced_at_once, TWO_IDS, "incarnation"),
    (retarget_forgets_the_write_in_flight, RETARGET, "source"),
    (retarget_fail_counts_nothing, RETARGET, "reuse"),
    (linger_ignores_consumed, RETARGET_LINGER, "prompt"),
    (linger_outlives_a_final_cancel, RETARGET_LINGER, "prompt"),
]
"""(mutation, the scope that reaches it, the kind of violation it must show)."""
