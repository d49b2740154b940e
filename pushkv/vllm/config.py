"""``kv_connector_extra_config`` of ``PushKVConnector``: typed, checked, documented.

Every key is optional. An unknown key, a value of the wrong type or out of
range raises :class:`ConnectorConfigError` naming the key, so a typo fails the
server at start-up instead of being ignored.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..direction import SETTINGS
from ..integrity import DEFAULT_MODE, Injector, IntegrityConfig
from ..protocol.config import ConsumerConfig, ProducerConfig
from ..protocol.errors import ConfigError
from ..protocol.events import FailurePolicy
from ..protocol.packing import PackingConfig
from ..transports.nixl.config import NixlConfig

#: Transport backends pushkv knows how to ask NIXL for.
BACKENDS = ("UCX", "LIBFABRIC")
#: When a producer hands prefilled KV to the transport (``push_granularity``).
GRANULARITIES = ("request", "chunk", "layer")


def _defaults(cls: type) -> dict[str, Any]:
    """Field defaults of a settings dataclass: the one definition each default has."""
    return {f.name: f.default for f in fields(cls)}


#: Protocol timeouts and bounds are the core's (vLLM's values), transport ones the
#: runtime's; the connector restates none of them.
_PRODUCER = _defaults(ProducerConfig)
_CONSUMER = _defaults(ConsumerConfig)
_NIXL = _defaults(NixlConfig)
_PACKING = _defaults(PackingConfig)
_PACKING_HELP = {f.name: f.metadata["help"] for f in fields(PackingConfig)}


class ConnectorConfigError(ConfigError):
    """``kv_connector_extra_config`` (or the rest of the KV transfer config) is invalid."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PushKVSettings:
    """The connector's settings, one field per ``kv_connector_extra_config`` key."""

    backend: str = field(
        default=_NIXL["backend"],
        metadata={"help": "NIXL backend moving the KV: UCX (host memory, TCP/CMA, CUDA) "
                  "or LIBFABRIC (EFA)"},
    )
    side_channel_host: str = field(
        default=_NIXL["host"],
        metadata={"help": "address this instance's handshake/control side channel binds "
                  "and advertises; set it to an address peers can reach"},
    )
    side_channel_port: int = field(
        default=_NIXL["port"],
        metadata={"help": "0 (default): every rank binds a free port, advertised to the "
                  "proxy through discovery; a port p: rank r binds p + r, and a port that "
                  "is taken stops the server at start-up"},
    )
    key_file: str = field(
        default=_NIXL["key_file"],
        metadata={"help": "file holding the shared key (at least 16 bytes): side-channel "
                  "frames are authenticated and only kv_transfer_params signed by a proxy "
                  "holding the key are accepted. Empty: the environment variable key_env"},
    )
    key_env: str = field(
        default=_NIXL["key_env"],
        metadata={"help": "environment variable holding the shared key when key_file is "
                  "empty; unset or empty: no key"},
    )
    lease_s: float = field(
        default=_PRODUCER["lease_s"],
        metadata={"help": "producer: how long prefilled KV is held without a heartbeat "
                  "from its consumer"},
    )
    retarget_hold_s: float = field(
        default=_PRODUCER["retarget_hold_s"],
        metadata={"help": "producer: keep a prefilled request's KV for a proxy to "
                  "re-target it to another decode instance, at most this long (within "
                  "lease_s): after the decode instance it is bound to dies, and after a "
                  "push wrote it (or its write failed), until that instance's first "
                  "decode step of the request; 0: release it at once"},
    )
    window_s: float = field(
        default=_CONSUMER["window_s"],
        metadata={"help": "consumer: a producer may start writing a registration up to "
                  "this long after receiving it; past it the transfer fails"},
    )
    fence_grace_s: float = field(
        default=_CONSUMER["fence_grace_s"],
        metadata={"help": "consumer: after the window, destination blocks are released "
                  "without a fence from the producer"},
    )
    heartbeat_s: float = field(
        default=_CONSUMER["heartbeat_s"],
        metadata={"help": "consumer: period of the heartbeats renewing producer leases"},
    )
    handshake_timeout_s: float = field(
        default=_CONSUMER["handshake_timeout_s"],
        metadata={"help": "consumer: a producer that does not complete the handshake "
                  "within this fails the transfers waiting for it"},
    )
    write_timeout_s: float = field(
        default=_NIXL["write_timeout_s"],
        metadata={"help": "producer: a posted write still running after this is cancelled "
                  "and the transfer failed"},
    )
    peer_confirm_s: float = field(
        default=_NIXL["peer_confirm_s"],
        metadata={"help": "a peer whose side channel dropped and stays unreachable this long "
                  "is declared dead: its transfers fail (consumer) or are released (producer)"},
    )
    max_pending_registrations: int = field(
        default=_PRODUCER["max_pending_registrations"],
        metadata={"help": "producer: registrations held while their prefill runs"},
    )
    notify_poll_ms: float = field(
        default=1.0,
        metadata={"help": "consumer: period of the check for write notifications while a "
                  "transfer is live (a notification waits for the next check); with none "
                  "live the transport's idle period applies"},
    )
    progress_delay_us: int = field(
        default=_NIXL["progress_delay_us"],
        metadata={"help": "sleep of the transport's progress thread between polls "
                  "(0 busy-spins a core)"},
    )
    transport_cpus: str = field(
        default="inherit",
        metadata={"help": "CPUs the transport's threads run on: 'inherit' (the worker's; "
                  "vLLM's CPU backend pins it to its OpenMP cores), 'auto' (the engine "
                  "process's), or a list such as '2,3' or '0-7' (spare cores)"},
    )
    direction: str = field(
        default="auto",
        metadata={"help": "producer: how the KV moves. 'auto': pull (the decode side reads "
                  "with its background reader) when a sequential router sends vLLM's NIXL "
                  "PD legs, push when pushkv's proxy dispatches both legs at once; 'push': "
                  "push behind sequential routers too; 'pull': as auto (a concurrently "
                  "dispatched leg cannot be pulled: its decode leg is sent before the "
                  "blocks are known)"},
    )
    push_granularity: str = field(
        default="request",
        metadata={"help": "producer: when KV is pushed. 'request': all of it once prefill "
                  "finished (one write per rank); 'chunk': each chunked-prefill step's "
                  "tokens, all layers, after the step; 'layer': each layer of each step, "
                  "as its attention returns. Applies to legs of pushkv's proxy (their "
                  "decode side registers while prefill runs)"},
    )
    pack: str = field(
        default=_PACKING["mode"],
        metadata={"help": "packed writes (a producer gathers a fragmented request into "
                  "staging memory and writes it in a few large descriptors; the consumer "
                  "scatters it): " + _PACKING_HELP["mode"]},
    )
    staging_bytes: int = field(
        default=_PACKING["staging_bytes"],
        metadata={"help": "packed writes: " + _PACKING_HELP["staging_bytes"]
                  + " (unused with pack 'never')"},
    )
    pipeline_bytes: int = field(
        default=_PACKING["pipeline_bytes"],
        metadata={"help": "packed writes: " + _PACKING_HELP["pipeline_bytes"]},
    )
    backend_options: dict[str, str] = field(
        default_factory=dict,
        metadata={"help": "extra backend parameters passed to NIXL as strings"},
    )
    integrity: str = field(
        default=DEFAULT_MODE,
        metadata={"help": "end-to-end check of pushed KV: 'on' (every write: the producer "
                  "seals its notification with a digest of the source bytes, the consumer "
                  "checks the landed bytes before the KV counts; a mismatch fails the "
                  "transfer with CORRUPT and kv_load_failure_policy applies), 'sample' or "
                  "'sample:N' (one transfer in N, default 10), 'off' (nothing computed, "
                  "plain notifications). Set it alike on both sides"},
    )
    integrity_inject: str = field(
        default="",
        metadata={"help": "tests and chaos runs only: corrupt landed writes on this consumer "
                  "before the check, 'kind[,kind...][:N]' (flip, neighbour, stale, zero; one "
                  "write in N). Empty (default): never"},
    )
    timeline_dir: str = field(
        default="",
        metadata={"help": "record a per-request timeline (pushkv.timeline) into this "
                  "directory, one file per process; empty: off"},
    )

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConnectorConfigError(
                f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}"
            )
        if not self.side_channel_host:
            raise ConnectorConfigError("side_channel_host must not be empty")
        if not 0 <= self.side_channel_port <= 65535:
            raise ConnectorConfigError(
                f"side_channel_port must be in [0, 65535], got {self.side_channel_port}"
            )
        for name in ("lease_s", "window_s", "fence_grace_s", "heartbeat_s",
                     "handshake_timeout_s", "write_timeout_s", "peer_confirm_s",
                     "notify_poll_ms"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConnectorConfigError(f"{name} must be a positive number, got {value!r}")
        if self.heartbeat_s >= self.lease_s:
            raise ConnectorConfigError(
                f"heartbeat_s ({self.heartbeat_s}) must be shorter than lease_s "
                f"({self.lease_s}), or leases expire between heartbeats"
            )
        if not (self.retarget_hold_s >= 0 and math.isfinite(self.retarget_hold_s)):
            raise ConnectorConfigError(
                f"retarget_hold_s must be a number >= 0, got {self.retarget_hold_s!r}")
        if self.max_pending_registrations < 1:
            raise ConnectorConfigError("max_pending_registrations must be >= 1")
        if not 0 <= self.progress_delay_us <= 1_000_000:
            raise ConnectorConfigError("progress_delay_us must be in [0, 1000000]")
        if self.direction not in SETTINGS:
            raise ConnectorConfigError(
                f"direction must be 'auto', 'push' or 'pull', got {self.direction!r}")
        if self.push_granularity not in GRANULARITIES:
            raise ConnectorConfigError(
                f"push_granularity must be one of {', '.join(map(repr, GRANULARITIES))}, "
                f"got {self.push_granularity!r}")
        if self.transport_cpus not in ("auto", "inherit"):
            parse_cpus(self.transport_cpus)
        try:
            IntegrityConfig.parse(self.integrity)
            if self.integrity_inject:
                Injector.parse(self.integrity_inject)
        except ConfigError as exc:
            raise ConnectorConfigError(
                f"integrity / integrity_inject: {exc.message} (integrity is one of 'off', "
                f"'sample', 'sample:N', 'on'; got integrity={self.integrity!r}, "
                f"integrity_inject={self.integrity_inject!r})") from None
        try:
            self.packing()
        except ConfigError as exc:
            raise ConnectorConfigError(
                f"pack / staging_bytes / pipeline_bytes: {exc.message} (pack is one of "
                f"'auto', 'never', 'always'; got pack={self.pack!r}, "
                f"staging_bytes={self.staging_bytes!r}, pipeline_bytes={self.pipeline_bytes!r})"
            ) from None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> PushKVSettings:
        """Parse ``kv_connector_extra_config``; ConnectorConfigError on any bad key."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConnectorConfigError(
                f"unknown kv_connector_extra_config key(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        kwargs: dict[str, Any] = {}
        for name, value in extra.items():
            kwargs[name] = _coerce(name, known[name].default, value)
        return cls(**kwargs)

    def packing(self) -> PackingConfig | None:
        """The endpoints' packed-write settings (None: no staging memory at all)."""
        if self.pack == "never":
            return None
        return PackingConfig(mode=self.pack, staging_bytes=self.staging_bytes,  # type: ignore[arg-type]
                             pipeline_bytes=self.pipeline_bytes)

    def producer_config(self) -> ProducerConfig:
        return ProducerConfig(lease_s=self.lease_s,
                              max_pending_registrations=self.max_pending_registrations,
                              packing=self.packing(), retarget_hold_s=self.retarget_hold_s)

    def consumer_config(self, policy: FailurePolicy) -> ConsumerConfig:
        return ConsumerConfig(window_s=self.window_s, fence_grace_s=self.fence_grace_s,
                              heartbeat_s=self.heartbeat_s,
                              handshake_timeout_s=self.handshake_timeout_s, policy=policy,
                              packing=self.packing())

    def load_key(self) -> bytes | None:
        """The shared key (key_file, else the key_env variable), or None; never logged."""
        from ..transports.nixl.sidechannel.auth import load_key

        try:
            return load_key(key_file=self.key_file, key_env=self.key_env)
        except ConfigError as exc:
            raise ConnectorConfigError(f"kv_connector_extra_config: {exc}") from None

    @staticmethod
    def help() -> dict[str, str]:
        """Key -> one-line description, for docs and error messages."""
        return {f.name: f.metadata["help"] for f in fields(PushKVSettings)}


def _coerce(name: str, default: Any, value: Any) -> Any:
    if name == "backend":
        if isinstance(value, list | tuple) and len(value) == 1:
            value = value[0]  # vLLM's NIXL spells it "backends": ["UCX"]
        if not isinstance(value, str):
            raise ConnectorConfigError(f"backend must be a string, got {value!r}")
        return value.upper()
    if name == "backend_options":
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            raise ConnectorConfigError("backend_options must be an object of strings")
        return {k: str(v) for k, v in value.items()}
    if isinstance(default, bool) or isinstance(value, bool):
        raise ConnectorConfigError(f"{name} must be a {type(default).__name__}, got {value!r}")
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int):
            raise ConnectorConfigError(f"{name} must be an integer, got {value!r}")
        return value
    if isinstance(default, float):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConnectorConfigError(f"{name} must be a number, got {value!r}") from None
        if not isinstance(value, int | float):
            raise ConnectorConfigError(f"{name} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str):
        if not isinstance(value, str):
            raise ConnectorConfigError(f"{name} must be a string, got {value!r}")
        return value
    raise AssertionError(f"no coercion for {name}")  # pragma: no cover


def parse_cpus(spec: str) -> frozenset[int]:
    """A CPU list such as ``"0-3,8"``; ConnectorConfigError if malformed or empty."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            lo, _, hi = part.strip().partition("-")
            first, last = int(lo), int(hi or lo)
            if first < 0 or last < first:
                raise ValueError(part)
            cpus.update(range(first, last + 1))
    except ValueError:
        raise ConnectorConfigError(
            f"transport_cpus must be 'auto', 'inherit' or a CPU list like '0-3,8', got {spec!r}"
        ) from None
    return frozenset(cpus)


def failure_policy(value: str) -> FailurePolicy:
    """vLLM's ``kv_load_failure_policy`` as the protocol's :class:`FailurePolicy`."""
    try:
        return FailurePolicy(value)
    except ValueError:
        raise ConnectorConfigError(
            f"kv_load_failure_policy must be 'fail' or 'recompute', got {value!r}"
        ) from None
