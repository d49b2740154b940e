"""Build one simulated deployment, run a workload through it, collect the results.

``run(cfg)`` is a pure function of ``cfg``: every random stream (arrivals,
each engine's free-block order, faults) is derived from
``(cfg.workload.seed, cfg.iteration)`` and passed in explicitly, and SimPy
breaks ties in simulated time in scheduling order, so the same config gives
the same result JSON byte for byte.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import simpy

from ..protocol import uniform_ranks
from .blocks import BlockPool
from .engine import DecodeEngine, PrefillEngine, Recorder
from .host import host_model
from .host.model import token_return_s
from .marks import Timeline
from .metrics import client_times, vllm_result
from .network import Network
from .profile import EngineProfile, Profile
from .request import Outcome, SimRequest
from .router import Router
from .scenario import SimConfig, TransferMode
from .trace import BLOCK_TOKENS, PrefixCache
from .transport import SimTransport
from .workload import generate


class SimulationError(RuntimeError):
    """The simulated system stopped before every request ended (a model bug)."""


@dataclass(slots=True)
class RunResult:
    """Everything one run produced."""

    config: SimConfig
    result: dict[str, Any]  #: the vLLM-style result JSON
    requests: list[SimRequest]
    leaks: dict[str, int]  #: per engine: blocks still held, lent or allocated
    transport_stats: dict[str, int]
    rejected: int
    wall_s: float = 0.0
    prefills: list[PrefillEngine] = field(default_factory=list)
    decodes: list[DecodeEngine] = field(default_factory=list)
    transport: SimTransport | None = None

    @property
    def leaked_blocks(self) -> int:
        return sum(self.leaks.values())

    def write(self, directory: str | Path) -> Path:
        """Write the result JSON as ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json``."""
        path = Path(directory) / self.config.file_name()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.result))
        return path


def _ranks(engine_id: str, profile: Profile, side: EngineProfile) -> Any:
    m = profile.model
    return uniform_ranks(
        engine_id, tp=side.tp, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim, dtype_bytes=m.dtype_bytes,
        num_blocks=side.num_blocks(m, profile.gpu), block_size=side.block_size,
    )[0]  # rank 0 stands for the whole TP group


def prefix_cache_blocks(profile: Profile) -> int:
    """Hashed blocks a prefill instance's prefix cache holds: its KV memory (the
    profile's blocks per rank, all ranks alike) in trace blocks of BLOCK_TOKENS."""
    side = profile.prefill
    return max(1, side.num_blocks(profile.model, profile.gpu) * side.block_size // BLOCK_TOKENS)


def arrival_rng(cfg: SimConfig, seed: np.random.SeedSequence) -> Any:
    """The generator of the run's arrival gaps: the run's own stream, or with
    ``workload.arrivals = "vllm"`` the one ``vllm bench serve --seed S`` draws them from
    (``np.random.seed(S)``, then ``np.random.gamma`` per request; S = seed + iteration,
    as ``benchmarks/bench_sim_vs_real.py`` seeds each iteration)."""
    if cfg.workload.arrivals == "vllm":
        return np.random.RandomState(cfg.workload.seed + cfg.iteration)
    return np.random.default_rng(seed)


def run(cfg: SimConfig, *, keep_objects: bool = False,
        timeline: Timeline | None = None,
        progress: Callable[[float, int, int], None] | None = None,
        progress_every_s: float = 60.0) -> RunResult:
    """Simulate ``cfg`` and return its results; with ``timeline``, record every
    request's marks into it (:mod:`pushkv.sim.marks`; the results do not change).
    ``progress(now_s, ended, total)`` is called every ``progress_every_s`` simulated
    seconds until every request ended (it reads, schedules nothing: the results do
    not change either)."""
    wall0 = time.perf_counter()
    seeds = np.random.SeedSequence([cfg.workload.seed, cfg.iteration])
    streams = seeds.spawn(4 + cfg.num_prefill + cfg.num_decode)
    arrival_seed, fault_seed, *pool_seeds, skew_seed, incarnation_seed = streams
    env = simpy.Environment()
    specs = (list(cfg.trace.requests) if cfg.trace is not None
             else generate(cfg.workload, arrival_rng(cfg, arrival_seed)))
    recorder = Recorder(env, len(specs))
    arrived = [0]
    # the host the processes run on (profile.host.model); its streams, if it draws, are
    # spawned after the run's own, so a profile without them draws nothing
    host = host_model(cfg.profile, env, seeds, in_flight=lambda: arrived[0] - len(recorder.ended))
    if host.profile is not cfg.profile:  # e.g. host times stretched by a share of a core
        cfg = dataclasses.replace(cfg, profile=host.profile)
    profile = cfg.profile
    network = Network(env, profile.network)
    transport = SimTransport(
        env, profile, network, cfg.protocol, cfg.faults,
        random.Random(int(fault_seed.generate_state(1)[0])), host,
        skew_rng=np.random.default_rng(skew_seed), packing=cfg.packing,
    )
    transport.timeline = timeline
    router_ref: list[Router] = []

    def on_done(req: SimRequest, block_ids: tuple[int, ...] | None) -> None:
        router_ref[0].prefill_done(req, block_ids)

    prefills: list[PrefillEngine] = []
    decodes: list[DecodeEngine] = []
    m, gpu = profile.model, profile.gpu
    for i in range(cfg.num_prefill):
        eid = f"prefill-{i}"
        pool = BlockPool(profile.prefill.num_blocks(m, gpu), profile.prefill.fragmentation,
                         np.random.default_rng(pool_seeds[i]), profile.prefill.free_order)
        eng = PrefillEngine(env, eid, profile, pool, transport, cfg.resolved_mode, on_done, host)
        eng.granularity = cfg.mode.granularity
        if cfg.trace is not None:  # the prompts' block hashes in a cache of this size
            eng.prefix_cache = PrefixCache(prefix_cache_blocks(profile))
        transport.add_producer(_ranks(eid, profile, profile.prefill), eng)
        prefills.append(eng)
    for j in range(cfg.num_decode):
        eid = f"decode-{j}"
        pool = BlockPool(profile.decode.num_blocks(m, gpu), profile.decode.fragmentation,
                         np.random.default_rng(pool_seeds[cfg.num_prefill + j]),
                         profile.decode.free_order)
        deng = DecodeEngine(env, eid, profile, pool, transport, cfg.resolved_mode, recorder,
                            host)
        transport.add_consumer(_ranks(eid, profile, profile.decode), deng)
        decodes.append(deng)
    transport.handshake()
    # a token's way: the hop, the client's, the wake-ups, decode's API server
    return_s = token_return_s(profile, host.return_wake_s)
    router = Router(env, cfg, transport, prefills, decodes, recorder, host,
                    random.Random(int(incarnation_seed.generate_state(1)[0])))
    router_ref.append(router)

    reqs = [SimRequest(spec=s, transfer_id=f"req-{s.index}") for s in specs]

    def reach(req: SimRequest) -> None:
        arrived[0] += 1
        router.arrive(req)

    def arrive_at(req: SimRequest) -> None:
        env.timeout(req.arrival).callbacks.append(lambda _: reach(req))

    if cfg.workload.max_concurrency is None:
        for r in reqs:
            arrive_at(r)
    else:
        _closed_loop(env, reqs, cfg.workload.max_concurrency, recorder, return_s, reach)
    if progress is not None:
        def report() -> Any:
            while not recorder.done.triggered:
                yield env.timeout(progress_every_s)
                progress(env.now, len(recorder.ended), len(reqs))
        env.process(report())
    _schedule_faults(env, cfg, transport, prefills, decodes, router)

    try:
        env.run(until=recorder.done)
        host.drain(env)  # what the host still does: the last tokens on their way out
    except RuntimeError as exc:
        pending = [r.transfer_id for r in reqs if r.outcome is Outcome.PENDING]
        raise SimulationError(
            f"simulation stalled at t={env.now:.3f}s with {len(pending)} requests pending "
            f"(first: {pending[:5]})"
        ) from exc
    end = env.now
    _drain(env, cfg, transport, prefills, decodes)
    leaks = _leaks(transport, prefills, decodes)

    extra = _extra(cfg, transport, prefills, decodes, router, reqs, leaks)
    if cfg.trace is not None:
        extra.update(_trace_extra(cfg, prefills, reqs))
    result = vllm_result(
        reqs, duration=end + profile.network.router_hop_s, model_id=profile.model.name,
        request_rate=cfg.workload.request_rate, burstiness=cfg.workload.burstiness,
        max_concurrency=cfg.workload.max_concurrency,
        label=cfg.label(), extra=extra, return_s=return_s,
        first_s=profile.network.client_first_s,
    )
    if timeline is not None:  # the client's marks: tokens as the result file counts them
        for r in reqs:
            times = client_times(r, return_s, profile.network.client_first_s)
            if r.outcome is Outcome.OK and times:
                timeline.mark(r.transfer_id, "first_token", times[0])
                timeline.mark(r.transfer_id, "last_token", times[-1])
    out = RunResult(
        config=cfg, result=result, requests=reqs, leaks=leaks,
        transport_stats=dict(transport.stats), rejected=len(transport.rejected),
    )
    if keep_objects:
        out.prefills, out.decodes, out.transport = prefills, decodes, transport
    out.wall_s = time.perf_counter() - wall0
    return out


def _closed_loop(env: simpy.Environment, reqs: list[SimRequest], limit: int,
                 recorder: Recorder, return_s: float,
                 send: Callable[[SimRequest], None]) -> None:
    """``vllm bench serve --max-concurrency``: each request is due at its arrival time
    but waits for one of ``limit`` slots; a slot frees when a request's last token (or
    its error) reaches the client, ``return_s`` after it ended. A request is sent when
    it has a slot, and its times count from then (the client starts its clock there)."""
    due: list[SimRequest] = []
    free = [limit]

    def go() -> None:
        while due and free[0] > 0:
            free[0] -= 1
            req = due.pop(0)
            req.spec = dataclasses.replace(req.spec, arrival=env.now)
            send(req)

    def arrived(req: SimRequest) -> None:
        due.append(req)
        go()

    def ended(_: SimRequest) -> None:
        def freed(_: Any) -> None:
            free[0] += 1
            go()
        env.timeout(return_s).callbacks.append(freed)

    def due_at(req: SimRequest) -> None:
        env.timeout(req.arrival).callbacks.append(lambda _: arrived(req))

    recorder.listeners.append(ended)
    for r in reqs:
        due_at(r)


def _schedule_faults(
    env: simpy.Environment, cfg: SimConfig, transport: SimTransport,
    prefills: list[PrefillEngine], decodes: list[DecodeEngine], router: Router,
) -> None:
    f = cfg.faults
    if f.kill_prefill_at is not None:
        def kill_p(_: Any) -> None:
            prefills[0].kill()
            transport.kill(prefills[0].engine_id)
        env.timeout(f.kill_prefill_at).callbacks.append(kill_p)
    if f.kill_decode_at is not None:
        def kill_d(_: Any) -> None:
            failover = cfg.faults.decode_failover != "fail"
            decodes[0].kill(router.hand_over if failover else None)
            transport.kill(decodes[0].engine_id)
        env.timeout(f.kill_decode_at).callbacks.append(kill_d)


def _leaks(
    transport: SimTransport, prefills: list[PrefillEngine], decodes: list[DecodeEngine]
) -> dict[str, int]:
    """Blocks still held by live endpoints or allocated in live engines' pools."""
    out = transport.leaks()
    for e in prefills:
        if e.alive:
            out[e.engine_id] += e.pool.num_used
    for d in decodes:
        if d.alive:
            out[d.engine_id] += d.pool.num_used
    return out


def _drain(
    env: simpy.Environment, cfg: SimConfig, transport: SimTransport,
    prefills: list[PrefillEngine], decodes: list[DecodeEngine],
) -> None:
    """Let in-flight messages land and the protocol's timers release what is left."""
    p = cfg.protocol
    cap = env.now + p.lease_s + p.window_s + p.fence_grace_s + cfg.faults.detect_s + 1.0
    while env.peek() <= cap and (
        transport.inflight or sum(_leaks(transport, prefills, decodes).values())
    ):
        env.step()


def _trace_extra(cfg: SimConfig, prefills: list[PrefillEngine],
                 reqs: list[SimRequest]) -> dict[str, Any]:
    """What a trace run adds to the extra key: the trace, and its prefix reuse."""
    assert cfg.trace is not None
    prompt = sum(r.input_len for r in reqs)
    cached = sum(p.cached_tokens for p in prefills)
    return {
        "trace": cfg.trace.name,
        "trace_speed": cfg.trace.speed,
        "trace_window_s": list(cfg.trace.window) if cfg.trace.window else None,
        "input_len": None,
        "output_len": None,
        "prefix_hit_fraction": None,
        "prefix_hit_rate": cached / prompt if prompt else 0.0,
        "prefix_cache_blocks": prefix_cache_blocks(cfg.profile),
        "prefix_hit_blocks": sum(p.prefix_cache.hit_blocks for p in prefills
                                 if p.prefix_cache is not None),
    }


def _extra(
    cfg: SimConfig, transport: SimTransport, prefills: list[PrefillEngine],
    decodes: list[DecodeEngine], router: Router, reqs: list[SimRequest], leaks: dict[str, int],
) -> dict[str, Any]:
    profile = cfg.profile
    desc = transport.descriptors
    ok = [r for r in reqs if r.outcome is Outcome.OK]
    waits = [r.kv_ready_at - r.arrival for r in ok if r.kv_ready_at is not None]
    return {
        "mode": cfg.mode.value,
        "dispatch": cfg.effective_dispatch.value,
        "direction": "push" if cfg.resolved_mode is TransferMode.PUSH else "pull",
        "num_prefill": cfg.num_prefill,
        "num_decode": cfg.num_decode,
        "profile": profile.name,
        "input_len": cfg.workload.input_len,
        "output_len": cfg.workload.output_len,
        "seed": cfg.workload.seed,
        "iteration": cfg.iteration,
        "prefix_hit_fraction": profile.prefill.prefix_hit_fraction,
        "fragmentation": profile.decode.fragmentation,
        "post_per_descriptor_s": profile.network.post_per_descriptor_s,
        "policy": cfg.protocol.policy.value,
        "recomputed": sum(1 for r in reqs if r.recomputed),
        "preempted": sum(d.preempted for d in decodes),
        "recomputed_ok": sum(1 for r in ok if r.recomputed),
        "transfer_failures": sum(d.failed_transfers for d in decodes),
        "rerouted": router.rerouted,
        **({"decode_failover": cfg.faults.decode_failover, "failovers": router.failovers,
            "prompt_tokens_recomputed": router.prompt_tokens_recomputed + sum(
                r.input_len for r in reqs if r.failovers and r.recomputed)}
           if cfg.faults.decode_failover != "fail" else {}),
        "leaked_blocks": sum(leaks.values()),
        "rejected_messages": len(transport.rejected),
        "lost_registrations": transport.stats["lost_Register"],
        "lost_notifications": transport.stats["lost_Notify"],
        "transfers": len(desc),
        "descriptors_mean": float(np.mean(desc)) if desc else 0.0,
        "descriptors_max": int(max(desc)) if desc else 0,
        "bytes_moved": transport.net.bytes_moved,
        "packed_writes": transport.staging.packed_writes,
        "prefill_post_ms": transport.post_s_by_thread.get("prefill-bg", 0.0) * 1000,
        "post_ms_by_thread": {k: v * 1000 for k, v in sorted(transport.post_s_by_thread.items())},
        "decode_stall_ms_total": sum(d.stall_s for d in decodes) * 1000,
        "decode_stalled_steps": sum(d.stalled_steps for d in decodes),
        "decode_steps": sum(d.steps for d in decodes),
        "decode_busy_s": sum(d.busy_s for d in decodes),
        "prefill_busy_s": sum(p.busy_s for p in prefills),
        "prefill_cached_tokens": sum(p.cached_tokens for p in prefills),
        "prefill_computed_tokens": sum(p.computed_tokens for p in prefills),
        "network_busy_s": transport.net.busy_s,
        "host_busy_s": transport.host.busy_s,
        "host_busy_s_by_process": dict(sorted(transport.host.busy_by_process.items())),
        "gil_wait_ms_by_engine": {k: v * 1000 for k, v in sorted(transport.gil_wait_s.items())
                                  if v > 0},
        "rank_skew_mean": float(np.mean(transport.skews)) if transport.skews else 0.0,
        "mean_kv_ready_ms": float(np.mean(waits)) * 1000 if waits else 0.0,
        **_progressive_extra(cfg, transport),
    }


def _progressive_extra(cfg: SimConfig, transport: SimTransport) -> dict[str, Any]:
    """Progressive push's own keys (none for the other modes, whose files stay as
    they were): the granularity, ranges reported and writes issued."""
    if cfg.mode.granularity == "request":
        return {}
    return {"granularity": cfg.mode.granularity,
            "ranges_reported": transport.stats["ranges_reported"],
            "writes": len(transport.descriptors)}
