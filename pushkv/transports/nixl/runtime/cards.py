"""The I/O loop's half that meets peers: the card exchange and liveness.

:class:`CardExchange` is a part of :class:`~.loop.IOLoop`, kept apart
because it is one concept: a consumer sends its card to every rank of a producer
engine and the table of :mod:`.handshake` says what each answer does; a
producer checks a consumer's card and answers with its own; every card is
validated before NIXL or the endpoint sees the peer (:func:`~.peers.card_problem`);
an engine whose ranks are all confirmed dead is handed to the endpoint
(``peer_died``). Everything here runs on the I/O thread.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import TYPE_CHECKING, Any

from pushkv.protocol import DecodeError, Hello, Peer, PushKVError, RankInfo, ValidationError, decode
from pushkv.protocol.errors import ConfigError

from ..agent import nixl_status
from ..sidechannel import channel as sc
from ..sidechannel.auth import identity
from .events import PeerLost
from .handshake import Effect, HandshakeInput, RemoteEngine
from .peers import Link, card_problem

if TYPE_CHECKING:
    from ..agent import Agent
    from .handshake import Handshakes
    from .peers import PeerTable

log = logging.getLogger("pushkv.transports.nixl.runtime.loop")


class CardExchange:
    """Handshakes and peer deaths, for the I/O loop (attributes are the loop's)."""

    role: str
    handshakes: Handshakes
    _agent: Agent
    _peers: PeerTable
    _side: sc.SideChannel
    _card: sc.PeerCard
    _stats: Counter[str]
    _endpoint: Any

    # the loop's own methods this half calls
    def _apply(self, actions: Any, now: float) -> None: raise NotImplementedError
    def _consumer(self) -> Any: raise NotImplementedError
    def _reject(self, peer: Any, why: str, cls: Any = ...) -> None: raise NotImplementedError
    def _emit(self, event: Any) -> None: raise NotImplementedError
    def _pulls_settled(self, engine_id: str, now: float, error: str = "") -> None:
        raise NotImplementedError

    # ----------------------------------------------------------- handshake

    def _handshake_needed(self, engine_id: str, now: float) -> None:
        """The endpoint waits for ``engine_id`` (its ``Connect`` action)."""
        eng = self.handshakes.engines.get(engine_id)
        if eng is None:  # cannot happen through register(), which checks first
            self._apply(self._consumer().handshake_failed(
                engine_id, f"no side-channel address for producer engine {engine_id!r}",
                now), now)
            return
        self._start_handshake(eng, now, HandshakeInput.NEEDED)

    def _start_handshake(self, eng: RemoteEngine, now: float,
                         inp: HandshakeInput = HandshakeInput.START) -> None:
        effect = self.handshakes.fire(eng, inp, now)
        if effect is Effect.ANNOUNCE:  # the endpoint asks again for an engine we know
            for info in eng.infos.values():
                self._apply(self._endpoint.add_peer(info, now=now), now)
        if effect is not Effect.SEND_CARDS:
            return
        self._stats["handshakes_started"] += 1
        body = sc.encode_card(self._card)
        for rank, address in eng.addresses.items():
            link = self._peers.links.get(address)
            if link is not None and link.dead:  # a fresh attempt at an address that died
                self._peers.forget(link)
            self._peers.link(address, identity(eng.engine_id, rank))
            self._side.send(address, sc.HELLO, body)

    def _on_card(self, body: bytes, now: float) -> None:
        try:
            card = sc.decode_card(body)
            hello = decode(card.hello)
            if not isinstance(hello, Hello):
                raise DecodeError("handshake card without a Hello")
        except DecodeError as exc:
            self._reject(None, exc.message)
            return
        info = hello.info
        peer = Peer(info.engine_id, info.rank)
        error = card.error or self._accept(card, info, now)
        if error:
            self._reject(peer, f"handshake with {peer} failed: {error}", ValidationError)
        if not card.reply:  # answer, with our refusal if any
            link = self._peers.link(card.address, identity(info.engine_id, info.rank))
            self._side.send(link.address, sc.HELLO,
                            sc.encode_card(sc.replace_card(self._card, reply=True, error=error)))
            return
        why = f"handshake with {peer} refused: {error}"
        eng, effect = self.handshakes.answer(info, card.address, not error, now, why)
        if effect is Effect.STALE or eng is None:
            self._stats["stale_cards"] += 1
        elif effect is Effect.READY:  # each card already went to the endpoint
            self._stats["handshakes_done"] += 1
            self._pulls_settled(eng.engine_id, now)
        elif effect is Effect.FAIL:
            self._engine_failed(eng, now)

    def _accept(self, card: sc.PeerCard, info: RankInfo, now: float) -> str:
        """Validate and install a peer's card, then tell the endpoint; returns an
        error text or ''."""
        # Order matters: the endpoint learns the peer last, once everything else
        # accepted it, so a refused card never lets the peer's messages through.
        problem = card_problem(card, info)
        if problem:
            return problem
        if (self.role == "producer") == card.reply:
            return f"a {self.role} does not pair with this peer"
        try:
            name = self._agent.add_peer(card.agent_metadata)
        except Exception as exc:
            return f"NIXL refused the agent metadata ({nixl_status(exc)})"
        try:
            if name != card.agent_name:
                raise ConfigError(f"NIXL metadata names agent {name!r}, card {card.agent_name!r}")
            actions = self._endpoint.add_peer(info, now=now)
        except PushKVError as exc:
            if self._peers.by_agent.get(name) is None:
                with contextlib.suppress(Exception):
                    self._agent.remove_peer(name)
            return exc.message
        peer = Peer(info.engine_id, info.rank)
        self._peers.install(self._peers.link(card.address, identity(*peer)), peer, card)
        self._stats["peers_accepted"] += 1
        if self.role == "producer":
            with contextlib.suppress(Exception):
                self._agent.connect(card.agent_name)
        self._apply(actions, now)  # e.g. registrations that waited for this peer
        return ""

    def _engine_failed(self, eng: RemoteEngine, now: float) -> None:
        """The card exchange failed: the endpoint fails what waits for the engine
        (``HANDSHAKE_FAILED``, destination released)."""
        self._stats["handshakes_failed"] += 1
        log.warning("%s", eng.error)
        self._pulls_settled(eng.engine_id, now, eng.error or "handshake failed")
        self._apply(self._consumer().handshake_failed(eng.engine_id, eng.error, now), now)

    # ------------------------------------------------------------ liveness

    def _check_deadlines(self, now: float) -> None:
        for eng in self.handshakes.expired(now):
            missing = sorted(set(eng.addresses) - eng.answered)
            why = (f"handshake with {eng.engine_id!r} timed out (ranks {missing} did not "
                   "answer)")
            if self.handshakes.fire(eng, HandshakeInput.TIMEOUT, now, why) is Effect.FAIL:
                self._engine_failed(eng, now)
        for engine_id, links in self._peers.dead_engines(now).items():
            self._peer_died(engine_id, links, now)

    def _peer_died(self, engine_id: str, links: list[Link], now: float) -> None:
        self._stats["peers_lost"] += 1
        if all(link.said_goodbye for link in links):
            log.info("peer engine %r closed", engine_id)
        else:
            log.warning("peer engine %r confirmed dead", engine_id)
        for link in links:
            self._peers.forget(link)
        eng = self.handshakes.engines.get(engine_id)
        if eng is not None:
            self.handshakes.fire(eng, HandshakeInput.DIED, now)
        self._apply(self._endpoint.peer_died(engine_id, now), now)
        self._emit(PeerLost(engine_id=engine_id))
