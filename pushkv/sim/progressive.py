"""Progressive push in the simulator: what-if TTFT of one request, by push mode.

One request of ``input_len`` tokens is prefilled on an idle prefill engine in
chunked-prefill steps of ``max_num_batched_tokens``, while the decode engine
has registered for it. The real :mod:`pushkv.protocol` endpoints decide every
write; this module only feeds them the inputs an engine would:

* ``push`` -- whole-request push: ``prefill_finished`` at the end of the last
  step (the one-range case; the same single write as the cluster simulator's);
* ``chunk`` -- ``range_ready(tokens of the step, every layer)`` after each step;
* ``layer`` -- ``range_ready(tokens of the step, layer l)`` after each layer of
  each step (per-layer compute = the step's roofline compute / layers);
* ``free`` -- the floor: the transfer costs nothing (READY at prefill end).

Each ``IssueWrite`` costs what it costs in :mod:`.transport`: posting on the
prefill node's background thread (fixed + per descriptor of the real plan,
holding the interpreter lock for ``post_gil_fraction`` of it, which delays
the engine's next step and its end-of-prefill hand-off), pipelined with the
wire (:func:`.costs.pipelined_s`); the protocol keeps one write in flight per
leg, so later ranges share the wire by waiting for it and are coalesced into
the next write. READY needs every
part's notification (one control latency after its bytes).

TTFT = router hop + max(prefill end, READY) + one decode step + router hop.
Only rank 0 of each engine is driven (ranks are symmetric).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import simpy

from ..protocol import (
    Action,
    Consumer,
    ConsumerConfig,
    IssueWrite,
    Producer,
    ProducerConfig,
    SendMessage,
    TransferReady,
    encode,
)
from .blocks import BlockPool, blocks_for
from .costs import pipelined_s, post_s, step_s
from .profile import Profile, profile_from_dict
from .runner import _ranks

MODES = ("push", "chunk", "layer", "free")


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


class _Run:
    def __init__(self, profile: Profile, input_len: int, mode: str, seed: int) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.profile, self.n, self.mode = profile, input_len, mode
        self.env = simpy.Environment()
        self.p = Producer(_ranks("P", profile, profile.prefill),
                          ProducerConfig(lease_s=1e6, orphan_ttl_s=1e6))
        self.c = Consumer(_ranks("D", profile, profile.decode),
                          ConsumerConfig(window_s=1e6))
        self.p.add_peer(self.c.info)
        self.c.add_peer(self.p.info)
        rng = np.random.default_rng(seed)
        pool = {}
        for side, info in (("P", self.p.info), ("D", self.c.info)):
            eng = profile.prefill if side == "P" else profile.decode
            need = blocks_for(input_len, eng.block_size)
            size = max(info.layout.num_blocks, need)
            pool[side] = BlockPool(size, eng.fragmentation, rng).allocate(need)
        self.src, self.dst = pool["P"], pool["D"]
        self.writer = simpy.Resource(self.env, 1)
        self.gil_free_at = 0.0  # the writer holds the interpreter lock until then
        self.prefill_end = -1.0
        self.ready_at = -1.0
        self.writes = self.descriptors = 0
        self.posted = 0.0

    # ------------------------------------------------------------ actions

    def _apply(self, side: str, actions: list[Action]) -> None:
        net = self.profile.network
        for a in actions:
            if isinstance(a, SendMessage):
                frame = encode(a.message)
                dest = self.p if a.peer.engine_id == "P" else self.c
                self._later(net.control_latency_s, dest, frame)
            elif isinstance(a, IssueWrite):
                self.env.process(self._write(a))
            elif isinstance(a, TransferReady):
                self.ready_at = self.env.now

    def _later(self, delay: float, dest: Producer | Consumer, frame: bytes) -> None:
        side = "P" if dest is self.p else "D"

        def deliver(_: Any) -> None:
            self._apply(side, dest.receive_bytes(frame, self.env.now))

        self.env.timeout(delay).callbacks.append(deliver)

    def _write(self, a: IssueWrite) -> Generator[Any, Any, None]:
        net = self.profile.network
        with self.writer.request() as slot:
            yield slot
            desc, nbytes = a.plan.descriptor_count, a.plan.nbytes
            cost = post_s(net, desc)
            self.writes += 1
            self.descriptors += desc
            self.posted += cost
            self.gil_free_at = self.env.now + cost * net.post_gil_fraction
            yield self.env.timeout(pipelined_s(net, nbytes, desc, read=False,
                                               posting_left_s=cost))
        self._later(net.control_latency_s, self.c, encode(a.notify))
        self._apply("P", self.p.write_completed(a.transfer_id, a.attempt, a.peer, True,
                                                self.env.now, incarnation=a.incarnation))

    # ------------------------------------------------------------ engines

    def _stall(self) -> Generator[Any, Any, None]:
        """At a step boundary, the engine thread waits while the writer holds the
        interpreter lock (as in :mod:`.transport`: posting delays step starts; the
        GPU runs the layers of a step already launched)."""
        if self.gil_free_at > self.env.now:
            yield self.env.timeout(self.gil_free_at - self.env.now)

    def _prefill(self) -> Generator[Any, Any, None]:
        prof, eng = self.profile, self.profile.prefill
        layers = prof.model.num_layers
        chunk = eng.max_num_batched_tokens
        bs = eng.block_size
        for a in range(0, self.n, chunk):
            b = min(self.n, a + chunk)
            step = step_s(prof, eng, prefill_chunks=((b - a, a),))
            per_layer = (step - eng.prefill_step_overhead_s) / layers
            yield from self._stall()  # a step starts only once the lock is free
            yield self.env.timeout(eng.prefill_step_overhead_s)
            ids = self.src[:blocks_for(b, bs)]
            for layer in range(layers):
                yield self.env.timeout(per_layer)
                if self.mode == "layer":
                    self._apply("P", self.p.range_ready("t", ids, (a, b), self.env.now,
                                                        layers=(layer, layer + 1)))
            if self.mode == "chunk" and b < self.n:
                self._apply("P", self.p.range_ready("t", ids, (a, b), self.env.now))
        yield from self._stall()
        self.prefill_end = self.env.now
        if self.mode == "free":
            self.ready_at = self.env.now
            return
        self._apply("P", self.p.prefill_finished("t", self.src, self.n, self.env.now))

    def run(self) -> Outcome:
        prof = self.profile
        if self.mode != "free":
            self._apply("D", self.c.register("t", "P", self.dst, self.n, 0.0))
        proc = self.env.process(self._prefill())
        self.env.run()
        assert proc.processed and self.ready_at >= 0, "the transfer never became ready"
        assert self.c.lent_blocks() == {} and self.p.held_blocks() == {}
        decode = step_s(prof, prof.decode, decode_contexts=self.n, num_decodes=1)
        hop = prof.network.router_hop_s
        ready = max(self.prefill_end, self.ready_at)
        return Outcome(self.mode, self.n, self.prefill_end, self.ready_at,
                       hop + ready + decode + hop, self.writes, self.descriptors, self.posted)


def whatif(profile: Profile, input_len: int, mode: str, *, seed: int = 0) -> Outcome:
    """TTFT of one ``input_len``-token request on idle engines, pushed in ``mode``."""
    return _Run(profile, input_len, mode, seed).run()


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
