"""Rule 10 on a consumer rank: lending staging to attempts, planning scatters.

The transitions live in :mod:`.states`; these build what they need: a staging
range for a new attempt, its release, and the :class:`~.packing.PackedPlan`
of a staged write (the producer's plan, from the same planner and the source
block ids its notification carries).
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import ConfigError, PlanError, ValidationError
from ..events import Action, Mode, Peer, ReleaseStaging, Scatter
from ..layout import KVLayout, RankInfo
from ..lending import StagingLedger, align_up, share
from ..mapping import assignment
from ..messages import Notify
from ..packing import PackedPlan, PackingConfig, chunk_bounds
from ..planner import plan_transfer
from ..records import Attempt, Chunks, Transfer
from ..states import ConsumerInput

CI = ConsumerInput

def ledger(pk: PackingConfig | None, book: StagingLedger) -> StagingLedger | None:
    """The rank's staging ledger ``book``, if the rank lends staging at all."""
    if pk is None or pk.mode == "never" or pk.staging_bytes <= 0:
        return None
    return book


def lend(book: StagingLedger | None, layout: KVLayout, writers: int, t: Transfer, a: Attempt,
         written: int) -> bool:
    """Lend a new push attempt the staging its ``written`` blocks could need (an
    aligned share for each of its ``writers`` producer ranks), when that much is
    free in ``book``; False when it is not (its producers then write directly)."""
    if book is None or t.mode is not Mode.PUSH or written <= 0:
        return True
    # Each producer rank writing into us gets an aligned share (see lending.share).
    ranks = writers or 1
    need = written * layout.block_bytes * layout.num_regions
    at = book.lend(ranks * align_up(-(-need // ranks)), (t.key, a.attempt))
    if at is None:
        return False
    a.staging = (at, book.size_of(at))
    return True


def unlend(book: StagingLedger, t: Transfer, a: Attempt) -> list[Action]:
    """Give an attempt's staging back (its fence, or READY, passed)."""
    if a.staging is None:
        return []
    at, n = a.staging
    a.staging = None
    book.give_back(at)
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

def staged_plan(me: RankInfo, writer: RankInfo | None, chunk_bytes: int, t: Transfer,
                a: Attempt, msg: Notify) -> StagedChunk:
    """The byte maps of chunk ``msg.chunk`` of a staged write by producer rank
    ``writer`` (None: not handshaken) into this rank ``me``, checked against what
    this attempt lent and against the rank's earlier chunks (packed in
    ``chunk_bytes``). Raises ValidationError (nothing changed) for a notification
    that cannot be one."""
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
    info = writer
    if info is None:
        raise invalid(f"no handshake with producer rank {msg.rank}")
    try:
        plan = plan_transfer(info.layout, me.layout,
                             assignment(info.engine, me.engine, msg.rank, me.rank),
                             msg.src_block_ids, a.block_ids, t.num_tokens, t.first_token)
        packed = PackedPlan(plan, chunk_bytes)
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


__all__ = ["StagedChunk", "count_chunk", "ledger", "lend", "rank_share", "repeated",
           "scatter", "staged_plan", "unlend"]
