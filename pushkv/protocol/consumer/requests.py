"""The messages a consumer rank sends its producer ranks -- registrations,
cancels, heartbeats -- and, in pull mode, the reads it posts. Building them
decides nothing; each takes what it reads (this rank, the transfer, the
producer directory) as arguments. Skips and abandons belong to the
directory (:mod:`.peers`)."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import LocalProtocolError
from ..events import Action, IssueRead, Mode, Peer, SendMessage, WriteScope
from ..layout import RankInfo
from ..mapping import assignment
from ..messages import MAX_HEARTBEAT_ITEMS, Cancel, Consumed, Heartbeat, Register
from ..planner import plan_transfer
from ..records import Transfer
from ..states import ConsumerState
from .peers import Producers
from .staging import rank_share

CS = ConsumerState


def registers(me: Peer, t: Transfer, window_s: float) -> list[Action]:
    """Register the current attempt with every producer rank that writes into us,
    each lent its share of the attempt's staging (rule 10)."""
    cur = t.cur
    window_ms = max(1, int(window_s * 1000))
    out: list[Action] = []
    for r in sorted(cur.expected):
        at, n = rank_share(cur, r)
        out.append(SendMessage(peer=Peer(t.producer, r), message=Register(
            transfer_id=t.transfer_id, attempt=cur.attempt, engine_id=me.engine_id,
            rank=me.rank, producer_engine_id=t.producer, block_ids=cur.block_ids,
            num_tokens=t.num_tokens, first_token=t.first_token, window_ms=window_ms,
            incarnation=t.inc, staging_offset=at if n else 0, staging_nbytes=n,
            target=t.target)))
    return out


def reads(
    me: RankInfo, producers: Producers, tid: str, producer: str, src: tuple[int, ...],
    dst: tuple[int, ...], n: int, first: int, attempt: int, inc: int = 0,
) -> list[IssueRead]:
    """Pull: one planned read per producer rank. Raises before any state changes."""
    out = []
    for r in sorted(producers.writers[producer]):
        info = producers.peers.get(Peer(producer, r))
        if info is None:
            raise LocalProtocolError(f"no handshake with producer rank {r}", transfer_id=tid)
        got = assignment(info.engine, me.engine, r, me.rank)
        plan = plan_transfer(info.layout, me.layout, got, src, dst, n, first)
        # Rule 11: the rectangle it lands, heads numbered as the producer rank does.
        scope = WriteScope(dst, first, n, got.layers, tuple((d, s, k) for s, d, k in got.heads))
        out.append(IssueRead(transfer_id=tid, attempt=attempt, peer=Peer(producer, r),
                             plan=plan, incarnation=inc, scope=scope))
    return out

def cancels(me: Peer, t: Transfer, *, final: bool,
            skip: frozenset[int] = frozenset()) -> list[Action]:
    """Cancel the attempt at every expected rank not fenced (nor in ``skip``: ranks
    whose own Fail started this, which post nothing more). Given up for good
    (``final``), the ranks that get no Cancel -- they wrote their share, or their
    write failed -- are told ``Consumed``: nothing here will want their source
    again (rule 12's linger ends)."""
    if t.mode is Mode.PULL:  # our own reads are the fence
        return []
    cur = t.cur
    out: list[Action] = [
        SendMessage(peer=Peer(t.producer, r), message=Cancel(
            transfer_id=t.transfer_id, attempt=cur.attempt,
            engine_id=me.engine_id, rank=me.rank, final=final,
            incarnation=t.inc))
        for r in sorted(cur.expected - cur.fenced - skip)
    ]
    if final:
        out += [SendMessage(peer=Peer(t.producer, r), message=Consumed(
            transfer_id=t.transfer_id, engine_id=me.engine_id, rank=me.rank,
            producer_engine_id=t.producer, incarnation=t.inc))
            for r in sorted((cur.notified | skip) & cur.expected)]
    return out

def final_cancels(me: Peer, t: Transfer) -> list[Action]:
    """Tell every producer rank it may drop the source KV."""
    return [
        SendMessage(peer=Peer(t.producer, r), message=Cancel(
            transfer_id=t.transfer_id, attempt=t.cur.attempt,
            engine_id=me.engine_id, rank=me.rank, final=True,
            incarnation=t.inc))
        for r in sorted(t.cur.expected)
    ]

def heartbeats(me: Peer, transfers: Iterable[Transfer]) -> list[Action]:
    """Renew the lease of every source this rank still waits on, per producer rank."""
    by_peer: dict[Peer, list[tuple[str, int, int]]] = {}
    for t in transfers:
        if t.state in (CS.REGISTERED, CS.PREEMPTING, CS.PREEMPTED):
            for r in t.cur.expected:
                by_peer.setdefault(Peer(t.producer, r), []).append(
                    (t.transfer_id, t.cur.attempt, t.inc))
    out: list[Action] = []
    for peer, items in sorted(by_peer.items()):
        for i in range(0, len(items), MAX_HEARTBEAT_ITEMS):
            out.append(SendMessage(peer=peer, message=Heartbeat(
                engine_id=me.engine_id, rank=me.rank,
                transfers=tuple(items[i:i + MAX_HEARTBEAT_ITEMS]))))
    return out
