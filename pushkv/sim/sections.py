"""The profile's sections: the model, the accelerator, each engine side, the fabric and
the control plane, every field with its help and its source.

Each field carries ``metadata["help"]`` and ``metadata["source"]``: the public figure
it comes from (docs/sim.md's "Sources" lists them with links), ``fit`` for the few
parameters chosen so that the simulated sweep reproduces the published figures, or
``assumed``. The whole profile, its validation and its file format:
:mod:`pushkv.sim.profile`; the host section: :mod:`pushkv.sim.host.profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..protocol.packing import POST_PER_DESCRIPTOR_S


def _f(default: Any, help: str, source: str) -> Any:
    return field(default=default, metadata={"help": help, "source": source})


CAL_MODEL = "Qwen3-32B model card (huggingface.co/Qwen/Qwen3-32B, config.json)"
CAL_HW = ("NVIDIA H200 specifications; AWS P5 instances (p5en: 8x H200, 16 EFA x 200 Gb/s); "
          "Mooncake efa_transport.md (p5en.48xlarge)")
CAL_POST = "vLLM blog 'Push-Based KV Transfer ...' (2026-10-14), launch flags"
CAL_DESC = ("NIXL issue 1514 (18,880 descriptors ~46 ms on LIBFABRIC); vLLM PR 55157 "
            "(one descriptor per layer, K/V and block)")
CAL_CHECK = ("derived: 2 x 31.2e9 matmul parameters x tokens against a TP8 H200 node's "
             "peak (docs/sim.md, 'The assumptions the fit needed')")
VLLM_DEFAULTS = "vLLM defaults (vllm/engine/arg_utils.py, vllm/config/cache.py)"
VLLM_LEASE = (
    "vLLM docs/design/nixl_kv_cache_lease.md ('while a request is queued or in-flight on D, "
    "D periodically sends heartbeats to P'); vLLM 0.32 nixl/base_scheduler.py "
    "on_new_request, build_connector_meta; base_worker.py _send_heartbeats"
)
VLLM_KV_LOAD = (
    "vLLM v1/worker/gpu/kv_connector.py (pre_forward / post_forward) and "
    "kv_connector_model_runner_mixin.py: async KV loads start after the forward launch "
    "(vllm-project/vllm PR 53333)"
)
INLINE_POSTS = ("after-forward", "before-forward")
WIRE_MODELS = ("measured-points", "two-limits")
SHARINGS = ("fair", "fifo")
SKEWS = ("exponential", "fixed")
ALLOCATORS = ("static", "history")
PREEMPTIONS = ("recompute", "reissue", "off")
MOONCAKE = (
    "Mooncake efa_transport.md: EFA WRITE on p5en by block size (64 KB 97 GB/s ... 2 MB 367)"
)
#: Engine fields one side never reads: setting them would be silently ignored, so a
#: profile that sets them is refused (the value must stay the default).
UNUSED = {
    "prefill": {
        "inline_post": "the prefill side posts no reads",
        "decode_step_overhead_s": "prefill steps always prefill",
        "kv_read_efficiency": "prefill steps read no decode KV",
        "heartbeat_queued": "only decode renews leases",
        "orders_at_forward": "prefill's worker takes no orders",
        "preemption": "prefill waits for free blocks instead",
        "order_handoff_s": "prefill's worker marks the finished prompt itself (no order "
        "waits for a step)",
        "event_handoff_s": "only decode waits for a transfer's readiness",
        "admit_lag_s": "only decode waits for a transfer's readiness",
    },
    "decode": {
        "prefix_hit_fraction": "decode runs with --no-enable-prefix-caching; a request "
        "recomputed on decode computes its whole prompt",
    },
}
FIT = "fit: chosen once so the default sweep reproduces the post (docs/sim.md)"
#: Engine keys measured on a real connector pair's timeline (all 0 by default).
CONNECTOR_KEYS = ("ingest_s", "return_s", "order_handoff_s", "event_handoff_s", "admit_lag_s")
#: ... and network.notify_wait_s, the one on the network table.
CONNECTOR = (
    "0 (off) by default; measured on a real pushkv pair by `python -m pushkv.fit.measure "
    "--connector-timeline DIR` from its pushkv.timeline marks (docs/sim.md, 'Against real "
    "engines, segment by segment')"
)
ASSUMED = "assumed (no public measurement; small effect, see docs/sim.md)"
MEGATRON = ("Megatron-LM tensor parallelism: two all-reduces per transformer layer in the "
            "forward pass, after attention and after the MLP (Shoeybi et al. 2019, "
            "https://arxiv.org/abs/1909.08053, section 3)")
#: all-reduces per layer of a tensor-parallel forward (none at TP1)
ALLREDUCES_PER_LAYER = 2
#: what a step costs besides its layers: the scheduler and the step's Python (the
#: built-in profile's step_python_s)
STEP_FIXED_S = 0.0015
#: one all-reduce of a step at TP > 1: the built-in decode step overhead (3.8 ms) less
#: STEP_FIXED_S over its 2 x 64 all-reduces (Qwen3-32B at TP8)
ALLREDUCE_S = (0.0038 - STEP_FIXED_S) / (ALLREDUCES_PER_LAYER * 64)
#: eager kernel launches of one layer of a prefill step: the built-in prefill step
#: overhead (20 ms) less the decode step's (fixed part and all-reduces) over 64 layers
PREFILL_LAYER_S = (0.020 - 0.0038) / 64
ALLREDUCE_SOURCE = (
    "fit: the built-in profile's decode step overhead (3.8 ms, " + CAL_POST + ") less "
    "STEP_FIXED_S (1.5 ms, the step's Python, assumed) over its 128 all-reduces (64 layers "
    "x 2 at TP8, " + MEGATRON + "): 18 us; no public per-all-reduce figure is used -- "
    "measure yours (e.g. nccl-tests all_reduce_perf, https://github.com/NVIDIA/nccl-tests, "
    "at your TP and the hidden size x tokens of a step) and set it")


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """Shape of the served model."""

    name: str = _f("Qwen/Qwen3-32B", "model id written into result files", CAL_MODEL)
    num_layers: int = _f(64, "transformer layers", CAL_MODEL)
    hidden_size: int = _f(5120, "hidden size", CAL_MODEL)
    num_q_heads: int = _f(64, "query heads", CAL_MODEL)
    num_kv_heads: int = _f(8, "KV heads", CAL_MODEL)
    head_dim: int = _f(128, "head dimension", CAL_MODEL)
    total_params: float = _f(32.8e9, "all parameters (weights read per decode step)", CAL_MODEL)
    non_embedding_params: float = _f(
        31.2e9, "parameters in matmuls per token (2 FLOPs each)", CAL_CHECK
    )
    dtype_bytes: int = _f(2, "bytes per weight and per KV element (bf16)", CAL_MODEL)

    def kv_heads_per_rank(self, tp: int) -> int:
        """KV heads one TP rank holds (one replicated head when heads < TP)."""
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV bytes of one token on one TP rank (all layers, K and V)."""
        return 2 * self.num_layers * self.kv_heads_per_rank(tp) * self.head_dim * self.dtype_bytes

    def weight_bytes_per_gpu(self, tp: int) -> float:
        return self.total_params * self.dtype_bytes / tp


@dataclass(frozen=True, kw_only=True)
class GPUProfile:
    """One accelerator."""

    name: str = _f("H200", "accelerator name", CAL_HW)
    peak_flops: float = _f(989e12, "dense bf16 peak FLOP/s", CAL_HW)
    hbm_bandwidth: float = _f(
        4.3e12, "achievable HBM bytes/s (measured copy, read + write)", CAL_HW
    )
    memory_bytes: float = _f(141e9, "HBM capacity", CAL_HW)


@dataclass(frozen=True, kw_only=True)
class EngineProfile:
    """One vLLM instance (prefill or decode side) and how fast its steps run."""

    tp: int = _f(8, "tensor-parallel size (one node)", CAL_POST)
    max_num_seqs: int = _f(8, "running requests at most (--max-num-seqs)", CAL_POST)
    max_num_batched_tokens: int = _f(
        8192, "token budget of one step (chunked prefill)", VLLM_DEFAULTS + ", H200 server"
    )
    block_size: int = _f(16, "tokens per KV block", VLLM_DEFAULTS + "; " + CAL_DESC)
    gpu_memory_utilization: float = _f(0.92, "fraction of HBM vLLM may use", VLLM_DEFAULTS)
    activation_reserve_bytes: float = _f(
        6e9, "HBM kept for activations and graphs, not KV", ASSUMED
    )
    compute_efficiency: float = _f(
        0.55, "fraction of peak FLOP/s that prefill matmuls and attention reach", FIT
    )
    prefill_step_overhead_s: float = _f(
        0.020, "fixed cost of a step that prefills (launches, all-reduces, scheduler); a "
        "profile that changes model.num_layers, tp or allreduce_s without setting it gets "
        "STEP_FIXED_S + layers x PREFILL_LAYER_S + all-reduces x allreduce_s "
        "(derived_step_overheads)", FIT
    )
    decode_step_overhead_s: float = _f(
        0.0038, "fixed cost of a decode step (128 all-reduces at TP8, scheduler); a profile "
        "that changes model.num_layers, tp or allreduce_s without setting it gets "
        "STEP_FIXED_S + all-reduces x allreduce_s (derived_step_overheads)", FIT
    )
    allreduce_s: float = _f(
        ALLREDUCE_S,
        "one all-reduce of a step at tp > 1 (2 per layer; none at TP1): what derived step "
        "overheads charge per all-reduce",
        ALLREDUCE_SOURCE,
    )
    kv_read_efficiency: float = _f(
        0.5,
        "fraction of the HBM bandwidth paged attention reaches reading KV in a decode step "
        "(small blocks: 4 KiB per layer and plane at TP8)",
        FIT,
    )
    step_python_s: float = _f(
        0.0015,
        "interpreter time an engine step needs before its forward can start (scheduling "
        "and launches, part of the step overheads): it waits while a background thread of "
        "the same process holds the interpreter lock",
        ASSUMED,
    )
    step_token_s: float = _f(
        0.0,
        "host time per token a step computes -- each prefill token, one per decoding "
        "sequence -- added to the step beside the roofline: on a CPU engine serving a tiny "
        "model the step is Python and small kernels, a fixed overhead plus a cost per "
        "token (0: none, the roofline covers a GPU's tokens)",
        "0 on GPUs; measured on CPU by pushkv.fit.measure (profiles/cpu-tiny.toml)",
    )
    ingest_s: float = _f(
        0.0,
        "API-server time of one leg beyond the router hop: what a request spends between "
        "reaching this instance and its engine's scheduler being able to see it (HTTP "
        "parsing, input processing, the hand-off to the engine core) that the plain "
        "server's request overhead (router_hop_s) does not show. One API server per "
        "instance handles legs one at a time: legs arriving together queue for it",
        CONNECTOR + ": median('legs out -> prefill sees' / 'decode sees') minus "
        "network.router_hop_s",
    )
    return_s: float = _f(
        0.0,
        "what an output of this instance takes beyond the router hop to reach the client: "
        "the engine core's output processing, the hand-off to the API server, "
        "detokenising and streaming (decode: every token; prefill: the prefill leg's "
        "answer a sequential router waits for)",
        CONNECTOR + ": decode: median('decode step -> first token') minus one decode step "
        "minus network.router_hop_s; prefill: from a pull pair's timeline, "
        "median('prefill finished -> decode sees') minus two router hops and "
        "decode.ingest_s (pushkv.fit.measure_connector.pull_keys)",
    )
    order_handoff_s: float = _f(
        0.0,
        "a step's orders reaching the worker: a push registration the scheduler ships in "
        "a step's connector metadata is handed to the transport this much later, and a "
        "pull's read is posted this much later, by the worker instead of inline in the "
        "scheduler's step (the worker takes the orders when it runs the step; vLLM's "
        "NixlConnector reads in the worker's start_load_kv)",
        CONNECTOR + ": median('registration shipped -> handed')",
    )
    orders_at_forward: bool = _f(
        False,
        "decode: the orders a step ships (a push registration, a pull's read) reach the "
        "transport when the worker runs that step's forward -- after the step's "
        "interpreter part (step_python_s), on the engine's core as busy as it is -- not "
        "order_handoff_s later; an order shipped while the loop computes nothing is "
        "still handed order_handoff_s later (a lone request's hand-off, which the key "
        "measured)",
        "vLLM 0.32 on CPU runs a step's schedule and then its execute (async scheduling "
        "off, vllm/platforms/cpu.py); the worker takes the connector's metadata in "
        "start_load_kv, inside the forward's context (pushkv: WorkerSide.apply; vLLM's "
        "NixlConnector reads there too); measured: 'registration shipped -> handed' 1.2 "
        "ms alone, 7.7 at 24 QPS push on the 2-vCPU VM, as long as a decode step there "
        "(docs/validation/2026-12-06-sim-saturation.md); false by default, so that "
        "earlier profiles' outputs stand; benchmarks/bench_sim_vs_real.py sets it",
    )
    event_handoff_s: float = _f(
        0.0,
        "a transfer's readiness reaching the worker: between the consumer endpoint's "
        "TransferReady (the notification arrived on the transport's thread) and the "
        "worker taking it (at its next step)",
        CONNECTOR + ": median('notification -> ready')",
    )
    admit_lag_s: float = _f(
        0.0,
        "between the worker having a transfer's readiness and the scheduler being able to "
        "admit the request: the worker reports it with a step's output, the scheduler "
        "admits it in the schedule after",
        CONNECTOR + ": median('ready -> scheduler knows') + median('scheduler knows -> "
        "decode step')",
    )
    prefix_hit_fraction: float = _f(
        0.0,
        "fraction of each prompt found in this engine's prefix cache",
        FIT + " on prefill, the assumption " + CAL_CHECK + " asks for; 0 on decode "
        "(--no-enable-prefix-caching, " + CAL_POST + ")",
    )
    inline_post: str = _f(
        "after-forward",
        "where the decode loop posts an inline (pull) read within its step: "
        "'after-forward' -- the step's forward is launched first and runs on the GPU "
        "while the CPU posts, so the step lasts max(forward, posting) (vLLM >= 0.29); "
        "'before-forward' -- posting, then the forward (earlier vLLM)",
        VLLM_KV_LOAD + "; assumed to hold for the post's vLLM 0.29",
    )
    heartbeat_queued: bool = _f(
        True,
        "decode renews the prefill lease of a request from the moment it is queued, not "
        "only once its transfer started: vLLM's scheduler tracks every request with remote "
        "KV from on_new_request and heartbeats them all every lease/6 (false: only "
        "transfers the consumer endpoint knows are renewed)",
        VLLM_LEASE,
    )
    fragmentation: float = _f(
        0.05,
        "the free queue at the start of a run: probability that a block is not "
        "physically next to the previous one (a warmed-up allocator; 0: a fresh server)",
        FIT + "; " + CAL_DESC,
    )
    preemption: str = _f(
        "recompute",
        "decode memory pressure: 'recompute' -- blocks are taken one at a time as tokens "
        "are generated; when none is free the newest running request is preempted, its "
        "blocks freed, and it computes its prompt and tokens again (vLLM's default); "
        "'reissue' -- first preempt the newest request whose push transfer is still in "
        "flight (the core's preempt: fence, release, then a reissue registers a new "
        "attempt), recompute only when there is none; 'off' -- every output block is "
        "reserved when a request starts running (no preemption)",
        "vLLM 0.32 v1/core/sched/scheduler.py (preempt the last running request, "
        "recompute); pushkv.protocol Consumer.preempt / reissue",
    )
    allocator: str = _f(
        "static",
        "what freed blocks do to the free queue: 'static' -- appended in order, so the "
        "starting shuffle (fragmentation) stays what it is; 'history' -- as vLLM frees "
        "them (a request's blocks in reverse order; prefix-cached blocks to the tail, "
        "uncached ones to the head, reused first), so descriptor counts follow from the "
        "run's allocations",
        "vLLM 0.32 v1/core/single_type_kv_cache_manager.py free(), block_pool.py "
        "free_blocks() (LIFO reuse of non-cached blocks)",
    )

    @property
    def free_order(self) -> str:
        """Where the pool puts freed blocks (see :class:`~pushkv.sim.blocks.BlockPool`)."""
        if self.allocator == "static":
            return "tail"
        return "vllm-cached" if self.prefix_hit_fraction > 0 else "vllm-uncached"

    def num_blocks(self, model: ModelProfile, gpu: GPUProfile) -> int:
        """KV blocks per rank: what is left of HBM after weights and activations."""
        free = (
            gpu.memory_bytes * self.gpu_memory_utilization
            - model.weight_bytes_per_gpu(self.tp)
            - self.activation_reserve_bytes
        )
        per_block = model.kv_bytes_per_token(self.tp) * self.block_size
        return max(1, int(free // per_block))

    def allreduces_per_step(self, model: ModelProfile) -> int:
        """All-reduces of one forward: 2 per layer under tensor parallelism, 0 at TP1."""
        return ALLREDUCES_PER_LAYER * model.num_layers if self.tp > 1 else 0

    def derived_step_overheads(self, model: ModelProfile) -> dict[str, float]:
        """The step overheads this engine's TP and ``model``'s shape imply: a decode step
        STEP_FIXED_S + all-reduces x allreduce_s, a prefill step that plus
        layers x PREFILL_LAYER_S (eager launches); the built-in Qwen3-32B TP8 profile's
        20 ms and 3.8 ms exactly (to the nanosecond)."""
        reduce = self.allreduces_per_step(model) * self.allreduce_s
        return {
            "prefill_step_overhead_s": round(
                STEP_FIXED_S + model.num_layers * PREFILL_LAYER_S + reduce, 9),
            "decode_step_overhead_s": round(STEP_FIXED_S + reduce, 9),
        }


@dataclass(frozen=True, kw_only=True)
class NetworkProfile:
    """The fabric between a prefill node and a decode node, and the cost of posting."""

    name: str = _f("EFA p5en", "fabric name", CAL_HW)
    gpus_per_node: int = _f(8, "GPUs sharing the node's NICs", CAL_HW)
    descriptor_rate: float = _f(
        97e9 / (64 << 10),
        "descriptors per second a node's NICs complete (small descriptors are bound by it)",
        CAL_HW + ": Mooncake WRITE at 64 KB, 97 GB/s / 64 KiB",
    )
    write_bandwidth: float = _f(
        365.7e9, "node WRITE bytes/s for large descriptors", CAL_HW + ": Mooncake peak WRITE"
    )
    read_bandwidth: float = _f(
        303.8e9, "node READ bytes/s for large descriptors", CAL_HW + ": Mooncake peak READ"
    )
    wire_latency_s: float = _f(20e-6, "one-way RDMA latency added to every transfer", ASSUMED)
    control_latency_s: float = _f(
        50e-6, "one-way latency of a control message or notification", ASSUMED
    )
    router_hop_s: float = _f(
        0.5e-3, "one HTTP hop through the proxy (request or response)", ASSUMED
    )
    post_fixed_s: float = _f(
        174e-6,
        "fixed cost of preparing and posting one transfer",
        CAL_DESC + ": fit of 118 desc = 460 us and 18,880 desc = 46 ms",
    )
    post_per_descriptor_s: float = _f(
        POST_PER_DESCRIPTOR_S,
        "cost per descriptor of preparing and posting, paid by the posting thread",
        FIT + ", inside " + CAL_DESC + " 2.4-3.9 us per descriptor",
    )
    post_gil_fraction: float = _f(
        0.003,
        "fraction of a background thread's posting during which it holds the Python "
        "interpreter lock, so that the engine loop of its process cannot start a step "
        "(0: posting never blocks the loop; 1: the whole post does)",
        "measured on NIXL 1.5.1 (pip show nixl), UCX, host memory, two processes, "
        "16,384 x 4 KiB WRITEs: 0.24-0.29% of a post over three runs "
        "(`python -m pushkv.transports.calibrate`; docs/validation/"
        "2026-12-06-posting-gil.md): transfer() (postXferReq) releases the lock, "
        "initialize_xfer (makeXferReq) and the descriptor lists hold it for ~10% of "
        "their 2-3 ms",
    )
    wire_model: str = _f(
        "measured-points",
        "how long the wire takes for descriptors of a given size: 'measured-points' -- "
        "node throughput interpolated (in log size) between measured points, "
        "descriptor-rate bound below the smallest; 'two-limits' -- the slower of "
        "descriptor_rate and the byte bandwidth",
        MOONCAKE,
    )
    point_sizes_bytes: tuple[float, ...] = _f(
        (64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20),
        "descriptor sizes of the measured points (ascending)", MOONCAKE,
    )
    point_write_bandwidth: tuple[float, ...] = _f(
        (97e9, 191e9, 325e9, 358e9, 353e9, 367e9),
        "node WRITE bytes/s at those sizes (READ: the same, capped at read_bandwidth)",
        MOONCAKE,
    )
    rank_skew: float = _f(
        0.0,
        "TP rank skew: each rank's transfer (its posting and its wire time) takes "
        "(1 + X) times the representative rank's, X drawn per rank and transfer from "
        "rank_skew_dist with this mean; READY waits for the slowest rank, and an inline "
        "posting step for the slowest poster (the next forward's all-reduces line the "
        "ranks up)",
        "NIXL issue 1514 (one rank's post time measured; a TP8 step waits for "
        "its slowest rank); no public distribution: 0 by default",
    )
    rank_skew_dist: str = _f(
        "exponential",
        "distribution of X: 'exponential' (the slowest of n ranks is H_n times the mean "
        "late) or 'fixed' (rank r is 2 * rank_skew * r / (n - 1) late: the slowest "
        "exactly 2x the mean)",
        ASSUMED,
    )
    client_hop_s: float = _f(
        0.0,
        "the client's way to and from a router beyond the router's own marks: the "
        "request's way from the client to the router, the router's time before its legs "
        "leave, and each output's way from the router on to the client (0: the client "
        "dispatches the legs itself, as the connector keys' timeline did; only the sum "
        "is measured, so all of it is added to each token's way back)",
        "measured per real run through a router: median over the requests that ran "
        "alone of the client's end-to-end latency (its result file) minus the router's "
        "'legs out -> answer sent' (pushkv.fit.measure_connector.client_hop; "
        "benchmarks/bench_sim_vs_real.py --client-hop)",
    )
    client_first_s: float = _f(
        0.0,
        "what the first output's way from the router to the client takes beyond a later "
        "output's (the response's start and the client's first chunk): added to the "
        "first token's arrival at the client alone, so a lone request's TTFT is the "
        "client's and its end-to-end latency is unchanged (client_hop_s holds the way "
        "every output takes); later tokens never reach the client before it",
        "measured per real run through a router, on requests sent one at a time: the "
        "router's mean 'first token -> answer sent' less the client's mean 'first token "
        "-> last token' (its result file's mean end-to-end latency less its mean TTFT) "
        "(pushkv.fit.measure_connector.client_first; bench_sim_vs_real.gauge_keys; "
        "docs/sim.md, 'The client's first token')",
    )
    notify_wait_s: float = _f(
        0.0,
        "what a write and its notification take on the connector servers beyond the "
        "modelled posting, wire and control latency: the transports' progress threads "
        "polling on busy cores; added after the wire, before the producer learns of the "
        "completion and the notification leaves",
        CONNECTOR + ": median('write posted -> notification') minus wire_latency_s, "
        "control_latency_s and post_fixed_s",
    )
    sharing: str = _f(
        "fair",
        "concurrent transfers on a node's NICs: 'fair' -- they share them equally "
        "(processor sharing, each flow at the share of its busiest link); 'fifo' -- one "
        "transfer at a time, first come first served",
        "not yet sourced: concurrent flows on one rail share it",
    )


VLLM_STEPS = ("vLLM 0.32 v1/core/sched/scheduler.py: connector metadata built once per step, "
              "finished transfers reported by get_finished at the step's end")


@dataclass(frozen=True, kw_only=True)
class ControlProfile:
    """The control plane: what a message and a first contact cost."""

    message_send_s: float = _f(
        30e-6,
        "sender's time per control message (msgspec encode, ZMQ send, Python): held on "
        "the interpreter lock of the sending engine's process",
        ASSUMED + "; " + VLLM_STEPS + " (side-channel messages cost sender and receiver "
        "time)",
    )
    message_recv_s: float = _f(
        30e-6,
        "receiver's time per control message or write notification (ZMQ or NIXL notif "
        "receive, decode, the endpoint's Python): held on the receiving process's lock",
        ASSUMED,
    )
    handshake_s: float = _f(
        2.0,
        "NIXL handshake between a new prefill/decode pair (metadata exchange, memory "
        "registration of the peer): a transfer to a producer this decode engine has not "
        "met waits for it (the core's Connect action)",
        CAL_DESC + ": 'NIXL handshake between a new P/D pair: seconds (first contact only)'",
    )
    handshake_before_run: bool = _f(
        True,
        "every pair has met before the first measured request (vllm bench serve sends "
        "one test prompt first); false: the run's first transfer to each producer pays "
        "handshake_s",
        "vLLM vllm/benchmarks/serve.py ('Starting initial single prompt test run')",
    )
