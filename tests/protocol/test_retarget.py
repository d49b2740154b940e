"""Rule 12: a held source re-targeted to another consumer engine.

The decode engine a request was sent to (``D``) is lost -- it died, froze, or a
router gave up on it -- and the router sends the decode leg to another engine
(``E``) at a later turn. The producer writes its held source to ``E``; prefill
is not repeated; nothing of ``D``'s attempt may land in blocks ``D`` no longer
lends to it, even if ``D`` comes back. The property test drives real endpoints
over the in-memory transport's adversarial delivery (a write's bytes land in
pieces, apart from its completion, as NIXL states), at every moment of the
transfer's life a re-target can come.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pushkv.protocol import (
    Cancel,
    ConfigError,
    ConsumerConfig,
    Consumed,
    Fail,
    FailReason,
    Peer,
    ProducerConfig,
    Register,
    Rejected,
    SendMessage,
    Skip,
)
from pushkv.protocol.layout import uniform_ranks
from pushkv.transports.conformance import reference_destination
from pushkv.transports.inmemory import InMemoryNetwork, region_memory

from .helpers import Pair, msgs

SRC, DST_D, DST_E, N = (9, 3, 17), (5, 6, 7), (1, 2, 4), 40


def _pair_with_e():
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0))
    for info in uniform_ranks("E", num_kv_heads=2):
        pair.p[0].add_peer(info)
    return pair


def _reg(engine, attempt=0, target=0, blocks=DST_D):
    return Register(transfer_id="t", attempt=attempt, engine_id=engine, rank=0,
                    producer_engine_id="P", block_ids=blocks, num_tokens=N, target=target)


def _fails(actions, engine):
    return [a.message for a in actions if isinstance(a, SendMessage)
            and isinstance(a.message, Fail) and a.peer.engine_id == engine]


def test_a_registered_leg_is_failed_and_the_new_engine_written():
    pair = _pair_with_e()
    p = pair.p[0]
    p.receive(_reg("D"), 0.0)
    out = p.receive(_reg("E", target=1, blocks=DST_E), 1.0)
    (fail,) = _fails(out, "D")
    assert fail.reason is FailReason.RETARGETED and (fail.posted, fail.failed) == (0, 0)
    out = p.prefill_finished("t", list(SRC), N, 2.0)
    assert [a.peer for a in out if type(a).__name__ == "IssueWrite"] == [Peer("E", 0)]
    assert p.stats["retargeted"] == 1


def test_a_write_in_flight_is_failed_with_its_count_and_holds_the_source():
    pair = _pair_with_e()
    p = pair.p[0]
    p.receive(_reg("D"), 0.0)
    p.prefill_finished("t", list(SRC), N, 0.0)  # the write into D is posted
    out = p.receive(_reg("E", target=1, blocks=DST_E), 1.0)
    (fail,) = _fails(out, "D")
    assert fail.posted == 1, "D must wait for the write in flight (its fence)"
    # E is written only now; the source stays held until D's write completed too.
    out = p.write_completed("t", 0, Peer("E", 0), True, 2.0)
    assert not any(type(a).__name__ == "ReleaseSource" for a in out)
    out = p.write_completed("t", 0, Peer("D", 0), True, 3.0)
    assert any(type(a).__name__ == "ReleaseSource" for a in out)


def test_the_engine_left_behind_cannot_take_the_source_back():
    pair = _pair_with_e()
    p = pair.p[0]
    p.receive(_reg("D"), 0.0)
    p.receive(_reg("E", target=1, blocks=DST_E), 0.0)
    # D comes back (a freeze) and reissues, or cancels for good: neither reopens
    # its leg nor releases the source E is waiting for.
    (fail,) = _fails(p.receive(_reg("D", attempt=1), 1.0), "D")
    assert fail.reason is FailReason.RETARGETED
    p.receive(Cancel(transfer_id="t", attempt=1, engine_id="D", rank=0, final=True), 1.0)
    p.receive(Skip(transfer_id="t", engine_id="D", rank=0, producer_engine_id="P"), 1.0)
    out = p.prefill_finished("t", list(SRC), N, 2.0)
    assert [a.peer for a in out if type(a).__name__ == "IssueWrite"] == [Peer("E", 0)]


def _kinds(actions):
    return [type(a).__name__ for a in actions]


@pytest.mark.parametrize("hold", [0.0, 5.0])
def test_a_dead_engines_source_is_held_for_a_retarget_only_when_asked(hold):
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=hold))
    p = pair.p[0]
    for info in uniform_ranks("E", num_kv_heads=2):
        p.add_peer(info)
    p.receive(_reg("D"), 0.0)
    p.peer_died("D", 1.0)
    out = p.prefill_finished("t", list(SRC), N, 1.5)
    if not hold:  # today's default: the source goes with its engine
        assert "ReleaseSource" in _kinds(out)
        (fail,) = _fails(p.receive(_reg("E", target=1, blocks=DST_E), 2.0), "E")
        assert fail.reason is FailReason.SOURCE_RELEASED
        return
    assert "ReleaseSource" not in _kinds(out)
    assert p.next_deadline() == pytest.approx(6.0)  # death + hold
    out = p.receive(_reg("E", target=1, blocks=DST_E), 2.0)
    assert [a.peer for a in out if type(a).__name__ == "IssueWrite"] == [Peer("E", 0)]
    # Unclaimed, a held source goes when the hold ends.
    q = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
             pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=hold)).p[0]
    q.receive(_reg("D"), 0.0)
    q.peer_died("D", 1.0)
    assert "ReleaseSource" not in _kinds(q.prefill_finished("t", list(SRC), N, 1.5))
    assert "ReleaseSource" in _kinds(q.handle_timer(6.0))


def _rejected(actions):
    return [str(a.error) for a in actions if isinstance(a, Rejected)]


def test_a_turn_that_does_not_follow_the_rule_is_refused_and_changes_nothing():
    pair = _pair_with_e()
    p = pair.p[0]
    p.receive(_reg("D"), 0.0)
    before = p.leg_state("t", Peer("D", 0))
    (why,) = _rejected(p.receive(_reg("D", attempt=1, target=3), 1.0))
    assert "turn 3 from the engine bound at turn 0" in why
    assert p.leg_state("t", Peer("D", 0)) is before
    p.receive(_reg("E", target=1, blocks=DST_E), 1.0)
    (why,) = _rejected(p.receive(_reg("D", attempt=2, target=2), 1.0))
    assert "bound to before" in why
    assert p.leg_state("t", Peer("E", 0)) is not None


def test_the_consumer_sends_its_turn():
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2})
    out = pair.c[0].register("t", "P", list(DST_E), N, 0.0, target=2)
    (reg,) = [a.message for a in out if isinstance(a, SendMessage)]
    assert reg.target == 2
    with pytest.raises(ConfigError, match="target"):
        pair.c[0].register("u", "P", [9], N, 0.0, target=-1)


# ----------------------------------------------------- under weak visibility


def _network(seed, e_tp, hold=0.0):
    net = InMemoryNetwork(seed=seed, latency=0.001, write_latency=0.002, keep_log=True)
    rng = np.random.default_rng(seed)
    (prod,) = uniform_ranks("P", num_kv_heads=2, block_size=16)
    net.add_producer(prod, ProducerConfig(lease_s=30.0, retarget_hold_s=hold),
                     region_memory(prod.layout, rng=rng))
    cfg = ConsumerConfig(window_s=5.0, fence_grace_s=2.0)
    for info in [*uniform_ranks("D", num_kv_heads=2, block_size=16),
                 *uniform_ranks("E", tp=e_tp, num_kv_heads=2, block_size=16)]:
        net.add_consumer(info, cfg)
    net.handshake()
    return net


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), prefill_at=st.integers(0, 12),
       retarget_at=st.integers(0, 12), after=st.sampled_from(["nothing", "abort", "kill"]),
       e_tp=st.sampled_from([1, 2]), hold=st.sampled_from([0.0, 5.0]))
def test_a_retarget_at_any_moment_writes_the_new_engine_and_spares_the_old(
        seed, prefill_at, retarget_at, after, e_tp, hold):
    """With ``retarget_hold_s`` the source also outlives D's READY (D never reports
    its first decode step here), so E is written whenever D was not aborted."""
    net = _network(seed, e_tp, hold)
    (p,) = net.producers.values()
    d = net.consumers[Peer("D", 0)]
    es = [n for peer, n in net.consumers.items() if peer.engine_id == "E"]
    d.apply(d.endpoint.register("t", "P", list(DST_D), N, net.now))
    for step in range(max(prefill_at, retarget_at) + 2):
        if step == prefill_at:
            p.apply(p.endpoint.prefill_finished("t", list(SRC), N, net.now))
        if step == retarget_at:  # the router lost D: the same source goes to E
            for e in es:
                e.apply(e.endpoint.register("t", "P", list(DST_E), N, net.now, target=1))
            if after == "kill":
                net.kill("D")
        if step == retarget_at + 1 and after == "abort" and d.outcome("t") is None:
            # D was only frozen: once E's registration is out, the router ends the
            # request there too (its final Cancel must not take the source from E).
            d.apply(d.endpoint.abort("t", net.now))
        net.advance(0.0007)
    net.run()
    net.advance(60.0)  # every deadline, grace and lease passes
    assert not net.violations, net.violations
    p_log = [a for _, a in p.log]
    for e in es:
        if e.outcome("t") != "ready":
            # Only because the source was released for D (its write done, or its
            # final Cancel in) before E's registration reached the producer: E fails
            # at once (SOURCE_RELEASED) and the router recomputes; nothing stays lent.
            # With a hold, only D's final Cancel (an abort overtaking E's Register)
            # can release it first.
            assert not hold or after == "abort"
            (failed,) = [a for _, a in e.log if type(a).__name__ == "TransferFailed"]
            assert failed.code is FailReason.SOURCE_RELEASED
            released = next(i for i, a in enumerate(p_log)
                            if type(a).__name__ == "ReleaseSource")
            answered = next(i for i, a in enumerate(p_log) if isinstance(a, SendMessage)
                            and a.peer == e.peer and isinstance(a.message, Fail))
            assert released < answered
            assert not _fails([a for a in p_log if isinstance(a, SendMessage)], "D")
            assert not e.endpoint.lent_blocks()
            event("the source was released before the re-target arrived")
            continue
        event("re-targeted while held: E written")
        # E was written, exactly the source's bytes.
        assert e.outcome("t") == "ready", (e.peer, e.outcomes)
        want = reference_destination([p.info], [p.memory], e.info, [(SRC, DST_E, N, 0)])
        got = e.memory
        for b in DST_E:
            lo = e.info.layout
            for w, g in zip(want, got, strict=True):
                assert np.array_equal(w[b * lo.stride:(b + 1) * lo.stride],
                                      g[b * lo.stride:(b + 1) * lo.stride])
        assert not e.endpoint.lent_blocks()
    # D ended one way or another and lends nothing any more; prefill ran once and
    # the source was released once (a second release is a violation above).
    if after != "kill":
        assert d.outcome("t") in ("ready", "failed", "cancelled")
        assert not d.endpoint.lent_blocks()
    assert not p.endpoint.held_blocks()


# ------------------------------------------- rule 12 after READY: the linger


def _written_to_d(hold, *, ccfg=None):
    """D registered, prefill finished, the write landed: D is READY."""
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=hold), ccfg=ccfg)
    p, c = pair.p[0], pair.c[0]
    for info in uniform_ranks("E", num_kv_heads=2):
        p.add_peer(info)
    pair.to_producers(c.register("t", "P", list(DST_D), N, 0.0))
    writes = p.prefill_finished("t", list(SRC), N, 0.0)
    back, notes = pair.complete(writes)
    assert "TransferReady" in _kinds(notes)
    return pair, back


def test_a_written_source_lingers_until_its_engine_consumed_it():
    pair, back = _written_to_d(5.0)
    p, c = pair.p[0], pair.c[0]
    assert "ReleaseSource" not in _kinds(back), "released before the first decode step"
    assert p.held_blocks() and p.stats["lingered"] == 1
    out = c.consumed("t", 0.5)
    (msg,) = [a.message for a in out if isinstance(a, SendMessage)]
    assert (msg.transfer_id, msg.engine_id, msg.producer_engine_id) == ("t", "D", "P")
    pair.now = 0.5
    assert "ReleaseSource" in _kinds(pair.to_producers(out))
    assert not p.held_blocks() and p.stats["consumed"] == 1
    # Told once: a repeat sends nothing.
    assert c.consumed("t", 0.6) == [] and c.stats["consumed_unknown"] == 1


def test_a_source_lost_after_ready_is_written_again_not_computed_again():
    """The decode engine died (or froze) between READY and its first token: the
    router's turn-1 Register finds the source held and E is written from it."""
    pair, _ = _written_to_d(5.0)
    p = pair.p[0]
    out = p.receive(_reg("E", target=1, blocks=DST_E), 1.0)
    assert not _fails(out, "D"), "D's leg was written: nothing to fail"
    (write,) = [a for a in out if type(a).__name__ == "IssueWrite"]
    assert write.peer == Peer("E", 0)
    out = p.write_completed("t", 0, Peer("E", 0), True, 1.5)
    assert "ReleaseSource" not in _kinds(out), "E's own linger"
    # D's Consumed (it came back) is not E's: nothing goes.
    d_said = Consumed(transfer_id="t", engine_id="D", rank=0, producer_engine_id="P")
    assert p.receive(d_said, 2.0) == [] and p.held_blocks()
    e_said = Consumed(transfer_id="t", engine_id="E", rank=0, producer_engine_id="P")
    assert "ReleaseSource" in _kinds(p.receive(e_said, 2.0))
    assert p.stats["retargeted"] == 1


def test_a_linger_ends_at_the_hold_or_the_lease():
    pair, _ = _written_to_d(5.0)
    p = pair.p[0]
    assert p.next_deadline() == pytest.approx(5.0)
    assert "ReleaseSource" not in _kinds(p.handle_timer(4.9))
    assert "ReleaseSource" in _kinds(p.handle_timer(5.0))
    (fail,) = _fails(p.receive(_reg("E", target=1, blocks=DST_E), 6.0), "E")
    assert fail.reason is FailReason.SOURCE_RELEASED
    # A lease shorter than the hold bounds it.
    q = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
             pcfg=ProducerConfig(lease_s=2.0, retarget_hold_s=5.0))
    q.to_producers(q.c[0].register("t", "P", list(DST_D), N, 0.0))
    q.complete(q.p[0].prefill_finished("t", list(SRC), N, 0.0))
    assert q.p[0].held_blocks()
    assert "ReleaseSource" in _kinds(q.p[0].handle_timer(2.0))


def test_without_a_hold_the_source_goes_when_written_and_consumed_is_harmless():
    pair, back = _written_to_d(0.0)
    p, c = pair.p[0], pair.c[0]
    assert "ReleaseSource" in _kinds(back) and p.stats["lingered"] == 0
    pair.now = 1.0
    assert pair.to_producers(c.consumed("t", 1.0)) == []
    assert p.stats["stale"] == 1 and p.stats["consumed"] == 0


def test_a_consumed_report_that_lies_is_refused_and_changes_nothing():
    pair, _ = _written_to_d(5.0)
    p = pair.p[0]
    wrong = Consumed(transfer_id="t", engine_id="D", rank=0, producer_engine_id="Q")
    assert "another engine" in _rejected(p.receive(wrong, 1.0))[0]
    stranger = Consumed(transfer_id="t", engine_id="X", rank=0, producer_engine_id="P")
    assert _rejected(p.receive(stranger, 1.0))
    unknown = Consumed(transfer_id="u", engine_id="D", rank=0, producer_engine_id="P")
    assert p.receive(unknown, 1.0) == []
    assert p.held_blocks(), "nothing above released the source"


def test_the_consumer_remembers_ready_pushes_within_its_bound():
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=5.0),
                ccfg=ConsumerConfig(max_unconsumed=1))
    p, c = pair.p[0], pair.c[0]
    for tid, blocks in (("t", DST_D), ("u", DST_E)):
        pair.to_producers(c.register(tid, "P", list(blocks), N, 0.0))
        pair.complete(p.prefill_finished(tid, list(SRC), N, 0.0))
    assert c.stats["unconsumed_dropped"] == 1
    assert c.consumed("t", 1.0) == []  # dropped: the producer's hold decides
    assert len(c.consumed("u", 1.0)) == 1
    with pytest.raises(ConfigError, match="max_unconsumed"):
        ConsumerConfig(max_unconsumed=-1)


def test_a_final_cancel_after_the_write_ends_the_linger():
    """Found by the checker's retarget-linger scope: D aborted after P's write was
    posted; the write completed (the leg DONE, lingering) and D's final Cancel of
    that attempt then found a finished leg. It must end the linger at once, not
    leave the source to the hold timer."""
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=5.0))
    p = pair.p[0]
    p.receive(_reg("D"), 0.0)
    (write,) = [a for a in p.prefill_finished("t", list(SRC), N, 0.0)
                if type(a).__name__ == "IssueWrite"]
    assert "ReleaseSource" not in _kinds(p.write_completed("t", 0, Peer("D", 0), True, 0.1))
    out = p.receive(Cancel(transfer_id="t", attempt=0, engine_id="D", rank=0, final=True), 0.2)
    assert "ReleaseSource" in _kinds(out)
    assert not p.held_blocks()


def test_a_write_that_failed_lingers_too_and_a_live_consumer_lets_it_go():
    """A write fails as it does when its engine just died, before anyone knows: the
    source stays for a re-target (found by the simulator's failover scenario, where
    such a request was computed again). A consumer that is alive gives the transfer
    up on the Fail and tells that rank Consumed, so nothing waits for the hold."""
    pair = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=5.0))
    p, c = pair.p[0], pair.c[0]
    for info in uniform_ranks("E", num_kv_heads=2):
        p.add_peer(info)
    pair.to_producers(c.register("t", "P", list(DST_D), N, 0.0))
    writes = p.prefill_finished("t", list(SRC), N, 0.0)
    back, _ = pair.complete(writes, ok=False)
    assert "ReleaseSource" not in _kinds(back) and p.held_blocks()
    # The engine is gone (nobody delivers the Fail): E is written from the source.
    out = p.receive(_reg("E", target=1, blocks=DST_E), 1.0)
    assert [a.peer for a in out if type(a).__name__ == "IssueWrite"] == [Peer("E", 0)]
    # Alive, the consumer takes the Fail, gives up and says so: the source goes.
    pair2 = Pair(producer={"num_kv_heads": 2}, consumer={"num_kv_heads": 2},
                 pcfg=ProducerConfig(lease_s=100.0, retarget_hold_s=5.0))
    p2, c2 = pair2.p[0], pair2.c[0]
    pair2.to_producers(c2.register("t", "P", list(DST_D), N, 0.0))
    back, _ = pair2.complete(p2.prefill_finished("t", list(SRC), N, 0.0), ok=False)
    answers = pair2.to_consumers(back)
    assert [type(m).__name__ for m in msgs(answers, Consumed)] == ["Consumed"]
    assert "ReleaseSource" in _kinds(pair2.to_producers(answers))
