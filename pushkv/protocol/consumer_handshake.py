"""Rule 8, handshake in the core: what a consumer rank does as producer ranks
are handshaken, when a handshake fails, and how it asks for one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .consumer_messages import abandons, skips
from .events import Action, Connect, Peer
from .layout import RankInfo
from .mapping import targets_of
from .messages import FailReason
from .states import ConsumerInput, ConsumerState

if TYPE_CHECKING:
    from .consumer import Consumer

CS, CI = ConsumerState, ConsumerInput


def learn_rank(c: Consumer, info: RankInfo, now: float | None) -> list[Action]:
    """A producer rank was added: the ranks that write nothing, usability, the Skips
    a late rank missed, and (rule 8) the registrations held for the engine."""
    if info.engine_id not in c._silent:
        # Producer ranks that write nothing into this engine learn from one
        # consumer rank (rank r from consumer rank r mod world) that their
        # source is not needed.
        src, dst = info.engine, c.info.engine
        c._silent[info.engine_id] = tuple(
            r for r in range(src.world_size)
            if r % dst.world_size == c.peer.rank and not targets_of(src, dst, r)
        )
    writers = c._writers[info.engine_id]
    if all(Peer(info.engine_id, r) in c._peers for r in writers):
        c._ready_engines.add(info.engine_id)
    when = c._now if now is None else now
    out = c._run_timers(when) if now is not None else []
    silent = c._silent[info.engine_id]
    if info.rank in silent:  # told late: Skip every transfer it missed
        untold = c._untold.get(info.engine_id, {})
        out += [a for key in untold for a in skips(c, key, info.engine_id,
                                                     only=info.rank)]
        if all(Peer(info.engine_id, r) in c._peers for r in silent):
            c._untold.pop(info.engine_id, None)
    if not c._usable(info.engine_id):
        return out
    # Rule 8: the engine became usable; the registrations held for it go out,
    # and the producer learns of the transfers that ended while they waited.
    c._connecting.pop(info.engine_id, None)
    for key in c._abandoned.pop(info.engine_id, ()):
        out += abandons(c, key, info.engine_id, c._writers[info.engine_id])
    for t in list(c._transfers.values()):
        if t.state is CS.CONNECTING and t.producer == info.engine_id:
            out += c._input(t, CI.CONNECTED, max(when, 0.0))
    return out


def fail_handshake(c: Consumer, engine_id: str, reason: str, now: float) -> list[Action]:
    """Every transfer waiting for ``engine_id``'s handshake fails (HANDSHAKE_FAILED)."""
    c._connecting.pop(engine_id, None)
    c._abandoned.pop(engine_id, None)  # no channel: the producer's lease decides
    c._untold.pop(engine_id, None)
    c.stats["handshakes_failed"] += 1
    out: list[Action] = []
    for t in list(c._transfers.values()):
        if t.state is CS.CONNECTING and t.producer == engine_id:
            t.why(FailReason.HANDSHAKE_FAILED,
                  f"handshake with producer engine {engine_id!r} failed: {reason}")
            out += c._input(t, CI.HANDSHAKE_FAILED, now)
    return out

def connect(c: Consumer, engine_id: str, now: float) -> list[Action]:
    """Ask the driver for a handshake, once per engine; a core timer bounds it."""
    if engine_id in c._connecting:
        return []
    deadline = c._connecting[engine_id] = now + c.config.handshake_timeout_s
    c._schedule(deadline, engine_id)
    c.stats["connects"] += 1
    return [Connect(engine_id=engine_id)]
