"""What the scheduler side tells the workers each step (vLLM's connector metadata).

The scheduler process decides, the worker processes act: each ``schedule()``
builds one :class:`PushKVMetadata` listing the transfers to open, end or hand
over, and vLLM ships it to every worker. Plain frozen dataclasses, so they
pickle across vLLM's process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from .params import Endpoint


@dataclass(frozen=True, kw_only=True)
class RankAddress(KVConnectorHandshakeMetadata):
    """Worker -> scheduler, once at start-up: where this rank's side channel listens
    (vLLM gathers every worker's and hands them to the scheduler connector)."""

    rank: int  #: global rank: pp_rank * tp_size + tp_rank
    address: str  #: tcp://host:port, as the runtime bound it


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvOrder:
    """Consumer: register ``block_ids`` for tokens ``[first_token, num_tokens)``."""

    req_id: str
    transfer_id: str
    producer: Endpoint
    block_ids: tuple[int, ...]
    num_tokens: int
    first_token: int
    incarnation: int = 0
    target: int = 0  #: rule 12: this engine's turn at the source (a re-target's > 0)
    direction: str = "push"  #: "pull": read ``src_block_ids`` instead of registering
    src_block_ids: tuple[int, ...] = ()
    #: Pull: the wall-clock time until which the source is known held (None: not said)
    lease_until: float | None = None
    #: Pull: every producer rank's seal (rule 11) as the answer relayed them; None:
    #: the source was published unsealed, its reads are not checked
    seals: dict[int, bytes] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SendOrder:
    """Producer: prefill of ``transfer_id`` finished; its KV is held in ``block_ids``."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    incarnation: int = 0
    direction: str = "push"  #: "pull": publish the blocks for the consumer to read


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeOrder:
    """Producer (progressive push): this step computes the KV of prompt tokens
    ``[start, end)`` of ``transfer_id``, held in ``block_ids``; report it final once
    written -- per layer, or after the step (``push_granularity``). ``start`` starts a
    vLLM block; ``end`` ends one, or is the prompt's end."""

    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    """Either side: the engine gave the request up."""

    req_id: str
    transfer_id: str
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Abandon:
    """Consumer: the request ended before its registration went out; tell the producer
    (a final cancel) so it releases the prefilled KV now, not when its lease ends."""

    transfer_id: str
    producer: Endpoint
    incarnation: int = 0


@dataclass(kw_only=True)
class PushKVMetadata(KVConnectorMetadata):
    """One step's orders. Workers apply them in field order."""

    #: consumer: registrations born this step
    recv: list[RecvOrder] = field(default_factory=list)
    #: consumer: requests aborted while their transfer was registered -> cancel, fence
    recv_abort: list[Abort] = field(default_factory=list)
    #: consumer: requests that will never be registered; report them done at once
    recv_drop: list[str] = field(default_factory=list)
    #: consumer: requests whose transfer cannot even start; report them failed at once
    recv_fail: list[str] = field(default_factory=list)
    #: consumer: transfers never registered whose request ended -> final cancel
    recv_abandon: list[Abandon] = field(default_factory=list)
    #: consumer: pushed transfers (READY) whose request takes its first decode step
    #: in this step, or ended before it: each rank tells the producer ranks that wrote
    #: it (rule 12's ``Consumed``), which keep the source for a re-target until then
    consumed: list[str] = field(default_factory=list)
    #: producer: prefills finished with their KV held
    send: list[SendOrder] = field(default_factory=list)
    #: producer: requests aborted (or ended early) before their KV was complete
    send_abort: list[Abort] = field(default_factory=list)
    #: producer (progressive push): prompt KV this step computes, reported as it is saved
    send_ranges: list[RangeOrder] = field(default_factory=list)
    #: producer: prefills this step completes and ends (a leg of one token), finished
    #: as soon as the step saved its KV
    send_at_save: list[SendOrder] = field(default_factory=list)

    def is_empty(self) -> bool:
        """No order to apply at the step's start (``send_ranges`` and ``send_at_save``
        are applied as the step saves its KV)."""
        return not (self.recv or self.recv_abort or self.recv_drop or self.recv_fail
                    or self.recv_abandon or self.consumed or self.send or self.send_abort)


@dataclass(kw_only=True)
class PublishedSeals(KVConnectorWorkerMetadata):
    """Worker -> scheduler, in the output of the step that published them: the seal
    (rule 11) of each source this step published for a pull, by transfer id and
    producer rank (``b""``: the rank sealed none, or not in time). vLLM merges the
    ranks' with :meth:`aggregate`; the scheduler side adds them to the prefill's
    answer before it leaves the engine."""

    seals: dict[str, dict[int, bytes]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PublishedSeals:
        if not isinstance(other, PublishedSeals):
            return self
        merged = {tid: dict(ranks) for tid, ranks in self.seals.items()}
        for tid, ranks in other.seals.items():
            merged.setdefault(tid, {}).update(ranks)
        return PublishedSeals(seals=merged)
