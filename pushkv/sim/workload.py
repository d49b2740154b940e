"""Requests as ``vllm bench serve --dataset-name random`` sends them.

Fixed input and output lengths (``--random-range-ratio 0``), gaps drawn from a
gamma distribution of shape ``burstiness`` and mean ``1 / request_rate``
(``burstiness = 1`` is a Poisson process), then rescaled -- as vLLM does -- so
that the last request leaves at exactly ``num_prompts / request_rate``.
With ``arrivals = "vllm"`` the gaps come from the generator ``vllm bench serve``
draws them from (``np.random.seed(seed)`` in its main, then one
``np.random.gamma`` per request in ``get_request``), so a simulated run gets the
very send times of the real run it is compared with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..protocol.errors import ConfigError

#: the arrival generators (see WorkloadConfig.arrivals)
ARRIVALS = ("pushkv", "vllm")


class WorkloadError(ConfigError):
    """A workload parameter is out of range."""


@dataclass(frozen=True, kw_only=True)
class WorkloadConfig:
    """What the benchmark client sends."""

    request_rate: float = field(
        default=1.0, metadata={"help": "requests per second (inf: all at once)"}
    )
    burstiness: float = field(
        default=1.0, metadata={"help": "gamma shape of the gaps; 1 is Poisson, <1 burstier"}
    )
    input_len: int = field(default=1024, metadata={"help": "prompt tokens per request"})
    output_len: int = field(default=128, metadata={"help": "generated tokens per request"})
    num_prompts: int = field(default=100, metadata={"help": "requests in the run"})
    seed: int = field(default=0, metadata={"help": "seed of the arrival process"})
    max_concurrency: int | None = field(default=None, metadata={
        "help": "closed loop, as vllm bench serve --max-concurrency: at most this many "
                "requests in flight; a request due while all are busy is sent when one "
                "ends (its TTFT counts from then); None: open loop"})
    arrivals: str = field(default="pushkv", metadata={
        "help": "generator of the gaps: 'pushkv' (the run's own stream of (seed, "
                "iteration)) or 'vllm' (the very gaps vllm bench serve --seed "
                "seed+iteration sends: numpy's legacy np.random.seed, then np.random.gamma)"})

    def __post_init__(self) -> None:
        if not (self.request_rate > 0):  # also rejects NaN
            raise WorkloadError(f"request rate must be > 0, got {self.request_rate}")
        if not (self.burstiness > 0) or math.isinf(self.burstiness):
            raise WorkloadError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.input_len < 1:
            raise WorkloadError(f"input length must be >= 1, got {self.input_len}")
        if self.output_len < 1:
            raise WorkloadError(f"output length must be >= 1, got {self.output_len}")
        if self.num_prompts < 1:
            raise WorkloadError(f"number of prompts must be >= 1, got {self.num_prompts}")
        if self.max_concurrency is not None and not (
                isinstance(self.max_concurrency, int) and self.max_concurrency >= 1):
            raise WorkloadError(f"max concurrency must be an integer >= 1, "
                                f"got {self.max_concurrency!r}")
        if self.arrivals not in ARRIVALS:
            raise WorkloadError(f"arrivals must be one of {', '.join(ARRIVALS)}, "
                                f"got {self.arrivals!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """One request of the workload."""

    index: int
    arrival: float
    input_len: int
    output_len: int
    #: ids of the prompt's hashed blocks (:data:`pushkv.sim.trace.BLOCK_TOKENS` tokens
    #: each; equal ids, equal prefix KV); empty for generated requests
    block_hashes: tuple[int, ...] = ()


def arrivals(cfg: WorkloadConfig, rng: np.random.Generator | np.random.RandomState
             ) -> np.ndarray:
    """Send times (seconds from the start) of ``cfg.num_prompts`` requests."""
    n = cfg.num_prompts
    if math.isinf(cfg.request_rate):
        return np.zeros(n)
    theta = 1.0 / (cfg.request_rate * cfg.burstiness)
    gaps = rng.gamma(shape=cfg.burstiness, scale=theta, size=n)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (n / cfg.request_rate) / times[-1]
    return times


def generate(cfg: WorkloadConfig, rng: np.random.Generator | np.random.RandomState
             ) -> list[Request]:
    """The requests of one run, in send order."""
    return [
        Request(index=i, arrival=float(t), input_len=cfg.input_len, output_len=cfg.output_len)
        for i, t in enumerate(arrivals(cfg, rng))
    ]
