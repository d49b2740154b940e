"""Rule 10 on a consumer rank: lending staging to attempts, planning scatters.

The transitions live in :mod:`.states`; these build what they need: a staging
range for a new attempt, its release, and the :class:`~.packing.PackedPlan`
of a staged write (the producer's plan, from the same planner and the source
block ids its notification carries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .errors import ConfigError, LocalProtocolError, PlanError, ValidationError
from .events import Action, Mode, Peer, ReleaseStaging, Scatter
from .lending import StagingLedger, align_up, share
from .mapping import assignment
from .messages import FailReason, Notify
from .packing import PackedPlan
from .planner import plan_transfer
from .records import Attempt, Transfer
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


def staged_plan(c: Consumer, t: Transfer, a: Attempt, msg: Notify) -> PackedPlan:
    """The byte maps of a staged write, checked against what this attempt lent.
    Raises ValidationError (nothing changed) for a notification that cannot be one."""
    def invalid(why: str) -> ValidationError:
        return ValidationError(why, transfer_id=t.transfer_id, attempt=msg.attempt,
                               input="STAGED")

    if msg.part != 0 or msg.parts != 1:
        raise invalid("only a whole-request write (part 0 of 1) may be staged")
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
    return packed


def scatter(t: Transfer, a: Attempt, rank: int, packed: PackedPlan) -> Scatter:
    """Start scattering rank ``rank``'s staged write (rule 10)."""
    a.scattering.add(rank)
    return Scatter(transfer_id=t.transfer_id, attempt=a.attempt, peer=Peer(t.producer, rank),
                   packed=packed, offset=rank_share(a, rank)[0], incarnation=t.inc)


def scatter_done(c: Consumer, transfer_id: str, attempt: int, peer: Peer, ok: bool,
                 now: float, inc: int | None) -> list[Action]:
    """The driver finished (``ok``) or failed a :class:`Scatter`: feed SCATTER_DONE
    or SCATTER_FAILED to its attempt (current or zombie)."""
    t = c._transfers.get(transfer_id)
    if t is not None and inc is not None and t.inc != inc:
        t = c._retired.get((transfer_id, inc))
    a = None if t is None else (t.cur if t.cur.attempt == attempt else t.zombies.get(attempt))
    if t is None or a is None or peer.engine_id != t.producer or (
            peer.rank not in a.scattering):
        raise LocalProtocolError("scatter completion for no scatter in flight",
                                 transfer_id=transfer_id, attempt=attempt)
    out = c._run_timers(now)
    a.scattering.discard(peer.rank)
    c.stats["scatters_ok" if ok else "scatters_failed"] += 1
    if not ok:
        t.why(FailReason.WRITE_FAILED, f"scatter of rank {peer.rank}'s staged write failed")
    inp = CI.SCATTER_DONE if ok else CI.SCATTER_FAILED
    ranks = frozenset((peer.rank,))
    if a is not t.cur:
        return out + c._zombie(t, a, inp, now, ranks)
    return out + c._input(t, inp, now, ranks=ranks)


__all__ = ["ledger", "lend", "rank_share", "scatter", "scatter_done", "staged_plan", "unlend"]
