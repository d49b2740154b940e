"""The life of one request as the simulator tracks it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .workload import Request


class Outcome(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class SimRequest:
    """Mutable per-request state shared by the router, the engines and the metrics."""

    spec: Request
    transfer_id: str
    incarnation: int = 0  #: drawn by the router for each use of ``transfer_id``
    prefill: str | None = None  #: prefill engine id
    decode: str | None = None  #: decode engine id
    # decode-side state
    dst_blocks: list[int] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)  #: output blocks held ahead (no preemption)
    src_blocks: tuple[int, ...] = ()  #: published by prefill (pull)
    kv_ready: bool = False
    awaiting_handshake: bool = False  #: pull: blocks allocated, the read waits for it
    local_prefill: bool = False  #: decode computes the prompt itself (recompute)
    prefilled: int = 0  #: prompt tokens computed on decode so far
    recompute_len: int = 0  #: tokens a preempted request computes again (0: the prompt)
    reissue: bool = False  #: its transfer was preempted: register again, a new attempt
    handing_off: bool = False  #: push: its registration order is on its way to the worker
    preempted: int = 0  #: times this request was preempted on decode
    # timeline
    prefill_done_at: float | None = None
    kv_ready_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    #: when each token reached the client (only with a frontend queue; else token_times
    #: plus the way's fixed latency)
    client_times: list[float] = field(default_factory=list)
    outcome: Outcome = Outcome.PENDING
    error: str = ""
    recomputed: bool = False
    #: Rule 12: the decode engine's turn at the held source (a re-target counts up)
    target: int = 0
    failovers: int = 0  #: decode instances this request lost before its first token
    #: a retry's leg stands for this client request (its outcome and timeline are copied)
    parent: SimRequest | None = None

    @property
    def input_len(self) -> int:
        return self.spec.input_len

    @property
    def output_len(self) -> int:
        return self.spec.output_len

    @property
    def arrival(self) -> float:
        return self.spec.arrival

    @property
    def prefill_target(self) -> int:
        """Tokens decode computes itself before the next token (local prefill only)."""
        return self.recompute_len or self.input_len

    @property
    def context(self) -> int:
        """Tokens of KV this request reads in its next decode step."""
        return self.input_len + len(self.token_times)
