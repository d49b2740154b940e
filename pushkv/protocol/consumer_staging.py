"""Rule 10 on a consumer rank: lending staging to attempts, planning scatters.

The transitions live in :mod:`.states`; these build what they need: a staging
range for a new attempt, its release, and the :class:`~.packing.PackedPlan`
of a staged write (the producer's plan, from the same planner and the source
block ids its notification carries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .errors import ConfigError, LocalProtocolError, PlanError, ValidationError
from .events import Action, Mode, Peer, ReleaseStaging, Scatter
from .lending import StagingLedger, align_up, share
from .mapping import assignment
from .messages import FailReason, Notify
from .packing import PackedPlan, chunk_bounds
from .planner import plan_transfer
from .records import Attempt, Chunks, Transfer
from .states import ConsumerInput

CI = ConsumerInput

if TYPE_CHECKING:
    from .consumer import Consumer


def ledger(c: Consumer) -> StagingLedger | None:
    """The rank's staging ledger, if it lends staging at all."""
    p = c.config.packing
    if p is None or p.mode == "never" or p.staging_bytes <= 0:
        return None
    return c._staging


def lend(c: Consumer, t: Transfer, a: Attempt, written: int) -> None:
    """Lend a new push attempt the staging its ``written`` blocks could need,
    when that much is free (else its producers write directly)."""
    book = ledger(c)
    if book is None or t.mode is not Mode.PUSH or written <= 0:
        return
    lo = c.info.layout
    # Each producer rank writing into us gets an aligned share (see lending.share).
    ranks = len(c._writers.get(t.producer) or ()) or 1
    need = written * lo.block_bytes * lo.num_regions
    at = book.lend(ranks * align_up(-(-need // ranks)), (t.key, a.attempt))
    if at is None:
        c.stats["staging_unavailable"] += 1
        return
    a.staging = (at, book.size_of(at))


def unlend(c: Consumer, t: Transfer, a: Attempt) -> list[Action]:
    """Give an attempt's staging back (its fence, or READY, passed)."""
    if a.staging is None:
        return []
    at, n = a.staging
    a.staging = None
    c._staging.give_back(at)
    return [ReleaseStaging(transfer_id=t.transfer_id, attempt=a.attempt, offset=at, nbytes=n,
                           incarnation=t.inc)]


def rank_share(a: Attempt, rank: int) -> tuple[int, int]:
    """The staging range producer rank ``rank`` may write for attempt ``a``."""
    if a.staging is None or rank not in a.expected:
        return 0, 0
    return share(a.staging[0], a.staging[1], a.expected, rank)


class StagedChunk(NamedTuple):
    """One landed chunk of a staged write, checked: what its Scatter copies."""

    packed: PackedPlan
    bounds: tuple[int, ...]
    chunk: int
    src: tuple[int, ...]  #: the source block ids it was planned from
    size: int  #: the chunk size it was cut at

def staged_plan(c: Consumer, t: Transfer, a: Attempt, msg: Notify) -> StagedChunk:
    """The byte maps of chunk ``msg.chunk`` of a staged write, checked against what
    this attempt lent and against the rank's earlier chunks. Raises ValidationError
    (nothing changed) for a notification that cannot be one."""
    def invalid(why: str) -> ValidationError:
        return ValidationError(why, transfer_id=t.transfer_id, attempt=msg.attempt,
                               input="STAGED")

    if msg.part != 0 or msg.parts != 1:
        raise invalid("only a whole-request write (part 0 of 1) may be staged")
    if not 0 <= msg.chunk < msg.chunks:
        raise invalid(f"chunk {msg.chunk} of {msg.chunks}")
    known = a.chunks.get(msg.rank)
    if known is not None and known.plan is not None:
        packed, bounds, src, size = known.plan
        assert isinstance(packed, PackedPlan)
        if (src, size, len(bounds) - 1) != (msg.src_block_ids, msg.chunk_bytes, msg.chunks):
            raise invalid("a chunk of another staged write than the rank's earlier chunks")
        return StagedChunk(packed, bounds, msg.chunk, msg.src_block_ids, msg.chunk_bytes)
    if known is not None and known.need != msg.chunks:
        raise invalid(f"{msg.chunks} chunks; the rank's earlier chunks said {known.need}")
    room = rank_share(a, msg.rank)[1]
    if room <= 0:
        raise invalid(f"rank {msg.rank} was lent no staging for this attempt")
    info = c._peers.get(Peer(t.producer, msg.rank))
    if info is None:
        raise invalid(f"no handshake with producer rank {msg.rank}")
    try:
        plan = plan_transfer(info.layout, c.info.layout,
                             assignment(info.engine, c.info.engine, msg.rank, c.peer.rank),
                             msg.src_block_ids, a.block_ids, t.num_tokens, t.first_token)
        packed = PackedPlan(plan, c.config.packing.chunk_bytes if c.config.packing else 1)
    except (PlanError, ConfigError) as exc:
        raise invalid(f"staged write cannot be planned: {exc.message}") from exc
    if packed.nbytes > room:
        raise invalid(f"staged write of {packed.nbytes} bytes exceeds the {room} lent")
    bounds = chunk_bounds(packed, msg.chunk_bytes)
    if len(bounds) - 1 != msg.chunks:
        raise invalid(f"{msg.chunks} chunks, but {msg.chunk_bytes}-byte chunks cut the "
                      f"{packed.nbytes} bytes into {len(bounds) - 1}")
    return StagedChunk(packed, bounds, msg.chunk, msg.src_block_ids, msg.chunk_bytes)


def count_chunk(a: Attempt, msg: Notify) -> bool:
    """Record that chunk ``msg.chunk`` of a rank's staged write landed; False (nothing
    recorded) when it had already (a repeat) or cannot be a chunk."""
    if not 0 <= msg.chunk < msg.chunks:
        return False
    ch = a.chunks.get(msg.rank)
    if ch is None:
        ch = a.chunks[msg.rank] = Chunks(need=msg.chunks)
    elif msg.chunk in ch.got:
        return False
    ch.need = max(ch.need, msg.chunks)
    ch.got.add(msg.chunk)
    return True


def repeated(a: Attempt, msg: Notify) -> bool:
    """A staged chunk notification that already arrived for ``a`` (rule 6: a repeat)."""
    ch = a.chunks.get(msg.rank)
    return ch is not None and msg.chunk in ch.got


def scatter(t: Transfer, a: Attempt, rank: int, got: StagedChunk) -> Scatter:
    """Start scattering chunk ``got.chunk`` of rank ``rank``'s staged write (rule 10)."""
    a.scattering[rank] = a.scattering.get(rank, 0) + 1
    ch = a.chunks[rank]
    if ch.plan is None:
        ch.plan = (got.packed, got.bounds, got.src, got.size)
    start, stop = got.bounds[got.chunk], got.bounds[got.chunk + 1]
    return Scatter(transfer_id=t.transfer_id, attempt=a.attempt, peer=Peer(t.producer, rank),
                   packed=got.packed, offset=rank_share(a, rank)[0], incarnation=t.inc,
                   chunk=got.chunk, start=start, stop=stop)


def scatter_done(c: Consumer, transfer_id: str, attempt: int, peer: Peer, ok: bool,
                 now: float, inc: int, corrupt: bool = False) -> list[Action]:
    """The driver finished (``ok``) or failed a :class:`Scatter`: feed SCATTER_DONE (the
    rank's last chunk), CHUNK_SCATTERED (another) or SCATTER_FAILED to its attempt
    (current or zombie)."""
    t = c._find(transfer_id, inc)
    a = None if t is None else (t.cur if t.cur.attempt == attempt else t.zombies.get(attempt))
    if t is None or a is None or peer.engine_id != t.producer or (
            a.scattering.get(peer.rank, 0) <= 0):
        raise LocalProtocolError("scatter completion for no scatter in flight",
                                 transfer_id=transfer_id, attempt=attempt)
    out = c._run_timers(now)
    left = a.scattering[peer.rank] - 1
    if left:
        a.scattering[peer.rank] = left
    else:
        del a.scattering[peer.rank]
    c.stats["scatters_ok" if ok else "scatters_failed"] += 1
    ch = a.chunks[peer.rank]
    if ok:
        ch.done += 1
    else:
        t.why(FailReason.WRITE_FAILED, f"scatter of rank {peer.rank}'s staged write failed")
    inp = CI.SCATTER_FAILED if not ok else (
        CI.SCATTER_DONE if ch.done >= ch.need else CI.CHUNK_SCATTERED)
    if corrupt and inp is CI.SCATTER_DONE:  # rule 11: scattered in full, and wrong
        inp = CI.CORRUPT
        c.stats["corrupt"] += 1
    ranks = frozenset((peer.rank,))
    if a is not t.cur:
        return out + c._zombie(t, a, inp, now, ranks)
    return out + c._input(t, inp, now, ranks=ranks)


__all__ = ["StagedChunk", "count_chunk", "ledger", "lend", "rank_share", "repeated",
           "scatter", "scatter_done", "staged_plan", "unlend"]
