"""The card-exchange table of the NIXL runtime: every (state, input) pair."""

from __future__ import annotations

import pytest

from pushkv.protocol import ConfigError, uniform_ranks
from pushkv.transports.runtime_handshake import (
    TABLE,
    Effect,
    HandshakeInput,
    Handshakes,
    HandshakeState,
)

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
