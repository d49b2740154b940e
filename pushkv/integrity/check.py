"""Digests on the data path: what a transport does with them, in one place.

A producer rank's transport asks :meth:`Integrity.tag` for each write it posts
(over the exact source bytes, before they move) and sends the write's
notification through :meth:`Integrity.notification` (sealed when it has a tag:
:mod:`.envelope`). A consumer rank's transport hands every notification frame to
:meth:`Integrity.deliver` instead of ``Consumer.receive_bytes``: it unseals it,
lets the fault injector at the landed bytes when one is set, checks them against
the tag, and tells the core -- ``receive`` when they match (or nothing is to be
checked), ``corrupt`` when they do not (rule 11). A staged write is checked once
its last chunk is scattered: :meth:`Integrity.scattered` gives ``scatter_done``
its ``corrupt`` argument.

A pull is checked the other way round: the producer rank seals what it publishes
(:meth:`Integrity.publish_seal`, over the exact source bytes when the pull is
offered; ``Publish.seal``), the relay hands each rank's seal to the consumer's
pull (:meth:`Integrity.pull_seals` validates them, :meth:`Integrity.expect_pull`
keeps them), and once a read finished well :meth:`Integrity.read_landed` checks
the bytes it landed -- ``read_completed``'s ``corrupt`` argument. A read of less
than its producer rank published (a cached prefix's remainder, a layer subset)
is checked against the digests of exactly what it reads: the consumer's
transport sends :meth:`Integrity.seal_query`'s query as it posts the read, the
producer's answers it (:meth:`Integrity.answer`, after checking its whole source
still matches what it sealed), and the read's check waits for the answer
(:meth:`Integrity.answered`); no answer, or an unknown or changed source, fails
the read.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pushkv.protocol import decode, encode
from pushkv.protocol.consumer import Consumer
from pushkv.protocol.errors import ConfigError, DecodeError
from pushkv.protocol.events import Action, IssueRead, IssueWrite, Publish, Scatter, WriteScope
from pushkv.protocol.layout import KVLayout
from pushkv.protocol.messages import Notify

from .config import OFF, IntegrityConfig
from .digest import digest
from .envelope import (
    ANSWER_CHANGED,
    ANSWER_OK,
    ANSWER_UNKNOWN,
    PullTag,
    SealAnswer,
    SealQuery,
    Tag,
    seal,
    seal_pull,
    unseal,
    unseal_pull,
)
from .inject import Injector

log = logging.getLogger(__name__)

#: Staged writes waiting for their last scatter, remembered at most (oldest dropped).
MAX_STAGED = 4096


@dataclass(frozen=True, slots=True)
class Corruption:
    """One landed range that failed its check: what the log line and metric name."""

    transfer_id: str
    incarnation: int
    attempt: int
    producer: str
    producer_rank: int
    consumer_rank: int
    tag: Tag
    expected: int  #: the producer's digest
    got: int  #: the consumer's, over its landed bytes
    kind: str = "write"  #: or "read" (pull)
    #: why it could not be checked, when no digest of the producer's was to be had
    #: (a read of part of a source: no answer, an unknown or a changed source)
    unverified: str = ""

    def detail(self) -> str:
        if self.unverified:
            return (f"rank {self.producer_rank}'s {self.kind} {self.tag.describe()} could not "
                    f"be verified: {self.unverified}")
        return (f"rank {self.producer_rank}'s {self.kind} {self.tag.describe()} failed its "
                f"digest check: producer {self.expected:016x}, landed {self.got:016x}")


class Integrity:
    """The integrity checks of one rank: its setting, memory, layout and counts.

    ``regions()`` returns the rank's KV regions as the digest takes them (numpy
    arrays or torch tensors), called when needed (memory may be bound late).
    ``on_corrupt`` is called with each :class:`Corruption` (logs, metrics).
    """

    def __init__(self, config: IntegrityConfig | None, layout: KVLayout,
                 regions: Callable[[], Sequence[Any]], *, injector: Injector | None = None,
                 on_corrupt: Callable[[Corruption], None] | None = None,
                 rank: int = 0) -> None:
        self.config = config or OFF
        self.layout = layout
        self.regions = regions
        self.injector = injector
        self.on_corrupt = on_corrupt
        self.rank = rank
        self.stats: Counter[str] = Counter()
        self.corruptions: list[Corruption] = []  # the latest ones, bounded
        self._staged: OrderedDict[tuple[str, int, int, int], list[Any]] = OrderedDict()
        #: (transfer id, incarnation, attempt) of writes the injector corrupted
        self.injected_keys: set[tuple[str, int, int]] = set()
        #: pull: (transfer id, incarnation) -> producer rank -> its published seal
        self._pulls: OrderedDict[tuple[str, int], dict[int, PullTag]] = OrderedDict()
        #: pull, producer: what each sealed publication covered and its head digests
        self._sources: OrderedDict[tuple[str, int], tuple[WriteScope, tuple[int, ...]]] = \
            OrderedDict()
        #: pull, consumer: reads whose rectangle was asked of their producer rank, by
        #: (transfer id, incarnation, attempt, producer rank) -> the answer (None: not yet)
        self._asked: OrderedDict[tuple[str, int, int, int], SealAnswer | None] = OrderedDict()

    # -------------------------------------------------------------- producer

    def tag(self, a: IssueWrite) -> Tag | None:
        """The digest of a write about to be posted, over its source bytes now
        (None: this transfer is not checked, or the write names no scope)."""
        if a.scope is None or not self.config.checks(a.transfer_id, a.incarnation):
            return None
        s = a.scope
        self.stats["sealed"] += 1
        return Tag(s.first_token, s.num_tokens, s.layers,
                   digest(self.regions(), self.layout, s))

    @staticmethod
    def notification(a: IssueWrite, k: int, tag: Tag | None) -> bytes:
        """Chunk ``k``'s notification frame of write ``a``, sealed with ``tag``."""
        frame = encode(a.chunk_notify(k))
        return frame if tag is None else seal(frame, tag)

    def publish_seal(self, a: Publish) -> bytes:
        """Pull: the seal of a publication (``Publish.seal``) over its source bytes
        now, one digest per head (b"": this transfer is not checked)."""
        if a.scope is None or not self.config.checks(a.transfer_id, a.incarnation):
            return b""
        s = a.scope
        digests = self._head_digests(s)
        self.stats["sealed"] += 1
        self._sources[(a.transfer_id, a.incarnation)] = (s, digests)
        while len(self._sources) > MAX_STAGED:
            self._sources.popitem(last=False)
        return seal_pull(PullTag(s.first_token, s.num_tokens, s.layers, digests))

    def _head_digests(self, s: WriteScope) -> tuple[int, ...]:
        """One digest per head of ``s`` as this rank numbers them (an opaque ``BLOCK``
        layout: one of every head)."""
        lo, regions = self.layout, self.regions()
        if lo.order == "BLOCK":
            return (digest(regions, lo, s),)
        return tuple(digest(regions, lo, replace(s, heads=((h, h, 1),)))
                     for h in range(lo.num_heads))

    def answer(self, q: SealQuery) -> SealAnswer:
        """Pull, producer: the answer to a consumer rank's :class:`SealQuery` -- the
        seal of the rectangle it reads, if this rank published it sealed and its whole
        source still digests as it did then (the source may have been reused)."""
        out = SealAnswer(q.transfer_id, q.incarnation, q.attempt, self.rank, ANSWER_UNKNOWN)
        got = self._sources.get((q.transfer_id, q.incarnation))
        if got is None:
            self.stats["queries_unknown"] += 1
            return out
        scope, sealed = got
        if not (scope.first_token <= q.first_token and q.num_tokens <= scope.num_tokens
                and scope.layers.start <= q.layers.start
                and q.layers.stop <= scope.layers.stop):
            self.stats["queries_unknown"] += 1
            return out
        if self._head_digests(scope) != sealed:
            self.stats["source_changed"] += 1
            return replace(out, status=ANSWER_CHANGED)
        part = replace(scope, first_token=q.first_token, num_tokens=q.num_tokens,
                       layers=q.layers)
        self.stats["queries_answered"] += 1
        return replace(out, status=ANSWER_OK, seal=seal_pull(PullTag(
            part.first_token, part.num_tokens, part.layers, self._head_digests(part))))

    def forget_source(self, transfer_id: str, incarnation: int) -> None:
        """Pull, producer: the source is released; queries about it are answered unknown."""
        self._sources.pop((transfer_id, incarnation), None)

    # -------------------------------------------------------------- consumer

    @staticmethod
    def pull_seals(seals: Mapping[int, bytes] | None, ranks: Iterable[int], *,
                   every_rank: bool = False) -> dict[int, PullTag] | None:
        """The relayed seals of a pull, one per producer rank in ``ranks`` (None or
        empty: the publication was not sealed, nothing is checked). A missing or
        extra rank is a ConfigError, a malformed seal a DecodeError; nothing changes.
        ``every_rank``: ``seals`` relays the whole publication, every producer rank's
        seal (a router passes one answer to every consumer rank): those of ``ranks``
        are taken (each must be there), the others are left."""
        if not seals:
            return None
        want = set(ranks)
        if not isinstance(seals, Mapping) or not (
                want <= set(seals) if every_rank else set(seals) == want):
            got = sorted(seals) if isinstance(seals, Mapping) else type(seals).__name__
            raise ConfigError(f"a sealed pull needs one seal per producer rank "
                              f"{sorted(want)}, got {got}")
        out = {}
        for r, raw in ((r, seals[r]) for r in sorted(want)):
            if not isinstance(raw, bytes | bytearray | memoryview):
                raise ConfigError(f"producer rank {r}'s seal is {type(raw).__name__}, "
                                  "not bytes")
            out[r] = unseal_pull(raw)
        return out

    def expect_pull(self, transfer_id: str, incarnation: int,
                    tags: dict[int, PullTag] | None) -> None:
        """Keep a started pull's seals (:meth:`pull_seals`) for its reads."""
        key = (transfer_id, incarnation)
        self._pulls.pop(key, None)
        if tags is None:
            return
        self._pulls[key] = tags
        while len(self._pulls) > MAX_STAGED:
            self._pulls.popitem(last=False)

    def seal_query(self, a: IssueRead, engine_id: str) -> SealQuery | None:
        """Pull, consumer: as read ``a`` is posted, the query to send its producer
        rank when the relayed seal covers more than the read lands (None: nothing to
        ask). The read's check then waits for the answer (:meth:`awaiting`)."""
        tags = self._pulls.get((a.transfer_id, a.incarnation))
        tag = None if tags is None else tags.get(a.peer.rank)
        s = a.scope
        if tag is None or s is None or not self.config.enabled or (
                tag.first_token, tag.num_tokens, tag.layers) == (
                s.first_token, s.num_tokens, s.layers) or s.first_token >= s.num_tokens:
            return None
        self._asked[(a.transfer_id, a.incarnation, a.attempt, a.peer.rank)] = None
        while len(self._asked) > MAX_STAGED:
            self._asked.popitem(last=False)
        self.stats["queries_sent"] += 1
        return SealQuery(a.transfer_id, a.incarnation, a.attempt, engine_id, self.rank,
                         s.first_token, s.num_tokens, s.layers)

    def awaiting(self, a: IssueRead) -> bool:
        """Read ``a``'s check waits for its producer rank's answer."""
        key = (a.transfer_id, a.incarnation, a.attempt, a.peer.rank)
        return key in self._asked and self._asked[key] is None

    def answered(self, ans: SealAnswer) -> bool:
        """A producer rank's :class:`SealAnswer` came; False if no read asked for it
        (late, repeated, or never asked: dropped and counted)."""
        key = (ans.transfer_id, ans.incarnation, ans.attempt, ans.rank)
        if key not in self._asked or self._asked[key] is not None:
            self.stats["answers_stale"] += 1
            return False
        self._asked[key] = ans
        return True

    def read_landed(self, a: IssueRead) -> str:
        """Pull: read ``a`` finished well; the ``corrupt`` argument of
        ``read_completed`` ("" unless its bytes fail the producer's digest)."""
        tags = self._pulls.get((a.transfer_id, a.incarnation))
        scope = a.scope
        if scope is None:
            return ""
        key = (a.transfer_id, a.incarnation, a.attempt, a.peer.rank)
        try:
            if self.injector is not None and self.injector.maybe(key, scope, self.regions(),
                                                                 self.layout):
                self.injected_keys.add(key[:3])
                self.stats["injected"] += 1
            bad = self._check_read(a, scope, None if tags is None else tags.get(a.peer.rank))
        except Exception:
            self._check_failed()
            return ""
        return "" if bad is None else bad.detail()

    def _check_read(self, a: IssueRead, scope: WriteScope, tag: PullTag | None
                    ) -> Corruption | None:
        if tag is None or not self.config.enabled:
            return None
        rect = (scope.first_token, scope.num_tokens, scope.layers)
        asked = (a.transfer_id, a.incarnation, a.attempt, a.peer.rank)
        if asked in self._asked:  # part of the source: checked against the answer
            ans = self._asked.pop(asked)
            why = ("no answer from the producer rank in time" if ans is None else
                   "the producer rank holds no such sealed source"
                   if ans.status == ANSWER_UNKNOWN else
                   "the producer rank's source changed since it sealed it"
                   if ans.status == ANSWER_CHANGED else "")
            if not why:
                assert ans is not None
                tag = unseal_pull(ans.seal)
                if (tag.first_token, tag.num_tokens, tag.layers) != rect:
                    why = "the producer rank answered for another range"
            if why:
                self.stats["checked"] += 1
                return self._bad(a, PullTag(*rect, ()), 0, 0, unverified=why)
        elif (tag.first_token, tag.num_tokens, tag.layers) != rect:
            # A cached prefix or a layer subset, not asked (no side channel to ask on):
            # the published digests sum over more.
            self.stats["unchecked"] += 1
            return None
        self.stats["checked"] += 1
        heads = [s + i for _, s, k in scope.heads for i in range(k)]
        if self.layout.order == "BLOCK":
            want = tag.digests[0] if len(tag.digests) == 1 else -1
        elif all(0 <= h < len(tag.digests) for h in heads):
            want = sum(tag.digests[h] for h in heads) & ((1 << 64) - 1)
        else:
            want = -1  # the seal does not name the heads read: fail closed
        got = digest(self.regions(), self.layout, scope)
        if got == want:
            self.stats["passed"] += 1
            return None
        return self._bad(a, tag, want & ((1 << 64) - 1), got)

    def _bad(self, a: IssueRead, tag: PullTag, want: int, got: int, *,
             unverified: str = "") -> Corruption:
        bad = Corruption(a.transfer_id, a.incarnation, a.attempt, a.peer.engine_id,
                         a.peer.rank, self.rank, Tag(tag.first_token, tag.num_tokens,
                                                     tag.layers, want),
                         want, got, kind="read", unverified=unverified)
        self.stats["corrupt"] += 1
        if unverified:
            self.stats["unverified"] += 1
        self.corruptions = [*self.corruptions[-63:], bad]
        if self.on_corrupt is not None:
            self.on_corrupt(bad)
        return bad

    def deliver(self, endpoint: Consumer, data: bytes, now: float) -> list[Action]:
        """A notification frame (sealed or plain) reached this consumer rank."""
        try:
            frame, tag = unseal(data)
        except DecodeError:
            self.stats["bad_envelope"] += 1
            return endpoint.receive_bytes(data, now)  # rejected there, and counted
        try:
            msg = decode(frame)
        except DecodeError:
            return endpoint.receive_bytes(frame, now)
        if not isinstance(msg, Notify):
            return endpoint.receive(msg, now)
        return self.deliver_notify(endpoint, msg, tag, now)

    def deliver_notify(self, endpoint: Consumer, msg: Notify, tag: Tag | None,
                       now: float) -> list[Action]:
        """A decoded notification with its tag (None: unsealed) reached this rank."""
        scope = endpoint.landed_scope(msg)
        if scope is None:
            if tag is not None:
                self.stats["unchecked"] += 1  # nothing it could count towards
            return endpoint.receive(msg, now)
        if msg.staged:  # rule 10: checked once its last chunk is scattered
            key = (msg.transfer_id, msg.incarnation, msg.attempt, msg.rank)
            got = self._staged.setdefault(key, [tag, msg, max(1, msg.chunks), 0])
            got[0] = got[0] or tag  # every chunk carries the write's tag
            self._staged.move_to_end(key)
            while len(self._staged) > MAX_STAGED:
                self._staged.popitem(last=False)
            return endpoint.receive(msg, now)
        try:
            self._inject(msg, scope, tag)
            bad = self._check(msg, scope, tag)
        except Exception:  # a check that cannot run (memory not viewable): unchecked
            self._check_failed()
            bad = None
        if bad is None:
            return endpoint.receive(msg, now)
        return endpoint.corrupt(msg, now, detail=bad.detail())

    def scattered(self, endpoint: Consumer, a: Scatter) -> str:
        """A scatter of ``a`` finished well: the ``corrupt`` argument for
        ``scatter_done`` ("" unless it was the write's last and the bytes are wrong)."""
        key = (a.transfer_id, a.incarnation, a.attempt, a.peer.rank)
        got = self._staged.get(key)
        if got is None:
            return ""
        got[3] += 1
        if got[3] < got[2]:
            return ""
        del self._staged[key]
        tag, msg = got[0], got[1]
        scope = endpoint.landed_scope(msg)
        if scope is None:
            return ""
        try:
            self._inject(msg, scope, tag)
            bad = self._check(msg, scope, tag)
        except Exception:
            self._check_failed()
            return ""
        return "" if bad is None else bad.detail()

    def _check_failed(self) -> None:
        """A digest that cannot be taken here is a local fault, not corruption: the
        write counts unchecked (``check_errors``); the first one is logged."""
        self.stats["check_errors"] += 1
        if self.stats["check_errors"] == 1:
            log.exception("pushkv integrity: cannot check landed bytes on rank %d (counted "
                          "as check_errors; further ones are not logged)", self.rank)

    def _inject(self, msg: Notify, scope: WriteScope, tag: Tag | None) -> None:
        if self.injector is None:
            return
        if tag is not None:  # the part's own rectangle (a progressive push's parts)
            scope = _within(scope, tag) or scope
        key = (msg.transfer_id, msg.incarnation, msg.attempt, msg.rank)
        if self.injector.maybe(key, scope, self.regions(), self.layout):
            self.injected_keys.add(key[:3])
            self.stats["injected"] += 1

    def _check(self, msg: Notify, scope: WriteScope, tag: Tag | None) -> Corruption | None:
        if tag is None or not self.config.enabled:
            return None
        self.stats["checked"] += 1
        part = _within(scope, tag)
        got = -1
        if part is not None:  # else: the tag claims a range outside the registration
            got = digest(self.regions(), self.layout, part)
            if got == tag.digest:
                self.stats["passed"] += 1
                return None
        bad = Corruption(msg.transfer_id, msg.incarnation, msg.attempt, msg.engine_id,
                         msg.rank, self.rank, tag, tag.digest, got & ((1 << 64) - 1))
        self.stats["corrupt"] += 1
        self.corruptions = [*self.corruptions[-63:], bad]
        if self.on_corrupt is not None:
            self.on_corrupt(bad)
        return bad


def _within(scope: WriteScope, tag: Tag) -> WriteScope | None:
    """The tag's rectangle of ``scope`` (None: it does not lie inside it)."""
    if not (scope.first_token <= tag.first_token <= tag.num_tokens <= scope.num_tokens
            and scope.layers.start <= tag.layers.start <= tag.layers.stop
            <= scope.layers.stop):
        return None
    return WriteScope(scope.block_ids, tag.first_token, tag.num_tokens, tag.layers,
                      scope.heads)


__all__ = ["MAX_STAGED", "Corruption", "Integrity"]
