"""Who holds which range of a rank's staging memory (packed writes).

The staging memory itself belongs to the transport (one buffer, registered
once); the endpoints only decide which byte ranges of it a packed write may
use, and for how long, as they do for destination blocks: a range is lent to
one attempt and given back only once nothing can land in it or be read from it
any more (the attempt's fence, its scatters included). :class:`StagingLedger`
is that bookkeeping: a first-fit lender of ``[0, nbytes)``, pure and exact.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from .errors import ConfigError, LocalProtocolError

#: Ranges are lent in multiples of this (cache-line aligned offsets).
ALIGN = 64


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class StagingLedger:
    """First-fit lender of the byte ranges of ``[0, nbytes)``."""

    __slots__ = ("_free", "_lent", "nbytes")

    def __init__(self, nbytes: int) -> None:
        if nbytes < 0:
            raise ConfigError(f"staging size must be >= 0, got {nbytes}")
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []  # (start, length)
        self._lent: dict[int, tuple[int, object]] = {}  # start -> (length, holder)

    @property
    def lent_bytes(self) -> int:
        return sum(n for n, _ in self._lent.values())

    def largest_free(self) -> int:
        return max((n for _, n in self._free), default=0)

    def lent(self) -> dict[int, tuple[int, object]]:
        """Every range lent: offset -> (length, holder)."""
        return dict(self._lent)

    def lend(self, nbytes: int, holder: object) -> int | None:
        """Offset of a fresh range of at least ``nbytes`` (rounded up to
        :data:`ALIGN`), or None when no free range is that large."""
        if nbytes <= 0:
            raise ConfigError(f"a staging range must be > 0 bytes, got {nbytes}")
        size = align_up(nbytes)
        for i, (start, n) in enumerate(self._free):
            if n >= size:
                if n == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, n - size)
                self._lent[start] = (size, holder)
                return start
        return None

    def size_of(self, offset: int) -> int:
        got = self._lent.get(offset)
        if got is None:
            raise LocalProtocolError(f"staging offset {offset} is not lent")
        return got[0]

    def give_back(self, offset: int) -> None:
        """Return a lent range (only once nothing can land in it or read it)."""
        got = self._lent.pop(offset, None)
        if got is None:
            raise LocalProtocolError(f"staging offset {offset} is not lent")
        merged: list[tuple[int, int]] = []
        for s, n in sorted([*self._free, (offset, got[0])]):
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self._free = merged

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StagingLedger):
            return NotImplemented
        return (self.nbytes, self._free, self._lent) == (other.nbytes, other._free, other._lent)

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"StagingLedger(nbytes={self.nbytes}, lent={self.lent_bytes})"


def share(offset: int, nbytes: int, ranks: frozenset[int], rank: int) -> tuple[int, int]:
    """The part of a consumer's staging range ``[offset, offset + nbytes)`` that
    producer rank ``rank`` may write: the range split evenly, aligned, among the
    expected ``ranks`` in rank order (the consumer sends each rank its share in
    :class:`~.messages.Register` and finds it again when it scatters)."""
    order = sorted(ranks)
    if rank not in ranks:
        raise LocalProtocolError(f"rank {rank} is not an expected writer")
    each = (nbytes // len(order)) // ALIGN * ALIGN
    return offset + order.index(rank) * each, each


__all__ = ["ALIGN", "StagingLedger", "align_up", "share"]
