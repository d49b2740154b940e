"""Closed-form durations: engine steps, descriptor posting, byte transfer.

Pure functions of a profile, so tests can check the simulator's timings
against them and the docs can quote them.

* **Prefill** is compute bound: ``2 * non_embedding_params`` FLOPs per new
  token plus causal attention, ``4 * layers * q_heads * head_dim`` FLOPs per
  (query, key) pair, over the whole node at ``peak * compute_efficiency``.
* **Decode** is memory bound: one step reads every weight once at the
  achievable HBM bandwidth and the KV of every running sequence at a fraction
  of it (paged attention over small blocks), plus a fixed per-step overhead
  (launches, TP all-reduces, the scheduler).
* **Posting** costs a fixed part plus a part per descriptor, paid by whichever
  thread posts (the decode engine loop in pull, a background thread otherwise).
* **Bytes** move at the node's throughput for descriptors of the transfer's
  mean size, shared by the node's GPUs (each rank moves its own slice). With
  ``wire_model = "measured-points"`` the throughput is interpolated, in log
  size, between measured points (Mooncake's EFA table), and below the
  smallest point it is bound by that point's descriptor rate (READs: the same,
  capped at the READ peak, which has no by-size table); with
  ``"two-limits"`` it is the slower of a descriptor rate and a byte
  bandwidth.
* **Posting and wire overlap**: the NIC starts on each descriptor as it is
  posted, so a transfer is done when the wire has moved every byte *and* the
  last descriptor has been posted, whichever is later.
"""

from __future__ import annotations

import bisect
import math

from .profile import EngineProfile, NetworkProfile, Profile


def prefill_flops(profile: Profile, new_tokens: int, context_start: int = 0) -> float:
    """FLOPs to prefill ``new_tokens`` after ``context_start`` tokens already in the cache."""
    m = profile.model
    n, c = float(new_tokens), float(context_start)
    linear = 2.0 * m.non_embedding_params * n
    pairs = n * c + n * (n + 1.0) / 2.0  # causal (query, key) pairs
    attention = 4.0 * m.num_layers * m.num_q_heads * m.head_dim * pairs
    return linear + attention


def compute_s(profile: Profile, engine: EngineProfile, flops: float) -> float:
    """Seconds for the whole TP group to execute ``flops``."""
    return flops / (engine.tp * profile.gpu.peak_flops * engine.compute_efficiency)


def decode_memory_s(profile: Profile, engine: EngineProfile, context_tokens: int) -> float:
    """Seconds to read the weights and ``context_tokens`` of KV once, per GPU."""
    m = profile.model
    bw = profile.gpu.hbm_bandwidth
    kv = context_tokens * m.kv_bytes_per_token(engine.tp)
    return m.weight_bytes_per_gpu(engine.tp) / bw + kv / (bw * engine.kv_read_efficiency)


def step_s(
    profile: Profile,
    engine: EngineProfile,
    *,
    decode_contexts: int = 0,
    num_decodes: int = 0,
    prefill_chunks: tuple[tuple[int, int], ...] = (),
) -> float:
    """One engine step: ``num_decodes`` sequences with ``decode_contexts`` tokens of KV
    in total each produce one token, and each ``(new_tokens, context_start)`` chunk is
    prefilled. A step with any prefill pays the prefill overhead, else the decode one;
    ``engine.step_token_s`` adds a host cost per token the step computes (one per
    decoding sequence and per prefilled token)."""
    if num_decodes == 0 and not prefill_chunks:
        return 0.0
    decode_flops = 2.0 * profile.model.non_embedding_params * num_decodes
    t_decode = 0.0
    if num_decodes:
        t_decode = max(
            decode_memory_s(profile, engine, decode_contexts),
            compute_s(profile, engine, decode_flops),
        )
    t_prefill = 0.0
    if prefill_chunks:
        flops = sum(prefill_flops(profile, n, c) for n, c in prefill_chunks)
        t_prefill = max(
            compute_s(profile, engine, flops),
            0.0 if num_decodes else decode_memory_s(profile, engine, 0),
        )
        dt = engine.prefill_step_overhead_s + t_prefill + t_decode
    else:
        dt = engine.decode_step_overhead_s + t_decode
    if engine.step_token_s:  # host time per computed token (CPU engines); 0 on GPUs
        dt += engine.step_token_s * (num_decodes + sum(n for n, _ in prefill_chunks))
    return dt


def post_s(network: NetworkProfile, descriptors: int) -> float:
    """Preparing and posting one transfer of ``descriptors`` descriptors."""
    return network.post_fixed_s + network.post_per_descriptor_s * descriptors


def node_throughput(network: NetworkProfile, size: float, *, read: bool) -> float:
    """Node bytes/s for descriptors of ``size`` bytes (``measured-points`` model)."""
    sizes, bws = network.point_sizes_bytes, network.point_write_bandwidth
    if size <= sizes[0]:
        bw = bws[0] * size / sizes[0]  # bound by the smallest point's descriptor rate
    elif size >= sizes[-1]:
        bw = bws[-1]
    else:
        i = bisect.bisect_right(sizes, size)
        x0, x1 = math.log2(sizes[i - 1]), math.log2(sizes[i])
        f = (math.log2(size) - x0) / (x1 - x0)
        bw = bws[i - 1] + f * (bws[i] - bws[i - 1])
    # READ has no by-size table: small descriptors are bound by the NIC's operation
    # rate as writes are; large ones by the measured READ peak.
    return min(bw, network.read_bandwidth) if read else bw


def transfer_s(network: NetworkProfile, nbytes: int, descriptors: int, *, read: bool) -> float:
    """Wire time of one rank's slice (``nbytes`` in ``descriptors`` descriptors), alone
    on the NICs. The node's GPUs share the node's throughput."""
    if nbytes <= 0 or descriptors <= 0:
        return network.wire_latency_s
    share = network.gpus_per_node
    if network.wire_model == "measured-points":
        return network.wire_latency_s + nbytes * share / node_throughput(
            network, nbytes / descriptors, read=read)
    bw = network.read_bandwidth if read else network.write_bandwidth
    return network.wire_latency_s + max(
        descriptors * share / network.descriptor_rate, nbytes * share / bw
    )


def pipelined_s(
    network: NetworkProfile, nbytes: int, descriptors: int, *, read: bool,
    posting_left_s: float = 0.0,
) -> float:
    """Seconds from the NIC taking a transfer to its completion, while ``posting_left_s``
    seconds of its posting remain: the wire, or the rest of the posting plus the
    one-way latency of the last descriptor, whichever is longer."""
    wire = transfer_s(network, nbytes, descriptors, read=read)
    return max(wire, posting_left_s + network.wire_latency_s)
