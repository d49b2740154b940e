"""Rule 9, partial readiness: ranges written as they become final (pair level)."""

from __future__ import annotations

import msgspec
import pytest

from pushkv.protocol import (
    CancelAck,
    ConfigError,
    ConsumerState,
    Fail,
    IssueWrite,
    Notify,
    ProducerState,
    ReleaseDestination,
    ReleaseSource,
    TransferReady,
)
from pushkv.protocol.ranges import add, next_rect, subtract, todo

from .helpers import Pair, msgs, of

L = 4  # layers
TB = 32  # bytes of one token of one layer and plane (1 head x 16 x 2 bytes)


def _pair():
    return Pair(producer={"num_layers": L}, consumer={"num_layers": L})


def _register(pair, blocks=(1, 2, 3), n=40):
    return pair.to_producers(pair.c[0].register("t", "P", list(blocks), n, pair.now))


def _ready(pair, a, b, layers=None):
    return pair.p[0].range_ready("t", [7, 8, 9], (a, b), pair.now, layers=layers)


def test_intervals_merge_subtract_and_coalesce():
    assert add(add((), 0, 4), 4, 8) == ((0, 8),)
    assert add(((0, 2), (6, 8)), 1, 7) == ((0, 8),)
    assert subtract(((0, 10),), ((2, 4), (6, 7))) == ((0, 2), (4, 6), (7, 10))
    pending = todo({0: ((0, 16),), 1: ((0, 16),), 2: ((0, 8),)}, {}, range(4), 0, 40)
    assert next_rect(pending) == (0, 16, 0, 2)  # two layers ready together: one write
    assert next_rect({}) is None
    assert todo(None, {0: ((0, 40),)}, range(1), 0, 40) == {}


def test_whole_request_is_one_write_of_one_part():
    pair = _pair()
    _register(pair)
    (w,) = of(pair.p[0].prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    assert (w.notify.part, w.notify.parts) == (0, 1)
    assert w.plan.nbytes == 40 * TB * L * 2  # every token of every layer, K and V
    _, notes = pair.complete([w])
    assert of(notes, TransferReady)


def test_ranges_before_registration_are_written_at_once_then_each_later_one():
    pair = _pair()
    _ready(pair, 0, 16)
    _ready(pair, 16, 32)  # chunks ready before anyone registered: never lost
    (w0,) = of(_register(pair), IssueWrite)
    assert w0.plan.nbytes == 32 * TB * L * 2  # both chunks coalesced into one write
    assert (w0.notify.part, w0.notify.parts) == (0, 0)
    back, notes = pair.complete([w0])
    assert of(back, IssueWrite) == [] and not of(notes, TransferReady)
    (w1,) = of(pair.p[0].prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    assert w1.plan.nbytes == 8 * TB * L * 2 and (w1.notify.part, w1.notify.parts) == (1, 2)
    _, notes = pair.complete([w1])
    assert of(notes, TransferReady)


def test_registration_between_two_layer_ranges():
    pair = _pair()
    _ready(pair, 0, 16, (0, 1))
    (w0,) = of(_register(pair), IssueWrite)
    assert w0.plan.src_regions.tolist() == [0, 1]  # layer 0, K and V
    assert of(_ready(pair, 0, 16, (1, 2)), IssueWrite) == []  # one write at a time
    _ready(pair, 0, 16, (2, 3))
    (w1,) = of(pair.complete([w0])[0], IssueWrite)
    assert w1.plan.src_regions.tolist() == [2, 3, 4, 5]  # layers 1-2 coalesced


def test_parts_notified_out_of_order_complete_the_rank_once():
    pair = _pair()
    _register(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    assert of(p.write_completed("t", 0, w0.peer, True, 0.0), IssueWrite) == []
    (w1,) = of(p.prefill_finished("t", [7, 8, 9], 40, 0.0), IssueWrite)
    p.write_completed("t", 0, w1.peer, True, 0.0)
    assert of(c.receive(w1.notify, 0.0), TransferReady) == []  # the last part first
    assert c.state_of("t") is ConsumerState.REGISTERED
    assert of(c.receive(w0.notify, 0.0), TransferReady)
    assert of(c.receive(w0.notify, 0.0), TransferReady) == []  # a repeat never counts


def test_cancel_between_parts_fences_only_after_the_parts_landed():
    pair = _pair()
    _register(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    p.write_completed("t", 0, w0.peer, True, 0.0)  # its notification is still on the way
    answers = pair.to_producers(c.abort("t", 0.0))
    (ack,) = msgs(answers, CancelAck)
    assert ack.posted == 1
    assert of(c.receive(ack, 0.0), ReleaseDestination) == []  # part 0 may still land
    assert of(_ready(pair, 16, 32), IssueWrite) == []  # ready after the cancel: not written
    out = c.receive(w0.notify, 0.0)
    assert of(out, ReleaseDestination) and c.state_of("t") is None


def test_cancel_with_a_part_in_flight_acks_its_count_when_it_finishes():
    pair = _pair()
    _register(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    assert msgs(pair.to_producers(c.abort("t", 0.0)), CancelAck) == []  # in flight
    (ack,) = msgs(p.write_completed("t", 0, w0.peer, True, 0.0), CancelAck)
    assert ack.posted == 1
    assert of(c.receive(ack, 0.0), ReleaseDestination) == []
    assert of(c.receive(w0.notify, 0.0), ReleaseDestination)
    assert of(p.prefill_finished("t", [7, 8, 9], 40, 0.0), ReleaseSource)


def test_preempt_and_reissue_write_every_ready_range_into_the_new_blocks():
    pair = _pair()
    _register(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    pair.to_producers(c.preempt("t", 0.0))
    (ack,) = msgs(p.write_completed("t", 0, w0.peer, True, 0.0), CancelAck)
    assert ack.posted == 1
    c.receive(ack, 0.0)
    _ready(pair, 16, 32)
    out = c.reissue("t", [20, 21, 22], 0.0)  # the old attempt is still fencing
    assert c.blocks_of("t", 0) == (1, 2, 3)
    (w1,) = of(pair.to_producers(out), IssueWrite)
    assert w1.attempt == 1 and w1.plan.nbytes == 32 * TB * L * 2
    assert of(c.receive(w0.notify, 0.0), ReleaseDestination)  # the zombie's fence


def test_request_aborted_with_a_part_in_flight_releases_after_it():
    pair = _pair()
    _register(pair)
    p = pair.p[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    assert of(p.prefill_aborted("t", 0.0), ReleaseSource) == []
    out = p.write_completed("t", 0, w0.peer, True, 0.0)
    assert len(of(out, ReleaseSource)) == 1


def test_window_passing_between_parts_fails_with_the_count():
    pair = _pair()
    _register(pair)
    p = pair.p[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    p.write_completed("t", 0, w0.peer, True, 0.0)
    (fail,) = msgs(p.handle_timer(10_000.0), Fail)
    assert fail.posted == 1


@pytest.mark.parametrize(("tokens", "layers"), [((5, 5), None), ((0, 49), None),
                                                 ((0, 8), (3, 9)), ((-1, 4), None)])
def test_bad_ranges_are_refused_and_change_nothing(tokens, layers):
    pair = _pair()
    before = pair.p[0].num_transfers
    with pytest.raises(ConfigError):
        pair.p[0].range_ready("t", [7, 8, 9], tokens, 0.0, layers=layers)
    assert pair.p[0].num_transfers == before


def test_notify_and_register_round_trip_with_parts():
    from pushkv.protocol.messages import decode, encode

    n = Notify(transfer_id="t", attempt=0, engine_id="P", rank=0, part=3, parts=4)
    assert decode(encode(n)) == n


def test_an_unasked_cancel_ack_with_parts_is_refused_and_changes_nothing():
    import copy

    from pushkv.protocol import Rejected

    pair = _pair()
    _register(pair)
    c = pair.c[0]
    before = copy.deepcopy(c._transfers["t"].cur)
    out = c.receive(CancelAck(transfer_id="t", attempt=0, engine_id="P", rank=0, posted=3), 0.0)
    assert of(out, Rejected)
    assert c._transfers["t"].cur == before


# Found by the model checker (scopes ``partial*``); each failed before its fix.


def _cancel(attempt, final):
    from pushkv.protocol import Cancel

    return Cancel(transfer_id="t", attempt=attempt, engine_id="D", rank=0, final=final)


@pytest.mark.parametrize("end", ["aborted", "finished"])
def test_a_range_of_a_concluded_transfer_is_released_once_when_the_request_ends(end):
    pair = _pair()
    p = pair.p[0]
    p.receive(_cancel(0, True), 0.0)  # the consumer gave up before prefill: an orphan
    p.handle_timer(10_000.0)  # nobody came back: forgotten
    assert p.num_transfers == 0
    assert p.range_ready("t", [7, 8], (0, 16), 10_000.0) == []  # nobody will read it
    out = (p.prefill_aborted("t", 10_000.0) if end == "aborted" else
           p.prefill_finished("t", [7, 8, 9], 40, 10_000.0))
    (rel,) = of(out, ReleaseSource)  # the blocks the range handed over come back
    assert rel.block_ids[:2] == (7, 8)
    assert of(p.prefill_aborted("t", 10_000.0), ReleaseSource) == []  # and only once


def test_a_parked_leg_preempted_then_reissued_writes_the_ready_range_at_once():
    pair = _pair()
    _register(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    pair.complete([w0])  # part 0 written; nothing more ready: the leg waits
    assert p.leg_state("t", w0.peer) is ProducerState.REGISTERED
    (ack,) = msgs(pair.to_producers(c.preempt("t", 0.0)), CancelAck)
    assert ack.posted == 1
    c.receive(ack, 0.0)
    (w1,) = of(pair.to_producers(c.reissue("t", [20, 21, 22], 0.0)), IssueWrite)
    assert w1.attempt == 1 and w1.plan.nbytes == 16 * TB * L * 2


def test_a_newer_registration_reaching_a_parked_leg_writes_the_ready_range_at_once():
    from pushkv.protocol import Register

    pair = _pair()
    (reg0,) = msgs(pair.c[0].register("t", "P", [1, 2, 3], 40, 0.0), Register)
    p = pair.p[0]
    p.receive(reg0, 0.0)
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    p.write_completed("t", 0, w0.peer, True, 0.0)
    newer = msgspec.structs.replace(reg0, attempt=1, block_ids=(20, 21, 22))
    out = p.receive(newer, 0.0)  # it overtook the preempt's Cancel
    assert [m.attempt for m in msgs(out, CancelAck)] == [0]
    (w1,) = of(out, IssueWrite)
    assert w1.attempt == 1 and w1.plan.nbytes == 16 * TB * L * 2


def test_a_stash_failed_during_a_part_answers_the_old_attempt_with_its_parts():
    pair = _pair()
    _register(pair)
    p, c = pair.p[0], pair.c[0]
    (w0,) = of(_ready(pair, 0, 16), IssueWrite)
    assert msgs(pair.to_producers(c.preempt("t", 0.0)), CancelAck) == []  # part in flight
    pair.to_producers(c.reissue("t", [20, 21, 22], 0.0))  # stashed behind the part
    (fail,) = msgs(p.prefill_aborted("t", 0.0), Fail)
    assert fail.attempt == 1
    out = p.write_completed("t", 0, w0.peer, True, 0.0)
    (ack,) = msgs(out, CancelAck)  # the old attempt's fence: one part was written
    assert (ack.attempt, ack.posted) == (0, 1) and msgs(out, Fail) == []
    assert len(of(out, ReleaseSource)) == 1
    assert of(c.receive(ack, 0.0), ReleaseDestination) == []
    assert of(c.receive(w0.notify, 0.0), ReleaseDestination)  # the zombie's fence
