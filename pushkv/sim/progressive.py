"""Progressive push in the simulator: what-if TTFT of one request, by push mode.

The one-request case of the cluster simulator (:func:`pushkv.sim.runner.run`):
one request of ``input_len`` fresh tokens (no prefix-cache hit) reaches idle
prefill and decode engines; the decode engine registers while prefill computes
it in chunked-prefill steps of ``max_num_batched_tokens``. The real
:mod:`pushkv.protocol` endpoints decide every write; the prefill engine loop feeds
them what it has computed, by mode (:class:`~pushkv.sim.scenario.TransferMode`):

* ``push`` -- whole-request push: ``prefill_finished`` at the end of the last
  step (one write);
* ``chunk`` (``push-chunk``) -- ``range_ready(tokens of the step, every layer)``
  after each step;
* ``layer`` (``push-layer``) -- ``range_ready(tokens of the step, layer l)``
  after each layer of each step (per-layer compute = the step's roofline compute
  / layers);
* ``free`` -- the floor: the transfer costs nothing (READY at prefill end; the
  push run's TTFT less its exposed transfer, as the decode engine is idle).

Each ``IssueWrite`` costs what it costs in :mod:`.transport` (posting on the
prefill node's background thread, holding the interpreter lock for
``post_gil_fraction`` of it, which delays the engine's next step; the wire
pipelined with the posting; the notification one control latency and its
receipt later); the protocol keeps one write in flight per leg, so later ranges
wait for it and are coalesced into the next write.

TTFT is the cluster simulator's: router hop, prefill, READY, one decode step,
the token's way back to the client. Under load the same modes run in
``pushkv sim --mode push-chunk|push-layer`` and ``pushkv sweep``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .profile import Profile, profile_from_dict
from .scenario import SimConfig, TransferMode
from .workload import WorkloadConfig

MODES = ("push", "chunk", "layer", "free")
#: the cluster simulator's mode behind each of :data:`MODES`
CLUSTER_MODES = {"push": TransferMode.PUSH, "chunk": TransferMode.PUSH_CHUNK,
                 "layer": TransferMode.PUSH_LAYER, "free": TransferMode.PUSH}


@dataclass(frozen=True)
class Outcome:
    mode: str
    input_len: int
    prefill_s: float  #: prefill start to end of its last step (GIL stalls included)
    ready_s: float  #: prefill start to READY on the decode side
    ttft_s: float
    writes: int
    descriptors: int
    post_s: float  #: posting time on the prefill background thread

    @property
    def exposed_s(self) -> float:
        """Transfer time not hidden behind prefill (READY after prefill end)."""
        return max(0.0, self.ready_s - self.prefill_s)


def one_request(profile: Profile, input_len: int, mode: str, *, seed: int = 0) -> SimConfig:
    """The cluster simulator's config of :func:`whatif`: one ``input_len``-token request
    of fresh tokens (the profile's prefix-cache hit set to 0), one output token."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fresh = dataclasses.replace(profile, prefill=dataclasses.replace(
        profile.prefill, prefix_hit_fraction=0.0))
    return SimConfig(mode=CLUSTER_MODES[mode], profile=fresh, workload=WorkloadConfig(
        input_len=input_len, output_len=1, num_prompts=1, seed=seed))


def whatif(profile: Profile, input_len: int, mode: str, *, seed: int = 0) -> Outcome:
    """TTFT of one ``input_len``-token request on idle engines, pushed in ``mode``."""
    from .marks import Timeline
    from .runner import run

    tl = Timeline()
    out = run(one_request(profile, input_len, mode, seed=seed), keep_objects=True, timeline=tl)
    (marks,) = tl.requests.values()
    assert out.transport is not None and "ready" in marks, "the transfer never became ready"
    assert out.leaked_blocks == 0
    t0 = marks["prefill_seen"]
    prefill, ready = marks["prefill_finished"] - t0, marks["ready"] - t0
    ttft = out.result["ttfts"][0]
    if mode == "free":  # READY at prefill end: the push's exposed transfer is gone
        ttft -= max(0.0, ready - prefill)
        return Outcome(mode, input_len, prefill, prefill, ttft, 0, 0, 0.0)
    desc = out.transport.descriptors
    return Outcome(mode, input_len, prefill, ready, ttft, len(desc), sum(desc),
                   out.transport.post_s_by_thread.get("prefill-bg", 0.0))


def hidden_share(push: Outcome, other: Outcome) -> float:
    """The share of whole-request push's exposed transfer that ``other`` hides."""
    if push.exposed_s <= 0:
        return 1.0
    return 1.0 - other.exposed_s / push.exposed_s


def ttft_gain(push: Outcome, other: Outcome, free: Outcome) -> float:
    """The share of push's TTFT above the free-transfer floor that ``other`` removes
    (1: at the floor; negative: slower than push)."""
    over = push.ttft_s - free.ttft_s
    return 1.0 if over <= 0 else (push.ttft_s - other.ttft_s) / over


#: Profiles where the transfer is large relative to prefill, as overrides of the
#: built-in one; every number's source is in :data:`SOURCES`.
PROFILES: dict[str, dict[str, Any]] = {
    "p5en": {},
    "tcp100": {
        "name": "qwen3-32b-h200-tp8-tcp100",
        "network": {"name": "100 Gbps TCP", "wire_model": "two-limits",
                    "write_bandwidth": 11.0e9, "read_bandwidth": 11.0e9,
                    "descriptor_rate": 11.0e9 / (16 << 10), "wire_latency_s": 50e-6},
    },
    "h20-72b": {
        "name": "qwen2.5-72b-h20-tp8-ib4x400",
        "model": {"name": "Qwen/Qwen2.5-72B-Instruct", "num_layers": 80, "hidden_size": 8192,
                  "num_q_heads": 64, "num_kv_heads": 8, "head_dim": 128,
                  "total_params": 72.7e9, "non_embedding_params": 70.2e9},
        "gpu": {"name": "H20", "peak_flops": 148e12, "hbm_bandwidth": 4.0e12,
                "memory_bytes": 96e9},
        "network": {"name": "4x400 Gbps InfiniBand", "wire_model": "two-limits",
                    "write_bandwidth": 4 * 50e9 * 0.9, "read_bandwidth": 4 * 50e9 * 0.9,
                    "descriptor_rate": 4 * 50e9 * 0.9 / (64 << 10), "wire_latency_s": 5e-6},
    },
}

SOURCES: dict[str, str] = {
    "tcp100 write_bandwidth": "100 Gbps line rate = 12.5 GB/s, less ~12% for TCP/IP and "
                              "framing (assumed)",
    "tcp100 descriptor_rate": "assumed: a TCP backend streams; 16 KiB descriptors reach line "
                              "rate (so small blocks are not penalised beyond the bytes)",
    "h20 gpu": "NVIDIA H20 product brief: 148 TFLOPS dense BF16, 4.0 TB/s HBM3, 96 GB",
    "h20 network": "4 ConnectX-7 at 400 Gbps = 200 GB/s per node, 90% achievable (assumed, "
                   "in line with the built-in profile's 365.7 of 400 GB/s)",
    "72b model": "Qwen2.5-72B-Instruct config.json: 80 layers, hidden 8192, 64 query heads, "
                 "8 KV heads, head_dim 128; 72.7B parameters, 70.2B outside the embeddings "
                 "(2 x 152064 x 8192 = 2.49B in embedding and LM head)",
}


def named_profile(name: str) -> Profile:
    """One of :data:`PROFILES` (``p5en`` is the built-in calibrated profile)."""
    from .profile import DEFAULT

    if name not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)}, got {name!r}")
    return profile_from_dict(PROFILES[name], DEFAULT) if PROFILES[name] else DEFAULT


def table(profile: Profile, lengths: tuple[int, ...] = (1024, 4096, 8192, 16384)
          ) -> list[dict[str, float]]:
    """Per input length: TTFT of every mode, ratios to push, hidden shares."""
    rows = []
    for n in lengths:
        out = {m: whatif(profile, n, m) for m in MODES}
        push = out["push"]
        rows.append({
            "input_len": n,
            **{f"ttft_{m}_ms": out[m].ttft_s * 1e3 for m in MODES},
            "ratio_chunk": out["chunk"].ttft_s / push.ttft_s,
            "ratio_layer": out["layer"].ttft_s / push.ttft_s,
            "hidden_chunk": hidden_share(push, out["chunk"]),
            "hidden_layer": hidden_share(push, out["layer"]),
            "gain_chunk": ttft_gain(push, out["chunk"], out["free"]),
            "gain_layer": ttft_gain(push, out["layer"], out["free"]),
            "writes_layer": out["layer"].writes,
            "push_exposed_ms": push.exposed_s * 1e3,
        })
    return rows


#: the cluster modes the loaded table compares, by column name
LOADED_MODES = {"push": "push", "chunk": "push-chunk", "layer": "push-layer"}


def loaded_config(profile: Profile, input_len: int, mode: str, concurrency: int, *,
                  prompts_per_slot: int = 4, output_len: int = 128, seed: int = 0
                  ) -> SimConfig:
    """A closed-loop point: ``concurrency`` requests in flight (``vllm bench serve
    --max-concurrency``, every request due at once), ``prompts_per_slot`` x
    ``concurrency`` fresh prompts (no prefix-cache hit, as :func:`whatif`) pushed in
    ``mode`` (a key of :data:`LOADED_MODES`)."""
    one = one_request(profile, input_len, "push", seed=seed)
    return dataclasses.replace(one, mode=TransferMode(LOADED_MODES[mode]), workload=(
        WorkloadConfig(request_rate=float("inf"), input_len=input_len, output_len=output_len,
                       num_prompts=max(8, prompts_per_slot * concurrency), seed=seed,
                       max_concurrency=concurrency)))


def loaded_point(cfg: SimConfig) -> dict[str, float]:
    """One closed-loop point (a top-level function, for ``spawn`` workers): mean TTFT;
    mean exposed transfer (READY after prefill end); the share of requests whose
    registration reached prefill before their prefill ended (only those can overlap);
    writes issued."""
    from .marks import Timeline
    from .runner import run

    tl = Timeline()
    out = run(cfg, timeline=tl)
    marks = list(tl.requests.values())
    exposed = [max(0.0, m["ready"] - m["prefill_finished"]) for m in marks
               if "ready" in m and "prefill_finished" in m]
    early = [m.get("registration_received", float("inf")) < m["prefill_finished"]
             for m in marks if "prefill_finished" in m]
    return {"ttft_ms": out.result["mean_ttft_ms"],
            "exposed_ms": 1e3 * sum(exposed) / max(1, len(exposed)),
            "registered_early": sum(early) / max(1, len(early)),
            "writes": out.result["pushkv"]["transfers"]}


def loaded_table(profile: Profile, lengths: tuple[int, ...] = (1024, 4096, 8192, 16384),
                 concurrencies: tuple[int, ...] = (1, 8, 32), *, prompts_per_slot: int = 4,
                 output_len: int = 128, jobs: int = 1) -> list[dict[str, Any]]:
    """Per concurrency and input length: mean TTFT of push, chunk and layer under
    closed-loop load, layer's and chunk's ratio to push, and what decode's KV wait and
    the prefill writer's posting were (the cluster simulator; ``jobs`` processes)."""
    points = [(c, n, m) for c in concurrencies for n in lengths for m in LOADED_MODES]
    cfgs = [loaded_config(profile, n, m, c, prompts_per_slot=prompts_per_slot,
                          output_len=output_len) for c, n, m in points]
    if jobs > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            outs = pool.map(loaded_point, cfgs)
    else:
        outs = [loaded_point(c) for c in cfgs]
    got = dict(zip(points, outs, strict=True))
    rows = []
    for c in concurrencies:
        for n in lengths:
            r = {m: got[c, n, m] for m in LOADED_MODES}
            ttft = {m: r[m]["ttft_ms"] for m in LOADED_MODES}
            rows.append({
                "concurrency": c, "input_len": n,
                **{f"ttft_{m}_ms": v for m, v in ttft.items()},
                "ratio_chunk": ttft["chunk"] / ttft["push"],
                "ratio_layer": ttft["layer"] / ttft["push"],
                "saved_layer_ms": ttft["push"] - ttft["layer"],
                "exposed_push_ms": r["push"]["exposed_ms"],
                "exposed_layer_ms": r["layer"]["exposed_ms"],
                "registered_early": r["layer"]["registered_early"],
                "writes_layer": r["layer"]["writes"],
            })
    return rows
