"""What the engine thread asks of a runtime's I/O thread: one small frozen type each.

:class:`~.runtime.NixlRuntime`'s engine-thread methods build one of these and
append it to the I/O thread's queue; the I/O thread
(:class:`~.runtime_loop.IOLoop`) dispatches it by type to the handler of the
same name. A command that names a transfer carries ``transfer_id``; if its
handler raises a pushkv error, the engine thread gets
:class:`~.runtime_events.CallFailed` with the command's ``operation``.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..protocol.events import Peer
from .runtime_events import RuntimeView


@dataclass(frozen=True, slots=True, kw_only=True)
class Connect:
    """Learn a producer engine's side-channel addresses; handshake now if ``eager``."""

    operation: ClassVar[str] = "connect"
    engine_id: str
    addresses: Mapping[int, str]
    eager: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillFinished:
    operation: ClassVar[str] = "prefill_finished"
    transfer_id: str
    block_ids: Any  #: a sequence or array of block ids, not mutated after the call
    num_tokens: int
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillAborted:
    operation: ClassVar[str] = "prefill_aborted"
    transfer_id: str
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Register:
    operation: ClassVar[str] = "register"
    transfer_id: str
    producer_engine_id: str
    block_ids: Any
    num_tokens: int
    first_token: int = 0
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Abandon:
    """The request ended before this rank registered it: final cancel to the producer."""

    operation: ClassVar[str] = "abandon"
    transfer_id: str
    producer_engine_id: str
    incarnation: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Preempt:
    operation: ClassVar[str] = "preempt"
    transfer_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Reissue:
    operation: ClassVar[str] = "reissue"
    transfer_id: str
    block_ids: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class Abort:
    operation: ClassVar[str] = "abort"
    transfer_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Inspect:
    """Answer with a :class:`RuntimeView` taken on the I/O thread."""

    operation: ClassVar[str] = "inspect"
    reply: Future[RuntimeView]


@dataclass(frozen=True, slots=True, kw_only=True)
class Inject:
    """Fault injection: a raw frame to a known peer rank."""

    operation: ClassVar[str] = "inject"
    peer: Peer
    frame: bytes
    channel: Literal["control", "notify"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Close:
    """Stop the I/O thread (after the commands queued before it)."""

    operation: ClassVar[str] = "close"


Command = (Connect | PrefillFinished | PrefillAborted | Register | Abandon | Preempt | Reissue
           | Abort | Inspect | Inject | Close)
