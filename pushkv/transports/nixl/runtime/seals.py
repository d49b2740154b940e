"""Rule 11, pull: the digests of part of a source, asked for over the side channel.

A consumer rank reading less than its producer rank published -- the remainder
after a cached prefix, some of its layers -- cannot check its read against the
relayed seal, which sums over the whole source. As it posts the read it asks
the producer rank for the digests of exactly what it reads (a ``"PQ"`` query,
:mod:`pushkv.integrity.envelope`); the producer rank checks that its whole source
still digests as it did when it sealed it and answers (``"PA"``). A read that
finished before its answer is parked here until the answer comes or
``seal_wait_s`` passes; then its check runs (no answer, an unknown or a changed
source: the read fails, ``CORRUPT``). The read's bytes and the answer travel at
once, so a check costs the read's time or one side-channel round trip and a
digest of the source, whichever is longer.

Both sides run on the runtime's I/O thread.
"""

from __future__ import annotations

from collections.abc import Callable

from pushkv.integrity import Integrity
from pushkv.integrity.envelope import (
    SealAnswer,
    SealQuery,
    decode_seal_frame,
    encode_answer,
    encode_query,
)
from pushkv.protocol.errors import DecodeError
from pushkv.protocol.events import IssueRead, Peer

from ..reader import ReadResult

#: (transfer id, incarnation, attempt, producer rank): one read.
Key = tuple[str, int, int, int]


class SealExchange:
    """One rank's queries and answers. ``send(peer, body)`` sends a seal frame to a
    known peer rank (False: no usable link); ``finish(result, read, now)`` runs a
    read's check and reports it to the core."""

    def __init__(self, integrity: Integrity, *, role: str, engine_id: str, wait_s: float,
                 send: Callable[[Peer, bytes], bool],
                 finish: Callable[[ReadResult, IssueRead, float], None]) -> None:
        self.integrity = integrity
        self.role = role
        self.engine_id = engine_id
        self.wait_s = wait_s
        self._send = send
        self._finish = finish
        self._parked: dict[Key, tuple[ReadResult, IssueRead, float]] = {}

    # ------------------------------------------------------------- consumer

    def posted(self, a: IssueRead) -> None:
        """Read ``a`` is being posted: ask its producer rank, if its check needs it."""
        q = self.integrity.seal_query(a, self.engine_id)
        if q is not None and not self._send(a.peer, encode_query(q)):
            self.integrity.stats["queries_unroutable"] += 1  # no answer: fails at the wait

    def park(self, r: ReadResult, a: IssueRead, now: float) -> bool:
        """A read finished: keep it here (True) while its check waits for an answer."""
        if not (r.ok and self.integrity.awaiting(a)):
            return False
        self._parked[(a.transfer_id, a.incarnation, a.attempt, a.peer.rank)] = (
            r, a, now + self.wait_s)
        return True

    def next_deadline(self) -> float | None:
        return min((d for _, _, d in self._parked.values()), default=None)

    def expire(self, now: float) -> None:
        """Parked reads whose answer did not come in ``wait_s``: checked now (they fail)."""
        for key in [k for k, (_, _, d) in self._parked.items() if d <= now]:
            r, a, _ = self._parked.pop(key)
            self._finish(r, a, now)

    @property
    def parked(self) -> int:
        return len(self._parked)

    # ---------------------------------------------------------------- both

    def on_frame(self, body: bytes, now: float) -> None:
        """A seal frame from the side channel. DecodeError for one malformed or sent to
        the wrong side (the caller refuses it)."""
        msg = decode_seal_frame(body)
        if isinstance(msg, SealQuery):
            if self.role != "producer":
                raise DecodeError("a seal query sent to a consumer rank")
            self._answer(msg)
            return
        if self.role != "consumer":
            raise DecodeError("a seal answer sent to a producer rank")
        self._answered(msg, now)

    def _answer(self, q: SealQuery) -> None:
        ans = self.integrity.answer(q)
        if not self._send(Peer(q.engine_id, q.rank), encode_answer(ans)):
            self.integrity.stats["answers_unroutable"] += 1

    def _answered(self, ans: SealAnswer, now: float) -> None:
        if not self.integrity.answered(ans):
            return
        got = self._parked.pop((ans.transfer_id, ans.incarnation, ans.attempt, ans.rank), None)
        if got is not None:  # the read had finished first
            r, a, _ = got
            self._finish(r, a, now)
