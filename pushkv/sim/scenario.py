"""What one simulated run is: transfer mode, router, topology, workload, faults.

Everything a run depends on lives in a :class:`SimConfig` (frozen, typed, a
help string per field), so a run is a pure function of its config and seed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from ..direction import choose_direction
from ..protocol import ConsumerConfig, FailurePolicy, ProducerConfig
from ..protocol.errors import ConfigError as ProtocolConfigError
from ..protocol.packing import PackingConfig
from .packing import SIM_PACKING
from .profile import DEFAULT, Profile
from .trace import Trace
from .workload import WorkloadConfig


class ConfigError(ProtocolConfigError):
    """A scenario parameter is out of range."""


class TransferMode(enum.Enum):
    """How KV moves from prefill to decode."""

    PULL = "pull"  #: decode reads; descriptors posted inline in the decode engine loop
    PUSH = "push"  #: prefill writes from a background thread into registered blocks
    PULL_ASYNC = "pull-async"  #: decode reads; a decode background thread posts
    #: chosen by the dispatch (:func:`pushkv.direction.choose_direction`), as the
    #: vLLM connector does: pull-async when sequential, push when concurrent
    AUTO = "auto"
    #: progressive push: each prefill step's tokens are reported to the producer
    #: endpoint (``range_ready``) as the step ends, every layer at once
    PUSH_CHUNK = "push-chunk"
    #: progressive push: each step's tokens are reported layer by layer, as each
    #: layer's compute ends (the step's roofline time / layers)
    PUSH_LAYER = "push-layer"

    @property
    def is_pull(self) -> bool:
        return self in (TransferMode.PULL, TransferMode.PULL_ASYNC)

    @property
    def granularity(self) -> str:
        """What a push reports before prefill ends: ``request`` (nothing: the whole
        prompt at its end), ``chunk`` or ``layer`` (vLLM's ``push_granularity``)."""
        return {TransferMode.PUSH_CHUNK: "chunk",
                TransferMode.PUSH_LAYER: "layer"}.get(self, "request")


class Dispatch(enum.Enum):
    """When the router sends the decode leg of a request."""

    CONCURRENT = "concurrent"  #: with the prefill leg, at arrival (push only)
    SEQUENTIAL = "sequential"  #: after the prefill leg has answered


class RouterPolicy(enum.Enum):
    """How the router picks an instance among several."""

    LEAST_LOADED = "least-loaded"  #: fewest requests outstanding
    ROUND_ROBIN = "round-robin"


def _core(cls: type, name: str) -> dict[str, Any]:
    """The core's definition of setting ``name``: its default and help, restated nowhere."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    return {"default": f.default, "metadata": {"help": f.metadata.get("help", "")}}


@dataclass(frozen=True, kw_only=True)
class ProtocolSettings:
    """Timeouts and failure policy of the endpoints: the core's settings and defaults
    (:mod:`pushkv.protocol.config`, vLLM's values), settable per run."""

    lease_s: float = field(**_core(ProducerConfig, "lease_s"))
    heartbeat_s: float = field(**_core(ConsumerConfig, "heartbeat_s"))
    window_s: float = field(**_core(ConsumerConfig, "window_s"))
    fence_grace_s: float = field(**_core(ConsumerConfig, "fence_grace_s"))
    policy: FailurePolicy = field(**_core(ConsumerConfig, "policy"))
    retarget_hold_s: float = field(**_core(ProducerConfig, "retarget_hold_s"))

    def producer_config(self) -> ProducerConfig:
        return ProducerConfig(lease_s=self.lease_s, retarget_hold_s=self.retarget_hold_s)

    def consumer_config(self) -> ConsumerConfig:
        return ConsumerConfig(
            window_s=self.window_s, fence_grace_s=self.fence_grace_s,
            heartbeat_s=self.heartbeat_s, policy=self.policy,
        )


#: The router's policies for a decode instance lost before a request's first token.
DECODE_FAILOVERS = ("fail", "retry", "retarget")


@dataclass(frozen=True, kw_only=True)
class FaultConfig:
    """What-if faults. All off by default."""

    drop_register: float = field(
        default=0.0, metadata={"help": "probability that a registration message is lost"}
    )
    drop_notify: float = field(
        default=0.0, metadata={"help": "probability that a write notification is lost"}
    )
    kill_prefill_at: float | None = field(
        default=None, metadata={"help": "time (s) at which prefill instance 0 dies"}
    )
    kill_decode_at: float | None = field(
        default=None, metadata={"help": "time (s) at which decode instance 0 dies"}
    )
    detect_s: float = field(
        default=1.0, metadata={"help": "time until peers and router learn of a death"}
    )
    decode_failover: str = field(
        default="fail",
        metadata={"help": "what the router does with a request whose decode instance dies "
                  "before its first token: 'fail' it, 'retry' it from scratch (a new "
                  "transfer: prefill computes the prompt again), or 'retarget' its held "
                  "source to another decode instance (protocol rule 12; prefill computes "
                  "nothing). A request already streaming fails under every policy"},
    )

    def __post_init__(self) -> None:
        if self.decode_failover not in DECODE_FAILOVERS:
            raise ValueError(f"decode_failover must be one of {', '.join(DECODE_FAILOVERS)}, "
                             f"got {self.decode_failover!r}")

    @property
    def any(self) -> bool:
        return bool(
            self.drop_register or self.drop_notify
            or self.kill_prefill_at is not None or self.kill_decode_at is not None
        )


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated benchmark run."""

    mode: TransferMode = field(
        default=TransferMode.PUSH,
        metadata={"help": "pull, push, pull-async, auto (chosen by the dispatch), or "
                  "push-chunk / push-layer (progressive push)"}
    )
    dispatch: Dispatch = field(
        default=Dispatch.CONCURRENT,
        metadata={"help": "push: send the decode leg at arrival (concurrent) or after "
                  "prefill (sequential); pull modes are always sequential"},
    )
    num_prefill: int = field(default=1, metadata={"help": "prefill instances (x in xPyD)"})
    num_decode: int = field(default=1, metadata={"help": "decode instances (y in xPyD)"})
    router_policy: RouterPolicy = field(
        default=RouterPolicy.LEAST_LOADED, metadata={"help": "instance choice"}
    )
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    protocol: ProtocolSettings = field(default_factory=ProtocolSettings)
    faults: FaultConfig = field(default_factory=FaultConfig)
    profile: Profile = field(default=DEFAULT)
    packing: PackingConfig = field(
        default=SIM_PACKING, metadata={"help": "packed writes: the transports' cost model"})
    iteration: int = field(default=0, metadata={"help": "iteration number (file name, seed)"})
    trace: Trace | None = field(default=None, metadata={
        "help": "requests replayed from a trace (pushkv.sim.trace) instead of the "
                "workload's; their block hashes play a prefix cache on each prefill "
                "instance in place of prefill.prefix_hit_fraction"})

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ConfigError("at least one prefill and one decode instance are needed")
        if self.profile.prefill.tp != self.profile.decode.tp:
            raise ConfigError(
                "the simulator drives one representative rank per side, which needs "
                f"equal TP sizes (prefill {self.profile.prefill.tp}, "
                f"decode {self.profile.decode.tp})"
            )
        f = self.faults
        for name in ("drop_register", "drop_notify"):
            v = getattr(f, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"{name} must be a probability in [0, 1], got {v}")
        for name in ("kill_prefill_at", "kill_decode_at"):
            v = getattr(f, name)
            if v is not None and not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"{name} must be a time >= 0, got {v}")
        if not f.detect_s > 0:
            raise ConfigError(f"detect_s must be > 0, got {f.detect_s}")
        if self.workload.input_len + self.workload.output_len > 1 << 20:
            raise ConfigError("input + output length above 1M tokens")

    @property
    def effective_dispatch(self) -> Dispatch:
        """Pull needs prefill's block ids before decode can start: always sequential."""
        return Dispatch.SEQUENTIAL if self.mode.is_pull else self.dispatch

    @property
    def resolved_mode(self) -> TransferMode:
        """The mode the engines run: ``auto`` resolved by the dispatch, the one rule
        the vLLM connector applies per request."""
        if self.mode.granularity != "request":
            return TransferMode.PUSH  # the engines push; the prefill loop reports ranges
        if self.mode is not TransferMode.AUTO:
            return self.mode
        chosen = choose_direction(self.dispatch.value)
        return TransferMode.PULL_ASYNC if chosen == "pull" else TransferMode.PUSH

    def label(self) -> str:
        """Mode label used in file names and legends (``push-seq`` for a sequential push)."""
        pushes = self.mode in (TransferMode.PUSH, TransferMode.AUTO) or (
            self.mode.granularity != "request")
        if pushes and self.dispatch is Dispatch.SEQUENTIAL:
            return f"{self.mode.value}-seq"
        return self.mode.value

    def file_name(self) -> str:
        """``{mode}_qps{q}_in{i}_out{o}_iter{n}.json``, as the post's benchmark script names it
        (closed loop: ``{mode}_qps{q}_c{N}_in...``, N the maximum concurrency)."""
        w = self.workload
        if self.trace is not None:
            return f"{self.label()}_trace-{self.trace.name}_iter{self.iteration}.json"
        q = w.request_rate
        qs = str(int(q)) if math.isfinite(q) and q == int(q) else str(q)
        conc = "" if w.max_concurrency is None else f"_c{w.max_concurrency}"
        return (f"{self.label()}_qps{qs}{conc}_in{w.input_len}_out{w.output_len}"
                f"_iter{self.iteration}.json")
