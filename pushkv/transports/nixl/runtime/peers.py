"""The peer table of one runtime: who its peers are, where, and whether alive.

A :class:`Link` is one peer *rank*, keyed by its side-channel address; once
its handshake card is accepted it also knows the rank's identity, NIXL agent
name and region addresses. The :class:`PeerTable` indexes links by address,
by rank and by agent name, and applies the liveness rule: a link whose
connection dropped and stayed down for ``confirm_s`` -- or whose peer said
goodbye -- is dead, and an engine is confirmed dead when every one of its
ranks is.

Used by one thread only (the runtime's I/O thread).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pushkv.protocol.errors import ConfigError
from pushkv.protocol.events import Peer
from pushkv.protocol.layout import RankInfo

from ..agent import Agent
from ..sidechannel.channel import PeerCard, SideChannel


@dataclass(slots=True)
class Link:
    """One peer rank, by side-channel address."""

    address: str
    peer: Peer | None = None
    agent_name: str | None = None
    bases: np.ndarray | None = None
    kind: str = "DRAM"
    device: int = 0
    staging_base: int = 0  #: the peer's staging buffer (packed writes; 0: none)
    up: bool = False
    lost_since: float | None = None
    dead: bool = False
    said_goodbye: bool = False


def parse_addresses(addresses: Mapping[int, str] | Sequence[str]) -> dict[int, str]:
    """Side-channel addresses by global rank, from a mapping or a rank-ordered list."""
    if isinstance(addresses, Mapping):
        out = {int(r): str(a) for r, a in addresses.items()}
    else:
        out = {r: str(a) for r, a in enumerate(addresses)}
    if not out:
        raise ConfigError("no addresses given")
    return out


def card_problem(card: PeerCard, info: RankInfo) -> str:
    """Why a card cannot be accepted ('' if it can), before NIXL sees it."""
    try:
        info.validate()
    except ConfigError as exc:
        return exc.message
    lo = info.layout
    if len(card.sizes) != lo.num_regions or min(card.sizes) < lo.region_bytes:
        return "the advertised memory does not hold the advertised layout"
    return ""


class PeerTable:
    """Links by address, rank and agent name; liveness."""

    def __init__(self, side: SideChannel, agent: Agent, confirm_s: float) -> None:
        self._side = side
        self._agent = agent
        self._confirm_s = confirm_s
        self.links: dict[str, Link] = {}
        self.by_peer: dict[Peer, Link] = {}
        self.by_agent: dict[str, Link] = {}

    def link(self, address: str, dest: str) -> Link:
        """The link to ``address`` (a rank whose identity is ``dest``), connecting on
        first use."""
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = Link(address)
        self._side.open(address, dest)
        return link

    def install(self, link: Link, peer: Peer, card: PeerCard) -> None:
        """Record an accepted card on its link."""
        old = self.by_peer.get(peer)
        if old is not None and old is not link:
            del self.by_peer[peer]
        link.peer, link.agent_name = peer, card.agent_name
        link.bases = np.asarray(card.bases, dtype=np.int64)
        link.kind, link.device = card.kind, card.device
        link.staging_base = card.staging_base if card.staging_size > 0 else 0
        link.dead, link.lost_since, link.said_goodbye = False, None, False
        self.by_peer[peer] = link
        self.by_agent[card.agent_name] = link

    def forget(self, link: Link) -> None:
        """Drop a link: its connection, its indexes and the peer's NIXL metadata."""
        if link.peer is not None and self.by_peer.get(link.peer) is link:
            del self.by_peer[link.peer]
        if link.agent_name is not None:
            self.by_agent.pop(link.agent_name, None)
            with contextlib.suppress(Exception):  # already gone
                self._agent.remove_peer(link.agent_name)
        self.links.pop(link.address, None)
        self._side.forget(link.address)

    # ------------------------------------------------------------ liveness

    def goodbye(self, address: str, now: float) -> bool:
        """A peer said goodbye; False if the address is not a known peer."""
        link = self.links.get(address)
        if link is None or link.peer is None:
            return False
        link.dead = link.said_goodbye = True
        link.lost_since = link.lost_since or now
        return True

    def transition(self, what: str, address: str, now: float) -> None:
        """A connection went ``"up"`` or ``"down"``."""
        link = self.links.get(address)
        if link is None or link.dead:
            return
        if what == "up":
            link.up, link.lost_since = True, None
        elif link.lost_since is None:
            link.up, link.lost_since = False, now

    def next_deadline(self) -> float:
        """When a lost link is next due for confirmation (inf if none)."""
        return min((link.lost_since + self._confirm_s for link in self.links.values()
                    if link.lost_since is not None and not link.dead), default=float("inf"))

    def dead_engines(self, now: float) -> dict[str, list[Link]]:
        """Engines every known rank of which is confirmed dead, with their links."""
        for link in self.links.values():
            if (link.lost_since is not None and not link.dead
                    and now - link.lost_since >= self._confirm_s):
                link.dead = True
        by_engine: dict[str, list[Link]] = {}
        for peer, link in self.by_peer.items():
            by_engine.setdefault(peer.engine_id, []).append(link)
        return {e: links for e, links in by_engine.items() if all(lk.dead for lk in links)}
