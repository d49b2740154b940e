"""The integrity setting: one definition of its modes, default and parsing."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Literal

from pushkv.protocol.errors import ConfigError

Mode = Literal["off", "sample", "on"]
MODES: tuple[str, ...] = ("off", "sample", "on")
#: The vLLM connector's default mode (docs/vllm.md, "Integrity": chosen from the
#: measured cost). A transport built without a setting checks nothing (``OFF``).
DEFAULT_MODE: Mode = "on"
#: ``sample``: one transfer in this many is checked.
DEFAULT_SAMPLE_EVERY = 10


@dataclass(frozen=True, slots=True)
class IntegrityConfig:
    """Whether writes carry a digest and their landed bytes are checked.

    ``off``: nothing is computed, notifications are exactly the plain frames.
    ``on``: every write. ``sample``: the transfers whose ``(transfer id,
    incarnation)`` hashes to 0 modulo ``sample_every`` -- the same ones on every
    rank of both engines, every attempt and part of them, without coordination.
    The producer decides (it seals the notification); a consumer checks every
    sealed notification it receives unless its own mode is ``off``.
    """

    mode: Mode = "off"
    sample_every: int = DEFAULT_SAMPLE_EVERY

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"integrity mode must be one of {', '.join(MODES)}, "
                              f"not {self.mode!r}")
        if isinstance(self.sample_every, bool) or not isinstance(self.sample_every, int) or (
                self.sample_every < 1):
            raise ConfigError(f"integrity sample_every must be an int >= 1, "
                              f"not {self.sample_every!r}")

    @classmethod
    def parse(cls, text: str) -> IntegrityConfig:
        """``"off"``, ``"on"``, ``"sample"`` or ``"sample:N"`` (one in N)."""
        if not isinstance(text, str):
            raise ConfigError(f"integrity must be a string (off, sample, sample:N, on), "
                              f"not {type(text).__name__}")
        mode, _, every = text.strip().partition(":")
        if every and mode != "sample":
            raise ConfigError(f"only sample takes a rate (sample:N), not {text!r}")
        try:
            n = int(every) if every else DEFAULT_SAMPLE_EVERY
        except ValueError:
            raise ConfigError(f"integrity sample rate must be an integer: {text!r}") from None
        return cls(mode, n)  # type: ignore[arg-type]

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def checks(self, transfer_id: str, incarnation: int = 0) -> bool:
        """Whether writes of this transfer carry a digest."""
        if self.mode == "on":
            return True
        if self.mode == "off":
            return False
        key = f"{transfer_id}\0{incarnation}".encode()
        return zlib.crc32(key) % self.sample_every == 0


OFF = IntegrityConfig("off")

__all__ = ["DEFAULT_MODE", "DEFAULT_SAMPLE_EVERY", "MODES", "OFF", "IntegrityConfig", "Mode"]
