"""What is in flight on the in-memory network: items, posted writes and reads, and
the pieces their bytes land in (adversarial visibility)."""


from __future__ import annotations

from typing import Any, NamedTuple

from ...protocol import (
    IssueRead,
    IssueWrite,
    Peer,
    TransferPlan,
)


class Item(NamedTuple):
    """Something in flight: a frame, a write, a read or a completion.

    A tuple ordered by (due time, sequence number) -- compared in C, so the
    pending heap stays cheap; the sequence number is unique, so later fields
    are never compared."""

    at: float
    seq: int
    kind: str  # "frame" | "write" | "read" | "piece" | "scatter" | "done" | "death"
    sent: float
    src: Peer | None
    dst: Peer | str
    payload: Any


#: Delivery models of :class:`InMemoryNetwork` (see the module docstring).
DELIVERIES = ("adversarial", "eager")


class Flight:
    """A write or read in flight under adversarial delivery: its pieces not yet landed."""

    __slots__ = ("action", "completed", "deadline", "dst", "failed", "kind", "pieces",
                 "posted", "src")

    def __init__(self, kind: str, action: IssueWrite | IssueRead, src: Peer, dst: Peer,
                 posted: float, deadline: float) -> None:
        self.kind = kind  # "write" | "read"
        self.action = action
        self.src = src  # the rank whose memory the bytes come from
        self.dst = dst  # the rank whose memory they land in
        self.posted = posted
        self.deadline = deadline  # no piece lands later (the max in-flight time)
        self.pieces: list[Piece] = []  # on the wire, in no particular order
        self.completed = False  # the write's local completion happened (ok)
        self.failed = False  # the write failed: its pieces on the wire land late, or never


class Piece:
    """Part of a flight's bytes, landing on its own: a sub-plan (direct writes and
    reads) or a byte range ``span`` of the staging image (packed writes)."""

    __slots__ = ("chunk", "data", "flight", "item", "plan", "span", "state")

    def __init__(self, flight: Flight, chunk: int, plan: TransferPlan | None,
                 span: tuple[int, int] | None) -> None:
        self.flight = flight
        self.chunk = chunk  # the pipelined chunk it belongs to (0: the whole write)
        self.plan = plan
        self.span = span
        #: The source bytes, once read ahead of landing: the image range (packed), or
        #: one buffer per region pair of ``plan``, rebased onto them (direct).
        self.data: Any = None
        self.item: Item | None = None
        self.state = "wire"  # "wire" | "landed" | "lost"

    @property
    def deadline(self) -> float:
        return self.flight.deadline
