"""Every (state, input) pair of both machines: a valid move, or a typed error
that leaves the endpoint exactly as it was.

At the endpoint level, every state is reached through the public API and every
public input is fed to it; every transition the endpoint makes is recorded
(``Endpoint.trace``) and checked against the table: the exact next state, the
exact effect, and the exact actions that effect emits. A coverage test shows
every row of both tables is exercised this way.
"""

import copy
import itertools
from pathlib import Path

import pytest

from pushkv.protocol import (
    Cancel,
    CancelAck,
    Consumer,
    ConsumerConfig,
    Fail,
    FailReason,
    LocalProtocolError,
    Mode,
    Notify,
    PackingConfig,
    Peer,
    ProducerConfig,
    ReadDone,
    Register,
    SendMessage,
)
from pushkv.protocol.consumer import staging as consumer_staging
from pushkv.protocol.diagram import page
from pushkv.protocol.layout import uniform_ranks
from pushkv.protocol.packing import chunk_bounds
from pushkv.protocol.states import (
    CONSUMER_TABLE,
    CONSUMER_TERMINAL,
    PRODUCER_TABLE,
    PRODUCER_TERMINAL,
    SOURCE_TABLE,
    ZOMBIE_TABLE,
    ConsumerEffect,
    ConsumerInput,
    ConsumerState,
    ProducerEffect,
    ProducerInput,
    ProducerState,
    SourceEffect,
    SourceState,
    ZombieState,
    consumer_step,
    producer_step,
)

from .helpers import Pair

PS, PI, PE = ProducerState, ProducerInput, ProducerEffect
CS, CI, CE = ConsumerState, ConsumerInput, ConsumerEffect


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
        effect, nxt = consumer_step(state, inp)
        assert isinstance(nxt, CS)
        if state in CONSUMER_TERMINAL:  # only a late message reaches an ended transfer
            assert (inp, effect, nxt) == (CI.STALE, CE.DROP, state)
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


def _kind(a):
    return type(a.message).__name__ if isinstance(a, SendMessage) else type(a).__name__


def _dump(endpoint):
    """Everything an endpoint holds, for equality (bound handlers left out)."""
    return copy.deepcopy({k: v for k, v in vars(endpoint).items()
                          if k not in ("_handlers", "trace")})


#: The actions each producer effect emits, as kinds: exact sequences allowed.
P_ACTIONS = {
    PE.NONE: {()}, PE.STALE: {()}, PE.ADOPT: {()},
    PE.ADOPT_AND_WRITE: {("IssueWrite",), ()},  # (): refused, WRITE_REFUSED / PLAN_FAILED
    PE.WRITE: {("IssueWrite",), ()},
    PE.ACK: {(), ("CancelAck",), ("CancelAck", "CancelAck")},  # a write in flight is its fence
    PE.ACK_AND_ADOPT: {("CancelAck",)},
    PE.ACK_STALE: {(), ("CancelAck",)},
    PE.FAIL: {("Fail",)}, PE.FAIL_GONE: {("Fail",)}, PE.FAIL_STASHED: {("Fail",)},
    PE.STASH: {(), ("CancelAck",)}, PE.ACK_STASHED_AND_STASH: {("CancelAck",)},
    PE.WRITE_STASHED: {("IssueWrite",), ()},
    PE.FAIL_AND_WRITE_STASHED: {("Fail", "IssueWrite"), ("Fail",)},
    PE.ACK_PARTS: {("CancelAck",)},
    PE.ACK_PARTS_AND_WRITE_STASHED: {("CancelAck", "IssueWrite"), ("CancelAck",)},
}
#: The actions each source effect emits itself (its legs' inputs are steps of their own).
S_ACTIONS = {
    SourceEffect.HOLD: {(), ("Publish",)}, SourceEffect.ABORT: {()},
    SourceEffect.EXPIRE: {()}, SourceEffect.RELEASE: {("ReleaseSource",)},
    SourceEffect.FORGET: {()}, SourceEffect.STREAM: {()},
}
_GIVE_UP = {("Cancel",) * a + ("Consumed",) * b for a in range(3) for b in range(3 - a)}
#: The actions each consumer effect emits (``*``: one per producer rank named).
C_ACTIONS = {
    CE.NONE: {()}, CE.COUNT: {()}, CE.FENCE: {()},
    CE.READY: {("TransferReady",), ("ReleaseStaging", "TransferReady")},
    # Rule 11: a corrupt part leaves its own rank to cancel too. Rule 12: given up
    # for good, the ranks that get no Cancel (they wrote, or their write failed) are
    # told Consumed, after the Cancels.
    CE.FAIL_REST: _GIVE_UP,
    CE.CANCEL_ALL: _GIVE_UP,
    CE.PREEMPT_ALL: {(), ("Cancel",), ("Cancel", "Cancel")},
    # Rule 10: an attempt lent staging gives it back with its blocks.
    CE.RELEASE: {("ReleaseDestination",), ("ReleaseStaging", "ReleaseDestination")},
    CE.RELEASE_CANCELLED: {("ReleaseDestination", "TransferCancelled"),
                           ("ReleaseStaging", "ReleaseDestination", "TransferCancelled")},
    CE.RELEASE_FAILED: {("ReleaseDestination", "TransferFailed"),
                        ("ReleaseStaging", "ReleaseDestination", "TransferFailed")},
    CE.REGISTER: {("Register", "Register")}, CE.ZOMBIFY_AND_REGISTER: {("Register", "Register")},
    CE.FINAL_CANCEL_RELEASED: {("Cancel", "Cancel", "TransferCancelled"), ("TransferCancelled",)},
    CE.REPORT_FAILED: {("TransferFailed",)},
    CE.SEND_HELD: {("Register", "Register")}, CE.HOLD: {(), ("Connect",)},
    CE.DROP: {()}, CE.PART: {()},
    CE.SCATTER: {("Scatter",)}, CE.FENCE_REMOTE: {()},
}
def _check_steps(steps, start, table, actions, where):
    """Every recorded transition is the table's, exactly, and they chain."""
    state = start
    for i, st in enumerate(steps):
        assert st.state is state, f"{where}: step {i} left from {st.state}, leg was in {state}"
        assert (st.state, st.input) in table, f"{where}: {st.state.name} x {st.input.name}"
        assert (st.effect, st.next) == table[st.state, st.input], where
        got = tuple(_kind(a) for a in st.actions)
        assert got in actions[st.effect], f"{where}: {st.effect} emitted {got}"
        state = st.next
    return state


# One producer rank writing into two consumer ranks (TP 1 -> 2), so that a leg
# into consumer rank 0 can sit in any state while the transfer stays alive.
# Recipes start at attempt 1 so that older, repeated and newer messages exist.

D0 = Peer("D", 0)
WINDOW_MS, LEASE = 50_000, 100.0


def _pair():
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"tp": 2, "num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=LEASE))
    for info in uniform_ranks("E", tp=2, num_kv_heads=2):  # rule 12: a second engine
        for p in pair.p:
            p.add_peer(info)
    return pair


def _reg(attempt, blocks=(1, 2, 3), rank=0, window_ms=WINDOW_MS):
    return Register(transfer_id="t", attempt=attempt, engine_id="D", rank=rank,
                    producer_engine_id="P", block_ids=blocks, num_tokens=40,
                    window_ms=window_ms)


def _cancel(attempt, final, rank=0):
    return Cancel(transfer_id="t", attempt=attempt, engine_id="D", rank=rank, final=final)


def _prefill(p, mode=Mode.PUSH):
    p.prefill_finished("t", [7, 8, 9], 40, 0.0, mode=mode)


def _writing(p):
    p.receive(_reg(1), 0.0)
    _prefill(p)


def _part(p, tokens=(0, 16)):  # rule 9: a first range of the prefill is final
    p.range_ready("t", [7, 8, 9], tokens, 0.0)


def _writing_part(p):  # the leg writes a part that is not its last
    p.receive(_reg(1), 0.0)
    _part(p)


def _other_writing(p):  # consumer rank 1's leg is being written
    p.receive(_reg(0, rank=1), 0.0)
    _prefill(p)


PRODUCER_RECIPES = {  # label -> (state of the leg into consumer rank 0, recipe)
    "EMPTY": (PS.EMPTY, lambda p: p.receive(_cancel(1, final=False), 0.0)),
    "REGISTERED": (PS.REGISTERED, lambda p: p.receive(_reg(1), 0.0)),
    "KV_READY": (PS.KV_READY, lambda p: (p.receive(_cancel(1, final=False), 0.0), _prefill(p))),
    "published (pull)": (None, lambda p: _prefill(p, Mode.PULL)),
    "WRITING": (PS.WRITING, _writing),
    "SUPERSEDED": (PS.SUPERSEDED, lambda p: (_writing(p), p.receive(_reg(2, (4, 5, 6)), 0.0))),
    "SUPERSEDED, long window": (PS.SUPERSEDED, lambda p: (
        _writing(p), p.receive(_reg(2, (4, 5, 6), window_ms=10**6), 0.0))),
    "CANCELLING": (PS.CANCELLING, lambda p: (_writing(p), p.receive(_cancel(1, True), 0.0))),
    "PREEMPTING": (PS.PREEMPTING, lambda p: (_writing(p), p.receive(_cancel(1, False), 0.0))),
    "DONE": (PS.DONE, lambda p: (_writing(p), p.write_completed("t", 1, D0, True, 0.0))),
    "FAILED": (PS.FAILED, lambda p: (_writing(p), p.write_completed("t", 1, D0, False, 0.0))),
    "CANCELLED": (PS.CANCELLED, lambda p: (p.receive(_reg(1), 0.0),
                                           p.receive(_cancel(1, final=True), 0.0))),
    "CANCELLED, other writing": (PS.CANCELLED, lambda p: (
        _other_writing(p), p.receive(_cancel(1, final=True), 0.0))),
    "EXPIRED": (PS.EXPIRED, lambda p: (p.receive(_reg(1), 0.0), p.handle_timer(55.0))),
    "EXPIRED, other writing": (PS.EXPIRED, lambda p: (
        p.receive(_reg(1, window_ms=1000), 0.0), p.handle_timer(2.0),
        p.receive(_reg(0, rank=1), 2.0), p.prefill_finished("t", [7, 8, 9], 40, 2.0))),
    "lease ended, other writing": (None, lambda p: (_other_writing(p),
                                                    p.handle_timer(LEASE + 11))),
    "GONE (forgotten)": (PS.GONE, lambda p: (p.receive(_reg(1), 0.0),
                                             p.prefill_aborted("t", 0.0))),
    # Rule 12: legs of a source bound to engine D (rank 1 registered) that a
    # re-target reaches before they were written.
    "EMPTY, engine bound": (PS.EMPTY, lambda p: (p.receive(_reg(0, rank=1), 0.0),
                                                 p.receive(_cancel(1, final=False), 0.0))),
    "KV_READY, other writing": (PS.KV_READY, lambda p: (
        _other_writing(p), p.receive(_cancel(1, final=False), 0.0))),
    "WRITING, request aborted": (PS.WRITING, lambda p: (_writing(p),
                                                          p.prefill_aborted("t", 0.0))),
    # Rule 9: the source is partly ready (prefill still running).
    "KV_READY, partial": (PS.KV_READY, lambda p: (p.receive(_cancel(1, final=False), 0.0),
                                                  _part(p))),
    "WRITING a part": (PS.WRITING, _writing_part),
    "REGISTERED, a part written": (PS.REGISTERED, lambda p: (
        _writing_part(p), p.write_completed("t", 1, D0, True, 0.0))),
    "SUPERSEDED, a part": (PS.SUPERSEDED, lambda p: (
        _writing_part(p), p.receive(_reg(2, (4, 5, 6)), 0.0))),
    "CANCELLING, a part": (PS.CANCELLING, lambda p: (
        _writing_part(p), p.receive(_cancel(1, True), 0.0))),
    "PREEMPTING, a part": (PS.PREEMPTING, lambda p: (
        _writing_part(p), p.receive(_cancel(1, False), 0.0))),
    "DONE, partial": (PS.DONE, lambda p: (
        p.receive(_reg(1), 0.0), _part(p, (0, 40)), p.write_completed("t", 1, D0, True, 0.0))),
    "FAILED, partial": (PS.FAILED, lambda p: (
        _writing_part(p), p.write_completed("t", 1, D0, False, 0.0))),
    "EXPIRED, partial": (PS.EXPIRED, lambda p: (
        p.receive(_reg(1, window_ms=1000), 0.0), p.receive(_reg(0, rank=1), 0.0),
        p.handle_timer(2.0))),
}


def _producer_calls(p):
    """Every public call that feeds an input to the leg into consumer rank 0."""
    writing = next((a for t, a, peer in p.writes_in_flight() if peer == D0), 0)
    return {
        "register newer": lambda: p.receive(_reg(5, (10, 11, 12)), 1.0),
        "register again": lambda: p.receive(_reg(1), 1.0),
        "register older": lambda: p.receive(_reg(0), 1.0),
        "register newer, too long": lambda: p.receive(
            Register(transfer_id="t", attempt=5, engine_id="D", rank=0,
                     producer_engine_id="P", block_ids=(1, 2, 3), num_tokens=48,
                     window_ms=WINDOW_MS), 1.0),
        "prefill": lambda: p.prefill_finished("t", [7, 8, 9], 40, 1.0),
        "range ready": lambda: p.range_ready("t", [7, 8, 9], (16, 32), 1.0),
        "prefill aborted": lambda: p.prefill_aborted("t", 1.0),
        "write ok": lambda: p.write_completed("t", writing, D0, True, 1.0),
        "write error": lambda: p.write_completed("t", writing, D0, False, 1.0),
        "cancel newer": lambda: p.receive(_cancel(5, final=True), 1.0),
        "preempt newer": lambda: p.receive(_cancel(5, final=False), 1.0),
        "cancel again": lambda: p.receive(_cancel(1, final=True), 1.0),
        "cancel older": lambda: p.receive(_cancel(0, final=True), 1.0),
        "other rank cancels": lambda: p.receive(_cancel(5, final=True, rank=1), 1.0),
        "peer died": lambda: p.peer_died("D", 1.0),
        "read done": lambda: p.receive(ReadDone(transfer_id="t", attempt=0, engine_id="D",
                                                rank=0, producer_engine_id="P"), 1.0),
        "re-targeted (rule 12)": lambda: p.receive(
            Register(transfer_id="t", attempt=0, engine_id="E", rank=0,
                     producer_engine_id="P", block_ids=(1, 2, 3), num_tokens=40,
                     window_ms=WINDOW_MS, target=1), 1.0),
        "window passes": lambda: p.handle_timer(WINDOW_MS / 1000 + 1),
        "lease passes": lambda: p.handle_timer(LEASE + 10),
    }


PRODUCER_CALLS = list(_producer_calls(_pair().p[0]))
#: The state a leg starts in when a message creates it (by where the source is).
_NEW_LEG = (PS.EMPTY, PS.KV_READY, PS.GONE)


def _run_producer(label, call):
    p = _pair().p[0]
    state, recipe = PRODUCER_RECIPES[label]
    recipe(p)
    assert p.leg_state("t", D0) is state
    before = _dump(p)
    p.trace = []
    try:
        _producer_calls(p)[call]()
    except LocalProtocolError:
        assert _dump(p) == before, "a refused call changed the endpoint"
        assert p.trace == []
        return []
    steps = [st for st in p.trace if st.peer == D0]
    for st in p.trace:
        if isinstance(st.state, SourceState):  # the source follows its own table
            assert (st.effect, st.next) == SOURCE_TABLE[st.state, st.input]
            assert tuple(_kind(a) for a in st.actions) in S_ACTIONS[st.effect]
    if state is None and steps:
        assert steps[0].state in _NEW_LEG
        state = steps[0].state
    end = _check_steps(steps, state, PRODUCER_TABLE, P_ACTIONS, f"{label}: {call}")
    now = p.leg_state("t", D0)
    assert now in (end, None), f"leg ended in {now}, the table says {end}"
    return p.trace


@pytest.mark.parametrize("label", list(PRODUCER_RECIPES))
@pytest.mark.parametrize("call", PRODUCER_CALLS)
def test_producer_endpoint_follows_the_table_exactly(label, call):
    _run_producer(label, call)


def test_every_producer_row_is_exercised_through_the_endpoint():
    hit = set()
    for label, call in itertools.product(PRODUCER_RECIPES, PRODUCER_CALLS):
        hit |= {(st.state, st.input) for st in _run_producer(label, call)}
    missing = sorted(f"{s.name} x {i.name}" for s, i in
                     (set(PRODUCER_TABLE) | set(SOURCE_TABLE)) - hit)
    assert not missing, missing


# A consumer rank with two producer ranks writing into it (TP 2 -> 1).


def _cpair():
    # Staging memory on the consumer (rule 10): every attempt is lent a range.
    return Pair(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                ccfg=ConsumerConfig(window_s=10, fence_grace_s=5, handshake_timeout_s=20,
                                    packing=PackingConfig(mode="always",
                                                          staging_bytes=1 << 20)))


def _staged(rank, attempt=0):
    return Notify(transfer_id="t", attempt=attempt, engine_id="P", rank=rank, staged=True,
                  src_block_ids=(4, 5, 6))


def _chunk(c, rank, attempt, k):
    """Chunk ``k`` of rank ``rank``'s staged write pipelined in chunks of half its
    bytes (the chunk count is the one the consumer's own plan gives)."""
    t = c._transfers.get("t")
    a = None if t is None else (t.cur if t.cur.attempt == attempt else
                                t.zombies.get(attempt))
    size, n = 64, 2
    known = None if a is None else a.chunks.get(rank)
    if known is not None and known.plan is not None:
        size, n = known.plan[3], len(known.plan[1]) - 1
    elif known is not None:
        size, n = 1, known.need
    elif a is not None and a.staging is not None and rank in a.expected:
        got = consumer_staging.staged_plan(
            c.info, c.producers.peers.get(Peer("P", rank)),
            c.config.packing.chunk_bytes if c.config.packing else 1, t, a,
            _staged(rank, attempt))
        size = max(1, got.packed.nbytes // 2)
        n = len(chunk_bounds(got.packed, size)) - 1
    return Notify(transfer_id="t", attempt=attempt, engine_id="P", rank=rank, staged=True,
                  src_block_ids=(4, 5, 6), chunk=min(k, n - 1), chunks=n, chunk_bytes=size)


def _then(c, *calls):
    """Run ``calls`` in order; one the endpoint refuses must change nothing, and
    the sequence goes on (a composite call exercises rows from any state)."""
    for call in calls:
        before = _dump(c)
        try:
            call()
        except LocalProtocolError:
            assert _dump(c) == before, "a refused call changed the endpoint"


def _scattered(c, rank, attempt, ok=True):
    return lambda: c.scatter_done("t", attempt, Peer("P", rank), ok, 5.0)


def _note(rank, attempt=0):
    return Notify(transfer_id="t", attempt=attempt, engine_id="P", rank=rank)


def _ack(rank, attempt=0):
    return CancelAck(transfer_id="t", attempt=attempt, engine_id="P", rank=rank)


def _reg_c(c):
    c.register("t", "P", [1, 2, 3], 40, 0.0)


def _connecting(pair):
    c = Consumer(pair.c[0].info, pair.c[0].config)
    c.add_peer(pair.p[0].info)  # rank 1 not yet: the engine is not usable
    _reg_c(c)
    return c


CONSUMER_RECIPES = {
    CS.CONNECTING: _connecting,
    CS.REGISTERED: lambda pair: pair.c[0],
    CS.PREEMPTING: lambda pair: (pair.c[0].preempt("t", 0.0), pair.c[0])[1],
    CS.PREEMPTED: lambda pair: (pair.c[0].preempt("t", 0.0), pair.c[0].receive(_ack(0), 0.0),
                                pair.c[0].receive(_ack(1), 0.0), pair.c[0])[3],
    CS.CANCELLING: lambda pair: (pair.c[0].abort("t", 0.0), pair.c[0])[1],
    CS.FAILING: lambda pair: (pair.c[0].handle_timer(10.0), pair.c[0])[1],
}
def _zombie_then(pair, then):
    c = pair.c[0]
    _reg_c(c)
    c.preempt("t", 0.0)
    c.reissue("t", [20, 21, 22], 0.0)
    then(c)
    return c


def _ready_with_zombie(pair):
    c = pair.c[0]
    _reg_c(c)
    c.preempt("t", 0.0)
    c.reissue("t", [20, 21, 22], 0.0)  # attempt 0 keeps its fence: a zombie
    c.receive(_note(0, 1), 0.0)
    c.receive(_note(1, 1), 0.0)
    return c


#: More recipes, by label: (state, recipe).
CONSUMER_MORE = {
    "READY, a zombie fencing": (CS.READY, _ready_with_zombie),
    "CANCELLED, a zombie fencing": (CS.CANCELLED, lambda pair: (
        _zombie_then(pair, lambda c: (c.abort("t", 0.0), c.receive(_ack(0, 1), 0.0),
                                      c.receive(_ack(1, 1), 0.0))))),
    "FAILED, a zombie fencing": (CS.FAILED, lambda pair: (
        _zombie_then(pair, lambda c: [c.receive(Fail(
            transfer_id="t", attempt=1, engine_id="P", rank=r,
            reason=FailReason.WRITE_FAILED), 0.0) for r in (0, 1)]))),
    "REGISTERED, a zombie fencing": (CS.REGISTERED, lambda pair: (
        _reg_c(pair.c[0]), pair.c[0].preempt("t", 0.0),
        pair.c[0].reissue("t", [20, 21, 22], 0.0), pair.c[0])[3]),
    "PREEMPTED while connecting": (CS.PREEMPTED, lambda pair: (
        lambda c: (c.preempt("t", 0.0), c)[1])(_connecting(pair))),
}


def _consumer_calls(c, pair):
    attempt = c.attempt_of("t") or 0
    return {
        "notify": lambda: c.receive(_note(0, attempt), 5.0),
        "notify both": lambda: (c.receive(_note(0, attempt), 5.0),
                                c.receive(_note(1, attempt), 5.0)),
        "fail": lambda: c.receive(Fail(transfer_id="t", attempt=attempt, engine_id="P",
                                       rank=0, reason=FailReason.WRITE_FAILED), 5.0),
        "cancel ack": lambda: c.receive(_ack(0, attempt), 5.0),
        "cancel ack both": lambda: (c.receive(_ack(0, attempt), 5.0),
                                    c.receive(_ack(1, attempt), 5.0)),
        "abort": lambda: c.abort("t", 5.0),
        "preempt": lambda: c.preempt("t", 5.0),
        "reissue": lambda: c.reissue("t", [20, 21, 22], 5.0),
        "window passes": lambda: c.handle_timer(10.0),
        "grace passes": lambda: c.handle_timer(16.0),
        "handshake times out": lambda: c.handle_timer(21.0),
        "peer died": lambda: c.peer_died("P", 5.0),
        "handshake done": lambda: c.add_peer(pair.p[1].info, now=5.0),
        "handshake failed": lambda: c.handshake_failed("P", "refused", 5.0),
        "notify again": lambda: (c.receive(_note(0, attempt), 5.0),
                                 c.receive(_note(0, attempt), 5.0)),
        "notify of another use": lambda: c.receive(
            Notify(transfer_id="t", attempt=attempt, engine_id="P", rank=0, incarnation=9), 5.0),
        "zombie notified": lambda: c.receive(_note(0, 0), 5.0),
        "zombie acked by both": lambda: (c.receive(_ack(0, 0), 5.0), c.receive(_ack(1, 0), 5.0)),
        # Rule 9: a part that does not finish its rank; then the rank's last word.
        "part": lambda: c.receive(Notify(transfer_id="t", attempt=attempt, engine_id="P",
                                         rank=0, part=0, parts=0), 5.0),
        "ack owing a part, then the part": lambda: (
            c.receive(CancelAck(transfer_id="t", attempt=attempt, engine_id="P", rank=0,
                                posted=1), 5.0),
            c.receive(Notify(transfer_id="t", attempt=attempt, engine_id="P", rank=0,
                             part=0, parts=0), 5.0)),
        "zombie part": lambda: c.receive(Notify(transfer_id="t", attempt=0, engine_id="P",
                                                rank=0, part=1, parts=0), 5.0),
        "zombie failed, then again": lambda: [c.receive(Fail(
            transfer_id="t", attempt=0, engine_id="P", rank=0,
            reason=FailReason.WRITE_FAILED), 5.0) for _ in range(2)],
        # Rule 7: a failed write fences its rank once the grace after its Fail passed.
        "write failed, grace passes": lambda: (c.receive(Fail(
            transfer_id="t", attempt=attempt, engine_id="P", rank=0,
            reason=FailReason.WRITE_FAILED, posted=1, failed=1), 5.0), c.handle_timer(10.0)),
        "ranks failed, grace passes": lambda: [*(c.receive(Fail(
            transfer_id="t", attempt=attempt, engine_id="P", rank=r,
            reason=FailReason.WRITE_FAILED, posted=1, failed=1), 5.0) for r in (0, 1)),
            c.handle_timer(10.0)],
        "zombie write failed, grace passes": lambda: (c.receive(Fail(
            transfer_id="t", attempt=0, engine_id="P", rank=0,
            reason=FailReason.WRITE_FAILED, posted=1, failed=1), 5.0), c.handle_timer(10.0)),
        # Rule 11: a landing that failed its digest check, whole or a part.
        "corrupt": lambda: c.corrupt(_note(0, attempt), 5.0, detail="digest"),
        "corrupt part": lambda: c.corrupt(Notify(transfer_id="t", attempt=attempt,
                                                 engine_id="P", rank=0, part=0, parts=0), 5.0),
        "corrupt, other notifies": lambda: (c.corrupt(_note(0, attempt), 5.0),
                                            c.receive(_note(1, attempt), 5.0)),
        "zombie corrupt": lambda: c.corrupt(_note(0, 0), 5.0),
        "staged both, scattered, one corrupt": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0),
            lambda: c.receive(_staged(1, attempt), 5.0),
            lambda: c.scatter_done("t", attempt, Peer("P", 0), True, 5.0, corrupt="digest"),
            _scattered(c, 1, attempt)),
        # Rule 10: staged writes and their scatters.
        "staged": lambda: c.receive(_staged(0, attempt), 5.0),
        "staged twice": lambda: (c.receive(_staged(0, attempt), 5.0),
                                 c.receive(_staged(0, attempt), 5.0)),
        "staged both, scattered": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0),
            lambda: c.receive(_staged(1, attempt), 5.0),
            _scattered(c, 0, attempt), _scattered(c, 1, attempt)),
        "staged, scatter failed": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0),
            _scattered(c, 0, attempt, ok=False)),
        "staged, abort, acks, scattered": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0), lambda: c.abort("t", 5.0),
            lambda: c.receive(_ack(0, attempt), 5.0), lambda: c.receive(_ack(1, attempt), 5.0),
            _scattered(c, 0, attempt)),
        "staged, abort, scatter failed": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0), lambda: c.abort("t", 5.0),
            _scattered(c, 0, attempt, ok=False)),
        "staged, abort, grace passes, scattered": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0), lambda: c.abort("t", 5.0),
            lambda: c.handle_timer(16.0), _scattered(c, 0, attempt)),
        "staged, preempt, reissue, scattered": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0), lambda: c.preempt("t", 5.0),
            lambda: c.reissue("t", [30, 31, 32], 5.0),
            lambda: c.receive(_ack(1, attempt), 5.0), _scattered(c, 0, attempt)),
        "staged, preempt, reissue, scatter failed": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0), lambda: c.preempt("t", 5.0),
            lambda: c.reissue("t", [30, 31, 32], 5.0), _scattered(c, 0, attempt, ok=False)),
        "zombie staged": lambda: c.receive(_staged(0, 0), 5.0),
        # Rule 10, pipelined: chunk by chunk, the rank counts at its last chunk's scatter.
        "chunked, scattered": lambda: _then(
            c, lambda: c.receive(_chunk(c, 0, attempt, 0), 5.0), _scattered(c, 0, attempt),
            lambda: c.receive(_chunk(c, 0, attempt, 1), 5.0), _scattered(c, 0, attempt)),
        "chunked, chunk twice": lambda: _then(
            c, lambda: c.receive(_chunk(c, 0, attempt, 0), 5.0),
            lambda: c.receive(_chunk(c, 0, attempt, 0), 5.0)),
        **{f"chunked, {how}, scattered, last lands": (
            lambda move=move: _then(
                c, lambda: c.receive(_chunk(c, 0, attempt, 0), 5.0), *move,
                _scattered(c, 0, attempt), lambda: c.receive(_chunk(c, 0, attempt, 1), 5.0),
                lambda: c.receive(_ack(0, attempt), 5.0),
                lambda: c.receive(_ack(1, attempt), 5.0)))
           for how, move in (("abort", (lambda: c.abort("t", 5.0),)),
                             ("preempt", (lambda: c.preempt("t", 5.0),)),
                             ("window passes", (lambda: c.handle_timer(10.0),)),
                             ("preempt, reissue", (lambda: c.preempt("t", 5.0),
                                                   lambda: c.reissue("t", [30, 31, 32],
                                                                     5.0))))},
        "staged both, window passes, scattered": lambda: _then(
            c, lambda: c.receive(_staged(0, attempt), 5.0),
            lambda: c.receive(_staged(1, attempt), 5.0), lambda: c.handle_timer(10.0),
            _scattered(c, 0, attempt), _scattered(c, 1, attempt)),
        **{f"staged, {how}, {then}": (
            lambda move=move, end=end: _then(
                c, lambda: c.receive(_staged(0, attempt), 5.0), move, *end))
           for how, move in (("preempt", lambda: c.preempt("t", 5.0)),
                             ("window passes", lambda: c.handle_timer(10.0)))
           for then, end in (("scattered", (_scattered(c, 0, attempt),)),
                             ("scatter failed", (_scattered(c, 0, attempt, ok=False),)),
                             ("grace passes, scattered", (lambda: c.handle_timer(16.0),
                                                          _scattered(c, 0, attempt))))},
    }


CONSUMER_CALLS = list(_consumer_calls(_cpair().c[0], None))


def _run_consumer(label, call):
    pair = _cpair()
    state, recipe = CONSUMER_MORE.get(label) or (label, CONSUMER_RECIPES[label])
    if state is not CS.CONNECTING and label not in CONSUMER_MORE:
        _reg_c(pair.c[0])
    c = recipe(pair)
    assert c.state_of("t") is state
    before = _dump(c)
    c.trace = []
    try:
        _consumer_calls(c, pair)[call]()
    except LocalProtocolError:
        assert _dump(c) == before, "a refused call changed the endpoint"
        assert c.trace == []
        return []
    steps = [st for st in c.trace if st.key[0] == "t" and not isinstance(st.state, ZombieState)]
    for st in c.trace:
        if isinstance(st.state, ZombieState):  # zombie steps follow the zombie table
            assert (st.effect, st.next) == ZOMBIE_TABLE[st.state, st.input]
            assert tuple(_kind(a) for a in st.actions) in C_ACTIONS[st.effect]
    end = _check_steps(steps, state, CONSUMER_TABLE, C_ACTIONS, f"{state} {call}")
    now = c.state_of("t")
    assert now in (end, None), f"transfer ended in {now}, the table says {end}"
    if now is None:  # terminal and forgotten: no block may stay lent
        assert end in CONSUMER_TERMINAL and c.lent_blocks() == {}
    return c.trace


@pytest.mark.parametrize("label", [*CONSUMER_RECIPES, *CONSUMER_MORE])
@pytest.mark.parametrize("call", CONSUMER_CALLS)
def test_consumer_endpoint_follows_the_table_exactly(label, call):
    _run_consumer(label, call)


def test_every_consumer_row_is_exercised_through_the_endpoint():
    hit = set()
    for state, call in itertools.product([*CONSUMER_RECIPES, *CONSUMER_MORE], CONSUMER_CALLS):
        hit |= {(st.state, st.input) for st in _run_consumer(state, call)}
    missing = sorted(f"{s.name} x {i.name}" for s, i in
                     (set(CONSUMER_TABLE) | set(ZOMBIE_TABLE)) - hit)
    assert not missing, missing


def test_a_refused_call_leaves_every_field_unchanged():
    """The comparison used above is not vacuous: it sees a changed counter."""
    p = _pair().p[0]
    before = _dump(p)
    p.stats["x"] += 1
    assert _dump(p) != before
