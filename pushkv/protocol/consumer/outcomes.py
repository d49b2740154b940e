"""What a consumer rank does with what its producer ranks report: notifications
(whole writes, parts, staged chunks, corrupt landings), CancelAcks and Fails,
and the completions of its own reads (pull) and scatters (rule 10).

Each report is checked (rule 6: other uses and attempts never count; a
producer that lies is rejected, nothing changed) and routed to the current
attempt's table or a zombie's. A mixin of :class:`~.endpoint.Consumer`
holding no state: what it needs of the endpoint is declared on
:class:`ConsumerOutcomes`, so this module imports nothing above it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from ..config import ConsumerConfig
from ..errors import LocalProtocolError, RemoteProtocolError, ValidationError
from ..events import Action, Mode, Peer, Rejected, WriteScope, sender_of
from ..layout import RankInfo
from ..mapping import assignment
from ..messages import CancelAck, Fail, FailReason, Notify
from ..records import Attempt, Transfer
from ..states import CONSUMER_FENCING, ConsumerInput, ConsumerState
from . import staging
from .parts import count_parts as _parts
from .peers import Producers
from .view import ConsumerView

CS, CI = ConsumerState, ConsumerInput
#: States in which producer outcomes for the current attempt still matter.
_LISTENING = frozenset({CS.REGISTERED, *CONSUMER_FENCING})


class ConsumerOutcomes(ConsumerView):
    """The producer-report and completion handlers of a :class:`~.endpoint.Consumer`."""

    info: RankInfo
    peer: Peer
    config: ConsumerConfig
    stats: Counter[str]
    producers: Producers
    _corrupt_detail: str

    if TYPE_CHECKING:  # provided by the endpoint
        def _input(self, t: Transfer, inp: ConsumerInput, now: float, *,
                   ranks: frozenset[int] = frozenset(), block_ids: tuple[int, ...] = (),
                   packed: staging.StagedChunk | None = None) -> list[Action]: ...
        def _zombie(self, t: Transfer, z: Attempt, inp: ConsumerInput, now: float,
                    ranks: frozenset[int] = frozenset()) -> list[Action]: ...
        def _run_timers(self, now: float) -> list[Action]: ...
        def _schedule(self, when: float, key: object) -> None: ...

    def read_completed(
        self, transfer_id: str, attempt: int, peer: Peer, ok: bool, now: float, *,
        incarnation: int = 0, corrupt: str = "",
    ) -> list[Action]:
        """Pull: the transport finished (``ok``) or failed a read issued by IssueRead
        for ``(transfer_id, incarnation)`` (the IssueRead's; 0: the default use).

        ``corrupt`` (rule 11): the read finished, and the bytes it landed failed their
        digest check against the producer's published one (what failed, both
        digests). Fed as ``CORRUPT``: a landing that fences its rank and never
        counts towards READY; the transfer fails with ``FailReason.CORRUPT``."""
        t = self._find(transfer_id, incarnation)
        if t is None:
            # Only possible when the read outlived the hard deadline (window + grace)
            # and its blocks were released: counted, as it breaks the timing assumption.
            self.stats["late_read"] += 1
            return self._run_timers(now)
        if t.mode is not Mode.PULL or peer.engine_id != t.producer:
            raise LocalProtocolError("read completion for a transfer that reads nothing "
                                     "from that peer", transfer_id=transfer_id, attempt=attempt)
        out = self._run_timers(now)
        failed = not ok  # (a read past the lease completed: none of its bytes stray)
        if ok and now >= t.lease_until:  # rule 4: the source may be gone under the read
            ok = False
            self.stats["reads_past_lease"] += 1
            t.why(FailReason.LEASE_EXPIRED, f"the read from {peer} completed after the "
                  "source's lease may have ended")
        self.stats["reads_ok" if ok else "reads_failed"] += 1
        inp = CI.NOTIFY if ok else CI.FAIL
        if ok and corrupt:
            a = t.cur if attempt == t.cur.attempt else t.zombies.get(attempt)
            if a is not None and peer.rank in a.expected and peer.rank not in a.fenced:
                # Rule 11: a read is its rank's one whole landing (rule 9's count).
                a.got.setdefault(peer.rank, set()).add(0)
                a.need[peer.rank] = max(1, a.need.get(peer.rank, 0))
                inp = CI.CORRUPT  # the tables decide: fails the attempt, or only fences
                self.stats["corrupt"] += 1
                self._corrupt_detail = corrupt
        if not ok:
            t.why(FailReason.READ_FAILED, f"read from {peer} failed")
            a = t.cur if attempt == t.cur.attempt else t.zombies.get(attempt)
            if failed and a is not None and peer.rank not in a.stray and (
                    peer.rank not in a.fenced):
                # Rule 7, for reads: nothing says a failed READ stopped writing the
                # blocks, so its stray bytes may land until the fence grace.
                a.stray[peer.rank] = now + self.config.fence_grace_s
                self._schedule(now + self.config.fence_grace_s, t.key)
        try:
            return out + self._report(t, attempt, peer.rank, inp, now)
        finally:
            self._corrupt_detail = ""

    def landed_scope(self, msg: Notify) -> WriteScope | None:
        """Rule 11: the logical KV the write ``msg`` notifies may have landed in,
        on this rank (the whole registration of the rank's slice: a part of a
        progressive push covers a rectangle inside it) -- or None when the
        notification cannot count towards READY (another use or attempt, a
        transfer not registered, a rank not expected), so there is nothing to check."""
        t = self._find(msg.transfer_id, msg.incarnation)
        if (t is None or t.mode is not Mode.PUSH or t.state is not CS.REGISTERED
                or msg.attempt != t.cur.attempt or msg.rank not in t.cur.expected
                or msg.engine_id != t.producer):
            return None
        info = self.producers.peers.get(Peer(t.producer, msg.rank))
        if info is None:
            return None
        got = assignment(info.engine, self.info.engine, msg.rank, self.peer.rank)
        return WriteScope(t.cur.block_ids, t.first_token, t.num_tokens, got.layers,
                          tuple((d, d, n) for _, d, n in got.heads))

    def corrupt(self, msg: Notify, now: float, *, detail: str = "") -> list[Action]:
        """Rule 11: the driver received ``msg`` and found the bytes its write landed
        failing their digest check (``detail`` says which range, both digests).

        Handled as the notification it is -- a landing, counted for the fence --
        except that it never counts towards READY: the registered attempt fails
        with ``FailReason.CORRUPT`` (blocks released at its fence, nothing READY).
        A staged write is checked after its scatter: see :meth:`scatter_done`."""
        if not isinstance(msg, Notify) or msg.staged:
            raise LocalProtocolError("corrupt() takes a direct write's Notify; a staged "
                                     "write is checked at scatter_done(corrupt=)",
                                     transfer_id=getattr(msg, "transfer_id", None))
        out = self._run_timers(now)
        self._corrupt_detail = detail or f"rank {msg.rank}'s write failed its digest check"
        try:  # as receive(): what the peer got wrong is Rejected, never raised
            out += self._from_producer(msg, CI.NOTIFY, now, corrupt=True)
        except RemoteProtocolError as exc:
            self.stats["rejected"] += 1
            out.append(Rejected(peer=sender_of(msg), error=exc))
        finally:
            self._corrupt_detail = ""
        return out

    def _from_producer(
        self, msg: Notify | CancelAck | Fail, inp: ConsumerInput, now: float,
        corrupt: bool = False,
    ) -> list[Action]:
        t = self._find(msg.transfer_id, msg.incarnation)  # rule 6: other uses never count
        if t is None:
            self.stats["stale"] += 1
            return []
        if msg.engine_id != t.producer:
            raise _invalid(f"{msg.engine_id!r} is not this transfer's producer",
                           t.transfer_id, msg.attempt, inp)
        if t.mode is Mode.PULL:
            if inp is CI.CANCEL_ACK:  # late answer to our final cancel
                self.stats["stale"] += 1
                return []
            raise _invalid("producer message for a pull transfer", t.transfer_id, msg.attempt,
                           inp)
        if isinstance(msg, Fail):
            t.why(msg.reason, f"{msg.reason.name} from rank {msg.rank}: {msg.detail}")
        a = t.cur if msg.attempt == t.cur.attempt else t.zombies.get(msg.attempt)
        packed = None
        staged = isinstance(msg, Notify) and msg.staged
        if isinstance(msg, Notify) and staged and a is t.cur and t.state is CS.REGISTERED and (
                msg.rank in a.expected and msg.rank not in a.fenced
                and not staging.repeated(a, msg)):
            # Rule 10: only a staged chunk of the registered attempt is scattered; its
            # plan is checked before any change. Elsewhere its landing only fences.
            packed = staging.staged_plan(
                self.info, self.producers.peers.get(Peer(t.producer, msg.rank)),
                self.config.packing.chunk_bytes if self.config.packing else 1, t, a, msg)
        if a is not None and msg.rank in a.expected and msg.rank not in a.fenced and (
            a is not t.cur or t.state in _LISTENING
        ) and not (inp is CI.CANCEL_ACK and a is t.cur and t.state is CS.REGISTERED):
            if isinstance(msg, Notify) and staged and not staging.count_chunk(a, msg):
                self.stats["duplicate"] += 1  # rule 10: its staged chunk already landed
                return self._input(t, CI.STALE, now) if a is t.cur else self._zombie(
                    t, a, CI.STALE, now)
            inp = _parts(a, msg.rank, inp, msg)
            if isinstance(msg, CancelAck | Fail) and msg.failed and msg.rank not in a.stray:
                # Rule 7: a failed write may still land bytes until the fence grace.
                a.stray[msg.rank] = now + self.config.fence_grace_s
                self._schedule(now + self.config.fence_grace_s, t.key)
            if staged and inp in (CI.NOTIFY, CI.PART):
                inp = CI.STAGED  # rule 10: a chunk of a staged write landed
            elif corrupt and (inp is CI.NOTIFY or (
                    inp is CI.PART and a is t.cur and t.state is CS.REGISTERED)):
                # Rule 11: a landing, never a count (while fencing, a part that does
                # not finish its rank stays a part: nothing is to be decided by it).
                inp = CI.CORRUPT
                self.stats["corrupt"] += 1
            elif inp is CI.PART:
                self.stats["parts"] += 1
        return self._report(t, msg.attempt, msg.rank, inp, now, packed)

    def scatter_done(
        self, transfer_id: str, attempt: int, peer: Peer, ok: bool, now: float, *,
        incarnation: int = 0, corrupt: str = "",
    ) -> list[Action]:
        """Rule 10: the driver finished (``ok``) or failed a :class:`Scatter` of
        ``(transfer_id, incarnation)`` (the Scatter's; 0: the default use).
        ``corrupt`` (rule 11): the rank's write, scattered in full by this one, failed
        its digest check -- what failed, both digests; fed as ``CORRUPT``."""
        self._corrupt_detail = corrupt
        try:
            return self._scattered(transfer_id, attempt, peer, ok, now, incarnation,
                                   bool(corrupt))
        finally:
            self._corrupt_detail = ""

    def _report(
        self, t: Transfer, attempt: int, rank: int, inp: ConsumerInput, now: float,
        packed: staging.StagedChunk | None = None,
    ) -> list[Action]:
        """Route one producer rank's outcome to the current attempt or a zombie."""
        z = t.zombies.get(attempt)
        a = t.cur if attempt == t.cur.attempt else z
        if a is None:
            self.stats["stale"] += 1  # rule 6: other attempts never count
            return self._input(t, CI.STALE, now)
        if rank not in a.expected:
            raise _invalid(f"rank {rank} is not an expected writer", t.transfer_id, attempt, inp)
        if rank in a.fenced:
            self.stats["duplicate"] += 1
            return self._zombie(t, z, CI.STALE, now) if z else self._input(t, CI.STALE, now)
        if z is not None:
            return self._zombie(t, z, inp, now, frozenset((rank,)))
        if t.state not in _LISTENING:
            self.stats["stale"] += 1
            return self._input(t, CI.STALE, now)
        if inp is CI.CANCEL_ACK and t.state is CS.REGISTERED:
            raise _invalid("CancelAck for an attempt that was not cancelled", t.transfer_id,
                           attempt, inp)
        return self._input(t, inp, now, ranks=frozenset((rank,)), packed=packed)

    def _scattered(self, transfer_id: str, attempt: int, peer: Peer, ok: bool, now: float,
                   inc: int, corrupt: bool) -> list[Action]:
        """The driver finished (``ok``) or failed a :class:`Scatter`: feed SCATTER_DONE (the
        rank's last chunk), CHUNK_SCATTERED (another) or SCATTER_FAILED to its attempt
        (current or zombie)."""
        t = self._find(transfer_id, inc)
        a = None if t is None else (t.cur if t.cur.attempt == attempt else t.zombies.get(attempt))
        if t is None or a is None or peer.engine_id != t.producer or (
                a.scattering.get(peer.rank, 0) <= 0):
            raise LocalProtocolError("scatter completion for no scatter in flight",
                                     transfer_id=transfer_id, attempt=attempt)
        out = self._run_timers(now)
        left = a.scattering[peer.rank] - 1
        if left:
            a.scattering[peer.rank] = left
        else:
            del a.scattering[peer.rank]
        self.stats["scatters_ok" if ok else "scatters_failed"] += 1
        ch = a.chunks[peer.rank]
        if ok:
            ch.done += 1
        else:
            t.why(FailReason.WRITE_FAILED, f"scatter of rank {peer.rank}'s staged write failed")
        inp = CI.SCATTER_FAILED if not ok else (
            CI.SCATTER_DONE if ch.done >= ch.need else CI.CHUNK_SCATTERED)
        if corrupt and inp is CI.SCATTER_DONE:  # rule 11: scattered in full, and wrong
            inp = CI.CORRUPT
            self.stats["corrupt"] += 1
        ranks = frozenset((peer.rank,))
        if a is not t.cur:
            return out + self._zombie(t, a, inp, now, ranks)
        return out + self._input(t, inp, now, ranks=ranks)

def _invalid(why: str, transfer_id: str, attempt: int, inp: ConsumerInput) -> ValidationError:
    return ValidationError(why, transfer_id=transfer_id, attempt=attempt, input=inp.value)
