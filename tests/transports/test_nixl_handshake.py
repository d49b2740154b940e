"""The card-exchange table of the NIXL runtime: every (state, input) pair."""

from __future__ import annotations

import logging
import time

import pytest

from pushkv.protocol import ConfigError, uniform_ranks
from pushkv.transports.nixl.runtime.handshake import (
    TABLE,
    Effect,
    HandshakeInput,
    Handshakes,
    HandshakeState,
)
from pushkv.vllm.testing import free_port

S, In, E = HandshakeState, HandshakeInput, Effect

#: The whole behaviour, written out pair by pair (the table is checked against it).
EXPECTED = {
    (S.NEW, In.START): (E.SEND_CARDS, S.HANDSHAKING),
    (S.NEW, In.NEEDED): (E.SEND_CARDS, S.HANDSHAKING),
    (S.NEW, In.ANSWER): (E.STALE, S.NEW),
    (S.NEW, In.LAST_ANSWER): (E.STALE, S.NEW),
    (S.NEW, In.REFUSED): (E.STALE, S.NEW),
    (S.NEW, In.TIMEOUT): (E.NONE, S.NEW),
    (S.NEW, In.DIED): (E.LOST, S.DEAD),
    (S.HANDSHAKING, In.START): (E.NONE, S.HANDSHAKING),
    (S.HANDSHAKING, In.NEEDED): (E.NONE, S.HANDSHAKING),
    (S.HANDSHAKING, In.ANSWER): (E.NONE, S.HANDSHAKING),
    (S.HANDSHAKING, In.LAST_ANSWER): (E.READY, S.READY),
    (S.HANDSHAKING, In.REFUSED): (E.FAIL, S.FAILED),
    (S.HANDSHAKING, In.TIMEOUT): (E.FAIL, S.FAILED),
    (S.HANDSHAKING, In.DIED): (E.LOST, S.DEAD),
    (S.READY, In.START): (E.NONE, S.READY),
    (S.READY, In.NEEDED): (E.ANNOUNCE, S.READY),
    (S.READY, In.ANSWER): (E.STALE, S.READY),
    (S.READY, In.LAST_ANSWER): (E.STALE, S.READY),
    (S.READY, In.REFUSED): (E.STALE, S.READY),
    (S.READY, In.TIMEOUT): (E.NONE, S.READY),
    (S.READY, In.DIED): (E.LOST, S.DEAD),
    (S.FAILED, In.START): (E.SEND_CARDS, S.HANDSHAKING),
    (S.FAILED, In.NEEDED): (E.SEND_CARDS, S.HANDSHAKING),
    (S.FAILED, In.ANSWER): (E.STALE, S.FAILED),
    (S.FAILED, In.LAST_ANSWER): (E.STALE, S.FAILED),
    (S.FAILED, In.REFUSED): (E.STALE, S.FAILED),
    (S.FAILED, In.TIMEOUT): (E.NONE, S.FAILED),
    (S.FAILED, In.DIED): (E.LOST, S.DEAD),
    (S.DEAD, In.START): (E.SEND_CARDS, S.HANDSHAKING),
    (S.DEAD, In.NEEDED): (E.SEND_CARDS, S.HANDSHAKING),
    (S.DEAD, In.ANSWER): (E.STALE, S.DEAD),
    (S.DEAD, In.LAST_ANSWER): (E.STALE, S.DEAD),
    (S.DEAD, In.REFUSED): (E.STALE, S.DEAD),
    (S.DEAD, In.TIMEOUT): (E.NONE, S.DEAD),
    (S.DEAD, In.DIED): (E.LOST, S.DEAD),
}


def test_the_table_covers_every_pair_exactly() -> None:
    assert set(TABLE) == {(s, i) for s in S for i in In}
    assert TABLE == EXPECTED


@pytest.mark.parametrize(("state", "inp"), sorted(EXPECTED, key=lambda k: (k[0].value,
                                                                              k[1].value)))
def test_fire_applies_each_pair(state: HandshakeState, inp: HandshakeInput) -> None:
    hs = Handshakes(timeout_s=2.0)
    eng = hs.connect("p", {0: "tcp://a:1"})
    eng.state = state
    if state is S.READY:
        hs.ready.add("p")
    effect = hs.fire(eng, inp, now=10.0, why="because")
    want_effect, want_state = EXPECTED[state, inp]
    assert (effect, eng.state) == (want_effect, want_state)
    assert ("p" in hs.ready) == (want_state is S.READY)
    assert eng.deadline == (12.0 if want_effect is E.SEND_CARDS else
                            float("inf") if want_state is not S.HANDSHAKING else eng.deadline)
    if want_effect is E.FAIL:
        assert eng.error == "because"


def test_answers_complete_the_set_then_time_out_nothing() -> None:
    infos = uniform_ranks("p", tp=2)
    hs = Handshakes(timeout_s=1.0)
    eng = hs.connect("p", {0: "tcp://a:1", 1: "tcp://a:2"})
    assert hs.fire(eng, In.START, 0.0) is E.SEND_CARDS
    assert hs.next_deadline() == 1.0
    assert hs.answer(infos[0], "tcp://a:9", True, 0.1) == (None, E.STALE)  # wrong address
    assert hs.answer(infos[0], "tcp://a:1", True, 0.1) == (eng, E.NONE)
    assert hs.answer(infos[1], "tcp://a:2", True, 0.2) == (eng, E.READY)
    assert eng.infos == {0: infos[0], 1: infos[1]} and "p" in hs.ready
    assert hs.expired(5.0) == [] and hs.next_deadline() == float("inf")


def test_a_refusal_or_the_deadline_fails_the_handshake() -> None:
    info = uniform_ranks("p")[0]
    hs = Handshakes(timeout_s=1.0)
    eng = hs.connect("p", {0: "tcp://a:1"})
    hs.fire(eng, In.START, 0.0)
    assert hs.answer(info, "tcp://a:1", False, 0.5, "bad layout") == (eng, E.FAIL)
    assert eng.error == "bad layout" and eng.state is S.FAILED
    hs.fire(eng, In.NEEDED, 2.0)
    assert hs.expired(2.5) == [] and hs.expired(3.0) == [eng]


def test_an_engine_comes_back_at_new_addresses_only_when_not_live() -> None:
    hs = Handshakes(timeout_s=1.0)
    eng = hs.connect("p", {0: "tcp://a:1"})
    hs.fire(eng, In.START, 0.0)
    with pytest.raises(ConfigError, match="other addresses"):
        hs.connect("p", {0: "tcp://b:1"})
    hs.fire(eng, In.DIED, 0.5)
    again = hs.connect("p", {0: "tcp://b:1"})
    assert again is not eng and again.state is S.NEW


# ------------------------------------------------------------- real runtimes


def _events_until(rt: object, done: object, timeout_s: float = 20.0) -> list[object]:
    """Poll ``rt`` until ``done(events so far)`` holds or the deadline passes."""
    seen: list[object] = []
    end = time.monotonic() + timeout_s
    while not done(seen) and time.monotonic() < end:  # type: ignore[operator]
        rt.wait(0.05)  # type: ignore[attr-defined]
        seen += rt.poll()  # type: ignore[attr-defined]
    return seen


@pytest.mark.nixl
def test_an_answer_after_the_deadline_is_counted_logged_and_the_next_attempt_connects(
        caplog: pytest.LogCaptureFixture) -> None:
    """A producer rank that answers only after the consumer's handshake deadline (as a
    vLLM TP worker does whose process is starved: its first forward compiles on a core
    another engine spins on). Its late card must not vanish silently: it is counted
    (``stale_cards``) and logged once, naming the rank and why; the registration that
    waited failed (HANDSHAKE_FAILED), and the next one handshakes again and lands."""
    pytest.importorskip("nixl._api", reason="the nixl package is not installed")
    from pushkv.protocol import ConsumerConfig, FailReason, TransferFailed, TransferReady
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlConfig, NixlRuntime

    port = free_port()  # the producer binds it only after the deadline
    c_info, p_info = uniform_ranks("decode-late")[0], uniform_ranks("prefill-late")[0]
    cons = NixlRuntime(c_info, region_memory(c_info.layout), role="consumer",
                       consumer_config=ConsumerConfig(handshake_timeout_s=0.5))
    prod = None
    caplog.set_level(logging.WARNING, logger="pushkv.transports.nixl.runtime.handshake")
    try:
        cons.connect("prefill-late", {0: f"tcp://127.0.0.1:{port}"})
        cons.register("t1", "prefill-late", [5], 16, incarnation=1)
        events = _events_until(cons, lambda ev: any(isinstance(e, TransferFailed) for e in ev))
        failed = [e for e in events if isinstance(e, TransferFailed)]
        assert [e.code for e in failed] == [FailReason.HANDSHAKE_FAILED], events

        # The card queued for the producer reaches it now; its answer comes late.
        prod = NixlRuntime(p_info, region_memory(p_info.layout, fill=7), role="producer",
                           config=NixlConfig(port=port))
        end = time.monotonic() + 20
        while cons.stats().get("stale_cards", 0) < 1 and time.monotonic() < end:
            cons.wait(0.05)
        assert cons.stats().get("stale_cards") == 1
        stale = [r.getMessage() for r in caplog.records if "stale" in r.getMessage()]
        assert len(stale) == 1, caplog.text
        assert "rank 0 of 'prefill-late'" in stale[0] and "failed" in stale[0]

        cons.register("t2", "prefill-late", [6], 16, incarnation=2)
        prod.prefill_finished("t2", [1], 16, incarnation=2)
        events = _events_until(cons, lambda ev: any(isinstance(e, TransferReady) for e in ev))
        assert TransferReady(transfer_id="t2", attempt=0, incarnation=2) in events, events
    finally:
        cons.close()
        if prod is not None:
            prod.close()


def test_frames_dropped_by_authentication_are_counted_each_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """A side channel drops frames that fail authentication (here: signed with another
    key); each is counted by reason, the first of each reason is logged, and none
    reaches the caller."""
    pytest.importorskip("zmq", reason="pyzmq is not installed")
    from pushkv.transports.nixl.sidechannel.auth import FAILED, SideKey
    from pushkv.transports.nixl.sidechannel.channel import HELLO, SideChannel

    caplog.set_level(logging.WARNING, logger="pushkv.transports.nixl.sidechannel.channel")
    rx = SideChannel("127.0.0.1", key=SideKey(b"k" * 32), me="e/0")
    tx = SideChannel("127.0.0.1", key=SideKey(b"x" * 32), me="e/1")
    try:
        tx.open(rx.address, "e/0")
        for i in range(3):
            assert tx.send(rx.address, HELLO, b"card %d" % i)
        frames: list[object] = []
        end = time.monotonic() + 10
        while rx.auth_dropped.get(FAILED, 0) < 3 and time.monotonic() < end:
            frames += rx.poll(0.05)[0]
        assert rx.auth_dropped == {FAILED: 3} and frames == []
        logged = [r.getMessage() for r in caplog.records]
        assert len(logged) == 1 and FAILED in logged[0] and "e/0" in logged[0], logged
    finally:
        tx.close(0)
        rx.close(0)


@pytest.mark.nixl
def test_malformed_frames_are_refused_counted_each_and_logged_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """Frames of no known shape reaching a runtime: each is counted (``rejected``) and
    reported as an event; the first is logged."""
    pytest.importorskip("nixl._api", reason="the nixl package is not installed")
    import zmq

    from pushkv.protocol import Rejected
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime

    caplog.set_level(logging.WARNING, logger="pushkv.transports.nixl.runtime.loop")
    info = uniform_ranks("prefill-junk")[0]
    rt = NixlRuntime(info, region_memory(info.layout), role="producer")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        push.connect(rt.address)
        for junk in (b"junk", b"more junk"):
            push.send(junk)  # one part: no kind
        events = _events_until(rt, lambda ev: sum(isinstance(e, Rejected) for e in ev) >= 2)
        assert sum(isinstance(e, Rejected) for e in events) == 2
        end = time.monotonic() + 10
        while rt.stats().get("rejected", 0) < 2 and time.monotonic() < end:
            rt.wait(0.05)
        assert rt.stats()["rejected"] == 2
        logged = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(logged) == 1 and "malformed" in logged[0], logged
    finally:
        push.close(0)
        ctx.term()
        rt.close()
