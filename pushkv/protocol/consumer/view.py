"""What a consumer rank shows: the introspection drivers, tests and the checker read.

A mixin of :class:`~.consumer.Consumer`: no state of its own, no transition.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..lending import StagingLedger
from ..records import Key
from ..records import Transfer as _Transfer
from ..states import ConsumerState
from .peers import Producers


class ConsumerView:
    """Introspection of a :class:`~.consumer.Consumer`."""

    _transfers: Mapping[str, _Transfer]
    _retired: Mapping[Key, _Transfer]
    _lent: Mapping[int, Key]
    _staging: StagingLedger
    producers: Producers

    @property
    def num_transfers(self) -> int:
        return len(self._transfers) + len(self._retired)

    def _find(self, transfer_id: str, incarnation: int) -> _Transfer | None:
        """The use ``incarnation`` of ``transfer_id``, live or retired (it outlives its
        end while old attempts are fenced)."""
        t = self._transfers.get(transfer_id)
        if t is not None and t.inc == incarnation:
            return t
        return self._retired.get((transfer_id, incarnation))

    def live_use(self, transfer_id: str) -> int | None:
        """The incarnation of the one use of ``transfer_id`` registered here and not
        forgotten (a rank holds at most one live use of an id), if any."""
        t = self._transfers.get(transfer_id)
        return t.inc if t else None

    def state_of(self, transfer_id: str, *, incarnation: int = 0) -> ConsumerState | None:
        """State of the use ``(transfer_id, incarnation)`` (None: not known here)."""
        t = self._find(transfer_id, incarnation)
        return t.state if t else None

    def attempt_of(self, transfer_id: str, *, incarnation: int = 0) -> int | None:
        """Current attempt of the use ``(transfer_id, incarnation)``."""
        t = self._find(transfer_id, incarnation)
        return t.cur.attempt if t else None

    def blocks_of(
        self, transfer_id: str, attempt: int, *, incarnation: int = 0
    ) -> tuple[int, ...]:
        """Destination blocks of a live attempt (current or zombie) of the use
        ``(transfer_id, incarnation)``, else ()."""
        t = self._find(transfer_id, incarnation)
        if t is None:
            return ()
        if t.cur.attempt == attempt:
            return t.cur.block_ids
        z = t.zombies.get(attempt)
        return z.block_ids if z else ()

    def knows(self, engine_id: str) -> bool:
        """Whether a producer engine is handshaken (and not declared dead)."""
        return engine_id in self.producers.engines

    def lent_to(self, block: int) -> Key | None:
        """The (transfer id, incarnation) a write into ``block`` may still come from."""
        return self._lent.get(block)

    def lent_blocks(self) -> dict[int, Key]:
        """Blocks a write may still land in, with their (transfer id, incarnation)."""
        return dict(self._lent)

    @property
    def in_grace(self) -> bool:
        """Whether blocks wait for a failed write's fence grace (rule 7): a timer, not
        a peer, ends that wait."""
        return any(until is not None
                   for t in (*self._transfers.values(), *self._retired.values())
                   for a in (t.cur, *t.zombies.values()) for until in a.stray.values())

    @property
    def staging_lent(self) -> int:
        """Bytes of staging lent to attempts (rule 10); 0 once everything ended."""
        return self._staging.lent_bytes

    def staging_holder(self, offset: int) -> tuple[Key, int] | None:
        """The ((transfer id, incarnation), attempt) the staging byte at ``offset`` is
        lent to, if any: a packed write or a scatter may touch it only for that one."""
        for start, (n, holder) in self._staging.lent().items():
            if start <= offset < start + n:
                return holder  # type: ignore[return-value]
        return None
