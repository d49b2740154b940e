"""What a producer rank says and shows: its answers to a consumer rank
(CancelAck, Fail, counted) and the introspection drivers and tests read.

A mixin of :class:`~.producer.Producer`: no state of its own, no transition.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from ..events import Peer, SendMessage
from ..lending import StagingLedger
from ..messages import CancelAck, Fail, FailReason
from ..records import Key, Kv, Leg
from ..records import Source as _Transfer
from ..states import ProducerState


class ProducerView:
    """Answers and introspection of a :class:`~.producer.Producer`."""

    peer: Peer
    stats: Counter[str]
    _transfers: Mapping[Key, _Transfer]
    _tombstones: Mapping[Key, _Transfer]
    _pending_regs: int
    _staging: StagingLedger

    def _find(self, key: Key) -> _Transfer | None:
        """The live transfer, else its tombstone (legs GONE), else None."""
        t = self._transfers.get(key)
        return t if t is not None else self._tombstones.get(key)

    def _ack(self, peer: Peer, key: Key, attempt: int, leg: Leg | None = None) -> SendMessage:
        """CancelAck ``attempt``, with the writes of it ``leg`` posted (none if no leg)."""
        self.stats["acks"] += 1
        posted, failed = leg.history.get(attempt, (0, 0)) if leg is not None else (0, 0)
        return SendMessage(
            peer=peer,
            message=CancelAck(
                transfer_id=key[0],
                attempt=attempt,
                engine_id=self.peer.engine_id,
                rank=self.peer.rank,
                incarnation=key[1],
                posted=posted,
                failed=failed,
            ),
        )

    def _fail(
        self, peer: Peer, key: Key, attempt: int, reason: FailReason, detail: str = "",
        leg: Leg | None = None,
    ) -> SendMessage:
        """Fail ``attempt``, with the writes of it ``leg`` posted (none if no leg)."""
        self.stats["fails"] += 1
        posted, failed = leg.history.get(attempt, (0, 0)) if leg is not None else (0, 0)
        return SendMessage(
            peer=peer,
            message=Fail(
                transfer_id=key[0],
                attempt=attempt,
                engine_id=self.peer.engine_id,
                rank=self.peer.rank,
                reason=reason,
                detail=detail[:1024],
                incarnation=key[1],
                posted=posted,
                failed=failed,
            ),
        )

    @property
    def num_transfers(self) -> int:
        return len(self._transfers)

    @property
    def pending_registrations(self) -> int:
        return self._pending_regs

    def held_blocks(self) -> dict[Key, tuple[int, ...]]:
        """Source blocks currently held, by (transfer id, incarnation)."""
        return {k: t.src_ids for k, t in self._transfers.items() if t.kv is Kv.HELD}

    def leg_state(
        self, transfer_id: str, peer: Peer, *, incarnation: int = 0
    ) -> ProducerState | None:
        """State of a leg (GONE once its transfer is forgotten, while remembered)."""
        t = self._find((transfer_id, incarnation))
        leg = t.legs.get(peer) if t else None
        return leg.state if leg else None

    def writes_in_flight(self) -> list[tuple[str, int, Peer]]:
        return [
            (t.transfer_id, leg.writing, leg.peer)
            for t in self._transfers.values()
            for leg in t.legs.values()
            if leg.writing is not None
        ]

    @property
    def staging_lent(self) -> int:
        """Bytes of this rank's staging held by packed writes in flight (rule 10)."""
        return self._staging.lent_bytes
