"""Rule 11 at the endpoints: a landing that failed its digest check fails the
transfer with CORRUPT, is fenced like the notification it is, and is never
READY; the write's scope is what a digest is taken over."""

from __future__ import annotations

from pushkv.protocol import (
    ConsumerState,
    FailReason,
    IssueRead,
    IssueWrite,
    Mode,
    Peer,
    Publish,
    ReleaseDestination,
    ReleaseSource,
    SendMessage,
    TransferFailed,
    TransferReady,
)
from pushkv.protocol.events import WriteScope
from pushkv.protocol.messages import Cancel, CancelAck, ReadDone

from .helpers import Pair, msgs, of


def _registered(pair, blocks=(4, 5, 6), n=40):
    acts = pair.c[0].register("t", "P", list(blocks), n, pair.now)
    return pair.to_producers(acts)


def test_a_corrupt_notification_fails_the_transfer_and_releases_at_once():
    pair = Pair()
    _registered(pair)
    writes = pair.p[0].prefill_finished("t", [9, 3, 17], 40, pair.now)
    (w,) = of(writes, IssueWrite)
    assert w.scope == WriteScope((9, 3, 17), 0, 40, range(0, 2), ((0, 0, 1),))
    assert pair.c[0].landed_scope(w.notify) == WriteScope((4, 5, 6), 0, 40, range(0, 2),
                                                          ((0, 0, 1),))
    pair.p[0].write_completed("t", 0, w.peer, True, pair.now)
    out = pair.c[0].corrupt(w.notify, pair.now, detail="rank 0's write: producer 1, landed 2")
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.CORRUPT and "producer 1, landed 2" in failed.reason
    assert of(out, ReleaseDestination) and not of(out, TransferReady)
    assert pair.c[0].lent_blocks() == {} and pair.c[0].stats["corrupt"] == 1
    # the only writer finished: nothing to cancel, its landing was its fence
    assert not msgs(out, Cancel)


def test_a_corrupt_part_waits_for_the_later_parts_before_the_blocks_go_back():
    """A progressive push's first part fails its check while the rank's count is
    unknown and its second part is on the wire: the rank is cancelled, not fenced;
    the blocks go back only once the second part, which its CancelAck counts, landed."""
    pair = Pair(producer={"num_layers": 4}, consumer={"num_layers": 4})
    _registered(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(p.range_ready("t", [9, 3, 17], (0, 16), pair.now), IssueWrite)
    assert (w0.scope.first_token, w0.scope.num_tokens, w0.notify.parts) == (0, 16, 0)
    assert not of(p.range_ready("t", [9, 3, 17], (16, 32), pair.now), IssueWrite)
    (w1,) = of(p.write_completed("t", 0, w0.peer, True, pair.now), IssueWrite)
    assert (w1.scope.first_token, w1.scope.num_tokens, w1.notify.part) == (16, 32, 1)
    out = c.corrupt(w0.notify, pair.now)
    assert c.state_of("t") is ConsumerState.FAILING and not of(out, ReleaseDestination)
    (cancel,) = msgs(out, Cancel)
    assert cancel.final
    assert not msgs(p.receive(cancel, pair.now), CancelAck)  # part 1 in flight: its fence
    (ack,) = msgs(p.write_completed("t", 0, w1.peer, True, pair.now), CancelAck)
    assert ack.posted == 2
    out = c.receive(ack, pair.now)
    assert not of(out, ReleaseDestination) and set(c.lent_blocks()) == {4, 5, 6}
    out = c.receive(w1.notify, pair.now)  # the last part landed: the fence
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.CORRUPT and of(out, ReleaseDestination)
    assert c.lent_blocks() == {}


def test_two_writers_one_corrupt_the_other_is_cancelled_and_fenced():
    pair = Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2})
    _registered(pair)
    w = [of(p.prefill_finished("t", [9, 3, 17], 40, pair.now), IssueWrite)[0]
         for p in pair.p]
    assert [x.scope.heads for x in w] == [((0, 0, 1),), ((0, 1, 1),)]
    out = pair.c[0].corrupt(w[0].notify, pair.now)
    (cancel,) = msgs(out, Cancel)
    assert cancel.final and not of(out, ReleaseDestination)
    out = pair.c[0].receive(w[1].notify, pair.now)  # the other's write landed: its fence
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.CORRUPT and of(out, ReleaseDestination)
    assert not of(out, TransferReady)


def test_a_corrupt_landing_of_an_older_attempt_only_fences_it():
    pair = Pair()
    _registered(pair)
    p, c = pair.p[0], pair.c[0]
    (w,) = of(p.prefill_finished("t", [9, 3, 17], 40, pair.now), IssueWrite)
    c.preempt("t", pair.now)
    c.reissue("t", [20, 21, 22], pair.now)  # attempt 0 is a zombie until it lands
    assert c.landed_scope(w.notify) is None  # nothing of it can count: nothing to check
    out = c.corrupt(w.notify, pair.now)
    assert of(out, ReleaseDestination) and not of(out, TransferFailed)
    assert c.state_of("t") is ConsumerState.REGISTERED and c.attempt_of("t") == 1
    assert set(c.lent_blocks()) == {20, 21, 22}


# --------------------------------------------------------------------- pull


def _pulled(tp=2):
    pair = Pair(producer={"tp": tp, "num_kv_heads": 2}, consumer={"num_kv_heads": 2})
    for p in pair.p:
        (pub,) = of(p.prefill_finished("t", [9, 3, 17], 40, pair.now, mode=Mode.PULL), Publish)
        lo = p.info.layout
        assert pub.scope == WriteScope((9, 3, 17), 0, 40, range(lo.layer_start, lo.layer_end),
                                       ((0, 0, lo.num_heads),)) and pub.seal == b""
    out = pair.c[0].start_pull("t", "P", [9, 3, 17], [4, 5, 6], 40, pair.now)
    return pair, pair.c[0], of(out, IssueRead)


def test_a_read_names_what_it_lands_with_the_producers_head_numbers():
    _, _, reads = _pulled()
    # P TP2 (one head each) -> D TP1 (two heads): D's head 1 is P rank 1's head 0
    assert [r.scope for r in reads] == [
        WriteScope((4, 5, 6), 0, 40, range(0, 2), ((0, 0, 1),)),
        WriteScope((4, 5, 6), 0, 40, range(0, 2), ((1, 0, 1),))]


def test_a_corrupt_read_fails_the_pull_once_the_other_read_ended():
    pair, c, _ = _pulled()
    out = c.read_completed("t", 0, Peer("P", 0), True, pair.now, corrupt="rank 0's read: bad")
    assert not of(out, TransferFailed) and not of(out, TransferReady)  # rank 1 still reads
    assert c.state_of("t") is ConsumerState.FAILING and set(c.lent_blocks()) == {4, 5, 6}
    out = c.read_completed("t", 0, Peer("P", 1), True, pair.now)  # its landing: the fence
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.CORRUPT and "rank 0's read: bad" in failed.reason
    assert of(out, ReleaseDestination) and not of(out, TransferReady)
    cancels = [a for a in out if isinstance(a, SendMessage) and isinstance(a.message, Cancel)]
    assert {a.peer.rank for a in cancels} == {0, 1} and all(a.message.final for a in cancels)
    assert not msgs(out, ReadDone) and c.lent_blocks() == {} and c.stats["corrupt"] == 1
    # each producer rank drops its source at the final Cancel
    assert all(of(pair.to_producers([a]), ReleaseSource) for a in out
               if isinstance(a, SendMessage) and a.peer.engine_id == "P")


def test_the_last_read_corrupt_releases_at_once():
    pair, c, _ = _pulled(tp=1)
    out = c.read_completed("t", 0, Peer("P", 0), True, pair.now, corrupt="bad")
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.CORRUPT and of(out, ReleaseDestination)
    assert c.lent_blocks() == {}


def test_a_failed_read_ignores_a_corrupt_detail():
    """A read that failed landed nothing known: it is a failure (fenced after the
    grace), whatever the driver says of its bytes."""
    pair, c, _ = _pulled(tp=1)
    out = c.read_completed("t", 0, Peer("P", 0), False, pair.now, corrupt="bad")
    assert not of(out, ReleaseDestination) and c.stats["corrupt"] == 0
    out = c.handle_timer(pair.now + c.config.fence_grace_s)
    (failed,) = of(out, TransferFailed)
    assert failed.code is FailReason.READ_FAILED


def test_a_corrupt_read_of_an_older_attempt_only_fences_it():
    pair, c, _ = _pulled(tp=1)
    c.preempt("t", pair.now)
    out = c.reissue("t", [20, 21, 22], pair.now)
    assert of(out, IssueRead)
    out = c.read_completed("t", 0, Peer("P", 0), True, pair.now, corrupt="bad")
    assert of(out, ReleaseDestination) and not of(out, TransferFailed)
    assert c.state_of("t") is ConsumerState.REGISTERED and c.attempt_of("t") == 1
    out = c.read_completed("t", 1, Peer("P", 0), True, pair.now)
    assert of(out, TransferReady)
