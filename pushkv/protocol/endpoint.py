"""What producer and consumer endpoints share: identity, the frame decoder and
message dispatch, the handshake, a timer heap and counters."""

from __future__ import annotations

import enum
import heapq
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

from .errors import ConfigError, DecodeError, RemoteProtocolError, ValidationError
from .events import Action, Peer, Rejected, sender_of
from .layout import RankInfo
from .messages import Hello, Message, decode

Handler = Callable[[Any, float], list[Action]]


class Step(NamedTuple):
    """One table transition an endpoint made (recorded when ``trace`` is a list)."""

    key: tuple[str, int]  #: (transfer id, incarnation)
    peer: Peer | None  #: the producer leg's consumer rank; None on a consumer
    state: enum.Enum
    input: enum.Enum
    effect: enum.Enum
    next: enum.Enum
    actions: tuple[Action, ...]  #: what the effect itself emitted


class Endpoint:
    """Base of :class:`~pushkv.protocol.producer.Producer` and
    :class:`~pushkv.protocol.consumer.Consumer`. Every method takes ``now``."""

    role = "endpoint"

    def __init__(self, info: RankInfo) -> None:
        info.validate()
        self.info = info
        self.peer = Peer(info.engine_id, info.rank)
        self.stats: Counter[str] = Counter()
        self._timers: list[tuple[float, int, Hashable]] = []  # (when, seq, key), lazy
        self._seq = 0
        self._now = float("-inf")  # the latest time any call brought
        #: Set to a list to record every table transition (tests, debugging).
        self.trace: list[Step] | None = None
        self._handlers: dict[type, Handler] = {Hello: self._on_hello}

    def add_peer(
        self, info: RankInfo, *, now: float | None = None
    ) -> list[Action]:  # pragma: no cover - overridden
        raise NotImplementedError

    # ------------------------------------------------------------- peer input

    def receive_bytes(self, frame: bytes, now: float) -> list[Action]:
        """Decode and handle one frame from a peer (control message or notification)."""
        try:
            msg = decode(frame)
        except DecodeError as exc:
            self.stats["decode_error"] += 1
            return [Rejected(peer=None, error=exc)]
        return self.receive(msg, now)

    def receive(self, msg: Message, now: float) -> list[Action]:
        """Handle one decoded message. What the peer got wrong becomes a
        :class:`Rejected` action and a count, never an exception."""
        out = self._run_timers(now)
        try:
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ValidationError(f"{type(msg).__name__} is not for a {self.role}")
            out += handler(msg, now)
        except RemoteProtocolError as exc:
            self.stats["rejected"] += 1
            out.append(Rejected(peer=sender_of(msg), error=exc))
        return out

    def _on_hello(self, msg: Hello, now: float) -> list[Action]:
        try:
            return self.add_peer(msg.info, now=now)
        except ConfigError as exc:
            raise ValidationError(f"handshake refused: {exc.message}") from exc

    # ----------------------------------------------------------------- timers

    def next_deadline(self) -> float | None:
        """Earliest time at which :meth:`handle_timer` may have work (maybe spurious)."""
        return self._timers[0][0] if self._timers else None

    def handle_timer(self, now: float) -> list[Action]:
        return self._run_timers(now)

    def _schedule(self, when: float, key: Hashable) -> None:
        if when != float("inf"):
            self._seq += 1
            heapq.heappush(self._timers, (when, self._seq, key))

    def _run_timers(self, now: float) -> list[Action]:
        # Take what is due first: a timer armed while expiring runs on the next call,
        # so a mistake that re-arms in the past can never spin inside one call.
        if now > self._now:
            self._now = now
        due = []
        while self._timers and self._timers[0][0] <= now:
            due.append(heapq.heappop(self._timers)[2])
        out: list[Action] = []
        for key in due:
            out += self._expire(key, now)
        return out

    def _expire(self, key: Any, now: float) -> list[Action]:  # pragma: no cover
        raise NotImplementedError
