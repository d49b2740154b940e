"""The messages a consumer rank sends: registrations' companions, cancels,
heartbeats, and pull-mode reads. Building them decides nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .consumer_staging import rank_share
from .errors import LocalProtocolError
from .events import Action, IssueRead, Mode, Peer, SendMessage
from .mapping import assignment
from .messages import MAX_HEARTBEAT_ITEMS, Cancel, Heartbeat, Register, Skip
from .planner import plan_transfer
from .records import Key, Transfer
from .states import ConsumerState

if TYPE_CHECKING:
    from .consumer import Consumer

CS = ConsumerState


def registers(c: Consumer, t: Transfer) -> list[Action]:
    """Register the current attempt with every producer rank that writes into us,
    each lent its share of the attempt's staging (rule 10)."""
    cur = t.cur
    window_ms = max(1, int(c.config.window_s * 1000))
    out: list[Action] = []
    for r in sorted(cur.expected):
        at, n = rank_share(cur, r)
        out.append(SendMessage(peer=Peer(t.producer, r), message=Register(
            transfer_id=t.transfer_id, attempt=cur.attempt, engine_id=c.peer.engine_id,
            rank=c.peer.rank, producer_engine_id=t.producer, block_ids=cur.block_ids,
            num_tokens=t.num_tokens, first_token=t.first_token, window_ms=window_ms,
            incarnation=t.inc, staging_offset=at if n else 0, staging_nbytes=n)))
    return out


def abandons(c: Consumer, key: Key, producer: str, writers: frozenset[int]) -> list[Action]:
    """A final Cancel to the ranks that would have written, Skip to the others."""
    return [
        SendMessage(peer=Peer(producer, r), message=Cancel(
            transfer_id=key[0], attempt=0, engine_id=c.peer.engine_id, rank=c.peer.rank,
            final=True, incarnation=key[1]))
        for r in sorted(writers)
    ] + skips(c, key, producer)


def skips(c: Consumer, key: Key, producer: str, only: int | None = None) -> list[Action]:
    """Skip to the producer ranks this rank speaks for that write nothing (and
    has handshaken with; ``only``: to that rank alone)."""
    silent = c._silent.get(producer, ())
    if only is None and any(Peer(producer, r) not in c._peers for r in silent):
        # A rank that writes nothing has not handshaken yet: tell it when it does.
        untold = c._untold.setdefault(producer, {})
        untold[key] = None
        while len(untold) > c.config.max_untold:
            del untold[next(iter(untold))]
    return [
        SendMessage(peer=Peer(producer, r), message=Skip(
            transfer_id=key[0], engine_id=c.peer.engine_id, rank=c.peer.rank,
            producer_engine_id=producer, incarnation=key[1]))
        for r in silent
        if Peer(producer, r) in c._peers and only in (None, r)
    ]

def reads(
    c: Consumer, tid: str, producer: str, src: tuple[int, ...], dst: tuple[int, ...], n: int,
    first: int, attempt: int, inc: int = 0,
) -> list[IssueRead]:
    """Pull: one planned read per producer rank. Raises before any state changes."""
    out = []
    for r in sorted(c._writers[producer]):
        info = c._peers.get(Peer(producer, r))
        if info is None:
            raise LocalProtocolError(f"no handshake with producer rank {r}", transfer_id=tid)
        plan = plan_transfer(
            info.layout, c.info.layout,
            assignment(info.engine, c.info.engine, r, c.peer.rank),
            src, dst, n, first,
        )
        out.append(IssueRead(transfer_id=tid, attempt=attempt, peer=Peer(producer, r),
                             plan=plan, incarnation=inc))
    return out

def cancels(c: Consumer, t: Transfer, *, final: bool,
            skip: frozenset[int] = frozenset()) -> list[Action]:
    """Cancel the attempt at every expected rank not fenced (nor in ``skip``: ranks
    whose own Fail started this, which post nothing more)."""
    if t.mode is Mode.PULL:  # our own reads are the fence
        return []
    cur = t.cur
    return [
        SendMessage(peer=Peer(t.producer, r), message=Cancel(
            transfer_id=t.transfer_id, attempt=cur.attempt,
            engine_id=c.peer.engine_id, rank=c.peer.rank, final=final,
            incarnation=t.inc))
        for r in sorted(cur.expected - cur.fenced - skip)
    ]

def final_cancels(c: Consumer, t: Transfer) -> list[Action]:
    """Tell every producer rank it may drop the source KV."""
    return [
        SendMessage(peer=Peer(t.producer, r), message=Cancel(
            transfer_id=t.transfer_id, attempt=t.cur.attempt,
            engine_id=c.peer.engine_id, rank=c.peer.rank, final=True,
            incarnation=t.inc))
        for r in sorted(t.cur.expected)
    ]

def heartbeats(c: Consumer) -> list[Action]:
    by_peer: dict[Peer, list[tuple[str, int, int]]] = {}
    for t in c._transfers.values():
        if t.state in (CS.REGISTERED, CS.PREEMPTING, CS.PREEMPTED):
            for r in t.cur.expected:
                by_peer.setdefault(Peer(t.producer, r), []).append(
                    (t.transfer_id, t.cur.attempt, t.inc))
    out: list[Action] = []
    for peer, items in sorted(by_peer.items()):
        for i in range(0, len(items), MAX_HEARTBEAT_ITEMS):
            out.append(SendMessage(peer=peer, message=Heartbeat(
                engine_id=c.peer.engine_id, rank=c.peer.rank,
                transfers=tuple(items[i:i + MAX_HEARTBEAT_ITEMS]))))
    return out
