"""Every (state, input) pair of both machines: a valid move, or a typed error
that leaves the endpoint exactly as it was."""

import copy
from pathlib import Path

import pytest

from pushkv.protocol import (
    Cancel,
    CancelAck,
    ConsumerConfig,
    Fail,
    FailReason,
    LocalProtocolError,
    Notify,
    Peer,
    ProducerConfig,
    ReadDone,
    Register,
)
from pushkv.protocol.diagram import page
from pushkv.protocol.states import (
    CONSUMER_TABLE,
    CONSUMER_TERMINAL,
    PRODUCER_TABLE,
    PRODUCER_TERMINAL,
    ConsumerInput,
    ConsumerState,
    ProducerInput,
    ProducerState,
    consumer_step,
    producer_step,
)

from .helpers import Pair

PS, PI, CS, CI = ProducerState, ProducerInput, ConsumerState, ConsumerInput


@pytest.mark.parametrize("state", list(PS))
@pytest.mark.parametrize("inp", list(PI))
def test_producer_table_pair(state, inp):
    if (state, inp) in PRODUCER_TABLE:
        _effect, nxt = producer_step(state, inp)
        assert isinstance(nxt, PS)
        if state in PRODUCER_TERMINAL:
            # Finished legs leave only by a reopen (rule 3) or with the source (GONE).
            assert nxt == state or (inp, nxt) in {(PI.REOPEN, PS.EMPTY),
                                                  (PI.SOURCE_GONE, PS.GONE)}
    else:
        with pytest.raises(LocalProtocolError) as info:
            producer_step(state, inp)
        assert info.value.state == state.value and info.value.input == inp.value


@pytest.mark.parametrize("state", list(CS))
@pytest.mark.parametrize("inp", list(CI))
def test_consumer_table_pair(state, inp):
    if (state, inp) in CONSUMER_TABLE:
        _, nxt = consumer_step(state, inp)
        assert isinstance(nxt, CS)
        assert state not in CONSUMER_TERMINAL
    else:
        with pytest.raises(LocalProtocolError):
            consumer_step(state, inp)


def test_every_state_is_reachable():
    reached_p = {PS.EMPTY} | {n for _, n in PRODUCER_TABLE.values()}
    reached_c = {CS.REGISTERED} | {n for _, n in CONSUMER_TABLE.values()}
    assert reached_p == set(PS) and reached_c == set(CS)


def test_docs_are_generated_from_the_tables():
    doc = Path(__file__).parents[2] / "docs" / "state-machines.md"
    assert doc.read_text() == page(), "run: python -m pushkv.protocol.diagram > " + str(doc)


# ------------------------------------------------------------- endpoint level
# One producer rank writing into two consumer ranks (TP 1 -> 2), so that a leg
# into consumer rank 0 can sit in any state while the transfer stays alive.

D0 = Peer("D", 0)


def _pair():
    return Pair(producer={"num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0))


def _reg(attempt, blocks=(1, 2, 3)):
    return Register(transfer_id="t", attempt=attempt, engine_id="D", rank=0,
                    producer_engine_id="P", block_ids=blocks, num_tokens=40, window_ms=50_000)


def _cancel(attempt, final):
    return Cancel(transfer_id="t", attempt=attempt, engine_id="D", rank=0, final=final)


def _writing(p):
    p.receive(_reg(0), 0.0)
    p.prefill_finished("t", [7, 8, 9], 40, 0.0)


PRODUCER_RECIPES = {
    PS.EMPTY: lambda p: p.receive(_cancel(0, final=False), 0.0),
    PS.REGISTERED: lambda p: p.receive(_reg(0), 0.0),
    PS.KV_READY: lambda p: (p.receive(_cancel(0, final=False), 0.0),
                            p.prefill_finished("t", [7, 8, 9], 40, 0.0)),
    PS.WRITING: _writing,
    PS.SUPERSEDED: lambda p: (_writing(p), p.receive(_reg(1, (4, 5, 6)), 0.0)),
    PS.CANCELLING: lambda p: (_writing(p), p.receive(_cancel(0, final=True), 0.0)),
    PS.PREEMPTING: lambda p: (_writing(p), p.receive(_cancel(0, final=False), 0.0)),
    PS.DONE: lambda p: (_writing(p), p.write_completed("t", 0, D0, True, 0.0)),
    PS.FAILED: lambda p: (_writing(p), p.write_completed("t", 0, D0, False, 0.0)),
    PS.CANCELLED: lambda p: (p.receive(_reg(0), 0.0), p.receive(_cancel(0, final=True), 0.0)),
    PS.EXPIRED: lambda p: (p.receive(_reg(0), 0.0), p.handle_timer(55.0)),
}


def _producer_inputs(p):
    """The public call that feeds each input to the leg into consumer rank 0."""
    writing = next((a for t, a, peer in p.writes_in_flight() if peer == D0), 0)
    newest = 5
    return {
        PI.REGISTER: lambda: p.receive(_reg(newest, (10, 11, 12)), 1.0),
        PI.KV_READY: lambda: p.prefill_finished("t", [7, 8, 9], 40, 1.0),
        PI.KV_ABORTED: lambda: p.prefill_aborted("t", 1.0),
        PI.WRITE_OK: lambda: p.write_completed("t", writing, D0, True, 1.0),
        PI.WRITE_ERROR: lambda: p.write_completed("t", writing, D0, False, 1.0),
        PI.CANCEL: lambda: p.receive(_cancel(newest, final=True), 1.0),
        PI.PREEMPT: lambda: p.receive(_cancel(newest, final=False), 1.0),
        PI.PEER_DIED: lambda: p.peer_died("D", 1.0),
        PI.READ_DONE: lambda: p.receive(
            ReadDone(transfer_id="t", attempt=0, engine_id="D", rank=0,
                     producer_engine_id="P"), 1.0),
    }


def _producer_view(p):
    return (p.leg_state("t", D0), p.held_blocks(), p.num_transfers, p.pending_registrations,
            p.writes_in_flight())


@pytest.mark.parametrize("state", list(PRODUCER_RECIPES))
@pytest.mark.parametrize("inp", list(_producer_inputs(_pair().p[0])))
def test_producer_endpoint_pair(state, inp):
    p = _pair().p[0]
    PRODUCER_RECIPES[state](p)
    assert p.leg_state("t", D0) is state
    before = _producer_view(p)
    snapshot = copy.deepcopy(p.__dict__)
    try:
        _producer_inputs(p)[inp]()
    except LocalProtocolError:
        assert _producer_view(p) == before, "a refused input changed the endpoint"
        assert p.__dict__.keys() == snapshot.keys()
        return
    after = p.leg_state("t", D0)
    assert after is None or isinstance(after, PS)
    if (state, inp) in PRODUCER_TABLE and after is not None and inp is not PI.REGISTER:
        # REGISTER on a finished leg reopens it first (rule 3); a peer's input may
        # also be dropped as stale, leaving the leg as it was.
        assert after in (PRODUCER_TABLE[state, inp][1], state) or after in PRODUCER_TERMINAL


def _cpair():
    return Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                ccfg=ConsumerConfig(window_s=10, fence_grace_s=5))


def _note(rank, attempt=0):
    return Notify(transfer_id="t", attempt=attempt, engine_id="P", rank=rank)


def _ack(rank, attempt=0):
    return CancelAck(transfer_id="t", attempt=attempt, engine_id="P", rank=rank)


CONSUMER_RECIPES = {
    CS.REGISTERED: lambda c: c.register("t", "P", [1, 2, 3], 40, 0.0),
    CS.PREEMPTING: lambda c: (c.register("t", "P", [1, 2, 3], 40, 0.0), c.preempt("t", 0.0)),
    CS.PREEMPTED: lambda c: (c.register("t", "P", [1, 2, 3], 40, 0.0), c.preempt("t", 0.0),
                             c.receive(_ack(0), 0.0), c.receive(_ack(1), 0.0)),
    CS.CANCELLING: lambda c: (c.register("t", "P", [1, 2, 3], 40, 0.0), c.abort("t", 0.0)),
    CS.FAILING: lambda c: (c.register("t", "P", [1, 2, 3], 40, 0.0), c.handle_timer(10.0)),
}


def _consumer_inputs(c):
    attempt = c.attempt_of("t") or 0
    return {
        CI.NOTIFY: lambda: c.receive(_note(0, attempt), 11.0),
        CI.FAIL: lambda: c.receive(Fail(transfer_id="t", attempt=attempt, engine_id="P",
                                        rank=0, reason=FailReason.WRITE_FAILED), 11.0),
        CI.CANCEL_ACK: lambda: c.receive(_ack(0, attempt), 11.0),
        CI.ABORT: lambda: c.abort("t", 11.0),
        CI.PREEMPT: lambda: c.preempt("t", 11.0),
        CI.REISSUE: lambda: c.reissue("t", [20, 21, 22], 11.0),
        CI.DEADLINE: lambda: c.handle_timer(11.0),
        CI.HARD_DEADLINE: lambda: c.handle_timer(16.0),
        CI.PEER_DIED: lambda: c.peer_died("P", 11.0),
    }


@pytest.mark.parametrize("state", list(CONSUMER_RECIPES))
@pytest.mark.parametrize("inp", list(_consumer_inputs(_cpair().c[0])))
def test_consumer_endpoint_pair(state, inp):
    c = _cpair().c[0]
    CONSUMER_RECIPES[state](c)
    assert c.state_of("t") is state
    before = (c.state_of("t"), c.lent_blocks(), c.attempt_of("t"))
    try:
        _consumer_inputs(c)[inp]()
    except LocalProtocolError:
        assert (c.state_of("t"), c.lent_blocks(), c.attempt_of("t")) == before
        return
    after = c.state_of("t")
    assert after is None or isinstance(after, CS)
    if after is None:  # terminal and forgotten: no block may stay lent
        assert c.lent_blocks() == {}
