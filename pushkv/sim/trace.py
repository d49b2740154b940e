"""Request traces to replay: arrival times, lengths and the prompts' prefix blocks.

A trace is a JSON-lines file, one request a line, in either of two formats:

* **Mooncake** (the FAST'25 trace release of the Mooncake project,
  github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``, Apache-2.0):
  ``timestamp`` (ms from the trace's start), ``input_length``, ``output_length`` and
  ``hash_ids``, one id per 512-token block of the prompt: equal ids, equal prefix KV;
* **pushkv**: ``arrival_s`` (seconds), ``input_len``, ``output_len`` and, optionally,
  ``block_hashes`` (integers, one per :data:`BLOCK_TOKENS`-token block).

Arrivals must not go back in time; a block list must have one id per started block
of the prompt. Any other key, a missing one or a bad value is refused with the
line's number (:class:`TraceError`). ``window`` keeps the requests that arrive in
``[t0, t1)`` seconds of trace time, shifted to start at 0; ``speed`` divides every
arrival time (2: twice the rate). The prefix reuse the hashes imply is played by
:class:`PrefixCache` on each prefill instance.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .workload import Request, WorkloadConfig, WorkloadError

#: tokens of one hashed block (the Mooncake traces' block)
BLOCK_TOKENS = 512
FORMATS = {
    "mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
    "pushkv": ("arrival_s", "input_len", "output_len", "block_hashes"),
}
_PER_S = {"mooncake": 1000.0, "pushkv": 1.0}  # the time unit, per second


class TraceError(WorkloadError):
    """A trace file, one of its lines, or a trace option is invalid."""


@dataclass(frozen=True)
class Trace:
    """The requests of a trace (arrivals from 0, scaled), and how they were cut."""

    name: str  #: the file's stem, for result files and plots
    requests: tuple[Request, ...]
    speed: float = 1.0
    window: tuple[float, float] | None = None

    @property
    def has_hashes(self) -> bool:
        return any(r.block_hashes for r in self.requests)

    @property
    def span_s(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the replayed span (inf when all arrive at once)."""
        return len(self.requests) / self.span_s if self.span_s > 0 else math.inf


def _int(value: object, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not value.is_integer()):
        raise TraceError(f"{where} must be an integer, got {value!r}")
    if value < low:
        raise TraceError(f"{where} must be >= {low}, got {value!r}")
    return int(value)


def parse_line(text: str, lineno: int, source: str = "trace") -> tuple[float, Request]:
    """One line as (trace time in seconds, request with index -1); :class:`TraceError`
    naming ``source:lineno`` on anything a request cannot be."""
    at = f"{source}:{lineno}"
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{at}: not JSON ({exc.msg})") from None
    if not isinstance(d, dict):
        raise TraceError(f"{at}: a request must be a JSON object")
    fmt = next((f for f, keys in FORMATS.items() if keys[0] in d), None)
    if fmt is None:
        raise TraceError(f"{at}: no arrival time (timestamp in ms, or arrival_s)")
    keys = FORMATS[fmt]
    unknown = sorted(set(d) - set(keys))
    if unknown:
        raise TraceError(f"{at}: unknown key(s) {', '.join(unknown)} for the {fmt} "
                         f"format ({', '.join(keys)})")
    for k in keys[:3]:
        if k not in d:
            raise TraceError(f"{at}: {k} is missing")
    t = d[keys[0]]
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{at}: {keys[0]} must be a time >= 0, got {t!r}")
    n_in = _int(d[keys[1]], f"{at}: {keys[1]}", 1)
    n_out = _int(d[keys[2]], f"{at}: {keys[2]}", 1)
    hashes: tuple[int, ...] = ()
    if keys[3] in d:
        raw = d[keys[3]]
        if not isinstance(raw, list):
            raise TraceError(f"{at}: {keys[3]} must be a list of integers")
        hashes = tuple(_int(h, f"{at}: {keys[3]}[{i}]", 0) for i, h in enumerate(raw))
        blocks = -(-n_in // BLOCK_TOKENS)
        if len(hashes) != blocks:
            raise TraceError(f"{at}: {len(hashes)} block hashes for {n_in} tokens "
                             f"({blocks} blocks of {BLOCK_TOKENS})")
    return float(t) / _PER_S[fmt], Request(index=-1, arrival=0.0, input_len=n_in,
                                          output_len=n_out, block_hashes=hashes)


def parse_lines(lines: Iterable[str], *, source: str = "trace", speed: float = 1.0,
                window: tuple[float, float] | None = None, name: str = "trace") -> Trace:
    """A trace from its lines (blank lines skipped); see the module doc."""
    if not (speed > 0 and math.isfinite(speed)):
        raise TraceError(f"trace speed must be a positive number, got {speed}")
    if window is not None:
        t0, t1 = window
        if not (0 <= t0 < t1):
            raise TraceError(f"trace window must be 0 <= T0 < T1, got {t0} {t1}")
    kept: list[tuple[float, Request]] = []
    last = -1.0
    for lineno, text in enumerate(lines, 1):
        if not text.strip():
            continue
        t, req = parse_line(text, lineno, source)
        if t < last:
            raise TraceError(f"{source}:{lineno}: arrival {t:g} s is before the previous "
                             f"line's {last:g} s (a trace is in arrival order)")
        last = t
        if window is None or window[0] <= t < window[1]:
            kept.append((t, req))
    if not kept:
        raise TraceError(f"{source}: no request" + (
            f" in the window [{window[0]:g}, {window[1]:g}) s" if window else ""))
    start = window[0] if window is not None else 0.0
    reqs = tuple(
        Request(index=i, arrival=(t - start) / speed, input_len=r.input_len,
                output_len=r.output_len, block_hashes=r.block_hashes)
        for i, (t, r) in enumerate(kept))
    return Trace(name=name, requests=reqs, speed=speed, window=window)


def read_trace(path: str | Path, *, speed: float = 1.0,
               window: tuple[float, float] | None = None) -> Trace:
    """Read a trace file; :class:`TraceError` with the line number on a bad line."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as f:
            name = re.sub(r"[^A-Za-z0-9._-]+", "-", p.stem) or "trace"
            return parse_lines(f, source=p.name, speed=speed, window=window, name=name)
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {p}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{p.name}: not UTF-8 text ({exc.reason})") from None
    except IsADirectoryError:
        raise TraceError(f"trace path is a directory: {p}") from None


def trace_workload(trace: Trace, seed: int = 0) -> WorkloadConfig:
    """The workload a trace run reports: its mean rate, its requests, their mean
    lengths (the run itself takes every request from the trace)."""
    n = len(trace.requests)
    return WorkloadConfig(
        request_rate=trace.mean_rate, num_prompts=n, seed=seed,
        input_len=max(1, round(sum(r.input_len for r in trace.requests) / n)),
        output_len=max(1, round(sum(r.output_len for r in trace.requests) / n)),
    )


def shipped_slice() -> Path:
    """The slice of Mooncake's conversation trace shipped with pushkv (its first
    requests; LICENSE-APACHE-2.0 beside it)."""
    return Path(__file__).resolve().parent / "traces" / "mooncake_conversation_head.jsonl"


class PrefixCache:
    """A prefill instance's prefix cache over hashed blocks, least recently used first
    out, holding ``capacity`` blocks.

    :meth:`admit` returns how many of a prompt's leading blocks are cached, then
    makes all of its blocks the most recently used -- last to first, so a prompt's
    first blocks are evicted last (vLLM frees a request's blocks tail first)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise TraceError(f"prefix cache capacity must be >= 1 block, got {capacity}")
        self.capacity = capacity
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.hit_blocks = 0
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._lru)

    def admit(self, hashes: Sequence[int]) -> int:
        hit = 0
        for h in hashes:
            if h not in self._lru:
                break
            hit += 1
        for h in reversed(hashes):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        self.hit_blocks += hit
        self.lookups += len(hashes)
        return hit


def cached_tokens(hit_blocks: int, input_len: int, block_size: int) -> int:
    """Prompt tokens the cache serves: the hit blocks' tokens, whole engine blocks,
    never the prompt's last token (it must be computed for the first output)."""
    return min(hit_blocks * BLOCK_TOKENS, input_len - 1) // block_size * block_size


__all__ = ["BLOCK_TOKENS", "FORMATS", "PrefixCache", "Trace", "TraceError", "cached_tokens",
           "parse_line", "parse_lines", "read_trace", "shipped_slice", "trace_workload"]
