"""What a consumer rank shows: the introspection drivers, tests and the checker read.

A mixin of :class:`~.consumer.Consumer`: no state of its own, no transition.
"""

from __future__ import annotations

from collections.abc import Mapping

from .lending import StagingLedger
from .records import Key
from .records import Transfer as _Transfer
from .states import ConsumerState


class ConsumerView:
    """Introspection of a :class:`~.consumer.Consumer`."""

    _transfers: Mapping[str, _Transfer]
    _retired: Mapping[Key, _Transfer]
    _engines: Mapping[str, object]
    _lent: Mapping[int, Key]
    _staging: StagingLedger

    @property
    def num_transfers(self) -> int:
        return len(self._transfers) + len(self._retired)

    def state_of(self, transfer_id: str) -> ConsumerState | None:
        t = self._transfers.get(transfer_id)
        return t.state if t else None

    def attempt_of(self, transfer_id: str) -> int | None:
        t = self._transfers.get(transfer_id)
        return t.cur.attempt if t else None

    def blocks_of(
        self, transfer_id: str, attempt: int, *, incarnation: int | None = None
    ) -> tuple[int, ...]:
        """Destination blocks of a live attempt (current or zombie), else ().
        ``incarnation`` None: the live use of the id."""
        t = self._transfers.get(transfer_id)
        if t is not None and incarnation is not None and t.inc != incarnation:
            t = self._retired.get((transfer_id, incarnation))
        if t is None:
            return ()
        if t.cur.attempt == attempt:
            return t.cur.block_ids
        z = t.zombies.get(attempt)
        return z.block_ids if z else ()

    def knows(self, engine_id: str) -> bool:
        """Whether a producer engine is handshaken (and not declared dead)."""
        return engine_id in self._engines

    def lent_to(self, block: int) -> str | None:
        """The transfer id a write into ``block`` may still come from, if any."""
        key = self._lent.get(block)
        return key[0] if key is not None else None

    def lender(self, block: int) -> Key | None:
        """The (transfer id, incarnation) a write into ``block`` may still come from."""
        return self._lent.get(block)

    def lent_blocks(self) -> dict[int, str]:
        """Blocks a write may still land in, with their transfer id."""
        return {b: k[0] for b, k in self._lent.items()}

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
