"""Measure what a simulator profile needs on this machine; write it as a TOML profile.

``python -m pushkv.fit.measure --out pushkv/sim/profiles/cpu-tiny.toml`` measures, on
the machine it runs on, the figures of the ``cpu-tiny`` profile -- the tiny random
Llama of :mod:`pushkv.vllm.testing` served by vLLM on CPU, one server per core --
and writes them as a profile :func:`~pushkv.sim.profile.load_profile` reads:

* **Engine steps**, through a real vLLM server (the prefill servers' recipe:
  ``ServerSpec(cpu=0, tokenizer=True, prefix_caching=False)``), from vLLM's own
  per-request metrics (``/metrics``): ``vllm:request_prefill_time_seconds`` of
  one-token requests sent one at a time at several prompt lengths is one prefill
  step; ``vllm:request_decode_time_seconds / (output tokens - 1)`` of ``B``
  requests sent at once is one decode step at batch ``B``. Each is fitted as a
  fixed per-step overhead plus a cost per token the step computes (the
  ``step_token_s`` key): the tiny model's matmuls are microseconds, the step is
  Python. The medians of many requests are fitted, not the means: the machine is
  shared.
* **Request overhead**: a request's client-side latency minus its engine time
  (HTTP, the API server, its hand-off to the engine core), and what one
  aiohttp relay in front adds (the routers are aiohttp relays); half of their
  sum is one router hop.
* **NIXL over UCX**, between two processes on host memory with the progress
  thread throttled as the servers' are (``--delay-us``): the posting thread's
  time (``initialize_xfer`` + ``transfer``) by descriptor count, and the time to
  completion by descriptor count and bytes.
* **Side channel**: a protocol frame (:func:`pushkv.protocol.encode`, msgspec)
  over pyzmq PUSH/PULL on loopback, echoed by another process: the sender's
  time, the receiver's time and the one-way latency.
* **The cores meanwhile**: a :class:`~pushkv.fit.cores.CoreProbe` records the share
  of a core a short burst gets; the profile holds every time scaled to a core of its
  own (``time x share``), so that ``cpu_share`` and ``wake_s`` of a later run start
  from it.
* **On the connector servers** (``--connector-timeline DIR [DIR ...]``, off by
  default): what a plain server cannot show, from the :mod:`pushkv.timeline` marks a
  real pushkv pair recorded (its router's or client's directory first, then the
  servers'; the requests that ran alone, unless ``--all-requests``): each leg's
  API-server time beyond the router hop (``ingest_s``), a token's way back beyond
  one step and the hop (``decode.return_s``),
  the step-boundary hand-offs of a push (``decode.order_handoff_s``,
  ``event_handoff_s``, ``admit_lag_s``) and a write's wait for its notification on
  busy cores (``network.notify_wait_s``) -- see
  :func:`pushkv.fit.measure_connector.connector_keys`. ``--pull-timeline DIR ...``
  (a pull pair's marks) adds the prefill answer's way out (``prefill.return_s``),
  ``--client-hop ROUTER_DIR RESULT`` (a router's marks and that run's ``vllm bench
  serve`` result) the client's way to and from the router (``network.client_hop_s``;
  :func:`~pushkv.fit.measure_connector.extend_router`). With ``--base PROFILE``
  nothing else is measured: the keys are added to that profile.

:func:`profile_data` turns a :class:`Measured` into the profile's tables and
validates them (:func:`~pushkv.sim.profile.profile_from_dict`); a measurement
that is not a finite, positive time, or a fit with a negative overhead, is
refused with :class:`MeasurementError`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sim.frontend import frontend_cores
from ..sim.profile import Profile, ProfileError, profile_from_dict
from .cores import CoreProbe


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
    cpu_count: int = 0  #: os.cpu_count() (0: unknown, control.frontend_cores left at 0)



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
    if m.engine_speed > 0:  # the reference a later run's cpu_speed is taken against
        data["control"]["probe_speed"] = m.engine_speed
    if m.cpu_count > 0:
        data["control"]["frontend_cores"] = frontend_cores(m.cpu_count)  # sim/frontend.py
        data["control"]["host_cores"] = m.cpu_count  # engines and frontends share them
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
    """A profile's tables as TOML, ``header`` lines as comments on top."""
    lines = [f"# {h}" if h else "#" for h in header]
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if k not in tables]
    for name, table in tables.items():
        lines += ["", f"[{name}]"]
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
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
    from ..sim.profile import load_profile

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_toml(data, head))
    return load_profile(out)


def write_profile(m: Measured, path: str | Path) -> Profile:
    """Validate, write ``path`` and return the profile as the simulator loads it."""
    from ..sim.profile import load_profile

    text = to_toml(profile_data(m), header(m))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return load_profile(out)


# ------------------------------------------------------------ engine steps


def metric_sums(text: str) -> dict[str, float]:
    """Every ``vllm:*_sum`` and ``vllm:*_count`` of a ``/metrics`` page, labels summed."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:") and ("_sum{" in line or "_count{" in line):
            name = line.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _engine_delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[f"vllm:{key}_sum"] - before[f"vllm:{key}_sum"]


async def _stream(session: Any, url: str, body: dict[str, Any]) -> float:
    t0 = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise MeasurementError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for _ in r.content:
            pass
    return time.perf_counter() - t0


def measure_engine(work: Path, reps: int, lengths: Sequence[int], batches: Sequence[int],
                   decode_input: int, output_len: int) -> dict[str, Any]:
    """Prefill and decode step times, request and relay overhead, on one real server."""
    import aiohttp

    from ..vllm.testing import (
        Server,
        ServerSpec,
        free_port,
        get_text,
        write_tiny_llama,
        write_word_tokenizer,
    )

    model = work / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    max_len = -(-(max(lengths) + output_len + 64) // 256) * 256
    spec = ServerSpec(model=str(model), port=free_port(), cpu=0, tokenizer=True,
                      prefix_caching=False, max_model_len=max_len)
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(5, 995) for _ in range(n)]

    def body(n: int, out: int, stream: bool) -> dict[str, Any]:
        return {"model": str(model), "prompt": prompt(n), "max_tokens": out,
                "temperature": 0, "ignore_eos": True, "stream": stream}

    async def run(url: str) -> dict[str, Any]:
        relay_url, stop_relay = await _start_relay(url)
        got: dict[str, Any] = {"overhead": [], "relay": []}
        async with aiohttp.ClientSession() as s:
            for _ in range(4):  # warm-up: first steps, the HTTP path
                await _stream(s, url, body(lengths[0], 2, True))
            # Sizes interleaved, in a fresh order each round: the shared machine's load
            # drifts over seconds, and reaches every size alike.
            steps: dict[int, list[float]] = {n: [] for n in lengths}
            for _ in range(reps):
                for n in rng.sample(list(lengths), len(lengths)):
                    before = metric_sums(get_text(url + "/metrics"))
                    lat = await _stream(s, url, body(n, 1, True))
                    after = metric_sums(get_text(url + "/metrics"))
                    step = _engine_delta(before, after, "request_prefill_time_seconds")
                    steps[n].append(step)
                    got["overhead"].append(lat - step)
            got["prefill"] = {n: statistics.median(v) for n, v in steps.items()}
            for _ in range(reps):  # one relay in front, alternating with direct requests
                direct = await _stream(s, url, body(lengths[0], 1, True))
                relayed = await _stream(s, relay_url, body(lengths[0], 1, True))
                got["relay"].append(relayed - direct)
            per_token: dict[int, list[float]] = {b: [] for b in batches}
            for _ in range(max(2, reps // 2)):
                for b in rng.sample(list(batches), len(batches)):
                    before = metric_sums(get_text(url + "/metrics"))
                    await asyncio.gather(*(_stream(s, url, body(decode_input, output_len, True))
                                           for _ in range(b)))
                    after = metric_sums(get_text(url + "/metrics"))
                    dec = _engine_delta(before, after, "request_decode_time_seconds")
                    per_token[b].append(dec / (b * (output_len - 1)))
            got["decode"] = {b: statistics.median(v) for b, v in per_token.items()}
        await stop_relay()
        return got

    server = Server(spec, work / "logs" / "measure-server.log")
    try:
        server.start()
        server.wait_healthy(600)
        with CoreProbe((0,)) as probe:
            got = asyncio.run(run(server.url))
        return got | {"share": probe.share(0), "wake": probe.wake_s(0),
                      "speed": probe.speed(0),
                      "probe_samples": len(probe.wakes.get(0, ()))}
    finally:
        server.stop()


async def _start_relay(target: str) -> tuple[str, Any]:
    """A streaming aiohttp relay of /v1/completions to ``target`` (what a router adds)."""
    import aiohttp
    from aiohttp import web

    from ..vllm.testing import free_port

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        async with session.post(target + "/v1/completions", json=body) as r:
            out = web.StreamResponse(status=r.status,
                                     headers={"Content-Type": r.content_type})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()

    async def stop() -> None:
        await runner.cleanup()
        await session.close()

    return f"http://127.0.0.1:{port}", stop


# ------------------------------------------------------------------ NIXL


def _nixl_target(conn: Any, size: int, delay_us: int) -> None:
    import numpy as np

    from ..transports.nixl.agent import Agent
    from ..transports.nixl.config import NixlConfig
    from ..transports.nixl.memory import KVMemory

    buf = np.zeros(size, np.uint8)
    agent = Agent("measure-target", NixlConfig(progress_delay_us=delay_us))
    mem = KVMemory.from_regions([buf])
    agent.register(mem)
    conn.send((agent.metadata(), mem.bases[0]))
    conn.recv()  # done
    agent.close()


def measure_nixl(reps: int, delay_us: int) -> dict[str, Any]:
    """Posting time by descriptor count; completion by descriptors and bytes."""
    import numpy as np

    from ..transports.nixl.agent import Agent
    from ..transports.nixl.config import NixlConfig
    from ..transports.nixl.memory import KVMemory

    size = 16 << 20
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_nixl_target, args=(child, size, delay_us), daemon=True)
    proc.start()
    try:
        meta, remote_base = parent.recv()
        src = np.full(size, 7, np.uint8)
        agent = Agent("measure-initiator", NixlConfig(progress_delay_us=delay_us))
        mem = KVMemory.from_regions([src])
        agent.register(mem)
        peer = agent.add_peer(meta)
        local_base = mem.bases[0]

        def descs(base: int, n: int, each: int) -> Any:
            rows = np.zeros((n, 3), np.uint64)
            rows[:, 0] = base + np.arange(n, dtype=np.uint64) * (2 * each)  # not adjacent
            rows[:, 1] = each
            return rows

        def one(n: int, each: int) -> tuple[float, float]:
            t0 = time.perf_counter()
            h = agent.prepare_write(descs(local_base, n, each), descs(remote_base, n, each),
                                    peer, b"", "DRAM")
            state = agent.post(h)
            posted = time.perf_counter()
            while state not in ("DONE", "ERR"):
                state = agent.state(h)
            done = time.perf_counter()
            agent.release(h)
            if state != "DONE":
                raise MeasurementError(f"NIXL WRITE of {n} descriptors ended {state}")
            return posted - t0, done - t0

        for _ in range(20):
            one(1, 8192)  # connection set-up, first registrations
        post_n = (1, 4, 16, 64, 256)
        wire_shape = [(1, 8192), (1, 1 << 16), (1, 1 << 19), (1, 1 << 22),
                      (16, 8192), (64, 8192), (256, 8192)]
        shapes = sorted({(n, 8192) for n in post_n} | set(wire_shape))
        times: dict[tuple[int, int], list[tuple[float, float]]] = {k: [] for k in shapes}
        order = random.Random(1)
        for _ in range(reps * 4):  # interleaved, as the engine's sizes
            for k in order.sample(shapes, len(shapes)):
                times[k].append(one(*k))
        post = [statistics.median(t[0] for t in times[n, 8192]) for n in post_n]
        wire = [statistics.median(t[1] for t in times[k]) for k in wire_shape]
        agent.close()
        parent.send(None)
        return {"post_descriptors": post_n, "post_s": post,
                "wire_descriptors": [n for n, _ in wire_shape],
                "wire_bytes": [n * e for n, e in wire_shape], "wire_s": wire}
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ------------------------------------------------------------ side channel


def _echo(port: int, back: int, count: int) -> None:
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{port}")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{back}")
    for _ in range(count):
        push.send_multipart(pull.recv_multipart())
    push.close(1000)
    pull.close(0)
    ctx.term()


def measure_side_channel(reps: int) -> dict[str, float]:
    """A protocol frame over pyzmq and back: sender's, receiver's time, one-way latency."""
    import zmq

    from ..protocol import Register, decode, encode
    from ..vllm.testing import free_port

    msg = Register(transfer_id="0" * 32, attempt=1, engine_id="decode-0", rank=0,
                   producer_engine_id="prefill-0", block_ids=tuple(range(8)), num_tokens=256,
                   incarnation=12345)
    count = reps * 50
    port, back = free_port(), free_port()
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"tcp://127.0.0.1:{back}")
    proc = mp.get_context("spawn").Process(target=_echo, args=(port, back, count), daemon=True)
    proc.start()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    sends, recvs, rtts = [], [], []
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    try:
        for _ in range(count):
            t0 = time.perf_counter()
            push.send_multipart([b"control", encode(msg)])
            t1 = time.perf_counter()
            if not poller.poll(10_000):
                raise MeasurementError("side channel: no echo within 10 s")
            t2 = time.perf_counter()
            _, frame = pull.recv_multipart()
            decode(frame)
            t3 = time.perf_counter()
            sends.append(t1 - t0)
            recvs.append(t3 - t2)
            rtts.append(t2 - t0)
    finally:
        proc.join(30)
        push.close(0)
        pull.close(0)
        ctx.term()
    send, recv = statistics.median(sends[10:]), statistics.median(recvs[10:])
    # One way: half the round trip the two ends' own times leave (two sends, two receives).
    one_way = max(1e-6, statistics.median(rtts[10:]) / 2 - send - recv)
    return {"message_send_s": send, "message_recv_s": recv, "message_latency_s": one_way}


# -------------------------------------------------------------------- main


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"a {os.cpu_count()}-core, {mem:.0f} GiB machine without GPU ({os.uname().nodename})"


def measure(work: Path, *, reps: int, delay_us: int) -> Measured:
    load = os.getloadavg()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lengths, batches, dec_in, out_len = (16, 64, 128, 192, 256, 384), (1, 2, 4, 8), 128, 32
    host = CoreProbe()
    host.__enter__()
    print("side channel ...", flush=True)
    side = measure_side_channel(reps)
    print(f"  {side}", flush=True)
    print("NIXL ...", flush=True)
    nixl = measure_nixl(reps, delay_us)
    print(f"  {nixl}", flush=True)
    host.__exit__()
    host_share = min(host.share(0), host.share(1))
    print("engine (one vLLM server) ...", flush=True)
    eng = measure_engine(work, reps, lengths, batches, dec_in, out_len)
    print(f"  {eng['prefill']} {eng['decode']}, core 0: share {eng['share']:.3f}, wake "
          f"{eng['wake'] * 1e3:.2f} ms", flush=True)
    return Measured(
        machine=machine(), when=when, load=(load[0], load[1], load[2]),
        prefill_lengths=tuple(lengths),
        prefill_step_s=tuple(eng["prefill"][n] for n in lengths),
        decode_batches=tuple(batches), decode_step_s=tuple(eng["decode"][b] for b in batches),
        decode_input_len=dec_in,
        request_overhead_s=statistics.median(eng["overhead"]),
        relay_s=max(1e-6, statistics.median(eng["relay"])),
        post_descriptors=tuple(nixl["post_descriptors"]), post_s=tuple(nixl["post_s"]),
        wire_descriptors=tuple(nixl["wire_descriptors"]),
        wire_bytes=tuple(nixl["wire_bytes"]), wire_s=tuple(nixl["wire_s"]), **side,
        engine_share=eng["share"], host_share=host_share, engine_wake_s=eng["wake"],
        engine_speed=eng["speed"],
        probe_samples=min([eng["probe_samples"], *(len(host.wakes.get(c, ())) for c in (0, 1))]),
        cpu_count=os.cpu_count() or 0,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the TOML profile to write")
    p.add_argument("--work", type=Path, default=Path("/tmp/pushkv-measure"),
                   help="model files and server logs")
    p.add_argument("--reps", type=int, default=20, help="requests per measured point")
    p.add_argument("--delay-us", type=int, default=100,
                   help="NIXL progress-thread sleep between polls (as benchmarks/e2e)")
    p.add_argument("--json", type=Path, help="also write the raw measurements here")
    c = p.add_argument_group("on the connector servers (off by default)")
    c.add_argument("--connector-timeline", nargs="+", type=Path, metavar="DIR",
                   help="pushkv.timeline directories of a real pushkv pair at low load, the "
                   "router's or client's first, then the servers': add the connector keys "
                   "(ingest_s, decode.return_s, order_handoff_s, event_handoff_s, "
                   "admit_lag_s, network.notify_wait_s) measured from them")
    c.add_argument("--connector-window", nargs=2, type=float, metavar=("T0", "T1"),
                   help="only the requests whose legs left between T0 and T1 "
                   "(time.monotonic; e.g. one point of bench_sim_vs_real, its cpu_probe.json "
                   "'window')")
    c.add_argument("--all-requests", action="store_true",
                   help="take every request of the timeline, not only those that ran alone "
                   "(nothing else in flight: the low-load sample the keys are defined on)")
    c.add_argument("--connector-steps", nargs=2, type=int, metavar=("IN", "OUT"),
                   help="also replace the engines' step overheads by those the connector "
                   "servers ran (the timeline's requests had IN prompt and OUT output "
                   "tokens); the other keys are then taken against them")
    c.add_argument("--host-spread", type=int, default=0, metavar="N",
                   help="with --connector-timeline: also set control.host_spread, the "
                   "keyed host times' spread around their medians at N quantiles "
                   "(pushkv.fit.measure_connector.host_spread; 0: none)")
    c.add_argument("--timeline-share", type=float, default=1.0, metavar="F",
                   help="the share of a core the pair's processes got meanwhile (a probe's "
                   "figure): the keys are scaled to a core of one's own by it")
    c.add_argument("--pull-timeline", nargs="+", type=Path, metavar="DIR", default=[],
                   help="a real pull pair's timeline (the router's or client's first): add "
                   "prefill.return_s (pushkv.fit.measure_connector.pull_keys)")
    c.add_argument("--client-hop", nargs=2, type=Path, metavar=("ROUTER_DIR", "RESULT"),
                   help="a router's timeline of one run and that run's vllm bench serve "
                   "result file: add network.client_hop_s (measure_connector.client_hop)")
    c.add_argument("--client-window", nargs=2, type=float, metavar=("T0", "T1"),
                   help="with --client-hop: only the router's requests of that interval "
                   "(the run's; time.monotonic, e.g. bench_sim_vs_real's 'window')")
    c.add_argument("--base", type=Path, metavar="PROFILE",
                   help="with --connector-timeline: measure nothing else, add the keys to "
                   "this profile (e.g. pushkv/sim/profiles/cpu-tiny.toml)")
    args = p.parse_args(argv)
    if args.reps < 2:
        p.error("--reps must be at least 2")
    if args.base and not (args.connector_timeline or args.pull_timeline or args.client_hop):
        p.error("--base needs --connector-timeline, --pull-timeline or --client-hop")
    if args.host_spread and not args.connector_timeline:
        p.error("--host-spread needs --connector-timeline")
    try:
        if args.base:
            import tomllib

            text = args.base.read_text()
            lines = text.splitlines()
            lead = next((i for i, line in enumerate(lines) if not line.startswith("#")),
                        len(lines))
            data, head = tomllib.loads(text), [  # the base's header comment, kept
                line[2:] if line.startswith("# ") else line.lstrip("#") for line in lines[:lead]]
        else:
            m = measure(args.work, reps=args.reps, delay_us=args.delay_us)
            if args.json:
                args.json.write_text(json.dumps(dataclasses.asdict(m), indent=1))
            data, head = profile_data(m), header(m)
        if args.connector_timeline:
            from .measure_connector import extend

            win = args.connector_window
            data, head = extend(data, head, args.connector_timeline,
                                window=(win[0], win[1]) if win else None,
                                alone_only=not args.all_requests, steps=args.connector_steps,
                                share=args.timeline_share, spread=args.host_spread)
        if args.pull_timeline or args.client_hop:
            from .measure_connector import extend_router

            data, head = extend_router(data, head, pull_dirs=args.pull_timeline,
                                       client=args.client_hop, share=args.timeline_share,
                                       client_window=args.client_window)
        prof = write_data(data, head, args.out)
    except (MeasurementError, ProfileError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} (profile {prof.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
