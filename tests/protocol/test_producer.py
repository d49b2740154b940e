"""Producer endpoint behaviour, one rule at a time."""

import numpy as np
import pytest

from pushkv.protocol import (
    Cancel,
    CancelAck,
    ConfigError,
    Fail,
    FailReason,
    Heartbeat,
    IssueWrite,
    LocalProtocolError,
    Mode,
    Peer,
    ProducerConfig,
    ProducerState,
    Publish,
    ReadDone,
    Register,
    Rejected,
    ReleaseSource,
    ValidationError,
)

from .helpers import Pair, msgs, of

D0 = Peer("D", 0)


def reg(attempt=0, tid="t", blocks=(1, 2, 3), n=40, rank=0, engine="D", producer="P",
        window_ms=1000):
    return Register(transfer_id=tid, attempt=attempt, engine_id=engine, rank=rank,
                    producer_engine_id=producer, block_ids=blocks, num_tokens=n,
                    window_ms=window_ms)


def cancel(attempt=0, tid="t", final=True, rank=0):
    return Cancel(transfer_id=tid, attempt=attempt, engine_id="D", rank=rank, final=final)


@pytest.fixture
def pair():
    return Pair(pcfg=ProducerConfig(lease_s=10.0))


def test_either_order_issues_the_same_write(pair):
    (p,) = pair.p
    first = p.receive(reg(tid="a"), 0.0) + p.prefill_finished("a", [7, 8, 9], 40, 0.1)
    second = p.prefill_finished("b", [7, 8, 9], 40, 0.0) + p.receive(reg(tid="b"), 0.1)
    (wa,), (wb,) = of(first, IssueWrite), of(second, IssueWrite)
    assert np.array_equal(wa.plan.runs, wb.plan.runs)
    assert wa.notify.attempt == wb.notify.attempt == 0


def test_newer_registration_waits_for_the_write_in_flight(pair):
    (p,) = pair.p
    (_w0,) = of(p.receive(reg(0), 0.0) + p.prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    assert p.receive(reg(1, blocks=(4, 5, 6)), 0.1) == []  # fenced behind attempt 0
    assert p.leg_state("t", D0) is ProducerState.SUPERSEDED
    out = p.write_completed("t", 0, D0, True, 0.2)
    (w1,) = of(out, IssueWrite)
    assert w1.attempt == 1 and not of(out, ReleaseSource)
    out = p.write_completed("t", 1, D0, True, 0.3)
    assert of(out, ReleaseSource)


def test_newer_registration_before_the_write_acks_the_old(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    out = p.receive(reg(1, blocks=(4, 5, 6)), 0.1)
    assert msgs(out, CancelAck)[0].attempt == 0
    (w,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.2), IssueWrite)
    assert w.attempt == 1


def test_stale_and_duplicate_messages_change_nothing(pair):
    (p,) = pair.p
    p.receive(reg(1), 0.0)
    assert p.receive(reg(0), 0.0) == []
    assert p.receive(reg(1), 0.0) == []
    # An older attempt's cancel is acknowledged (it can never be written now),
    # and changes nothing else.
    assert [m.attempt for m in msgs(p.receive(cancel(0), 0.0), CancelAck)] == [0]
    assert p.stats["stale"] == 2 and p.stats["duplicate"] == 1
    assert p.leg_state("t", D0) is ProducerState.REGISTERED


def test_cancel_that_overtakes_its_registration(pair):
    (p,) = pair.p
    out = p.receive(cancel(0), 0.0)
    assert msgs(out, CancelAck)[0].attempt == 0
    assert p.receive(reg(0), 0.1) == []  # the late registration is stale
    out = p.prefill_finished("t", [7, 8, 9], 40, 0.2)
    assert not of(out, IssueWrite) and of(out, ReleaseSource)


def test_cancel_during_write_is_fenced_by_the_completion(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    p.prefill_finished("t", [7, 8, 9], 40, 0.0)
    assert p.receive(cancel(0), 0.1) == []  # no ack: the write's notification is the fence
    assert p.leg_state("t", D0) is ProducerState.CANCELLING
    out = p.write_completed("t", 0, D0, True, 0.2)
    assert of(out, ReleaseSource) and p.num_transfers == 0


def test_preempt_during_write_keeps_the_source_for_a_reissue(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    p.prefill_finished("t", [7, 8, 9], 40, 0.0)
    p.receive(cancel(0, final=False), 0.1)
    out = p.write_completed("t", 0, D0, True, 0.2)
    assert not of(out, ReleaseSource)
    assert p.leg_state("t", D0) is ProducerState.KV_READY
    (w,) = of(p.receive(reg(1, blocks=(4, 5, 6)), 0.3), IssueWrite)
    assert w.attempt == 1


def test_lease_expires_without_heartbeats_and_renews_with_them(pair):
    (p,) = pair.p
    p.prefill_finished("a", [1], 10, 0.0)
    p.prefill_finished("b", [2], 10, 0.0)
    hb = Heartbeat(engine_id="D", rank=0, transfers=(("b", 0, 0),))
    p.receive(hb, 5.0)
    p.receive(hb, 9.0)  # lease of b now 9 + 10 * 2/3
    out = p.handle_timer(10.0)
    assert [a.transfer_id for a in of(out, ReleaseSource)] == ["a"]
    out = p.handle_timer(15.7)
    assert [a.transfer_id for a in of(out, ReleaseSource)] == ["b"]
    assert p.num_transfers == 0 and p.stats["lease_expired"] == 2


def test_registration_window_expires_then_late_kv_is_freed(pair):
    (p,) = pair.p
    p.receive(reg(0, window_ms=500), 0.0)
    assert p.next_deadline() == 0.5
    out = p.handle_timer(0.5)
    assert msgs(out, Fail)[0].reason is FailReason.DEADLINE
    out = p.prefill_finished("t", [7, 8, 9], 40, 100.0)
    assert of(out, ReleaseSource) and not of(out, IssueWrite)


def test_write_is_never_started_after_the_window(pair):
    (p,) = pair.p
    p.receive(reg(0, window_ms=500), 0.0)
    out = p.prefill_finished("t", [7, 8, 9], 40, 0.6)  # timers run first
    assert not of(out, IssueWrite)
    assert msgs(out, Fail)[0].reason is FailReason.DEADLINE


def test_prefill_aborted_fails_the_registration(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    out = p.prefill_aborted("t", 0.1)
    assert msgs(out, Fail)[0].reason is FailReason.PREFILL_ABORTED
    assert p.num_transfers == 0
    assert msgs(p.receive(reg(1), 0.2), Fail)[0].reason is FailReason.PREFILL_ABORTED


def test_write_error_fails_and_releases(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    p.prefill_finished("t", [7, 8, 9], 40, 0.0)
    out = p.write_completed("t", 0, D0, False, 0.1)
    assert msgs(out, Fail)[0].reason is FailReason.WRITE_FAILED
    assert of(out, ReleaseSource)


def test_reissue_after_release_reports_source_released(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    p.prefill_finished("t", [7, 8, 9], 40, 0.0)
    p.write_completed("t", 0, D0, True, 0.1)
    out = p.receive(reg(1, blocks=(4, 5, 6)), 0.2)
    assert msgs(out, Fail)[0].reason is FailReason.SOURCE_RELEASED


def test_registration_asking_more_tokens_than_prefill_fails(pair):
    (p,) = pair.p
    p.receive(reg(0, n=48), 0.0)
    out = p.prefill_finished("t", [7, 8, 9], 40, 0.1)
    (f,) = msgs(out, Fail)
    assert f.reason is FailReason.INVALID and "48 tokens" in f.detail


def test_peer_death_ends_its_legs_and_frees_the_source(pair):
    (p,) = pair.p
    p.receive(reg(0), 0.0)
    p.peer_died("D", 0.1)
    out = p.prefill_finished("t", [7, 8, 9], 40, 0.2)
    assert of(out, ReleaseSource) and not of(out, IssueWrite)


@pytest.mark.parametrize(
    ("msg", "match"),
    [
        (reg(engine="stranger"), "no handshake"),
        (reg(blocks=(1, 2, 64)), "outside the 64 registered blocks"),
        (reg(blocks=(1,)), "cannot hold"),
        (reg(producer="other"), "another engine"),
        (ReadDone(transfer_id="t", attempt=0, engine_id="D", rank=0, producer_engine_id="x"),
         "another engine"),
        (CancelAck(transfer_id="t", attempt=0, engine_id="D", rank=0), "not for a producer"),
    ],
)
def test_bad_registrations_are_rejected_without_state_change(pair, msg, match):
    (p,) = pair.p
    out = p.receive(msg, 0.0)
    (r,) = of(out, Rejected)
    assert isinstance(r.error, ValidationError) and match in str(r.error)
    assert p.num_transfers == 0 and p.pending_registrations == 0


def test_registration_for_a_rank_it_does_not_write_is_rejected():
    pair = Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2})
    out = pair.p[0].receive(reg(rank=1), 0.0)
    assert "does not write into" in str(of(out, Rejected)[0].error)


def test_pending_registrations_are_bounded():
    pair = Pair(pcfg=ProducerConfig(max_pending_registrations=2))
    (p,) = pair.p
    p.receive(reg(tid="a"), 0.0)
    p.receive(reg(tid="b"), 0.0)
    out = p.receive(reg(tid="c"), 0.0)
    assert msgs(out, Fail)[0].reason is FailReason.OVERLOADED
    assert p.num_transfers == 2 and p.pending_registrations == 2
    out = p.receive(cancel(tid="d"), 0.0)  # an early cancel is bounded too
    assert msgs(out, CancelAck) and p.num_transfers == 2


def test_local_misuse_raises_and_changes_nothing(pair):
    (p,) = pair.p
    p.prefill_finished("t", [1, 2, 3], 40, 0.0)
    held = p.held_blocks()
    with pytest.raises(LocalProtocolError, match="already reported"):
        p.prefill_finished("t", [1, 2, 3], 40, 0.0)
    with pytest.raises(ConfigError, match="outside"):
        p.prefill_finished("u", [64], 10, 0.0)
    with pytest.raises(ConfigError, match="cannot hold"):
        p.prefill_finished("u", [1], 17, 0.0)
    with pytest.raises(LocalProtocolError, match="not in flight"):
        p.write_completed("t", 0, D0, True, 0.0)
    assert p.held_blocks() == held and p.num_transfers == 1


def test_pull_publishes_and_releases_after_every_reader():
    pair = Pair(consumer={"tp": 2, "num_kv_heads": 2}, producer={"num_kv_heads": 2})
    (p,) = pair.p
    out = p.prefill_finished("t", [1, 2, 3], 40, 0.0, mode=Mode.PULL)
    assert of(out, Publish)[0].block_ids == (1, 2, 3)
    done = [ReadDone(transfer_id="t", attempt=0, engine_id="D", rank=r, producer_engine_id="P")
            for r in (0, 1)]
    assert not of(p.receive(done[0], 0.1), ReleaseSource)
    assert p.receive(done[0], 0.1) == []  # duplicate
    assert of(p.receive(done[1], 0.2), ReleaseSource)


def test_a_peer_cannot_change_its_memory_under_the_same_name(pair):
    from pushkv.protocol import Hello, uniform_ranks

    (p,) = pair.p
    other = uniform_ranks("D", num_blocks=128)[0]
    out = p.receive(Hello(info=other), 0.0)
    assert "changed its layout" in str(of(out, Rejected)[0].error)
    p.receive(Hello(info=pair.c[0].info), 0.0)  # the same announcement again is fine
    assert p.stats["rejected"] == 1


def test_lease_expiring_during_a_write_neither_spins_nor_leaks():
    """A lease timer re-armed in the past while a write was in flight once made
    handle_timer loop forever (found by a stateful run that never ended)."""
    from .helpers import deadline

    pair = Pair(producer={"num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=10.0))
    (p,) = pair.p
    p.receive(reg(0), 0.0)  # only consumer rank 0 registers; rank 1 never does
    (_w,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    with deadline(5):
        assert p.handle_timer(11.0) == []  # lease passed mid-write: nothing to do yet
        out = p.write_completed("t", 0, D0, True, 12.0)
        assert of(out, ReleaseSource)
        p.handle_timer(100.0)
    assert p.num_transfers == 0
