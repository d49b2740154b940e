"""The contract under NIXL's stated semantics: a producer's local completion
proves nothing at the destination, a CancelAck or Fail may overtake a write's
bytes, and a failed write may land any part of itself.

Each test is a race found under those semantics, driven through the public
endpoint API with messages routed by hand: a write "completes" on the producer
while its notification (and so, possibly, its bytes) is still on the wire.
Before the fix each one released destination blocks that a write could still
land in.
"""

from pushkv.protocol import (
    CancelAck,
    ConsumerConfig,
    ConsumerState,
    Fail,
    IssueRead,
    IssueWrite,
    Notify,
    Peer,
    ReleaseDestination,
    SendMessage,
    TransferReady,
)

from .helpers import Pair, msgs, of

D0, P0 = Peer("D", 0), Peer("P", 0)
L = 4


def _released(actions):
    return [b for a in of(actions, ReleaseDestination) for b in a.block_ids]


def _write_completed_unseen(pair, *, inc=1):
    """Register t, finish prefill, and let the write complete on the producer only:
    its notification (and bytes) are still on the wire. Returns the IssueWrite."""
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=inc))
    (w,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=inc), IssueWrite)
    p.write_completed("t", 0, D0, True, 0.0, incarnation=inc)
    return w


def test_a_cancel_after_the_write_completed_waits_for_its_notification():
    pair = Pair()
    (c,) = pair.c
    w = _write_completed_unseen(pair)
    answers = pair.to_producers(c.abort("t", 0.1))
    (ack,) = msgs(answers, CancelAck)
    assert (ack.posted, ack.failed) == (1, 0), "the ack must count the write it posted"
    out = pair.to_consumers(answers)
    assert not _released(out), "blocks released while the write may still land"
    out = c.receive(w.notify, 0.2)  # the bytes are there: the notification says so
    assert _released(out) == [1, 2, 3]
    assert c.state_of("t", incarnation=1) is None and c.stats["cancelled"] == 1


def test_a_preempt_after_the_write_completed_waits_for_its_notification():
    pair = Pair()
    (c,) = pair.c
    w = _write_completed_unseen(pair)
    answers = pair.to_producers(c.preempt("t", 0.1))
    assert not _released(pair.to_consumers(answers))
    assert c.state_of("t", incarnation=1) is ConsumerState.PREEMPTING
    assert _released(c.receive(w.notify, 0.2)) == [1, 2, 3]
    assert c.state_of("t", incarnation=1) is ConsumerState.PREEMPTED


def test_a_duplicate_cancel_answered_after_the_ack_counts_the_write_too():
    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=1))
    (w,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=1), IssueWrite)
    cancel = c.abort("t", 0.1)
    assert pair.to_producers(cancel) == []  # the write is in flight: its end answers
    # Its completion is its fence: the consumer waits for the notification.
    assert not msgs(p.write_completed("t", 0, D0, True, 0.2, incarnation=1), CancelAck)
    (again,) = msgs(pair.to_producers(cancel), CancelAck)  # the network repeated it
    assert again.posted == 1
    # The repeat's answer overtakes the notification.
    assert not _released(c.receive(again, 0.3))
    assert _released(c.receive(w.notify, 0.4)) == [1, 2, 3]


def test_a_stale_cancel_of_an_older_attempt_after_a_reissue_counts_its_write():
    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=1))
    (w0,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=1), IssueWrite)
    preempt = c.preempt("t", 0.1)  # attempt 0 is written meanwhile
    c.reissue("t", [4, 5, 6], 0.2)  # attempt 0 becomes a zombie: its blocks stay lent
    p.write_completed("t", 0, D0, True, 0.2, incarnation=1)
    (ack,) = msgs(pair.to_producers(preempt), CancelAck)  # reaches the finished leg
    assert (ack.attempt, ack.posted) == (0, 1)
    assert not _released(c.receive(ack, 0.3)), "the zombie's write may still land"
    assert c.lent_to(1) == ("t", 1)
    assert _released(c.receive(w0.notify, 0.4)) == [1, 2, 3]


def test_progressive_parts_are_all_counted_by_a_late_cancel():
    pair = Pair(producer={"num_layers": L}, consumer={"num_layers": L})
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=1))
    (w0,) = of(p.range_ready("t", [7, 8, 9], (0, 40), 0.0, layers=(0, 2), incarnation=1),
               IssueWrite)
    p.write_completed("t", 0, D0, True, 0.0, incarnation=1)
    (w1,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=1), IssueWrite)
    p.write_completed("t", 0, D0, True, 0.0, incarnation=1)
    (ack,) = msgs(pair.to_producers(c.abort("t", 0.1)), CancelAck)
    assert ack.posted == 2
    assert not _released(c.receive(ack, 0.1) + c.receive(w1.notify, 0.2))
    assert _released(c.receive(w0.notify, 0.3)) == [1, 2, 3]


def test_a_failed_write_fences_only_after_the_grace():
    grace = 7.0
    pair = Pair(ccfg=ConsumerConfig(fence_grace_s=grace))
    (p,), (c,) = pair.p, pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=1))
    of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, incarnation=1), IssueWrite)
    (fail,) = msgs(p.write_completed("t", 0, D0, False, 1.0, incarnation=1), Fail)
    assert (fail.posted, fail.failed) == (1, 1)
    out = c.receive(fail, 1.0)
    assert not _released(out), "a failed write may still land stray bytes"
    assert c.in_grace
    assert not _released(c.handle_timer(1.0 + grace - 0.5))
    out = c.handle_timer(1.0 + grace)
    assert _released(out) == [1, 2, 3] and not c.in_grace
    assert c.stats["failed"] == 1


def test_a_dead_producer_fences_after_the_grace_not_at_once():
    grace = 5.0
    pair = Pair(ccfg=ConsumerConfig(fence_grace_s=grace))
    (c,) = pair.c
    _write_completed_unseen(pair)
    assert not _released(c.peer_died("P", 2.0)), "its posted write may still land"
    assert _released(c.handle_timer(2.0 + grace)) == [1, 2, 3]


# ------------------------------------------------- older incarnations, found


def _pull_zombie_then_new_use(pair):
    """Incarnation 1 pulls; its attempt 0 is preempted with the read in flight and
    reissued (a zombie), then READY; incarnation 2 of the id comes and ends."""
    (c,) = pair.c
    c.start_pull("t", "P", [7, 8, 9], [1, 2, 3], 40, 0.0, incarnation=1)
    c.preempt("t", 0.1)  # the read of attempt 0 is in flight: a zombie after the reissue
    assert of(c.reissue("t", [4, 5, 6], 0.2), IssueRead)
    out = c.read_completed("t", 1, P0, True, 0.3, incarnation=1)
    assert of(out, TransferReady)
    c.start_pull("t", "P", [7, 8, 9], [10, 11, 12], 40, 0.4, incarnation=2)
    out = c.read_completed("t", 0, P0, True, 0.5, incarnation=2)
    assert of(out, TransferReady)
    assert c.live_use("t") is None  # the newer use ended and was forgotten
    return c


def test_an_older_incarnations_late_read_still_fences_its_zombie():
    c = _pull_zombie_then_new_use(Pair())
    assert c.blocks_of("t", 0, incarnation=1) == (1, 2, 3)
    out = c.read_completed("t", 0, P0, True, 0.6, incarnation=1)
    assert _released(out) == [1, 2, 3], "the zombie's blocks stayed lent"
    assert c.stats["late_read"] == 0 and c.num_transfers == 0


def test_abandoning_one_incarnation_while_another_is_live():
    pair = Pair()
    (c,) = pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=1))
    out = c.abandon("t", "P", 0.1, incarnation=2)
    cancels = [a.message for a in out if isinstance(a, SendMessage)]
    assert [(m.incarnation, m.final) for m in cancels] == [(2, True)]
    assert c.state_of("t", incarnation=1) is ConsumerState.REGISTERED  # live, untouched


def test_notify_and_cancel_ack_name_their_counts_apart():
    assert "part" in Notify.__struct_fields__ and "posted" not in Notify.__struct_fields__
    for m in (CancelAck, Fail):
        assert {"posted", "failed"} <= set(m.__struct_fields__)
        assert "parts" not in m.__struct_fields__


# ------------------------------------------------ pull: a read takes its bytes late


def test_a_prefill_abort_keeps_a_published_pull_source_until_it_is_read():
    """A READ takes the source's bytes any time until it completes: the producer's
    engine aborting the request must not free blocks a reader may be reading."""
    from pushkv.protocol import Mode, ReadDone, ReleaseSource

    pair = Pair()
    (p,), (c,) = pair.p, pair.c
    p.prefill_finished("t", [7, 8, 9], 40, 0.0, Mode.PULL, incarnation=1)
    assert not of(p.prefill_aborted("t", 0.1, incarnation=1), ReleaseSource)
    assert of(c.start_pull("t", "P", [7, 8, 9], [1, 2, 3], 40, 0.2, incarnation=1,
                           lease_s=10.0), IssueRead)
    out = c.read_completed("t", 0, P0, True, 0.3, incarnation=1)
    assert of(out, TransferReady)
    (done,) = msgs(out, ReadDone)
    assert of(p.receive(done, 0.4), ReleaseSource) == [
        ReleaseSource(transfer_id="t", block_ids=(7, 8, 9), incarnation=1)]


def test_an_aborted_pull_source_nobody_reads_is_released_at_its_lease():
    from pushkv.protocol import Mode, ProducerConfig, ReleaseSource

    pair = Pair(pcfg=ProducerConfig(lease_s=10.0))
    (p,) = pair.p
    p.prefill_finished("t", [7, 8, 9], 40, 0.0, Mode.PULL, incarnation=1)
    assert not of(p.prefill_aborted("t", 0.1, incarnation=1), ReleaseSource)
    assert of(p.handle_timer(10.0), ReleaseSource)


def test_a_read_that_completes_after_the_sources_lease_fails_closed():
    from pushkv.protocol import FailReason, TransferFailed

    pair = Pair()
    (c,) = pair.c
    assert of(c.start_pull("t", "P", [7, 8, 9], [1, 2, 3], 40, 0.0, incarnation=1,
                           lease_s=10.0), IssueRead)
    out = c.read_completed("t", 0, P0, True, 10.5, incarnation=1)
    assert not of(out, TransferReady), "the source may have been freed under the read"
    (f,) = of(out, TransferFailed)
    assert f.code is FailReason.LEASE_EXPIRED and "lease" in f.reason
    assert _released(out) == [1, 2, 3] and c.num_transfers == 0


def test_a_pull_whose_source_lease_already_ended_reads_nothing():
    from pushkv.protocol import FailReason, TransferFailed

    pair = Pair()
    (c,) = pair.c
    out = c.start_pull("t", "P", [7, 8, 9], [1, 2, 3], 40, 5.0, incarnation=1, lease_s=0.0)
    assert not of(out, IssueRead)
    (f,) = of(out, TransferFailed)
    assert f.code is FailReason.LEASE_EXPIRED
    assert c.lent_blocks() == {} and c.num_transfers == 0
    assert _released(out) == [1, 2, 3], "its blocks come back as from any other failure"
    from pushkv.protocol import Cancel  # the producer is told to drop the source now

    assert [(m.incarnation, m.final) for m in msgs(out, Cancel)] == [(1, True)]


# ------------------------------------------- pull, found by the checker's pull world


def test_a_reissued_read_completing_as_the_lease_ends_fails_closed():
    """Found by the checker (``pull`` with two attempts): the producer frees the source
    the moment its lease ends, so a read of a reissued attempt completing at that very
    moment may have copied freed blocks. Before the fix it was READY."""
    from pushkv.protocol import (
        FailReason,
        Mode,
        ProducerConfig,
        Publish,
        ReleaseSource,
        TransferFailed,
    )

    pair = Pair(pcfg=ProducerConfig(lease_s=6.0))
    (p,), (c,) = pair.p, pair.c
    (pub,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0, Mode.PULL, incarnation=1),
                Publish)
    assert of(c.start_pull("t", "P", [7, 8, 9], [1, 2, 3], 40, 0.0, incarnation=1,
                           lease_s=pub.lease_s), IssueRead)
    c.preempt("t", 0.0)
    c.read_completed("t", 0, P0, True, 0.0, incarnation=1)  # the zombie's read lands
    assert of(p.handle_timer(6.0), ReleaseSource)  # the lease ended: the source is freed
    assert of(c.reissue("t", [4, 5, 6], 6.0), IssueRead)
    out = c.read_completed("t", 1, P0, True, 6.0, incarnation=1)
    assert not of(out, TransferReady), "the source was freed as the read completed"
    (f,) = of(out, TransferFailed)
    assert f.code is FailReason.LEASE_EXPIRED


def test_a_failed_read_holds_its_blocks_for_the_fence_grace():
    """Nothing NIXL or UCX states says a failed READ stopped writing its local
    buffer, so (rule 7, the weaker assumption) its stray bytes may land until the
    fence grace. Before the fix the blocks were released at once."""
    grace = 5.0
    pair = Pair(ccfg=ConsumerConfig(fence_grace_s=grace))
    (c,) = pair.c
    assert of(c.start_pull("t", "P", [7, 8, 9], [1, 2, 3], 40, 0.0, incarnation=1),
              IssueRead)
    out = c.read_completed("t", 0, P0, False, 1.0, incarnation=1)
    assert not _released(out) and c.in_grace
    assert not _released(c.handle_timer(1.0 + grace - 0.5))
    assert _released(c.handle_timer(1.0 + grace)) == [1, 2, 3]


def test_a_producer_death_while_preempting_fails_the_transfer():
    """Found by the checker (two attempts, a producer death): the producer died while
    the consumer fenced a preempted attempt; its source died with it, so no reissue
    can be written. Before the fix the transfer waited in PREEMPTED for a reissue
    that could only fail, heartbeating a dead engine."""
    from pushkv.protocol import TransferFailed

    grace = 3.0
    pair = Pair(ccfg=ConsumerConfig(fence_grace_s=grace))
    (c,) = pair.c
    pair.to_producers(c.register("t", "P", [1, 2, 3], 40, 0.0, incarnation=1))
    c.preempt("t", 0.1)
    assert not c.peer_died("P", 0.2)  # what it posted may still land: the grace
    assert c.state_of("t", incarnation=1) is ConsumerState.FAILING
    out = c.handle_timer(0.2 + grace)
    assert _released(out) == [1, 2, 3] and of(out, TransferFailed)
    assert c.num_transfers == 0
