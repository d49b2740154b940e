"""A CPU profile from measured figures: the fits, the checks, the TOML.

:class:`Measured` holds what :mod:`pushkv.fit.measure` timed on this machine (a vLLM
server's steps, a NIXL pair, the side channel, the core probe's share);
:func:`profile_data` fits the profile's keys to it -- a robust straight line per
cost (:func:`fit_line`: a fixed part and a part per token, descriptor or byte) --
and validates the tables (:func:`~pushkv.sim.profile.profile_from_dict`); a
measurement that is not a finite, positive time, or a fit with a negative overhead,
is refused with :class:`MeasurementError`. :func:`to_toml` and :func:`write_profile`
write the tables as a profile :func:`~pushkv.sim.profile.load_profile` reads, the
raw medians as a comment on top (:func:`header`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sim.host import SHARED_CPU
from ..sim.host.frontend import frontend_cores
from ..sim.profile import Profile, ProfileError, load_profile, profile_from_dict


class MeasurementError(ProfileError):
    """A measurement cannot make a profile (not finite, negative, too few points)."""


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Everything :func:`profile_data` needs; times in seconds, medians over requests."""

    machine: str  #: where, in words (cores, memory)
    when: str  #: UTC time of the measurement
    load: tuple[float, float, float]  #: load average (1, 5, 15 min) when it started
    prefill_lengths: tuple[int, ...]  #: prompt tokens of the one-token requests
    prefill_step_s: tuple[float, ...]  #: engine prefill time at each length
    decode_batches: tuple[int, ...]  #: requests decoding at once
    decode_step_s: tuple[float, ...]  #: engine time per output token at each batch
    decode_input_len: int  #: prompt tokens of the decode measurements
    request_overhead_s: float  #: client latency minus engine time, one request
    relay_s: float  #: what one aiohttp relay adds to a request (both ways)
    post_descriptors: tuple[int, ...]  #: descriptors per NIXL WRITE
    post_s: tuple[float, ...]  #: posting thread's time at each count
    wire_descriptors: tuple[int, ...]  #: descriptors of each completion measurement
    wire_bytes: tuple[int, ...]  #: bytes of each completion measurement
    wire_s: tuple[float, ...]  #: post start to completion
    message_send_s: float
    message_recv_s: float
    message_latency_s: float  #: one way, between the two ends' own times
    #: share of a core a probe's bursts got (:class:`CoreProbe`) while the engine server,
    #: and this process (NIXL, side channel), were measured; the profile holds every
    #: time scaled to a core of its own (``time x share``)
    engine_share: float = 1.0
    host_share: float = 1.0
    engine_wake_s: float = 0.0  #: the probe's wake-up delay on the engine's core
    #: the probe's rate of fixed work on the engine's core (CoreProbe.speed; 0: none)
    engine_speed: float = 0.0
    probe_samples: int = 0  #: the fewest samples a probe took (0: no probe, shares 1)
    max_num_seqs: int = 128  #: vLLM's CPU default for the API server
    max_num_batched_tokens: int = 2048  #: vLLM's CPU default for the API server
    block_size: int = 32
    kv_cache_bytes: float = float(1 << 30)  #: VLLM_CPU_KVCACHE_SPACE=1
    cpu_count: int = 0  #: os.cpu_count() (0: unknown, host.frontend_cores left at 0)



def _check_times(name: str, values: Sequence[float]) -> None:
    for v in values:
        if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
            raise MeasurementError(f"{name}: every measured time must be a positive finite "
                                   f"number of seconds, got {v!r}")


def fit_line(xs: Sequence[float], ys: Sequence[float], name: str, *,
             slope_only: bool = False) -> tuple[float, float]:
    """A robust straight line ``y = a + b x`` (Theil-Sen: ``b`` the median of the
    pairwise slopes, ``a`` the median of ``y - b x``), so that one point a load spike
    hit does not tilt it; ``(a, b)``. A slope below 0 (the per-unit cost is within the
    noise) is taken as 0 with ``a`` the mean; ``a < 0`` is refused unless only the
    slope is wanted."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise MeasurementError(f"{name}: need measurements at two different sizes or more")
    _check_times(name, ys)
    pts = list(zip(xs, ys, strict=True))
    b = statistics.median((y1 - y0) / (x1 - x0) for i, (x0, y0) in enumerate(pts)
                          for x1, y1 in pts[i + 1:] if x1 != x0)
    if b < 0:
        return statistics.fmean(ys), 0.0
    a = statistics.median(y - b * x for x, y in pts)
    if a < 0 and not slope_only:
        raise MeasurementError(f"{name}: the fit gives a negative fixed cost ({a:.3g} s); "
                               "measure at smaller sizes")
    return a, b


def tiny_params() -> tuple[float, float]:
    """All parameters of the tiny Llama, and those in per-token matmuls."""
    from ..vllm.testing import TINY_LLAMA as c

    h, inter, v, hd = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    layer = h * q + 2 * h * kv + q * h + 3 * h * inter
    matmuls = c["num_hidden_layers"] * layer + v * h  # + lm_head
    return float(matmuls + v * h), float(matmuls)


def profile_data(m: Measured) -> dict[str, Any]:
    """The profile's tables from measured figures, validated; MeasurementError if not."""
    from ..vllm.testing import TINY_LLAMA as c

    _check_times("prefill_step_s", m.prefill_step_s)
    _check_times("decode_step_s", m.decode_step_s)
    _check_times("post_s", m.post_s)
    _check_times("wire_s", m.wire_s)
    _check_times("request overhead", [m.request_overhead_s, m.relay_s])
    _check_times("side channel", [m.message_send_s, m.message_recv_s, m.message_latency_s])
    for name, share in (("engine_share", m.engine_share), ("host_share", m.host_share)):
        if not (math.isfinite(share) and 0 < share <= 1):
            raise MeasurementError(f"{name} must be a CPU share in (0, 1], got {share!r}")
    es, hs = m.engine_share, m.host_share
    p_over, p_tok = fit_line(m.prefill_lengths, [t * es for t in m.prefill_step_s],
                             "prefill steps")
    d_over, d_tok = fit_line(m.decode_batches, [t * es for t in m.decode_step_s],
                             "decode steps")
    post_fixed, post_desc = fit_line(m.post_descriptors, [t * hs for t in m.post_s],
                                     "NIXL posting")
    if len(m.wire_bytes) != len(m.wire_s) or len(m.wire_descriptors) != len(m.wire_s):
        raise MeasurementError("wire: one descriptor count and byte count per time")
    by_bytes = [(b, t) for d, b, t in zip(m.wire_descriptors, m.wire_bytes, m.wire_s,
                                          strict=True) if d == 1]
    wire_lat, per_byte = fit_line([b for b, _ in by_bytes], [t for _, t in by_bytes],
                                  "NIXL bytes")
    by_desc = [(d, t) for d, b, t in zip(m.wire_descriptors, m.wire_bytes, m.wire_s,
                                         strict=True) if d > 1 or b == min(m.wire_bytes)]
    _, per_desc_wire = fit_line([d for d, _ in by_desc], [t for _, t in by_desc],
                                "NIXL descriptors", slope_only=True)
    total, matmuls = tiny_params()
    hop = (m.request_overhead_s + m.relay_s) / 2 * es
    kv_bytes = m.kv_cache_bytes
    weights = total * 4
    engine = {
        "tp": 1, "max_num_seqs": m.max_num_seqs,
        "max_num_batched_tokens": m.max_num_batched_tokens, "block_size": m.block_size,
        "gpu_memory_utilization": 1.0, "activation_reserve_bytes": 0.0,
        "compute_efficiency": 1.0, "fragmentation": 0.0, "allocator": "history",
    }
    data: dict[str, Any] = {
        "name": "cpu-tiny",
        "model": {
            "name": "tiny-llama", "num_layers": c["num_hidden_layers"],
            "hidden_size": c["hidden_size"], "num_q_heads": c["num_attention_heads"],
            "num_kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
            "total_params": total, "non_embedding_params": matmuls, "dtype_bytes": 4,
        },
        # The roofline is off: the steps' measured costs are all in the per-step
        # overheads and step_token_s (a bound that never binds: 1 PFLOP/s, 1 PB/s).
        "gpu": {"name": "CPU core", "peak_flops": 1e15, "hbm_bandwidth": 1e15,
                "memory_bytes": weights + kv_bytes},
        "prefill": engine | {
            "prefill_step_overhead_s": p_over, "step_token_s": p_tok,
            "step_python_s": p_over,
            # the servers run with prefix caching off (the default profile's prefill
            # has 0.9 of each prompt cached)
            "prefix_hit_fraction": 0.0,
        },
        "decode": engine | {
            "decode_step_overhead_s": d_over, "step_token_s": d_tok,
            "step_python_s": d_over, "inline_post": "before-forward",
            "kv_read_efficiency": 1.0, "preemption": "recompute",
        },
        "network": {
            "name": "UCX on loopback (CMA)", "gpus_per_node": 1, "wire_model": "two-limits",
            "descriptor_rate": 1.0 / per_desc_wire if per_desc_wire > 0 else 1e12,
            "write_bandwidth": 1.0 / per_byte if per_byte > 0 else 1e15,
            "read_bandwidth": 1.0 / per_byte if per_byte > 0 else 1e15,
            "wire_latency_s": wire_lat, "control_latency_s": m.message_latency_s,
            "router_hop_s": hop, "post_fixed_s": post_fixed,
            "post_per_descriptor_s": post_desc, "post_gil_fraction": 1.0,
            "sharing": "fair", "rank_skew": 0.0,
        },
        "control": {
            "message_send_s": m.message_send_s * hs, "message_recv_s": m.message_recv_s * hs,
            "handshake_before_run": True,
        },
    }
    host: dict[str, Any] = {}
    if m.engine_speed > 0:  # the reference a later run's cpu_speed is taken against
        host["probe_speed"] = m.engine_speed
    if m.cpu_count > 0:
        host["frontend_cores"] = frontend_cores(m.cpu_count)  # sim/host/frontend.py
        host["cores"] = m.cpu_count  # engines and frontends share them
    if host:  # the machine's cores, shared: the shared-CPU host model
        data["host"] = {"model": SHARED_CPU, **host}
    try:
        profile_from_dict(data)
    except ProfileError as exc:
        raise MeasurementError(f"the measurements make no valid profile: {exc}") from exc
    return data


# ------------------------------------------------------------------ TOML


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def to_toml(data: dict[str, Any], header: Sequence[str] = ()) -> str:
    """A profile's tables as TOML (sub-tables as ``[host.prefill]``), ``header`` lines
    as comments on top."""
    lines = [f"# {h}" if h else "#" for h in header]

    def table(name: str, t: dict[str, Any]) -> None:
        subs = {k: v for k, v in t.items() if isinstance(v, dict)}
        lines.extend(["", f"[{name}]"])
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in t.items() if k not in subs)
        for k, v in subs.items():
            table(f"{name}.{k}", v)

    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if k not in tables]
    for name, t in tables.items():
        table(name, t)
    return "\n".join(lines) + "\n"


def header(m: Measured) -> list[str]:
    return [
        "cpu-tiny: the tiny random Llama of pushkv.vllm.testing on vLLM CPU, one core per",
        "server, NIXL over UCX on host memory. Written by `python -m pushkv.fit.measure`;",
        f"measured {m.when} on {m.machine}, load average at the start "
        f"{m.load[0]:.2f}, {m.load[1]:.2f}, {m.load[2]:.2f} (shared machine).",
        "Raw medians (s): prefill step by prompt length "
        + ", ".join(f"{n}: {t:.5f}" for n, t in zip(m.prefill_lengths, m.prefill_step_s,
                                                    strict=True)) + ";",
        "decode step by batch " + ", ".join(
            f"{n}: {t:.5f}" for n, t in zip(m.decode_batches, m.decode_step_s, strict=True))
        + f" (input {m.decode_input_len});",
        f"request overhead {m.request_overhead_s:.5f}, relay {m.relay_s:.5f};",
        "NIXL post by descriptors " + ", ".join(
            f"{n}: {t * 1e6:.1f} us" for n, t in zip(m.post_descriptors, m.post_s, strict=True))
        + ";",
        f"side channel send {m.message_send_s * 1e6:.1f} us, receive "
        f"{m.message_recv_s * 1e6:.1f} us, one way {m.message_latency_s * 1e6:.1f} us;",
        (f"Probe on the cores meanwhile ({m.probe_samples} samples or more): share "
         f"{m.engine_share:.3f} (engine), {m.host_share:.3f} (NIXL, side channel), wake-up "
         f"delay {m.engine_wake_s * 1e3:.2f} ms; times below scaled to a core of one's own."
         if m.probe_samples else "No probe samples: times below as measured (shares 1)."),
    ]


def write_data(data: dict[str, Any], head: Sequence[str], path: str | Path) -> Profile:
    """Write a profile's tables to ``path``; return the profile as the simulator loads it."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(data, head))
    return load_profile(out)


def write_profile(m: Measured, path: str | Path) -> Profile:
    """Validate, write ``path`` and return the profile as the simulator loads it."""
    text = to_toml(profile_data(m), header(m))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return load_profile(out)
