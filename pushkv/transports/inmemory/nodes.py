"""One rank on the in-memory network: its endpoint, its memory, and the glue that
carries out the endpoint's actions through the network (:class:`Wire`)."""


from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import numpy as np

from ... import timeline
from ...integrity import Injector, Integrity, IntegrityConfig, Tag, unseal
from ...protocol import (
    Action,
    Connect,
    Consumer,
    DecodeError,
    IssueRead,
    IssueWrite,
    Notify,
    Peer,
    Producer,
    Publish,
    RankInfo,
    Register,
    Rejected,
    ReleaseDestination,
    ReleaseSource,
    ReleaseStaging,
    Scatter,
    SendMessage,
    Skip,
    TransferCancelled,
    TransferFailed,
    TransferReady,
    decode,
    encode,
)
from ...protocol.packing import PackingConfig
from ..staging import gather_host


class Wire(Protocol):
    """What a rank asks of the network it sits on (:class:`~.network.InMemoryNetwork`)."""

    now: float
    keep_log: bool
    packing: PackingConfig | None
    integrity: IntegrityConfig
    injector: Injector | None
    write_latency: float
    stats: Counter[str]
    violations: list[str]
    tags: dict[int, tuple[Any, Tag]]

    def send(self, src: Peer, dst: Peer, frame: bytes) -> None: ...
    def post_write(self, src: Peer, a: IssueWrite) -> Any: ...
    def post_read(self, dst: Peer, a: IssueRead) -> Any: ...
    def enqueue(self, kind: str, src: Peer | None, dst: Peer | str, payload: Any,
                delay: float) -> Any: ...
    def connect(self, consumer: Peer, engine_id: str) -> None: ...


class Node:
    """One rank: an endpoint, its memory, and what it has seen."""

    def __init__(self, net: Wire, info: RankInfo, memory: list[np.ndarray]) -> None:
        self.net = net
        self.info = info
        self.peer = Peer(info.engine_id, info.rank)
        self.name = timeline.node(info.engine_id, info.rank)  # in its timeline steps
        self.grace: float | None = None  # a consumer's fence_grace_s (timeline steps)
        self.memory = memory
        #: Staging memory (packed writes): ranges of it are lent by the endpoint.
        self.staging = np.zeros(net.packing.staging_bytes if net.packing else 0, np.uint8)
        self.alive = True
        self.rejected: list[Rejected] = []
        self.log: list[tuple[float, Action]] = []
        #: Digests (rule 11): sealed on the producer, checked on the consumer.
        self.integrity = Integrity(net.integrity, info.layout, lambda: self.memory,
                                   injector=net.injector, rank=info.rank)

    def apply(self, actions: list[Action]) -> None:
        if actions and timeline.enabled():  # the protocol steps, at simulated time
            timeline.actions(self.name, actions, self.net.now, self.grace)
        for a in actions:
            if self.net.keep_log:
                self.log.append((self.net.now, a))
            if isinstance(a, SendMessage):
                self.net.send(self.peer, a.peer, encode(a.message))
            elif isinstance(a, Rejected):
                self.rejected.append(a)
            else:
                self.handle(a)

    def handle(self, action: Action) -> None:  # pragma: no cover - overridden
        raise NotImplementedError(action)

    def frame(self, data: bytes, now: float) -> None:
        raise NotImplementedError  # pragma: no cover


class ProducerNode(Node):
    def __init__(self, net: Wire, endpoint: Producer, memory: list[np.ndarray]):
        super().__init__(net, endpoint.info, memory)
        self.endpoint = endpoint
        self.released: Counter[str] = Counter()  # by transfer id (every incarnation)
        self.released_by_key: Counter[tuple[str, int]] = Counter()  # by (id, incarnation)
        self.released_at: dict[tuple[str, int], float] = {}  # when, by (id, incarnation)
        self.published: dict[str, Publish] = {}
        #: (transfer id, incarnation, consumer rank) of each registration taken in: a
        #: Register, or a Skip (nothing to write for that consumer rank)
        self.registrations: set[tuple[str, int, int]] = set()
        self.writes = 0  # writes started (every attempt and part)

    def handle(self, a: Action) -> None:
        if isinstance(a, IssueWrite):
            self.writes += 1
            tag = self.integrity.tag(a) if self.net.integrity.enabled else None
            if tag is not None:  # over the source bytes as they are now
                self.net.tags[id(a)] = (a, tag)
            if a.packed is not None:  # rule 10: gathered now, into the staging lent to it
                pw = a.packed
                gather_host(pw.packed, self.memory,
                            self.staging[pw.src_offset:pw.src_offset + pw.packed.nbytes])
            self.net.post_write(self.peer, a)
        elif isinstance(a, ReleaseSource):
            key = (a.transfer_id, a.incarnation)
            self.released[a.transfer_id] += 1
            self.released_by_key[key] += 1
            self.released_at.setdefault(key, self.net.now)
            if self.released_by_key[key] > 1:
                self.net.violations.append(f"{self.peer}: source of {key} released twice")
        elif isinstance(a, Publish):  # rule 11: sealed over the source as it is now
            seal = self.integrity.publish_seal(a) if self.net.integrity.enabled else b""
            self.published[a.transfer_id] = replace(a, seal=seal) if seal else a
        else:  # pragma: no cover
            raise AssertionError(f"unexpected producer action {a!r}")

    def frame(self, data: bytes, now: float) -> None:
        self.apply(self.endpoint.receive_bytes(data, now))
        try:
            msg = decode(data)
        except DecodeError:
            return
        if isinstance(msg, Register | Skip):
            self.registrations.add((msg.transfer_id, msg.incarnation, msg.rank))


class ConsumerNode(Node):
    def __init__(self, net: Wire, endpoint: Consumer, memory: list[np.ndarray]):
        super().__init__(net, endpoint.info, memory)
        self.endpoint = endpoint
        self.grace = endpoint.config.fence_grace_s
        self.outcomes: dict[str, list[tuple[str, int]]] = {}  # by id (every incarnation)
        self.outcomes_by_key: dict[tuple[str, int], list[tuple[str, int]]] = {}
        self.released: list[ReleaseDestination] = []
        self.staging_released: list[ReleaseStaging] = []
        self.connects: list[str] = []

    def _outcome(self, kind: str, a: TransferReady | TransferFailed | TransferCancelled) -> None:
        self.outcomes.setdefault(a.transfer_id, []).append((kind, a.attempt))
        self.outcomes_by_key.setdefault((a.transfer_id, a.incarnation), []).append(
            (kind, a.attempt))

    def handle(self, a: Action) -> None:
        if isinstance(a, TransferReady):
            self._outcome("ready", a)
            if (a.transfer_id, a.incarnation, a.attempt) in self.integrity.injected_keys:
                self.net.stats["served_from_corrupt"] += 1  # READY over injected bytes
        elif isinstance(a, TransferFailed):
            self._outcome("failed", a)
        elif isinstance(a, TransferCancelled):
            self._outcome("cancelled", a)
        elif isinstance(a, ReleaseDestination):
            self.released.append(a)
        elif isinstance(a, ReleaseStaging):
            self.staging_released.append(a)
        elif isinstance(a, Scatter):
            self.net.enqueue("scatter", self.peer, self.peer, a, self.net.write_latency)
        elif isinstance(a, IssueRead):
            self.net.post_read(self.peer, a)
        elif isinstance(a, Connect):
            self.connects.append(a.engine_id)
            self.net.connect(self.peer, a.engine_id)
        else:  # pragma: no cover
            raise AssertionError(f"unexpected consumer action {a!r}")

    def start_pull(self, transfer_id: str, producer: str, src_block_ids: Sequence[int],
                   block_ids: Sequence[int], num_tokens: int, first_token: int = 0, *,
                   incarnation: int = 0, lease_s: float | None = None,
                   seals: Mapping[int, bytes] | None = None) -> None:
        """Pull as a driver starts it: the publication's seals relayed (rule 11: one per
        producer rank, ``Publish.seal``; checked first, a bad one changes nothing),
        then the endpoint's ``start_pull``."""
        tags = Integrity.pull_seals(seals, self.endpoint.producers.writers.get(producer, ()))
        self.apply(self.endpoint.start_pull(transfer_id, producer, src_block_ids, block_ids,
                                            num_tokens, self.net.now, first_token,
                                            incarnation=incarnation, lease_s=lease_s))
        self.integrity.expect_pull(transfer_id, incarnation, tags)

    def read_done(self, a: IssueRead, ok: bool, now: float) -> None:
        """A read of this rank ended: its landed bytes checked (rule 11), then the
        endpoint told."""
        checked, corrupt = self.integrity.stats["checked"], self.integrity.stats["corrupt"]
        bad = self.integrity.read_landed(a) if ok and (
            self.net.integrity.enabled or self.net.injector is not None) else ""
        if timeline.enabled():
            timeline.read_done(self.name, a.transfer_id, a.incarnation, a.attempt, a.peer, ok,
                               self.integrity.stats["checked"] > checked, now)
            if self.integrity.stats["checked"] > checked:
                timeline.checked(self.name, a.transfer_id, a.incarnation, a.attempt, a.peer,
                                 self.integrity.stats["corrupt"] == corrupt, now)
        self.apply(self.endpoint.read_completed(a.transfer_id, a.attempt, a.peer, ok, now,
                                                incarnation=a.incarnation, corrupt=bad))

    def frame(self, data: bytes, now: float) -> None:
        note = self._notified(data, now) if timeline.enabled() else None
        checked, corrupt = self.integrity.stats["checked"], self.integrity.stats["corrupt"]
        if self.net.integrity.enabled or self.net.injector is not None:
            actions = self.integrity.deliver(self.endpoint, data, now)
        else:
            actions = self.endpoint.receive_bytes(data, now)
        if note is not None and self.integrity.stats["checked"] > checked:
            timeline.checked(self.name, note.transfer_id, note.incarnation, note.attempt,
                             (note.engine_id, note.rank),
                             self.integrity.stats["corrupt"] == corrupt, now)
        self.apply(actions)

    def _notified(self, data: bytes, now: float) -> Notify | None:
        """Record a notification's arrival (timeline steps); the Notify, if it is one."""
        try:
            frame, tag = unseal(data)
            msg = decode(frame)
        except DecodeError:
            return None
        if not isinstance(msg, Notify):
            return None
        timeline.notified(self.name, msg, tag is not None and self.net.integrity.enabled, now)
        return msg

    def outcome(self, transfer_id: str) -> str | None:
        seen = self.outcomes.get(transfer_id)
        return seen[-1][0] if seen else None
