"""What each endpoint remembers per transfer: plain records, no behaviour.

The transitions that change them live in :mod:`.states`; the endpoints
(:mod:`.producer`, :mod:`.consumer`) carry them out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .events import Mode, Peer
from .messages import FailReason
from .ranges import Grid
from .states import ConsumerState, ProducerInput, ProducerState, SourceState

#: A transfer is one use of an id: (transfer id, incarnation).
Key = tuple[str, int]
Kv = SourceState

# ------------------------------------------------------------------ producer

@dataclass(slots=True)
class Registration:
    attempt: int
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    deadline: float
    staging: tuple[int, int] | None = None  #: consumer staging lent to us (offset, bytes)


@dataclass(slots=True)
class Leg:
    peer: Peer
    state: ProducerState
    attempt: int = -1  # newest attempt seen on this leg
    reg: Registration | None = None
    stash: Registration | None = None
    writing: int | None = None  # attempt of the write in flight
    refused: tuple[ProducerInput, FailReason, str] | None = None  # a write that may not start
    # Rule 9 (progressive push), for the registration in ``reg``: what its
    # writes covered, how many finished, whether the one in flight is the last.
    written: Grid = field(default_factory=dict)
    parts: int = 0
    last: bool = True
    parts_of: int = -1  # the attempt ``parts`` counts for
    staging_at: int | None = None  # own staging lent to the write in flight (packed)
    # Per attempt ever written on this leg: (writes posted, writes failed). What a
    # CancelAck or Fail of that attempt tells the consumer to wait for; kept for
    # the leg's life (tombstones included), never reset by a newer attempt.
    history: dict[int, tuple[int, int]] = field(default_factory=dict)


@dataclass(slots=True)
class Source:
    """One transfer on one producer rank: its source KV and one leg per consumer rank."""

    transfer_id: str
    inc: int = 0
    mode: Mode = Mode.PUSH
    kv: Kv = Kv.PENDING
    src_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    ready: Grid = field(default_factory=dict)  # rule 9: final ranges, while PARTIAL
    lease: float = float("inf")
    lease_armed: float = float("inf")  # when the scheduled lease timer fires
    orphan: float = float("inf")  # while KV is pending: forget after this
    legs: dict[Peer, Leg] = field(default_factory=dict)
    consumer_engine: str | None = None
    target: int = 0  # rule 12: the bound consumer engine's turn
    hold_until: float = 0.0  # rule 12: its engine died; held for a re-target until then
    # Rule 12: a push written to its bound engine lingers for a re-target until that
    # engine's Consumed (consumed) or this time (None: not lingering yet).
    linger_until: float | None = None
    consumed: bool = False
    final: bool = False
    expired: bool = False
    aborted: bool = False
    dead: bool = False  # forgotten: kept only as a tombstone answering late messages
    reported: bool = False  # the local engine reported KV for it (prefill or a range)
    # Rule 9, on a tombstone: blocks ranges handed after the transfer concluded
    # here, released when the local request ends (finished or aborted).
    late: tuple[int, ...] = ()

    key: Key = field(init=False)  #: (transfer id, incarnation), set once

    def __post_init__(self) -> None:
        self.key = (self.transfer_id, self.inc)



# ------------------------------------------------------------------ consumer

@dataclass(slots=True)
class Attempt:
    attempt: int
    block_ids: tuple[int, ...]
    expected: frozenset[int]
    deadline: float
    hard: float
    notified: set[int] = field(default_factory=set)
    fenced: set[int] = field(default_factory=set)
    # Rule 9: per producer rank, the parts (writes) that notified, and how many
    # there are (from the rank's last word: final Notify, CancelAck or Fail).
    got: dict[int, set[int]] = field(default_factory=dict)
    need: dict[int, int] = field(default_factory=dict)
    # Packed writes: local staging lent to the attempt (offset, bytes), per producer
    # rank the chunk scatters running out of it now (no entry: none), and per rank
    # the chunks of its staged write (a write of one chunk has one).
    staging: tuple[int, int] | None = None
    scattering: dict[int, int] = field(default_factory=dict)
    chunks: dict[int, Chunks] = field(default_factory=dict)
    # Rule 7: per producer rank whose word said a write of the attempt failed, until
    # when its stray bytes may still land (None: that fence grace has passed).
    stray: dict[int, float | None] = field(default_factory=dict)

    def all_fenced(self) -> bool:
        """No write of the attempt can land, and no scatter of it still writes."""
        return self.fenced >= self.expected and not self.scattering

    def parts_in(self, rank: int) -> bool:
        """Every part ``rank`` said it wrote has notified (rule 9)."""
        return len(self.got.get(rank, ())) >= self.need.get(rank, 0)

    def landed(self, rank: int) -> bool:
        """Every write ``rank`` said it posted has notified (rules 7, 9) -- or, for one
        that failed, its fence grace has passed -- and every chunk of its staged write
        (rule 10): nothing of it lands any more."""
        if rank in self.stray:  # a failed write or a dead producer: done once graced
            return self.stray[rank] is None
        if not self.parts_in(rank):
            return False
        c = self.chunks.get(rank)
        return c is None or len(c.got) >= c.need

    def settled(self, rank: int) -> bool:
        """``rank`` may be fenced: its writes landed and no scatter of it still runs
        (a rank fenced mid-scatter would be skipped by a later final Cancel)."""
        return self.landed(rank) and rank not in self.scattering


@dataclass(slots=True)
class Chunks:
    """Rule 10: one producer rank's staged write into an attempt, chunk by chunk."""

    need: int  #: chunks the write was cut into (its notifications say)
    got: set[int] = field(default_factory=set)  #: chunks whose notification arrived
    done: int = 0  #: chunks scattered into the blocks
    #: once a chunk of it was scattered: (plan, cut points, source ids, chunk bytes)
    plan: tuple[object, tuple[int, ...], tuple[int, ...], int] | None = None


@dataclass(slots=True)
class Transfer:
    """One transfer on one consumer rank: the current attempt and abandoned ones."""

    transfer_id: str
    inc: int
    producer: str
    mode: Mode
    state: ConsumerState
    cur: Attempt
    num_tokens: int
    first_token: int
    src_ids: tuple[int, ...] = ()
    zombies: dict[int, Attempt] = field(default_factory=dict)
    skipped: bool = False  # the producer ranks that write nothing were told (Skip)
    reason: str = ""
    code: FailReason = FailReason.WRITE_FAILED
    #: Pull: until when the source is known held; a read completing later fails.
    lease_until: float = float("inf")
    #: Rule 12: this engine's turn at the source (Register.target, Skip.target).
    target: int = 0

    key: Key = field(init=False)  #: (transfer id, incarnation), set once

    def __post_init__(self) -> None:
        self.key = (self.transfer_id, self.inc)

    def why(self, code: FailReason, reason: str) -> None:
        """Record the first cause of a failure (later ones are consequences)."""
        if not self.reason:
            self.code, self.reason = code, reason
