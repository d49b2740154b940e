"""Registrations made before their producer engine's handshake completed.

The consumer endpoint can register a transfer only with an engine it has
handshaked with, so these wait here, outside the endpoint, until the
handshake ends: on success they are registered with the endpoint (a
registration preempted meanwhile is parked until its reissue), on failure
they fail with nothing written. Every method returns the events to pass on.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..protocol import (
    Consumer,
    FailReason,
    FailurePolicy,
    PushKVError,
    ReleaseDestination,
    TransferCancelled,
    TransferFailed,
)
from ..protocol.errors import ConfigError
from . import runtime_commands as cmd
from .runtime_events import CallFailed


@dataclass(slots=True)
class Pending:
    engine_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    incarnation: int
    preempted: bool = False


class PendingRegistrations:
    def __init__(self) -> None:
        self._waiting: dict[str, Pending] = {}  # waiting for the handshake
        self._parked: dict[str, Pending] = {}  # preempted, handshake done: wait for reissue

    def __contains__(self, transfer_id: str) -> bool:
        return transfer_id in self._waiting or transfer_id in self._parked

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def blocks(self) -> dict[str, tuple[int, ...]]:
        return {tid: p.block_ids for tid, p in self._waiting.items()}

    def hold(self, c: cmd.Register, now: float) -> list[Any]:
        if c.transfer_id in self:
            raise ConfigError("transfer already registered", transfer_id=c.transfer_id)
        self._waiting[c.transfer_id] = Pending(
            c.producer_engine_id, tuple(int(b) for b in c.block_ids), c.num_tokens,
            c.first_token, c.incarnation)
        return []

    def preempt(self, tid: str) -> list[Any]:
        p = self._waiting.get(tid)
        if p is None or p.preempted:
            return []
        out = [ReleaseDestination(transfer_id=tid, attempt=0, block_ids=p.block_ids)]
        p.preempted, p.block_ids = True, ()
        return out

    def reissue(self, consumer: Consumer, c: cmd.Reissue, ready: Collection[str],
                now: float) -> list[Any]:
        blocks = tuple(int(b) for b in c.block_ids)
        parked = self._parked.pop(c.transfer_id, None)
        if parked is not None:
            return consumer.register(c.transfer_id, parked.engine_id, blocks,
                                     parked.num_tokens, now, parked.first_token,
                                     incarnation=parked.incarnation)
        p = self._waiting[c.transfer_id]
        if not p.preempted:
            raise ConfigError("reissue needs a preempted transfer", transfer_id=c.transfer_id)
        p.preempted, p.block_ids = False, blocks
        return []

    def abort(self, tid: str) -> list[Any]:
        out: list[Any] = []
        self._parked.pop(tid, None)
        p = self._waiting.pop(tid, None)
        if p is not None and not p.preempted:
            out.append(ReleaseDestination(transfer_id=tid, attempt=0, block_ids=p.block_ids))
        out.append(TransferCancelled(transfer_id=tid, attempt=0))
        return out

    def _take(self, engine_id: str) -> list[tuple[str, Pending]]:
        mine = [(tid, p) for tid, p in self._waiting.items() if p.engine_id == engine_id]
        for tid, _ in mine:
            del self._waiting[tid]
        return mine

    def engine_ready(self, consumer: Consumer, engine_id: str, now: float) -> list[Any]:
        out: list[Any] = []
        for tid, p in self._take(engine_id):
            if p.preempted:
                self._parked[tid] = p
                continue
            try:
                out += consumer.register(tid, engine_id, p.block_ids, p.num_tokens, now,
                                         p.first_token, incarnation=p.incarnation)
            except PushKVError as exc:
                out.append(CallFailed(operation="register", transfer_id=tid, error=str(exc)))
                out.append(ReleaseDestination(transfer_id=tid, attempt=0,
                                              block_ids=p.block_ids))
        return out

    def engine_failed(self, engine_id: str, why: str, code: FailReason,
                      policy: FailurePolicy) -> list[Any]:
        out: list[Any] = []
        for tid, p in self._take(engine_id):
            if not p.preempted:
                out.append(ReleaseDestination(transfer_id=tid, attempt=0,
                                              block_ids=p.block_ids))
            out.append(TransferFailed(transfer_id=tid, attempt=0, reason=why, policy=policy,
                                      code=code))
        return out
