"""Timeouts and bounds of the endpoints, with the defaults vLLM uses.

The one definition of every protocol timeout and table bound: the simulator,
the transports and the vLLM connector take their defaults from these fields."""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ConfigError
from .events import FailurePolicy
from .packing import PackingConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerConfig:
    """Settings of a producer (prefill) rank."""

    lease_s: float = field(
        default=30.0,
        metadata={"help": "how long source KV is held without a heartbeat (vLLM: 30 s)"},
    )
    renew_fraction: float = field(
        default=2 / 3,
        metadata={"help": "a heartbeat extends the lease to now + lease * this"},
    )
    max_pending_registrations: int = field(
        default=4096,
        metadata={"help": "registrations waiting for KV, and transfers peers spoke of before "
                  "prefill finished here (orphans: an early cancel, an early pull ReadDone); "
                  "beyond this, Fail(OVERLOADED), a CancelAck, or the report dropped and "
                  "counted (its lease decides)"},
    )
    orphan_ttl_s: float = field(
        default=60.0,
        metadata={"help": "how long a cancel or pull ReadDone for a transfer whose prefill "
                  "has not finished here is remembered"},
    )
    max_tombstones: int = field(
        default=8192,
        metadata={"help": "finished transfers remembered to answer late messages"},
    )
    packing: PackingConfig | None = field(
        default=None,
        metadata={"help": "packed writes: the rank's staging memory and when to use it "
                  "(None: no staging memory, every write is direct)"},
    )
    retarget_hold_s: float = field(
        default=0.0,
        metadata={"help": "rule 12: keep a source this long (never past its lease) for a "
                  "router to re-target it to another engine: after its consumer engine "
                  "died, and after a push wrote it, until that engine's first decode step "
                  "(Consumed); 0: release it at once"},
    )

    def __post_init__(self) -> None:
        if not self.retarget_hold_s >= 0:
            raise ConfigError(f"retarget_hold_s must be >= 0, got {self.retarget_hold_s}")
        if not self.lease_s > 0:
            raise ConfigError(f"lease_s must be > 0, got {self.lease_s}")
        if not 0 < self.renew_fraction <= 1:
            raise ConfigError(f"renew_fraction must be in (0, 1], got {self.renew_fraction}")
        if self.max_pending_registrations < 1 or self.max_tombstones < 0:
            raise ConfigError("table bounds must be positive")
        if not self.orphan_ttl_s > 0:
            raise ConfigError(f"orphan_ttl_s must be > 0, got {self.orphan_ttl_s}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerConfig:
    """Settings of a consumer (decode) rank."""

    window_s: float = field(
        default=480.0,
        metadata={"help": "a producer may start the write up to this long after the "
                  "registration (vLLM's decode watchdog: 480 s)"},
    )
    fence_grace_s: float = field(
        default=30.0,
        metadata={"help": "after the window, blocks are released without a fence; must "
                  "exceed message transit plus the longest write"},
    )
    heartbeat_s: float = field(
        default=5.0,
        metadata={"help": "heartbeat period renewing producer leases (vLLM: lease/6)"},
    )
    handshake_timeout_s: float = field(
        default=10.0,
        metadata={"help": "transfers waiting for a producer engine's handshake fail "
                  "(HANDSHAKE_FAILED) when it has not completed within this"},
    )
    max_untold: int = field(
        default=4096,
        metadata={"help": "transfers remembered, per producer engine, to Skip a rank that "
                  "writes nothing once its handshake completes; beyond this its lease decides"},
    )
    max_unconsumed: int = field(
        default=8192,
        metadata={"help": "rule 12: push transfers remembered after READY until the engine "
                  "reports its first decode step (Consumed to the producers); beyond this "
                  "the oldest is dropped and its producers' retarget_hold_s decides"},
    )
    policy: FailurePolicy = field(
        default=FailurePolicy.FAIL,
        metadata={"help": "what a failed transfer means for the request"},
    )
    packing: PackingConfig | None = field(
        default=None,
        metadata={"help": "packed writes: the rank's staging memory, lent to registrations "
                  "(None: no staging memory, producers write directly)"},
    )

    def __post_init__(self) -> None:
        for name in ("window_s", "fence_grace_s", "heartbeat_s", "handshake_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_untold < 0:
            raise ConfigError(f"max_untold must be >= 0, got {self.max_untold}")
        if self.max_unconsumed < 0:
            raise ConfigError(f"max_unconsumed must be >= 0, got {self.max_unconsumed}")
        if not isinstance(self.policy, FailurePolicy):
            raise ConfigError(f"policy must be a FailurePolicy, got {self.policy!r}")
