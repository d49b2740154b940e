"""Consumer endpoint behaviour: counting, fences, deadlines, misuse."""

import pytest

from pushkv.protocol import (
    Cancel,
    CancelAck,
    ConfigError,
    Connect,
    ConsumerConfig,
    ConsumerState,
    Fail,
    FailReason,
    FailurePolicy,
    Heartbeat,
    IssueRead,
    LocalProtocolError,
    Notify,
    Peer,
    ReadDone,
    Register,
    Rejected,
    ReleaseDestination,
    TransferCancelled,
    TransferFailed,
    TransferReady,
)

from .helpers import Pair, msgs, of

CS = ConsumerState


def note(rank, attempt=0, tid="t"):
    return Notify(transfer_id=tid, attempt=attempt, engine_id="P", rank=rank)


def ack(rank, attempt=0, tid="t"):
    return CancelAck(transfer_id=tid, attempt=attempt, engine_id="P", rank=rank)


def fail(rank, attempt=0, tid="t", reason=FailReason.WRITE_FAILED):
    return Fail(transfer_id=tid, attempt=attempt, engine_id="P", rank=rank, reason=reason)


@pytest.fixture
def two_writers():
    """Producer TP 2 into consumer TP 1: two notifications per transfer."""
    pair = Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                ccfg=ConsumerConfig(window_s=10, fence_grace_s=5, heartbeat_s=1,
                                    policy=FailurePolicy.RECOMPUTE))
    return pair, pair.c[0]


def test_ready_only_after_every_expected_writer(two_writers):
    _, c = two_writers
    out = c.register("t", "P", [1, 2, 3], 40, 0.0)
    assert [a.peer.rank for a in out] == [0, 1] and len(msgs(out, Register)) == 2
    assert c.receive(note(0), 0.1) == []
    assert c.receive(note(0), 0.1) == []  # duplicates never count
    assert c.receive(note(0, attempt=5), 0.1) == []  # nor other attempts
    assert c.stats["duplicate"] == 1 and c.stats["stale"] == 1
    assert c.state_of("t") is CS.REGISTERED
    out = c.receive(note(1), 0.2)
    assert of(out, TransferReady) == [TransferReady(transfer_id="t", attempt=0)]
    assert c.num_transfers == 0 and c.lent_blocks() == {}


def test_unexpected_writer_is_rejected():
    pair = Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2})
    c = pair.c[0]
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.receive(note(1), 0.1)  # rank 1 writes into consumer rank 1 only
    assert "not an expected writer" in str(of(out, Rejected)[0].error)
    assert c.state_of("t") is CS.REGISTERED


def test_fail_cancels_the_rest_and_waits_for_their_fence(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.receive(fail(0), 0.1)
    (cn,) = msgs(out, Cancel)
    assert out[0].peer == Peer("P", 1) and cn.final
    assert not of(out, ReleaseDestination)  # rank 1 may still be writing
    out = c.receive(ack(1), 0.2)
    (f,) = of(out, TransferFailed)
    assert f.policy is FailurePolicy.RECOMPUTE and "WRITE_FAILED" in f.reason
    assert f.code is FailReason.WRITE_FAILED
    assert of(out, ReleaseDestination)[0].block_ids == (1, 2, 3)


def test_a_finished_write_is_a_fence(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    c.receive(note(1), 0.1)
    out = c.receive(fail(0), 0.2)
    assert not msgs(out, Cancel) and of(out, TransferFailed)


def test_deadline_then_hard_deadline_releases_without_fence(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.handle_timer(10.0)
    assert len(msgs(out, Cancel)) == 2 and c.state_of("t") is CS.FAILING
    assert not of(c.handle_timer(14.9), ReleaseDestination)
    out = c.handle_timer(15.0)
    assert of(out, ReleaseDestination) and of(out, TransferFailed)
    assert of(out, TransferFailed)[0].code is FailReason.DEADLINE
    assert c.stats["forced_release"] == 1 and c.num_transfers == 0


def test_abort_fences_then_cancels(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.abort("t", 0.1)
    assert all(m.final for m in msgs(out, Cancel))
    c.receive(ack(0), 0.2)
    out = c.receive(ack(1), 0.3)
    assert of(out, TransferCancelled) and of(out, ReleaseDestination)


def test_preempt_release_and_reissue(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.preempt("t", 0.1)
    assert not any(m.final for m in msgs(out, Cancel))
    c.receive(ack(0), 0.2)
    out = c.receive(ack(1), 0.2)
    assert of(out, ReleaseDestination) and c.state_of("t") is CS.PREEMPTED
    out = c.reissue("t", [1, 2, 3], 0.3)  # the released blocks may be reused
    assert {m.attempt for m in msgs(out, Register)} == {1}


def test_reissue_before_the_fence_keeps_old_blocks_lent(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    c.preempt("t", 0.1)
    with pytest.raises(LocalProtocolError, match="may still be written"):
        c.reissue("t", [3, 4, 5], 0.2)
    c.reissue("t", [4, 5, 6], 0.2)
    assert set(c.lent_blocks()) == {1, 2, 3, 4, 5, 6}
    assert c.receive(note(0, attempt=0), 0.3) == []  # a zombie fence, not a count
    out = c.receive(ack(1, attempt=0), 0.3)
    assert of(out, ReleaseDestination)[0].attempt == 0
    assert set(c.lent_blocks()) == {4, 5, 6}
    c.receive(note(0, attempt=1), 0.4)
    assert of(c.receive(note(1, attempt=1), 0.4), TransferReady)


def test_unsolicited_cancel_ack_is_rejected(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    out = c.receive(ack(0), 0.1)
    assert "not cancelled" in str(of(out, Rejected)[0].error)
    assert c.state_of("t") is CS.REGISTERED


def test_heartbeats_list_live_transfers(two_writers):
    _, c = two_writers
    c.register("a", "P", [1], 10, 0.0)
    c.register("b", "P", [2], 10, 0.0)
    assert c.next_deadline() == 1.0
    out = c.handle_timer(1.0)
    beats = msgs(out, Heartbeat)
    assert {b.rank for b in beats} == {0}  # sent from this rank...
    assert len(beats) == 2  # ...to both producer ranks
    assert beats[0].transfers == (("a", 0, 0), ("b", 0, 0))


def test_producer_death_fails_the_transfer(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    assert c.knows("P")
    out = c.peer_died("P", 0.5)
    # Its posted writes may still land stray bytes: the fence grace first (rule 7).
    assert not of(out, ReleaseDestination) and not c.knows("P")
    out = c.handle_timer(0.5 + c.config.fence_grace_s)
    assert of(out, TransferFailed) and of(out, ReleaseDestination)
    assert of(out, TransferFailed)[0].code is FailReason.PEER_DIED
    # A later registration waits for a new handshake instead of failing.
    assert c.register("u", "P", [4], 10, 1.0) == [Connect(engine_id="P")]


def test_local_misuse_raises_and_changes_nothing(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    lent = c.lent_blocks()
    cases = [
        (lambda: c.register("t", "P", [7], 10, 0.0), LocalProtocolError, "already"),
        (lambda: c.start_pull("u", "nobody", [1], [7], 10, 0.0), LocalProtocolError,
         "handshake"),
        (lambda: c.register("u", "P", [64], 10, 0.0), ConfigError, "outside"),
        (lambda: c.register("u", "P", [7, 7], 20, 0.0), ConfigError, "twice"),
        (lambda: c.register("u", "P", [7], 17, 0.0), ConfigError, "cannot hold"),
        (lambda: c.register("u", "P", [2], 10, 0.0), LocalProtocolError, "still be written"),
        (lambda: c.reissue("t", [8], 0.0), LocalProtocolError, "preempted"),
        (lambda: c.abort("nope", 0.0), LocalProtocolError, "unknown"),
        (lambda: c.read_completed("t", 0, Peer("P", 0), True, 0.0), LocalProtocolError,
         "reads nothing"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert c.lent_blocks() == lent and c.state_of("t") is CS.REGISTERED


def test_pull_reads_then_reports_to_every_producer(two_writers):
    _, c = two_writers
    out = c.start_pull("t", "P", [9, 10, 11], [1, 2, 3], 40, 0.0)
    reads = of(out, IssueRead)
    assert [r.peer.rank for r in reads] == [0, 1]
    assert reads[0].plan.nbytes > 0
    c.read_completed("t", 0, Peer("P", 0), True, 0.1)
    out = c.read_completed("t", 0, Peer("P", 1), True, 0.2)
    assert of(out, TransferReady)
    assert {m.rank for m in msgs(out, ReadDone)} == {0}
    assert len(msgs(out, ReadDone)) == 2


def test_pull_read_failure_waits_for_the_other_read(two_writers):
    _, c = two_writers
    c.start_pull("t", "P", [9, 10, 11], [1, 2, 3], 40, 0.0)
    out = c.read_completed("t", 0, Peer("P", 0), False, 0.1)
    assert not of(out, TransferFailed)  # our other read may still land
    out = c.read_completed("t", 0, Peer("P", 1), True, 0.2)
    assert not of(out, ReleaseDestination), "the failed read may still write the blocks"
    out = c.handle_timer(0.1 + c.config.fence_grace_s)  # rule 7: until its grace passed
    assert of(out, TransferFailed) and of(out, ReleaseDestination)
    assert all(m.final for m in msgs(out, Cancel))  # producers may drop the source


def test_producer_death_while_preempted_fails_the_request(two_writers):
    _, c = two_writers
    c.register("t", "P", [1, 2, 3], 40, 0.0)
    c.preempt("t", 0.1)
    c.receive(ack(0), 0.2)
    c.receive(ack(1), 0.2)
    out = c.peer_died("P", 0.5)
    (f,) = of(out, TransferFailed)
    assert "died" in f.reason and not of(out, ReleaseDestination)  # released before
    assert c.num_transfers == 0


def test_pull_reads_in_flight_are_not_fenced_by_the_producer_death(two_writers):
    """Found by the stateful test: a dead producer does not stop our own READ from
    writing into our memory; only its completion does."""
    _, c = two_writers
    c.start_pull("t", "P", [9, 10, 11], [1, 2, 3], 40, 0.0)
    c.abort("t", 0.1)
    out = c.peer_died("P", 0.2)
    assert not of(out, ReleaseDestination) and c.lent_blocks()
    c.read_completed("t", 0, Peer("P", 0), False, 0.3)
    out = c.read_completed("t", 0, Peer("P", 1), False, 0.3)
    assert not of(out, ReleaseDestination), "failed reads may still write the blocks"
    out = c.handle_timer(0.3 + c.config.fence_grace_s)  # rule 7: until their grace passed
    assert of(out, ReleaseDestination) and of(out, TransferCancelled)
    assert not c.lent_blocks()


def test_a_read_outliving_the_hard_deadline_is_counted_not_raised(two_writers):
    _, c = two_writers
    c.start_pull("t", "P", [9, 10, 11], [1, 2, 3], 40, 0.0)
    c.handle_timer(10.0)  # window: fail, wait for our reads
    out = c.handle_timer(15.0)  # window + grace: released without a fence
    assert of(out, TransferFailed) and c.num_transfers == 0
    assert c.read_completed("t", 0, Peer("P", 0), True, 16.0) == []
    assert c.stats["late_read"] == 1 and c.stats["forced_release"] == 1


def test_a_shared_cached_prefix_is_never_lent(two_writers):
    """Two requests sharing a locally cached prefix block register concurrently:
    only the blocks a transfer writes are lent (found with vLLM's prefix cache)."""
    _, c = two_writers
    lo = c.info.layout
    c.register("a", "P", [7, 1, 2], 3 * lo.block_size, 0.0, first_token=lo.block_size)
    c.register("b", "P", [7, 3, 4], 3 * lo.block_size, 0.0, first_token=lo.block_size)
    assert set(c.lent_blocks()) == {1, 2, 3, 4}
    with pytest.raises(LocalProtocolError, match="still be written"):
        c.register("x", "P", [7, 2], 2 * lo.block_size, 0.0, first_token=lo.block_size)


def test_a_pull_that_cannot_be_planned_changes_nothing():
    pair = Pair(producer={"order": "BLOCK"}, consumer={"order": "BLOCK"})
    c = pair.c[0]
    with pytest.raises(LocalProtocolError, match="block boundary"):
        c.start_pull("t", "P", [9, 10], [1, 2], 20, 0.0, first_token=3)
    assert c.num_transfers == 0 and c.lent_blocks() == {}
