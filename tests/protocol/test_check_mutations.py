"""The model checker can fail: each test injects one known bug into the real
endpoints (a table row or a method, patched for the test alone) and expects the
checker to find it, on its own, with a trace.

Each mutation names the scope that can reach the bug and the kind of broken
promise it must show; the search stops at the first violation of that kind.
"""

from __future__ import annotations

import msgspec
import pytest

from pushkv.protocol import consumer as consumer_module
from pushkv.protocol import producer as producer_module
from pushkv.protocol import records, states
from pushkv.protocol.check import Scope, explore
from pushkv.protocol.states import (
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


def stale_incarnation_counted(mp: pytest.MonkeyPatch) -> None:
    """The consumer matches producer messages on the transfer id alone."""
    orig = Consumer._from_producer

    def mutated(self, msg, inp, now):
        t = self._transfers.get(msg.transfer_id)
        if t is not None:
            msg = msgspec.structs.replace(msg, incarnation=t.inc)
        return orig(self, msg, inp, now)

    mp.setattr(Consumer, "_from_producer", mutated)


def silent_rank_holds_source(mp: pytest.MonkeyPatch) -> None:
    """A producer rank that writes nothing ignores the consumer's Skip."""
    mp.setattr(producer_module, "on_skip", lambda p, msg, now: [])


def write_after_lease(mp: pytest.MonkeyPatch) -> None:
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


def write_after_window(mp: pytest.MonkeyPatch) -> None:
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


def known_answer_waited_out(mp: pytest.MonkeyPatch) -> None:
    """A held registration whose prefill is aborted is not told so."""
    mp.setitem(states.PRODUCER_TABLE, (P.REGISTERED, PI.KV_ABORTED), (PE.NONE, P.FAILED))


def registration_dropped_as_stale(mp: pytest.MonkeyPatch) -> None:
    """A registration reaching a released source is dropped instead of failed."""
    mp.setitem(states.PRODUCER_TABLE, (P.GONE, PI.REGISTER), (PE.STALE, P.GONE))


def dropped_fence(mp: pytest.MonkeyPatch) -> None:
    """The consumer takes one rank's fence for all of them."""
    mp.setattr(records.Attempt, "all_fenced", lambda self: bool(self.fenced))


def double_count(mp: pytest.MonkeyPatch) -> None:
    """A repeated notification is counted for a rank that has not notified yet."""
    orig = Consumer._report

    def report(self, t, attempt, rank, inp, now, *rest):
        a = t.cur
        if inp is CI.NOTIFY and attempt == a.attempt and rank in a.notified:
            rank = next((r for r in sorted(a.expected) if r not in a.notified), rank)
        return orig(self, t, attempt, rank, inp, now, *rest)

    mp.setattr(Consumer, "_report", report)


def write_into_reused_blocks(mp: pytest.MonkeyPatch) -> None:
    """Preemption releases the destination at once, without waiting for the fence."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.PREEMPT), (CE.RELEASE, C.PREEMPTED))


def ready_too_early(mp: pytest.MonkeyPatch) -> None:
    """The first notification of an attempt makes it READY."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.NOTIFY), (CE.READY, C.READY))


def source_released_twice(mp: pytest.MonkeyPatch) -> None:
    """Settling a released source releases it again."""
    orig = Producer._settle

    def settle(self, t, now):
        out = orig(self, t, now)
        return out + [a for a in out if type(a).__name__ == "ReleaseSource"]

    mp.setattr(Producer, "_settle", settle)


def ready_after_the_first_part(mp: pytest.MonkeyPatch) -> None:
    """The consumer takes any part's notification for the rank's last (rule 9)."""
    orig = consumer_module._parts

    def parts(a, rank, inp, msg):
        got = orig(a, rank, inp, msg)
        return CI.NOTIFY if isinstance(msg, consumer_module.Notify) else got

    mp.setattr(consumer_module, "_parts", parts)


def cancel_ack_with_a_part_in_flight(mp: pytest.MonkeyPatch) -> None:
    """A cancel of a leg writing a part is acknowledged at once, with the parts so far."""
    orig = Producer._effect

    def effect(self, t, leg, effect, *args):
        if effect is not PE.ACK or leg.writing is None:
            return orig(self, t, leg, effect, *args)
        writing, leg.writing = leg.writing, None
        try:
            return orig(self, t, leg, effect, *args)
        finally:
            leg.writing = writing

    mp.setattr(Producer, "_effect", effect)


def range_before_registration_dropped(mp: pytest.MonkeyPatch) -> None:
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


def source_released_with_a_part_in_flight(mp: pytest.MonkeyPatch) -> None:
    """A request aborted mid-stream releases its source at once."""
    mp.setitem(states.SOURCE_TABLE, (SourceState.PARTIAL, SourceInput.PREFILL_ABORTED),
               (SourceEffect.RELEASE, SourceState.RELEASED))


def part_written_after_a_cancel(mp: pytest.MonkeyPatch) -> None:
    """A leg cancelled during a part goes on writing the ranges ready after it."""
    mp.setitem(states.PRODUCER_TABLE, (P.CANCELLING, PI.PART_OK), (PE.WRITE, P.WRITING))


#: Rule 10: every write packed; a scatter may outlast the hard deadline.
PACKED = Scope(name="packed-1", attempts=2, staging_bytes=128, max_scatter_s=4.0,
               heartbeats=False)


def release_during_scatter(mp: pytest.MonkeyPatch) -> None:
    """An attempt counts as fenced while a scatter still writes its blocks."""
    mp.setattr(records.Attempt, "all_fenced", lambda self: self.fenced >= self.expected)


def ready_before_the_scatter(mp: pytest.MonkeyPatch) -> None:
    """A staged write counts as landed when it reaches staging, not the blocks."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.STAGED), (CE.COUNT, C.REGISTERED))


def hard_deadline_cuts_a_scatter(mp: pytest.MonkeyPatch) -> None:
    """The hard deadline releases the blocks of an aborted transfer mid-scatter."""
    mp.setitem(states.CONSUMER_TABLE, (C.CANCELLING, CI.HARD_DEADLINE_SCATTERING),
               (CE.RELEASE_CANCELLED, C.CANCELLED))


def staging_given_back_at_the_notification(mp: pytest.MonkeyPatch) -> None:
    """The consumer frees an attempt's staging as soon as a staged write notified."""
    orig = Consumer._from_producer

    def mutated(self, msg, inp, now):
        out = orig(self, msg, inp, now)
        t = self._transfers.get(msg.transfer_id)
        if t is not None and getattr(msg, "staged", False) and t.cur.staging is not None:
            out += consumer_module.staging.unlend(self, t, t.cur)
        return out

    mp.setattr(Consumer, "_from_producer", mutated)


#: Rule 10, pipelined: every write packed in chunks of one byte.
PACKED_CHUNKED = Scope(name="packed-chunked-1", attempts=2, staging_bytes=128,
                       pipeline_bytes=1, max_scatter_s=4.0, heartbeats=False)


def ready_at_the_first_chunk(mp: pytest.MonkeyPatch) -> None:
    """A rank of a pipelined write counts once any chunk is scattered, not its last."""
    mp.setitem(states.CONSUMER_TABLE, (C.REGISTERED, CI.CHUNK_SCATTERED),
               (CE.COUNT, C.REGISTERED))


def fenced_at_the_first_chunk(mp: pytest.MonkeyPatch) -> None:
    """A rank's staged write counts as landed (its fence) once its parts notified, while
    later chunks of it are still on their way."""
    mp.setattr(records.Attempt, "landed", records.Attempt.parts_in)


MUTATIONS = [
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
    (cancel_ack_with_a_part_in_flight, PARTIAL, "reuse"),
    (range_before_registration_dropped, PARTIAL, "prompt"),
    (source_released_with_a_part_in_flight, PARTIAL, "source"),
    (part_written_after_a_cancel, PARTIAL, "cancelled"),
    (release_during_scatter, PACKED, "staging"),
    (ready_before_the_scatter, PACKED, "bytes"),
    (hard_deadline_cuts_a_scatter, PACKED, "staging"),
    (staging_given_back_at_the_notification, PACKED, "staging"),
    (ready_at_the_first_chunk, PACKED_CHUNKED, "bytes"),
    (fenced_at_the_first_chunk, PACKED_CHUNKED, "staging"),
]


@pytest.mark.parametrize(("mutate", "scope", "kind"), MUTATIONS,
                         ids=[m[0].__name__ for m in MUTATIONS])
def test_the_checker_finds_an_injected_bug(monkeypatch, mutate, scope, kind):
    mutate(monkeypatch)
    res = explore(scope, want=kind, max_states=400_000)
    assert res.violations, f"{mutate.__name__}: no {kind} violation in {res.summary()}"
    found = res.violations[0]
    assert found.kind == kind
    assert found.steps and len(found.story) >= len(found.steps)
    assert "!!" in found.story[-1] or "!!" in "".join(found.story)
    # The trace is the shortest: replaying one step fewer shows no such violation.
    assert all(line.strip() for line in found.story)


def test_every_mutation_is_a_real_bug_of_its_own():
    """The unmutated core passes each mutation's search (else the test proves nothing)."""
    kinds = {}
    for mutate, scope, kind in MUTATIONS:
        kinds.setdefault((scope.name, kind), []).append(mutate.__name__)
    for (name, kind), muts in kinds.items():
        scope = next(s for _, s, _ in MUTATIONS if s.name == name)
        res = explore(scope, want=kind)
        assert not res.violations, (muts, res.violations[0].report())
