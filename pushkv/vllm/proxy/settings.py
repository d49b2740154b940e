"""The settings of ``pushkv proxy`` (each one a command-line flag: :mod:`.cli`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pushkv.transports.nixl.config import NixlConfig

from .failover import RETRY, check_policy
from .pool import HealthSettings

ARRIVAL = "arrival"
LATE = "late"
#: When the decode instance of a request is chosen (:attr:`ProxySettings.bind`).
BINDS = (ARRIVAL, LATE)

#: Environment variable holding the shared key when no file is given (the runtime's).
KEY_ENV: str = NixlConfig.key_env


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    """Settings of ``pushkv proxy`` (each one a command-line flag)."""

    request_timeout_s: float = 600.0  #: the longest a client waits for its answer or an error
    connect_timeout_s: float = 5.0  #: opening a connection to an instance
    retries: int = 1  #: times a request is sent again after a leg failed before any output
    #: what a leg failing before the answer began leads to: "retry" or "retarget"
    failover: str = RETRY
    #: times a completion (streamed, or non-streamed and answered from a streamed decode
    #: leg) is resumed elsewhere (0: never; non-streamed ones then pass through)
    resumes: int = 2
    #: when the decode instance is chosen: "arrival" (both legs at once) or "late" (once
    #: the prefill leg answered: the least loaded then, the decode leg sent then)
    bind: str = ARRIVAL
    max_body_bytes: int = 8 << 20  #: larger request bodies get 413
    max_tokens_limit: int = 0  #: bound on max_tokens besides the model's length (0: none)
    health: HealthSettings = field(default_factory=HealthSettings)
    key: bytes | None = field(default=None, repr=False)  #: shared key signing the params

    def __post_init__(self) -> None:
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("timeouts must be positive")
        if self.retries < 0 or self.resumes < 0 or self.max_body_bytes < 1 or \
                self.max_tokens_limit < 0:
            raise ValueError("retries, resumes, max_body_bytes and max_tokens_limit must "
                             "be >= 0")
        check_policy(self.failover)
        if self.bind not in BINDS:
            raise ValueError(f"bind must be one of {', '.join(BINDS)}, got {self.bind!r}")
