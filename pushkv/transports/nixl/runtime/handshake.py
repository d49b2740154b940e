"""The consumer's card exchange with each producer engine, as a table.

A consumer rank introduces itself to every rank of a producer engine with its
card and waits for each rank's card back (see :mod:`..sidechannel.channel`). Per engine
this is a small state machine; the table below is all of it, and the I/O loop
(:class:`~.loop.IOLoop`) carries out the effect of each arc:

========================  ===================  ==============  ==================
state                      input                effect          next state
========================  ===================  ==============  ==================
NEW / FAILED / DEAD        START, NEEDED        SEND_CARDS      HANDSHAKING
HANDSHAKING                START, NEEDED        --              HANDSHAKING
READY                      START                --              READY
READY                      NEEDED               ANNOUNCE        READY
HANDSHAKING                ANSWER               --              HANDSHAKING
HANDSHAKING                LAST_ANSWER          READY           READY
HANDSHAKING                REFUSED / TIMEOUT    FAIL            FAILED
NEW / READY / FAILED /     ANSWER, LAST_ANSWER  STALE           (same)
DEAD                       REFUSED
any                        DIED                 LOST            DEAD
other states               TIMEOUT              --              (same)
========================  ===================  ==============  ==================

``START`` is ``connect(eager=True)``; ``NEEDED`` the endpoint's ``Connect``
action (a registration waits for the engine); ``ANSWER`` a rank's accepted
card (``LAST_ANSWER`` when it completes the set); ``REFUSED`` a card that
refuses us or that we refuse; ``TIMEOUT`` the handshake deadline (the
consumer's ``handshake_timeout_s``); ``DIED`` every rank of the engine
confirmed dead. Each accepted card is handed to the endpoint at once
(``add_peer``); ``ANNOUNCE`` hands it the cards it already has again (it
asked for an engine this rank is connected to). What a transfer waiting for
the engine becomes is the protocol core's business: the loop tells the
endpoint (``add_peer``, ``handshake_failed``), it does not decide.

A ``STALE`` card is counted by the loop (``stale_cards``); the first of each
kind (an engine not asked, a rank answering from an address other than the one
advertised for it, a card outside a handshake) is also logged, with both
addresses where they differ.

Used by one thread only (the I/O thread); :attr:`Handshakes.ready` may be read
from any (membership tests only).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from pushkv.protocol.errors import ConfigError
from pushkv.protocol.layout import RankInfo


class HandshakeState(enum.Enum):
    NEW = "new"
    HANDSHAKING = "handshaking"
    READY = "ready"
    FAILED = "failed"
    DEAD = "dead"


class HandshakeInput(enum.Enum):
    START = "start"
    NEEDED = "needed"
    ANSWER = "answer"
    LAST_ANSWER = "last_answer"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    DIED = "died"


class Effect(enum.Enum):
    NONE = "none"
    SEND_CARDS = "send_cards"  #: (re)connect to every rank and send our card
    READY = "ready"  #: every rank answered
    ANNOUNCE = "announce"  #: hand the endpoint the cards it already has, again
    FAIL = "fail"  #: the handshake failed: the endpoint fails what waits for it
    STALE = "stale"  #: a card outside a handshake: counted and ignored
    LOST = "lost"  #: the engine died


log = logging.getLogger(__name__)

S, In, E = HandshakeState, HandshakeInput, Effect

TABLE: Final[dict[tuple[HandshakeState, HandshakeInput], tuple[Effect, HandshakeState]]] = {
    **{(s, i): (E.SEND_CARDS, S.HANDSHAKING) for s in (S.NEW, S.FAILED, S.DEAD)
       for i in (In.START, In.NEEDED)},
    (S.HANDSHAKING, In.START): (E.NONE, S.HANDSHAKING),
    (S.HANDSHAKING, In.NEEDED): (E.NONE, S.HANDSHAKING),
    (S.READY, In.START): (E.NONE, S.READY),
    (S.READY, In.NEEDED): (E.ANNOUNCE, S.READY),
    (S.HANDSHAKING, In.ANSWER): (E.NONE, S.HANDSHAKING),
    (S.HANDSHAKING, In.LAST_ANSWER): (E.READY, S.READY),
    (S.HANDSHAKING, In.REFUSED): (E.FAIL, S.FAILED),
    (S.HANDSHAKING, In.TIMEOUT): (E.FAIL, S.FAILED),
    **{(s, i): (E.STALE, s) for s in (S.NEW, S.READY, S.FAILED, S.DEAD)
       for i in (In.ANSWER, In.LAST_ANSWER, In.REFUSED)},
    **{(s, In.DIED): (E.LOST, S.DEAD) for s in S},
    **{(s, In.TIMEOUT): (E.NONE, s) for s in (S.NEW, S.READY, S.FAILED, S.DEAD)},
}


@dataclass(slots=True)
class RemoteEngine:
    """A producer engine this consumer rank talks to, and its handshake."""

    engine_id: str
    addresses: dict[int, str]  #: side-channel address by global rank
    state: HandshakeState = HandshakeState.NEW
    deadline: float = float("inf")
    answered: set[int] = field(default_factory=set)
    infos: dict[int, RankInfo] = field(default_factory=dict)  #: accepted cards, by rank
    error: str = ""


class Handshakes:
    """Every producer engine known to one consumer rank, and the table applied to them."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.engines: dict[str, RemoteEngine] = {}
        #: Engines whose handshake completed (read by the engine thread).
        self.ready: set[str] = set()
        self._noted: set[str] = set()  # kinds of stale card already logged

    def connect(self, engine_id: str, addresses: Mapping[int, str]) -> RemoteEngine:
        """The engine at ``addresses``; ConfigError if it is live at other addresses.

        An engine that failed or died may come back at new addresses (a restart)."""
        eng = self.engines.get(engine_id)
        if eng is None or (eng.addresses != addresses
                           and eng.state in (S.NEW, S.FAILED, S.DEAD)):
            eng = self.engines[engine_id] = RemoteEngine(engine_id, dict(addresses))
        elif eng.addresses != addresses:
            raise ConfigError(f"engine {engine_id!r} is live with other addresses")
        return eng

    def fire(self, eng: RemoteEngine, inp: HandshakeInput, now: float, why: str = "") -> Effect:
        """Apply one input; returns the effect the caller carries out."""
        effect, nxt = TABLE[eng.state, inp]
        eng.state = nxt
        if effect is E.SEND_CARDS:
            eng.deadline, eng.error = now + self.timeout_s, ""
            eng.answered.clear()
            eng.infos.clear()
        elif effect is E.FAIL:
            eng.error = why
        if nxt is S.READY:
            self.ready.add(eng.engine_id)
        else:
            self.ready.discard(eng.engine_id)
        if nxt is not S.HANDSHAKING:
            eng.deadline = float("inf")
        return effect

    def answer(self, info: RankInfo, address: str, ok: bool, now: float,
               why: str = "") -> tuple[RemoteEngine | None, Effect]:
        """A card came back from ``info``'s rank at ``address`` (``ok``: accepted)."""
        who = f"rank {info.rank} of {info.engine_id!r} ({address})"
        eng = self.engines.get(info.engine_id)
        if eng is None:
            return self._stale("unknown", f"{who}: no handshake with that engine")
        if eng.addresses.get(info.rank) != address:
            return self._stale("address", f"{who}: that rank's advertised address is "
                               f"{eng.addresses.get(info.rank)}")
        if not ok:
            effect = self.fire(eng, In.REFUSED, now, why)
        else:
            if eng.state is S.HANDSHAKING:
                eng.answered.add(info.rank)
                eng.infos[info.rank] = info
            last = eng.answered >= set(eng.addresses)
            effect = self.fire(eng, In.LAST_ANSWER if last else In.ANSWER, now)
        if effect is E.STALE:
            self._stale("late", f"{who}: it came while the handshake is {eng.state.value} "
                        "(an answer after the deadline, or a duplicate)")
        return eng, effect

    def _stale(self, kind: str, detail: str) -> tuple[None, Effect]:
        """A card no handshake waits for: log the first of each kind (all are counted)."""
        if kind not in self._noted:
            self._noted.add(kind)
            log.warning("pushkv: stale handshake card from %s; ignored and counted as "
                        "stale_cards (further ones of this kind are not logged)", detail)
        return None, E.STALE

    def expired(self, now: float) -> list[RemoteEngine]:
        """Engines whose handshake deadline passed (still HANDSHAKING)."""
        if not self.engines:  # a producer's loop asks every pass
            return []
        return [e for e in self.engines.values()
                if e.state is S.HANDSHAKING and now >= e.deadline]

    def next_deadline(self) -> float:
        if not self.engines:
            return float("inf")
        return min(e.deadline for e in self.engines.values())
