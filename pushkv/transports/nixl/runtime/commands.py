"""What the engine thread asks of a runtime's I/O thread: one small immutable type each.

:class:`~.api.NixlRuntime`'s engine-thread methods build one of these and
append it to the I/O thread's queue; the I/O thread
(:class:`~.loop.IOLoop`) dispatches it by type to the handler of the
same name. A command that names a transfer carries ``transfer_id``; if its
handler raises a pushkv error, the engine thread gets
:class:`~.events.CallFailed` naming the method (:func:`operation_of`).

They are typed named tuples rather than frozen dataclasses: building one is on
the engine thread's hot path, and a frozen dataclass costs three times as much
to construct (each field set through ``object.__setattr__``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from concurrent.futures import Future
from typing import Any, Literal, NamedTuple

from pushkv.protocol.events import Mode, Peer

from .events import RuntimeView


class Connect(NamedTuple):
    """Learn a producer engine's side-channel addresses; handshake now if ``eager``."""

    engine_id: str
    addresses: Mapping[int, str]
    eager: bool = False


class PrefillFinished(NamedTuple):
    transfer_id: str
    block_ids: Any  #: a sequence or array of block ids, not mutated after the call
    num_tokens: int
    incarnation: int = 0
    mode: Mode = Mode.PUSH  #: PULL: publish the blocks; the consumer reads them


class StartPull(NamedTuple):
    """Pull: read a producer's published ``src_block_ids`` into ``block_ids``."""

    transfer_id: str
    producer_engine_id: str
    src_block_ids: Any
    block_ids: Any
    num_tokens: int
    first_token: int = 0
    incarnation: int = 0
    lease_until: float | None = None  #: monotonic: until when the source is known held
    seals: Any = None  #: rule 11: producer rank -> its ``Publish.seal`` (None: unsealed)
    every_rank: bool = False  #: ``seals`` holds every producer rank's (a router's relay)


class RangeReady(NamedTuple):
    """Progressive push: tokens x layers of a prefill are final (once ``ready``
    says so: an object with ``query() -> bool``, e.g. a CUDA event; None: now)."""

    transfer_id: str
    block_ids: Any
    tokens: tuple[int, int]
    layers: tuple[int, int] | None = None
    incarnation: int = 0
    ready: Any = None


class PrefillAborted(NamedTuple):
    transfer_id: str
    incarnation: int = 0


class Register(NamedTuple):
    transfer_id: str
    producer_engine_id: str
    block_ids: Any
    num_tokens: int
    first_token: int = 0
    incarnation: int = 0
    target: int = 0  #: rule 12: this engine's turn at the source


class Abandon(NamedTuple):
    """The request ended before this rank registered it: final cancel to the producer."""

    transfer_id: str
    producer_engine_id: str
    incarnation: int = 0


class Preempt(NamedTuple):
    transfer_id: str


class Reissue(NamedTuple):
    transfer_id: str
    block_ids: Any


class Abort(NamedTuple):
    transfer_id: str


class Consumed(NamedTuple):
    """Push: the engine took its first decode step from the transfer's KV (rule 12)."""

    transfer_id: str


class Inspect(NamedTuple):
    """Answer with a :class:`RuntimeView` taken on the I/O thread."""

    reply: Future[RuntimeView]


class Inject(NamedTuple):
    """Fault injection: a raw frame to a known peer rank."""

    peer: Peer
    frame: bytes
    channel: Literal["control", "notify"]


class Close(NamedTuple):
    """Stop the I/O thread (after the commands queued before it)."""



Command = (Connect | PrefillFinished | RangeReady | PrefillAborted | Register | StartPull
           | Abandon | Preempt
           | Reissue | Abort | Consumed | Inspect | Inject | Close)

_OPERATIONS: dict[type[Any], str] = {
    c: re.sub(r"(?<!^)(?=[A-Z])", "_", c.__name__).lower()
    for c in (Connect, PrefillFinished, RangeReady, PrefillAborted, Register, StartPull,
              Abandon, Preempt,
              Reissue, Abort, Consumed, Inspect, Inject, Close)
}


def operation_of(command: Command) -> str:
    """The engine-thread method a command stands for (``PrefillFinished`` ->
    ``"prefill_finished"``), as :class:`~.events.CallFailed` reports it."""
    return _OPERATIONS[type(command)]
