"""Rule 9 on a consumer rank: which blocks a transfer writes, and counting parts."""

from __future__ import annotations

from ..messages import CancelAck, Fail, Notify
from ..records import Attempt
from ..states import ConsumerInput

CI = ConsumerInput


def written_blocks(ids: tuple[int, ...], block_size: int, first: int, n: int) -> tuple[int, ...]:
    """The blocks a transfer of tokens ``[first, n)`` writes into: a cached prefix
    below ``first`` is shared and never written, so it is never lent."""
    return ids[first // block_size:-(-n // block_size)]


def count_parts(a: Attempt, rank: int, inp: ConsumerInput, msg: Notify | CancelAck | Fail) -> (
        ConsumerInput):
    """Rule 9: count a producer rank's parts. A Notify that does not complete the
    rank (more parts to come, or its count not known yet) is the input PART; the
    rank's last word says how many parts to wait for (a final Notify: its count; a
    CancelAck or Fail: the writes it posted less those that failed), and the part
    that completes them is fed as NOTIFY (its fence)."""
    owed = a.need.get(rank)
    if isinstance(msg, Notify):
        ch = a.chunks.get(rank) if msg.staged else None
        if ch is not None and len(ch.got) < ch.need:
            return CI.PART  # rule 10: a chunk, not the last in: the write is not yet
        a.got.setdefault(rank, set()).add(msg.part)
        if msg.parts:
            a.need[rank] = max(msg.parts, owed or 0)
        elif owed is None:
            return CI.PART
        return CI.NOTIFY if a.parts_in(rank) else CI.PART
    # The rank's word: its posted writes that did not fail will each notify (rule 7).
    a.need[rank] = max(msg.posted - min(msg.failed, msg.posted), owed or 0)
    return inp
