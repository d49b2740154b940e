"""Closed-form bounds the planner prunes and brackets with.

Each is a pure function of a profile (whose TP is the configuration's) and the
workload's lengths, built from the same step costs the simulator charges
(:mod:`pushkv.sim.costs`):

* :func:`ttft_floor`: no request of the configuration can see its first token
  sooner, at any rate. Its prompt's uncached tokens take at least
  ``ceil(new / max_num_batched_tokens)`` prefill steps, each paying the step
  overhead and together at least the prompt's FLOPs (chunking does not change
  them) and a weight read per step; its first token comes from a decode step
  that starts once the KV is in place; each leg and the token's way back cross
  the router. Queueing, transfers, posting and batching only add to it.
* :func:`tpot_floor`: every token after the first needs a decode step of its
  own, which reads the weights and at least the request's own KV. It holds on
  a ``dedicated`` host; on a ``shared-cpu`` host a queue of tokens on their way
  out can bunch them, so the floor is 0 there (no pruning by TPOT).
* :func:`capacity`: no rate above it can be sustained: the prefill instances
  have a FLOP and step-overhead budget per second, the decode instances a step
  budget (each step yields at most one token per running sequence, and running
  sequences are capped by ``max_num_seqs`` and by the KV blocks).

The planner never simulates a configuration whose floors are above the SLO
(every request would miss it, whatever the rate) and searches rates up to
the capacity, so a goodput is never above what the instances could sustain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..costs import compute_s, decode_memory_s, prefill_flops, step_s
from ..profile import EngineProfile, Profile


def cached_prefix(engine: EngineProfile, input_len: int) -> int:
    """Prompt tokens the prefill engine finds in its prefix cache (as the engine does:
    whole blocks, never the last token)."""
    bs = engine.block_size
    hit = int(engine.prefix_hit_fraction * input_len) // bs * bs
    return min(hit, input_len - 1)


def prefill_floor(profile: Profile, input_len: int) -> float:
    """Seconds one prompt spends in prefill steps at the least (its steps alone)."""
    eng = profile.prefill
    cached = cached_prefix(eng, input_len)
    new = input_len - cached
    steps = math.ceil(new / eng.max_num_batched_tokens)
    compute = compute_s(profile, eng, prefill_flops(profile, new, cached))
    weights = decode_memory_s(profile, eng, 0)  # a prefill step reads the weights once
    return (steps * eng.prefill_step_overhead_s + max(compute, steps * weights)
            + eng.step_token_s * new)


def decode_step_floor(profile: Profile, context: int) -> float:
    """The shortest decode step that yields a token for a sequence of ``context`` tokens
    of KV: it alone in the batch, with the cheaper of the two step overheads (a step
    that also prefills pays the prefill one)."""
    eng = profile.decode
    alone = step_s(profile, eng, decode_contexts=context, num_decodes=1)
    return alone - eng.decode_step_overhead_s + min(eng.decode_step_overhead_s,
                                                    eng.prefill_step_overhead_s)


def ttft_floor(profile: Profile, input_len: int) -> float:
    """No request's TTFT is below this, at any rate (seconds)."""
    net = profile.network
    way_back = 0.0
    if profile.host.model == "dedicated":  # else a frontend queue carries the tokens
        way_back = net.client_hop_s + profile.decode.return_s + net.client_first_s
    return (2 * net.router_hop_s + way_back + prefill_floor(profile, input_len)
            + decode_step_floor(profile, input_len))


def tpot_floor(profile: Profile, input_len: int, output_len: int) -> float:
    """No request's TPOT is below this, at any rate (seconds; 0 when it cannot be bound)."""
    if output_len <= 1 or profile.host.model != "dedicated":
        return 0.0
    step = decode_step_floor(profile, input_len + 1)
    # the first token reaches the client client_first_s later, shortening TPOT's span
    return max(0.0, step - profile.network.client_first_s / (output_len - 1))


@dataclass(frozen=True, slots=True)
class Capacity:
    """Requests per second the instances could sustain at most, per side."""

    prefill: float
    decode: float

    @property
    def rate(self) -> float:
        return min(self.prefill, self.decode)

    @property
    def side(self) -> str:
        return "prefill" if self.prefill <= self.decode else "decode"


def capacity(profile: Profile, input_len: int, output_len: int, num_prefill: int,
             num_decode: int) -> Capacity:
    """Upper bounds on the sustainable request rate of ``num_prefill`` prefill and
    ``num_decode`` decode instances."""
    p = profile.prefill
    cached = cached_prefix(p, input_len)
    new = input_len - cached
    # a request takes at least its share of steps: its tokens of a step's token budget,
    # and one of the max_num_seqs places of a step
    share = max(new / p.max_num_batched_tokens, 1 / p.max_num_seqs)
    per_request = (share * p.prefill_step_overhead_s
                   + compute_s(profile, p, prefill_flops(profile, new, cached))
                   + p.step_token_s * new)
    prefill_rate = num_prefill / per_request

    d = profile.decode
    blocks = d.num_blocks(profile.model, profile.gpu)
    per_seq = math.ceil((input_len + 1) / d.block_size)
    seqs = max(1, min(d.max_num_seqs, blocks // per_seq))
    m, bw = profile.model, profile.gpu.hbm_bandwidth
    step_fixed = (min(d.decode_step_overhead_s, d.prefill_step_overhead_s)
                  + m.weight_bytes_per_gpu(d.tp) / bw)
    kv_read = input_len * m.kv_bytes_per_token(d.tp) / (bw * d.kv_read_efficiency)
    per_token = step_fixed / seqs + kv_read + d.step_token_s
    decode_rate = num_decode / (output_len * per_token)
    return Capacity(prefill=prefill_rate, decode=decode_rate)


__all__ = ["Capacity", "cached_prefix", "capacity", "decode_step_floor", "prefill_floor",
           "tpot_floor", "ttft_floor"]
