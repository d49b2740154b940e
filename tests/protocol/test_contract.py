"""The contract's properties 1-4, each as the race that once broke it.

Each test drives the public endpoint API only: messages are routed by hand, so
a delayed or duplicated message is simply delivered late, or twice.
"""

import pytest

from pushkv.protocol import (
    Cancel,
    CancelAck,
    Connect,
    ConsumerConfig,
    ConsumerState,
    Fail,
    FailReason,
    IssueWrite,
    LocalProtocolError,
    Notify,
    Peer,
    ProducerConfig,
    ProducerState,
    Register,
    ReleaseDestination,
    ReleaseSource,
    Skip,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)

from .helpers import Pair, msgs, of

D0, D1 = Peer("D", 0), Peer("D", 1)


def reg(attempt=0, tid="t", blocks=(1, 2, 3), n=40, rank=0, incarnation=0, window_ms=480_000):
    return Register(transfer_id=tid, attempt=attempt, engine_id="D", rank=rank,
                    producer_engine_id="P", block_ids=blocks, num_tokens=n,
                    window_ms=window_ms, incarnation=incarnation)


# ----------------------------------------------------------- 1. incarnations


def test_a_late_notification_of_an_ended_use_never_completes_a_reused_id():
    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    first = c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=11)
    pair.to_producers(first)
    (w,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=11), IssueWrite)
    old_note = w.notify
    assert of(c.receive(old_note, 0.0), TransferReady)
    p.write_completed("t", 0, D0, True, 0.0, incarnation=11)
    # The id comes back at once for a new request, into other blocks.
    c.register("t", "P", [4, 5, 6], 40, 1.0, incarnation=12)
    # The old write's notification is delivered again (a duplicate, late).
    out = c.receive(old_note, 1.0)
    assert not of(out, TransferReady), "an old notification completed a new transfer"
    assert c.state_of("t", incarnation=12) is ConsumerState.REGISTERED
    assert c.stats["stale"] == 1


def test_a_reused_id_is_a_new_transfer_at_the_producer():
    pair = Pair(pcfg=ProducerConfig(lease_s=10.0))
    (p,) = pair.p
    p.receive(reg(incarnation=11), 0.0)
    p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=11)
    assert of(p.write_completed("t", 0, D0, True, 0.1, incarnation=11), ReleaseSource)
    # A new request with the same id: its prefill holds new blocks, its
    # registration (attempt 0 again) is not "stale".
    out = p.prefill_finished("t", [10, 11, 12], 40, 1.0, incarnation=12)
    assert not of(out, ReleaseSource)
    (w,) = of(p.receive(reg(blocks=(4, 5, 6), incarnation=12), 1.1), IssueWrite)
    assert w.incarnation == 12 and w.notify.incarnation == 12
    assert p.stats["stale"] == 0


def test_old_cancel_and_fail_never_touch_a_new_incarnation():
    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=12)
    (w,) = of(p.receive(reg(incarnation=12), 0.0), IssueWrite)
    # A Cancel of an older use of the id arrives late: it must not fence this write.
    p.receive(Cancel(transfer_id="t", attempt=0, engine_id="D", rank=0, final=True,
                     incarnation=11), 0.1)
    assert p.leg_state("t", D0, incarnation=12) is ProducerState.WRITING
    # On the consumer, a Fail and a CancelAck of the older use are stale too.
    c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=12)
    for m in (Fail(transfer_id="t", attempt=0, engine_id="P", rank=0,
                   reason=FailReason.WRITE_FAILED, incarnation=11),
              CancelAck(transfer_id="t", attempt=0, engine_id="P", rank=0, incarnation=11)):
        assert c.receive(m, 0.2) == []
    assert c.state_of("t", incarnation=12) is ConsumerState.REGISTERED
    assert of(c.receive(w.notify, 0.3), TransferReady)


# ------------------------------------------------------ 2. prompt outcomes


def test_a_rank_that_writes_nothing_releases_without_waiting_for_the_lease():
    # Two producer ranks hold a replicated KV head; one consumer rank reads it
    # from rank 0 only, so rank 1 writes nothing.
    pair = Pair(producer={"tp": 2, "num_kv_heads": 1}, consumer={"num_kv_heads": 1},
                pcfg=ProducerConfig(lease_s=30.0))
    (p0, p1), (c,) = pair.p, pair.c
    out = c.register("t", "P", [1, 2, 3], 40, 0.0)
    answers = pair.to_producers(out)
    out0 = p0.prefill_finished("t", [7, 8, 9], 40, 0.1)
    out1 = p1.prefill_finished("t", [7, 8, 9], 40, 0.1)
    released = of(answers + out1, ReleaseSource)
    assert released and released[0].transfer_id == "t", "rank 1 pins its blocks"
    assert p1.held_blocks() == {}
    back, notes = pair.complete(out0)
    assert of(notes, TransferReady) and of(back, ReleaseSource)


def test_a_late_registration_after_the_release_is_failed_at_once():
    # Producer rank 0 writes into two consumer ranks. Rank 0's leg finishes, the
    # lease ends, the source goes; then rank 1's registration (delayed) arrives.
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=10.0))
    (p,), (c0, c1) = pair.p, pair.c
    pair.to_producers(c0.register("t", "P", [1, 2, 3], 40, 0.0))
    late = c1.register("t", "P", [1, 2, 3], 40, 0.0)
    pair.complete(p.prefill_finished("t", [7, 8, 9], 40, 0.0))
    assert of(p.handle_timer(10.0), ReleaseSource)
    pair.now = 11.0
    answer = pair.to_producers(late)
    (fail,) = msgs(answer, Fail)
    assert fail.reason is FailReason.SOURCE_RELEASED
    out = pair.to_consumers(answer)
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.SOURCE_RELEASED


# ------------------------------------------------------------ 3. the lease


def test_no_stashed_registration_is_written_after_the_lease_ended():
    pair = Pair(pcfg=ProducerConfig(lease_s=10.0))
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    (_w0,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    assert p.receive(reg(1, blocks=(4, 5, 6)), 1.0) == []  # stashed behind attempt 0
    # The lease ends while attempt 0 is still being written: the stash is
    # answered then, not left to be written later.
    out = p.handle_timer(10.0)
    assert [(f.attempt, f.reason) for f in msgs(out, Fail)] == [(1, FailReason.LEASE_EXPIRED)]
    out = p.write_completed("t", 0, D0, True, 20.0)
    assert not of(out, IssueWrite), "a write started after the lease ended"
    assert of(out, ReleaseSource)


# ---------------------------------------------------- 4. known answers


def test_preempt_reissue_twice_against_a_released_source_fails_promptly():
    pair = Pair(pcfg=ProducerConfig(lease_s=10.0))
    (p,), (c,) = pair.p, pair.c
    assert of(p.prefill_finished("t", [7, 8, 9], 40, 0.0), ReleaseSource) == []
    assert of(p.handle_timer(10.0), ReleaseSource)  # nobody registered: the lease ends
    pair.now = 11.0
    sent = c.register("t", "P", [1, 2, 3], 40, 11.0)
    sent += c.preempt("t", 11.0)
    sent += c.reissue("t", [4, 5, 6], 11.0)
    sent += c.preempt("t", 11.0)
    sent += c.reissue("t", [7, 8, 9], 11.0)
    assert c.attempt_of("t") == 2
    answers = pair.to_producers(sent)
    out = pair.to_consumers(answers)
    (failed,) = of(out, TransferFailed)
    assert failed.attempt == 2 and failed.code is FailReason.SOURCE_RELEASED
    assert c.num_transfers == 0 and c.lent_blocks() == {}


def test_consumer_config_has_the_handshake_timeout():
    assert ConsumerConfig().handshake_timeout_s == 10.0
    assert isinstance(Notify(transfer_id="t", attempt=0, engine_id="P", rank=0).incarnation, int)


# ------------------------------------------------ handshake in the core (rule 8)


def _fresh_consumer(pair, ccfg=None):
    from pushkv.protocol import Consumer

    return Consumer(pair.c[0].info, ccfg or ConsumerConfig())


def test_a_registration_waits_for_the_handshake_then_goes_out():
    pair = Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2})
    c = _fresh_consumer(pair)
    out = c.register("t", "P", [1, 2, 3], 40, 0.0)
    assert out == [Connect(engine_id="P")]
    assert c.state_of("t") is ConsumerState.CONNECTING and c.lent_blocks()
    assert c.register("u", "P", [4, 5, 6], 40, 0.1) == []  # one Connect per engine
    assert c.add_peer(pair.p[0].info, now=0.5) == []  # rank 1 still unknown
    out = c.add_peer(pair.p[1].info, now=0.6)
    sent = msgs(out, Register)
    assert sorted((m.transfer_id, m.rank) for m in sent) == [("t", 0), ("t", 0), ("u", 0),
                                                              ("u", 0)]
    assert c.state_of("t") is ConsumerState.REGISTERED
    assert c.next_deadline() is not None


def test_a_failed_handshake_fails_the_waiting_transfers_with_its_own_reason():
    pair = Pair()
    c = _fresh_consumer(pair)
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.handshake_failed("P", "connection refused", 1.0)
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.HANDSHAKE_FAILED and "connection refused" in failed.reason
    assert of(out, ReleaseDestination) and c.lent_blocks() == {} and c.num_transfers == 0
    # A later registration asks again.
    assert c.register("u", "P", [1, 2, 3], 40, 2.0) == [Connect(engine_id="P")]


def test_the_handshake_times_out_on_a_core_timer():
    pair = Pair()
    c = _fresh_consumer(pair, ConsumerConfig(handshake_timeout_s=3.0))
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    assert c.next_deadline() == 3.0
    out = c.handle_timer(3.0)
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.HANDSHAKE_FAILED and "timed out" in failed.reason
    assert c.num_transfers == 0 and c.next_deadline() is None


def test_preempt_reissue_and_abort_while_waiting_for_the_handshake():
    pair = Pair()
    c = _fresh_consumer(pair)
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.preempt("t", 0.1)
    assert of(out, ReleaseDestination) and c.state_of("t") is ConsumerState.PREEMPTED
    assert c.reissue("t", [4, 5, 6], 0.2) == []  # the Connect already went out
    assert c.state_of("t") is ConsumerState.CONNECTING and c.attempt_of("t") == 1
    (reg1,) = msgs(c.add_peer(pair.p[0].info, now=0.3), Register)
    assert reg1.attempt == 1 and reg1.block_ids == (4, 5, 6)
    c.register("u", "Q", [7, 8], 20, 0.4)
    out = c.abort("u", 0.5)
    assert of(out, TransferCancelled) and of(out, ReleaseDestination)
    assert c.state_of("u") is None


def test_ranks_that_write_nothing_are_told_even_after_a_preempted_handshake_wait():
    pair = Pair(producer={"tp": 2, "num_kv_heads": 1}, consumer={"num_kv_heads": 1})
    c = _fresh_consumer(pair)
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    c.preempt("t", 0.1)
    c.reissue("t", [4, 5, 6], 0.2)  # attempt 1, still waiting for the handshake
    out = c.add_peer(pair.p[0].info, now=0.3)  # the writer: the registration goes out
    assert [(m.attempt, m.rank) for m in msgs(out, Register)] == [(1, 0)]
    out = c.add_peer(pair.p[1].info, now=0.3)  # the rank that writes nothing: told now
    (skip,) = msgs(out, Skip)
    assert skip.transfer_id == "t"
    assert [a.peer.rank for a in out if isinstance(a.message, Skip)] == [1]


# ------------------------------------------- fences answered, never waited out


def test_an_overtaken_cancel_of_an_older_attempt_is_still_acknowledged():
    """Register a1 overtakes Cancel a0 and Register a0: the old attempt will never
    be written, so its cancel is acknowledged and its zombie released at once."""
    pair = Pair()
    (c,) = pair.c
    reg0 = c.register("t", "P", [1, 2, 3], 40, 0.0)
    cancel0 = c.preempt("t", 0.0)
    reg1 = c.reissue("t", [4, 5, 6], 0.0)
    answers = pair.to_producers(reg1) + pair.to_producers(cancel0) + pair.to_producers(reg0)
    assert [m.attempt for m in msgs(answers, CancelAck)] == [0]
    out = pair.to_consumers(answers)
    assert [r.attempt for r in of(out, ReleaseDestination)] == [0]
    assert c.lent_blocks() == {4: ("t", 0), 5: ("t", 0), 6: ("t", 0)}


def test_a_newer_cancel_also_fences_the_older_registration_it_drops():
    """Cancel a1 (final) reaches a leg still holding Register a0: both are
    acknowledged, so the consumer's zombie a0 is not left to the hard deadline."""
    pair = Pair()
    (c,) = pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0))
    late = c.preempt("t", 0.0) + c.reissue("t", [4, 5, 6], 0.0)
    answers = pair.to_producers(c.abort("t", 0.0))
    assert sorted(m.attempt for m in msgs(answers, CancelAck)) == [0, 1]
    out = pair.to_consumers(answers)
    assert of(out, TransferCancelled) and c.lent_blocks() == {} and c.num_transfers == 0
    pair.to_consumers(pair.to_producers(late))  # the overtaken messages change nothing
    assert c.lent_blocks() == {}


def test_a_final_cancel_after_a_preempt_of_the_same_attempt_releases_the_source():
    """Preempt then abort while the write is in flight: the abort must not be
    taken for a repeat of the preempt, or the source waits for its lease."""
    pair = Pair(pcfg=ProducerConfig(lease_s=30.0))
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0))
    cancels = c.preempt("t", 0.0) + c.abort("t", 0.0)
    writes = p.prefill_finished("t", [7, 8, 9], 40, 0.0)
    pair.to_producers(cancels)
    back, _ = pair.complete(writes)
    assert of(back, ReleaseSource) and p.held_blocks() == {}


def test_a_transfer_ended_while_waiting_for_the_handshake_is_told_once_connected():
    """Aborted while its registration waited for the handshake: when the engine
    becomes usable, the producer is told at once (final Cancel, Skip) instead of
    holding the prefill until its lease."""
    pair = Pair(producer={"tp": 2, "num_kv_heads": 1}, consumer={"num_kv_heads": 1})
    c = _fresh_consumer(pair)
    c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=7)
    c.add_peer(pair.p[1].info, now=0.0)  # the rank that writes nothing
    c.abort("t", 0.1)
    out = c.add_peer(pair.p[0].info, now=0.2)  # the writer: the engine is usable now
    (cancel,) = msgs(out, Cancel)
    assert (cancel.final, cancel.incarnation, cancel.attempt) == (True, 7, 0)
    assert [a.peer.rank for a in out if isinstance(a.message, Skip)] == [1]
    assert c.add_peer(pair.p[0].info, now=0.3) == []  # told once


def test_a_rank_that_writes_nothing_and_handshakes_last_is_still_told():
    """The transfer ended (here: aborted while waiting) before the rank that writes
    nothing finished its handshake: it is told when it does."""
    pair = Pair(producer={"tp": 2, "num_kv_heads": 1}, consumer={"num_kv_heads": 1})
    c = _fresh_consumer(pair)
    c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=7)
    c.abort("t", 0.1)
    assert msgs(c.add_peer(pair.p[0].info, now=0.2), Cancel)  # the writer is told
    out = c.add_peer(pair.p[1].info, now=0.3)  # then the rank that writes nothing
    assert [(a.peer.rank, a.message.incarnation) for a in out
            if isinstance(a.message, Skip)] == [(1, 7)]


# ------------------------------------------- uses of an id are named, never guessed


def test_a_remembered_use_of_an_id_is_refused_with_a_typed_error():
    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0))  # the default use, 0
    with pytest.raises(LocalProtocolError, match="already in use") as err:
        c.register("t", "P", [4, 5, 6], 40, 0.1)
    assert err.value.incarnation == 0
    (w,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    pair.complete([w])
    assert c.state_of("t") is None and not p.held_blocks()  # ended and forgotten here
    # The producer still remembers the use: the same id and incarnation again is
    # refused, not silently released as a duplicate; another incarnation is a new use.
    before = (p.num_transfers, dict(p.stats))
    with pytest.raises(LocalProtocolError, match="already used"):
        p.prefill_finished("t", [7, 8, 9], 40, 1.0)
    assert (p.num_transfers, dict(p.stats)) == before
    assert p.prefill_finished("t", [7, 8, 9], 40, 1.0, incarnation=5) == []


def test_queries_and_completions_name_the_use():
    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=7))
    assert c.state_of("t") is None  # the default use (0) is not this one
    assert c.state_of("t", incarnation=7) is ConsumerState.REGISTERED
    assert c.attempt_of("t", incarnation=7) == 0 and c.live_use("t") == 7
    assert c.lent_to(1) == ("t", 7) and c.lent_blocks()[2] == ("t", 7)
    assert of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=7), IssueWrite)
    assert p.held_blocks() == {("t", 7): (7, 8, 9)}
    with pytest.raises(LocalProtocolError):  # the default use has no write in flight
        p.write_completed("t", 0, D0, True, 0.1)
    p.write_completed("t", 0, D0, True, 0.1, incarnation=7)
