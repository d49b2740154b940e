"""The world around the real endpoints: engines, a network, memory, a clock.

Everything the endpoints do not own is modelled here as plain, immutable
tuples, so that a whole world state can be hashed and stored:

* the **network**: a multiset of items in flight -- control frames (really
  encoded), writes posted by a producer rank and their completions. Any item
  may be delivered next; a frame may also be duplicated or dropped, within the
  scope's budgets. A write *lands* (its bytes and then its notification frame)
  or fails, then completes on the producer. Under *adversarial* visibility (the
  default, as NIXL states it) a write's bytes land in pieces, in any order, at
  any time before its notification frame is sent; its producer may learn that it
  completed before any byte landed; a failed write (or one of a dead producer)
  may still land any of its pieces, as garbage, until ``max_write_s`` after it
  was posted, and sends no notification.
* the **engines**: one consumer engine ``D`` and one producer engine ``P``,
  each with a block pool that hands freed blocks out again at once (lowest id
  first), and the life of each *incarnation* (use) of the transfer id ``t``.
* **memory**, abstractly: for every byte of every consumer block, and the
  producer rank that writes it, which (incarnation, attempt) last wrote it.
  READY must find every byte each expected writer owes written by the current
  incarnation and attempt, after the blocks were allocated -- every part of a
  write in pieces (rule 9) included.
* **staging memory** (rule 10), per share of a consumer rank's staging range:
  which (incarnation, attempt) it is lent to, and which packed write last
  landed in it (with the gather map it was packed by). A packed write lands in
  the staging share it was lent, never in one released or lent to another
  attempt; the consumer's scatter (an item of its own, which may take any time)
  copies it into the blocks, and staging is never released while a scatter
  still reads it.
* the **clock**: it only moves to the next deadline an endpoint reports,
  firing that endpoint's timers; frames older than ``max_transit_s`` are lost
  and writes land within ``max_write_s`` (the protocol's timing assumption).

The frozen world is the tuple :data:`Frozen`; :class:`World` is its mutable
twin used while one step runs.
"""

from __future__ import annotations

import bisect
from typing import Any

from .scope import Scope

TID = "t"

# Consumer incarnation status
C_IDLE, C_LIVE, C_OVER = 0, 1, 2
# Producer incarnation status (P_PARTIAL: prefilling into its blocks, some ranges
# reported final; the prefill is still owed)
P_WAIT, P_PREFILL, P_HELD, P_OVER, P_PARTIAL = 0, 1, 2, 3, 4

# Item kinds in flight (sorted first by kind); SWRITE: a packed write into staging,
# SCATTER: a consumer's scatter out of staging into its blocks (rule 10); READ: a
# consumer's read of a published source (pull)
FRAME, WRITE, DONE, HELLO, SWRITE, SCATTER, READ = 0, 1, 2, 3, 4, 5, 6

#: (kind, ...) -- see :func:`frame_item`, :func:`write_item`, :func:`done_item`.
Item = tuple[Any, ...]
Frozen = tuple[Any, ...]


def frame_item(dst: tuple[str, int], src: tuple[str, int], frame: bytes, sent: float) -> Item:
    return (FRAME, dst[0], dst[1], src[0], src[1], frame, sent)


#: What the producer of a write in flight has been told (weak visibility: its bytes
#: land independently of this): nothing yet, that it completed, that it failed.
POSTED, COMPLETED, FAILED = 0, 1, 2


def write_item(p_rank: int, d_rank: int, attempt: int, inc: int, src_blocks: tuple[int, ...],
               dst_blocks: tuple[int, ...], notify: bytes, data: int,
               pieces: tuple[tuple[tuple[int, int], ...], ...], sent: float,
               status: int = POSTED) -> Item:
    """A posted write: ``data`` is the incarnation whose prefill fills the source blocks,
    ``pieces`` the destination bytes it still has to copy, as (block, byte in block),
    cut into pieces that land one at a time, in any order (one piece when eager);
    ``status`` what its producer has been told (:data:`POSTED`, ...)."""
    return (WRITE, p_rank, d_rank, attempt, inc, src_blocks, dst_blocks, notify, data, pieces,
            status, sent)


def swrite_item(p_rank: int, d_rank: int, attempt: int, inc: int, src_blocks: tuple[int, ...],
                where: tuple[int, int, int, int, tuple[int, ...]], notify: tuple[bytes, ...],
                data: int, gmap: int, sent: float, status: int = POSTED) -> Item:
    """A posted packed write: ``where`` is (consumer staging offset, producer staging
    offset, bytes, next chunk to land, chunk cut points), ``notify`` the frame of each
    chunk; ``gmap`` names the gather map it was packed by; ``status`` as for
    :func:`write_item`."""
    return (SWRITE, p_rank, d_rank, attempt, inc, src_blocks, where, notify, data, gmap,
            status, sent)


def scatter_item(d_rank: int, p_rank: int, attempt: int, inc: int, offset: int,
                 dst_blocks: tuple[int, ...], cells: tuple[tuple[int, int], ...], gmap: int,
                 sent: float) -> Item:
    """A scatter in progress: staging share ``offset`` into ``cells`` of ``dst_blocks``."""
    return (SCATTER, d_rank, p_rank, attempt, inc, offset, dst_blocks, cells, gmap, sent)


def read_item(p_rank: int, d_rank: int, attempt: int, inc: int, src_blocks: tuple[int, ...],
              dst_blocks: tuple[int, ...], data: int,
              pieces: tuple[tuple[tuple[int, int], ...], ...], sent: float,
              status: int = POSTED) -> Item:
    """A posted read (pull), laid out as :func:`write_item` without a notification: it
    copies ``pieces`` of the source into the destination at any time until it completes,
    each what the source blocks hold at that moment; ``status`` what the consumer has
    been told (:data:`POSTED`, or :data:`FAILED` with stray pieces still to come)."""
    return (READ, p_rank, d_rank, attempt, inc, src_blocks, dst_blocks, b"", data, pieces,
            status, sent)


def hello_item(d_rank: int, p_rank: int, sent: float) -> Item:
    """A handshake between a consumer rank and a producer rank, under way."""
    return (HELLO, d_rank, p_rank, sent)


def done_item(p_rank: int, d_rank: int, attempt: int, inc: int, ok: bool, sent: float) -> Item:
    return (DONE, p_rank, d_rank, attempt, inc, ok, sent)


class CInc:
    """The consumer engine's view of one incarnation."""

    __slots__ = ("aborted", "allocs", "freed", "outcomes", "released", "status")

    def __init__(self, status: int, allocs: tuple[tuple[int, ...], ...],
                 released: frozenset[tuple[int, int]], outcomes: tuple[Any, ...],
                 aborted: bool, freed: frozenset[int]) -> None:
        self.status = status
        self.allocs = allocs  # destination blocks per attempt
        self.released = released  # (rank, attempt) released by that rank
        self.outcomes = outcomes  # per rank: None or (kind, attempt)
        self.aborted = aborted
        self.freed = freed  # attempts whose blocks went back to the pool

    def freeze(self) -> tuple[Any, ...]:
        return (self.status, self.allocs, self.released, self.outcomes, self.aborted,
                self.freed)


class PInc:
    """The producer engine's view of one incarnation."""

    __slots__ = ("aborted", "blocks", "ready", "released", "status", "told")

    def __init__(self, status: int, blocks: tuple[int, ...], released: frozenset[int],
                 aborted: bool, ready: frozenset[int], told: frozenset[int]) -> None:
        self.status = status
        self.blocks = blocks
        self.released = released  # producer ranks that released the source
        self.aborted = aborted
        self.ready = ready  # ranges (of the scope's pieces) reported final before prefill
        # Pull: the producer ranks whose core was told the prefill finished (its
        # prefill_finished ran); the engine's bytes are final before any of them is.
        self.told = told

    def freeze(self) -> tuple[Any, ...]:
        return (self.status, self.blocks, self.released, self.aborted, self.ready, self.told)


class World:
    """Mutable twin of a frozen world, for the length of one step.

    Copy on write: a part of the world is thawed only when a step reads or
    changes it, and freezing reuses every part left untouched.
    """

    __slots__ = ("_cinc", "_content", "_d_owner", "_leases", "_p_owner", "_pinc", "_s_content",
                 "_s_owner", "_windows", "cancelled", "dead", "drops", "dups", "f", "faulted",
                 "flight", "lossy", "now", "published", "retargeted", "shaken")

    def __init__(self, f: Frozen) -> None:
        self.f = f
        (self.now, flight, self.dups, self.drops, self.dead, self.lossy, self.faulted) = f[:7]
        self.flight: list[Item] = list(flight)  # kept sorted
        self._cinc: list[CInc] | None = None
        self._pinc: list[PInc] | None = None
        self._d_owner: list[tuple[int, int] | None] | None = None
        self._p_owner: list[int | None] | None = None
        self._content: dict[tuple[int, int, int, int], tuple[int, int]] | None = None
        self._leases: dict[tuple[int, int], float] | None = None
        self._windows: dict[tuple[int, int, int, int], float] | None = None
        self._s_owner: dict[tuple[int, int], tuple[int, int]] | None = None
        self._s_content: dict[tuple[int, int], tuple[int, int, int]] | None = None
        #: (consumer rank, producer rank) pairs that completed a handshake
        self.shaken: frozenset[tuple[int, int]] = f[14]
        #: (producer rank, consumer rank, attempt, incarnation) a Cancel reached
        self.cancelled: frozenset[tuple[int, int, int, int]] = f[15]
        #: pull: (producer rank, incarnation, the end of the lease its Publish stated)
        self.published: frozenset[tuple[int, int, float]] = f[18]
        #: rule 12: the uses whose source a router re-targeted to engine E
        self.retargeted: frozenset[int] = f[19]

    def add(self, item: Item) -> None:
        bisect.insort(self.flight, item)

    @property
    def engines_touched(self) -> bool:
        return self._cinc is not None or self._pinc is not None

    @property
    def cinc(self) -> list[CInc]:
        if self._cinc is None:
            self._cinc = [CInc(*c) for c in self.f[7]]
        return self._cinc

    @property
    def pinc(self) -> list[PInc]:
        if self._pinc is None:
            self._pinc = [PInc(*p) for p in self.f[8]]
        return self._pinc

    @property
    def d_owner(self) -> list[tuple[int, int] | None]:
        """Which (incarnation, attempt) holds each consumer block (None: free)."""
        if self._d_owner is None:
            self._d_owner = list(self.f[9])
        return self._d_owner

    @property
    def p_owner(self) -> list[int | None]:
        """Which incarnation's prefill holds each producer block (None: free)."""
        if self._p_owner is None:
            self._p_owner = list(self.f[10])
        return self._p_owner

    @property
    def content(self) -> dict[tuple[int, int, int, int], tuple[int, int]]:
        """(consumer rank, block, writer rank, byte) -> (incarnation, attempt) that wrote
        that byte of the block (``byte``: region times block stride plus the offset)."""
        if self._content is None:
            self._content = dict(self.f[11])
        return self._content

    @property
    def leases(self) -> dict[tuple[int, int], float]:
        """(producer rank, incarnation) -> when its source's lease ends, at the latest."""
        if self._leases is None:
            self._leases = dict(self.f[12])
        return self._leases

    @property
    def windows(self) -> dict[tuple[int, int, int, int], float]:
        """(producer rank, consumer rank, attempt, incarnation) -> end of the write window."""
        if self._windows is None:
            self._windows = dict(self.f[13])
        return self._windows

    @property
    def s_owner(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(consumer rank, staging share offset) -> the (incarnation, attempt) it is lent to."""
        if self._s_owner is None:
            self._s_owner = dict(self.f[16])
        return self._s_owner

    @property
    def s_content(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """(consumer rank, staging share offset) -> (incarnation, attempt, gather map) of
        the packed write that last landed there (incarnation -1: it failed)."""
        if self._s_content is None:
            self._s_content = dict(self.f[17])
        return self._s_content

    def freeze(self) -> Frozen:
        f = self.f
        return (self.now, tuple(self.flight), self.dups, self.drops, self.dead,
                self.lossy, self.faulted,
                f[7] if self._cinc is None else tuple(c.freeze() for c in self._cinc),
                f[8] if self._pinc is None else tuple(p.freeze() for p in self._pinc),
                f[9] if self._d_owner is None else tuple(self._d_owner),
                f[10] if self._p_owner is None else tuple(self._p_owner),
                f[11] if self._content is None else tuple(sorted(self._content.items())),
                f[12] if self._leases is None else tuple(sorted(self._leases.items())),
                f[13] if self._windows is None else tuple(sorted(self._windows.items())),
                self.shaken, self.cancelled,
                f[16] if self._s_owner is None else tuple(sorted(self._s_owner.items())),
                f[17] if self._s_content is None else tuple(sorted(self._s_content.items())),
                self.published, self.retargeted)


def initial(scope: Scope) -> Frozen:
    n = scope.incarnations
    cinc: tuple[Any, ...] = tuple(
        (C_IDLE, (), frozenset(), (None,) * scope.d_tp, False, frozenset()) for _ in range(n))
    pinc: tuple[Any, ...] = tuple(
        ((P_PREFILL if k == 0 or scope.distinct_ids else P_WAIT), (), frozenset(), False,
         frozenset(), frozenset())
        for k in range(n))
    return (0.0, (), scope.dups, scope.drops, "", False, False, cinc, pinc,
            (None,) * scope.d_blocks, (None,) * scope.p_blocks, (), (), (), frozenset(),
            frozenset(), (), (), frozenset(), frozenset())
