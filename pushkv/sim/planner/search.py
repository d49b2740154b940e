"""The planner's search: configurations within a budget, the goodput of each.

A configuration (:class:`Candidate`) is a transfer mode, ``x`` prefill and ``y``
decode instances and one TP size for both sides (the simulator drives one
representative rank per side, which needs equal TP). The search:

1. **enumerates** every ``xPyD`` with ``(x + y) * tp`` within the GPU budget, for
   each TP asked for, and each mode;
2. **prunes** those that cannot meet the SLO at any rate: their closed-form
   TTFT or TPOT floor (:mod:`.bounds`) is already above it, so every request
   misses it whatever the load -- no simulation;
3. **bisects** the rate of the others on a geometric ladder from the
   configuration's capacity bound down by ``rate_range``, in steps of
   ``1 + rate_tol``: one simulation at the bottom rung (failing: the
   configuration misses the SLO even lightly loaded), one at the top (passing:
   goodput is the capacity), then halving the bracket. Under a monotone
   attainment (more load, no more requests within the SLO) it returns exactly
   the highest rung the full ladder would, in at most ``2 + ceil(log2(rungs))``
   simulations instead of ``rungs``.

The simulator is seeded by ``(seed, iteration)``, and the arrivals of one seed at
two rates are the same gaps scaled, so attainment is close to monotone in the
rate; the search is deterministic: the same spec gives the same plan, on any
backend (:mod:`.backends`: local processes or Ray) and any number of workers.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from ...protocol.errors import ConfigError
from ..packing import SIM_PACKING
from ..profile import DEFAULT, Profile, ProfileError
from ..scenario import SimConfig
from ..sweep import MODE_LABELS, parse_mode
from ..trace import Trace, trace_workload
from ..workload import WorkloadConfig
from .bounds import Capacity, capacity, tpot_floor, ttft_floor
from .measure import SLO, Sample, Verdict, judge, simulate

#: The packed-write settings a plan may search (``pushkv sim --pack``).
PACKS = ("never", "auto", "always")
#: a floor must exceed the SLO by this much to prune (result files round times to 0.1 us)
PRUNE_MARGIN_S = 1e-6


class PlanError(ConfigError):
    """A plan cannot be made as asked (bad SLO, budget, TP or mode)."""


@dataclass(frozen=True, slots=True, order=True)
class Candidate:
    """One deployment: a transfer mode, ``num_prefill`` P and ``num_decode`` D
    instances of ``tp`` GPUs each."""

    mode: str
    num_prefill: int
    num_decode: int
    tp: int
    #: packed writes (``pushkv sim --pack``): "never", "auto" (per write, by the
    #: transports' cost model) or "always"; pushes only
    pack: str = "never"

    @property
    def gpus(self) -> int:
        return (self.num_prefill + self.num_decode) * self.tp

    @property
    def label(self) -> str:
        packed = "" if self.pack == "never" else f" packed-{self.pack}"
        return f"{self.mode}{packed} {self.num_prefill}P{self.num_decode}D TP{self.tp}"


@dataclass(frozen=True, kw_only=True)
class PlanSpec:
    """What to plan: the profile, the workload (its rate is searched), the SLO, the
    GPU budget and the search space."""

    profile: Profile = field(default=DEFAULT, metadata={"help": "hardware and model"})
    workload: WorkloadConfig = field(
        default_factory=lambda: WorkloadConfig(input_len=4096, output_len=128, num_prompts=200),
        metadata={"help": "lengths, burstiness, prompts per simulation, seed (rate ignored)"})
    slo: SLO = field(default_factory=lambda: SLO(ttft_s=1.0, tpot_s=0.05))
    gpus: int = field(default=16, metadata={"help": "GPU budget"})
    modes: tuple[str, ...] = field(default=("pull", "push"), metadata={"help": "mode labels"})
    packs: tuple[str, ...] = field(default=("never",), metadata={
        "help": "packed-write settings searched for push modes (never, auto, always)"})
    tps: tuple[int, ...] | None = field(
        default=None, metadata={"help": "TP sizes; None: the two largest the node allows"})
    seeds: int = field(default=1, metadata={"help": "iterations (seeds) per simulated rate"})
    rate_tol: float = field(default=0.1, metadata={"help": "ladder step: rungs 1+tol apart"})
    rate_range: float = field(default=32.0, metadata={
        "help": "the ladder spans capacity / rate_range .. capacity"})
    trace: Trace | None = field(default=None, metadata={
        "help": "requests replayed from a trace instead of the workload's (its lengths, "
                "prefix hashes and arrival pattern); the rate searched scales its arrivals"})

    def __post_init__(self) -> None:
        s = self.slo
        for name, v in (("TTFT SLO", s.ttft_s), ("TPOT SLO", s.tpot_s)):
            if not (v > 0 and math.isfinite(v)):
                raise PlanError(f"the {name} must be a positive number of seconds, got {v}")
        if not 0 < s.percentile < 100:
            raise PlanError(f"the percentile must be in (0, 100), got {s.percentile}")
        if not 0 < s.attainment <= 1:
            raise PlanError(f"the attainment target must be in (0, 1], got {s.attainment}")
        if self.gpus < 1:
            raise PlanError(f"the budget must be at least one GPU, got {self.gpus}")
        if not self.modes:
            raise PlanError("at least one mode is needed")
        for m in self.modes:
            if m not in MODE_LABELS:
                raise PlanError(f"unknown mode {m!r} (choose from {', '.join(MODE_LABELS)})")
        if not self.packs or any(p not in PACKS for p in self.packs):
            raise PlanError(f"packs must name some of {', '.join(PACKS)}, got "
                            f"{list(self.packs)}")
        if self.seeds < 1:
            raise PlanError(f"seeds must be >= 1, got {self.seeds}")
        if not (self.rate_tol > 0 and math.isfinite(self.rate_tol)):
            raise PlanError(f"the rate tolerance must be > 0, got {self.rate_tol}")
        if not (self.rate_range > 1 and math.isfinite(self.rate_range)):
            raise PlanError(f"the rate range must be > 1, got {self.rate_range}")
        if self.trace is not None and not (
                0 < self.trace.mean_rate < math.inf and len(self.trace.requests) > 1):
            raise PlanError(f"trace {self.trace.name!r} has no rate to scale: it needs two "
                            "requests or more, not all arriving at once")


# ------------------------------------------------------------------ space


def profile_at(profile: Profile, tp: int) -> Profile:
    """``profile`` with TP ``tp`` on both sides, validated (:class:`ProfileError` when
    the model does not split ``tp`` ways or leaves no room for KV). Step overheads
    that follow from the model's shape and TP (the profile's equal their derivation)
    are derived again for ``tp``; overheads a profile set otherwise are kept."""
    def at(engine: Any, keys: tuple[str, ...]) -> Any:
        derived = engine.derived_step_overheads(profile.model)
        follows = all(abs(getattr(engine, k) - derived[k]) < 1e-12 for k in keys)
        engine = dataclasses.replace(engine, tp=tp)
        if follows:
            again = engine.derived_step_overheads(profile.model)
            engine = dataclasses.replace(engine, **{k: again[k] for k in keys})
        return engine
    p = dataclasses.replace(
        profile, prefill=at(profile.prefill, ("prefill_step_overhead_s",)),
        decode=at(profile.decode, ("prefill_step_overhead_s", "decode_step_overhead_s")))
    return p.validate()


def allowed_tps(profile: Profile) -> list[int]:
    """TP sizes within one node for which the profile is valid (ascending)."""
    out = []
    for tp in range(1, profile.network.gpus_per_node + 1):
        try:
            profile_at(profile, tp)
        except ProfileError:
            continue
        out.append(tp)
    return out


def resolve_tps(spec: PlanSpec) -> tuple[int, ...]:
    """The TP sizes to search: those asked for (each checked), or the two largest the
    node and model allow."""
    node = spec.profile.network.gpus_per_node
    if spec.tps is None:
        ok = allowed_tps(spec.profile)
        if not ok:
            raise PlanError(f"no TP size up to the node's {node} GPUs fits profile "
                            f"{spec.profile.name!r}")
        return tuple(ok[-2:])
    for tp in spec.tps:
        if tp < 1 or tp > node:
            raise PlanError(f"TP {tp} is outside one node (1 .. {node} GPUs, "
                            "network.gpus_per_node)")
        try:
            profile_at(spec.profile, tp)
        except ProfileError as exc:
            raise PlanError(f"TP {tp} does not fit profile {spec.profile.name!r}: {exc}") from None
    return tuple(sorted(set(spec.tps)))


def candidates(spec: PlanSpec) -> list[Candidate]:
    """Every configuration within the budget, in a fixed order."""
    tps = resolve_tps(spec)
    smallest = min(tps)
    if 2 * smallest > spec.gpus:
        raise PlanError(f"a budget of {spec.gpus} GPUs is smaller than one 1P1D deployment "
                        f"(2 instances x TP {smallest} = {2 * smallest} GPUs)")
    out = []
    for mode in spec.modes:
        # packing changes only how a push writes (a pull reads what was published)
        packs = spec.packs if parse_mode(mode)[0].value.startswith("push") else ("never",)
        for pack in dict.fromkeys(packs):
            for tp in tps:
                most = spec.gpus // tp
                for x in range(1, most):
                    for y in range(1, most - x + 1):
                        out.append(Candidate(mode, x, y, tp, pack))
    return out


def scaled_trace(trace: Trace, rate: float) -> Trace:
    """``trace`` replayed at a mean rate of ``rate`` requests per second: its arrival
    times divided by ``rate / trace.mean_rate`` (lengths and hashes kept)."""
    k = rate / trace.mean_rate
    return dataclasses.replace(trace, speed=trace.speed * k, requests=tuple(
        dataclasses.replace(r, arrival=r.arrival / k) for r in trace.requests))


def sim_config(spec: PlanSpec, cand: Candidate, rate: float) -> SimConfig:
    """The simulator's config of ``cand`` at ``rate`` (with a trace: the trace scaled
    to that mean rate)."""
    mode, dispatch = parse_mode(cand.mode)
    trace = None if spec.trace is None else scaled_trace(spec.trace, rate)
    workload = (dataclasses.replace(spec.workload, request_rate=rate) if trace is None
                else trace_workload(trace, seed=spec.workload.seed))
    return SimConfig(
        mode=mode, dispatch=dispatch, num_prefill=cand.num_prefill,
        num_decode=cand.num_decode, profile=profile_at(spec.profile, cand.tp),
        workload=workload, trace=trace,
        packing=dataclasses.replace(SIM_PACKING, mode=cand.pack),
    )


# ----------------------------------------------------------------- bounds


@dataclass(frozen=True, slots=True)
class Bounds:
    """A configuration's closed-form floors and capacity."""

    ttft_floor: float
    tpot_floor: float
    capacity: Capacity

    def prune_reason(self, slo: SLO) -> str | None:
        """Why no rate can meet ``slo`` (None: a rate might)."""
        if self.ttft_floor > slo.ttft_s + PRUNE_MARGIN_S:
            return (f"TTFT floor {self.ttft_floor * 1e3:.1f} ms is above the "
                    f"{slo.ttft_s * 1e3:g} ms SLO")
        if self.tpot_floor > slo.tpot_s + PRUNE_MARGIN_S:
            return (f"TPOT floor {self.tpot_floor * 1e3:.2f} ms is above the "
                    f"{slo.tpot_s * 1e3:g} ms SLO")
        return None


#: with a trace the ladder's top is this many times the capacity of its mean lengths
TRACE_HEADROOM = 2.0


def bounds(spec: PlanSpec, cand: Candidate) -> Bounds:
    p = profile_at(spec.profile, cand.tp)
    if spec.trace is not None:
        return _trace_bounds(p, spec.trace, cand)
    w = spec.workload
    return Bounds(
        ttft_floor=ttft_floor(p, w.input_len),
        tpot_floor=tpot_floor(p, w.input_len, w.output_len),
        capacity=capacity(p, w.input_len, w.output_len, cand.num_prefill, cand.num_decode),
    )


def _trace_bounds(p: Profile, trace: Trace, cand: Candidate) -> Bounds:
    """A trace's requests differ in length and hit the prefix cache as their hashes
    say: the floors are the least over its requests with every whole block of each
    prompt cached (the most a cache can give), so they still hold for every request;
    the capacity is that of the mean lengths, as cached, times :data:`TRACE_HEADROOM`
    -- an estimate, not a bound, since lengths vary."""
    cached = dataclasses.replace(p, prefill=dataclasses.replace(p.prefill,
                                                                prefix_hit_fraction=1.0))
    lengths = sorted({(r.input_len, r.output_len) for r in trace.requests})
    w = trace_workload(trace)
    cap = capacity(cached, w.input_len, w.output_len, cand.num_prefill, cand.num_decode)
    return Bounds(
        ttft_floor=min(ttft_floor(cached, i) for i, _ in lengths),
        tpot_floor=min(tpot_floor(cached, i, o) for i, o in lengths),
        capacity=Capacity(prefill=cap.prefill * TRACE_HEADROOM,
                          decode=cap.decode * TRACE_HEADROOM),
    )


# ------------------------------------------------------------------ rates


def ladder(top: float, rate_tol: float, rate_range: float) -> tuple[float, ...]:
    """Rates from about ``top / rate_range`` up to ``top``, ``1 + rate_tol`` apart
    (ascending; the last rung is ``top``)."""
    if not (top > 0 and math.isfinite(top)):
        raise PlanError(f"the capacity bound must be a positive rate, got {top}")
    steps = math.ceil(math.log(rate_range) / math.log1p(rate_tol))
    return tuple(top / (1 + rate_tol) ** (steps - k) for k in range(steps + 1))


def highest_passing(n: int, passes: Callable[[int], bool]) -> tuple[int | None, int | None]:
    """Bisect rungs ``0 .. n-1`` of a predicate that holds up to some rung and not
    above it: returns (the highest rung that passes or None, the lowest evaluated rung
    that fails or None). Evaluates rung 0, then rung ``n - 1``, then halves the
    bracket: at most ``2 + ceil(log2(n))`` calls."""
    if n < 1:
        raise PlanError("an empty ladder")
    if not passes(0):
        return None, 0
    if n == 1:
        return 0, None
    if passes(n - 1):
        return n - 1, None
    lo, hi = 0, n - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


# ----------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the search found for one configuration."""

    candidate: Candidate
    bounds: Bounds
    pruned: str | None  #: why it was never simulated (None: it was)
    goodput: float  #: highest rung meeting the SLO (req/s; 0 if none)
    at_goodput: Verdict | None  #: the point at the goodput rate
    first_fail: Verdict | None  #: the lowest simulated rate that missed the SLO
    points: tuple[Verdict, ...]  #: every simulated rate, in the order simulated
    simulations: int  #: runs of the simulator (points x seeds)
    wall_s: float

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.candidate.gpus

    @property
    def binding(self) -> str:
        """What stops a higher rate: ``ttft``, ``tpot``, ``both`` (the SLO at the first
        rate that missed it), ``capacity`` (met at the capacity bound) or ``pruned``."""
        if self.pruned is not None:
            return "pruned"
        if self.first_fail is None:
            return "capacity"
        return self.first_fail.binding


def search_candidate(spec: PlanSpec, cand: Candidate,
                     evaluate: Callable[[SimConfig, int], Sample] = simulate) -> Outcome:
    """Prune or bisect one configuration (``evaluate`` runs one point over the seeds)."""
    t0 = time.perf_counter()
    b = bounds(spec, cand)
    reason = b.prune_reason(spec.slo)
    if reason is not None:
        return Outcome(cand, b, reason, 0.0, None, None, (), 0, time.perf_counter() - t0)
    rates = ladder(b.capacity.rate, spec.rate_tol, spec.rate_range)
    seen: dict[int, Verdict] = {}
    order: list[Verdict] = []

    def passes(k: int) -> bool:
        v = judge(evaluate(sim_config(spec, cand, rates[k]), spec.seeds), spec.slo)
        seen[k] = v
        order.append(v)
        return v.meets(spec.slo)

    best, fail = highest_passing(len(rates), passes)
    return Outcome(
        candidate=cand, bounds=b, pruned=None,
        goodput=rates[best] if best is not None else 0.0,
        at_goodput=seen[best] if best is not None else None,
        first_fail=seen[fail] if fail is not None else None,
        points=tuple(order), simulations=len(order) * spec.seeds,
        wall_s=time.perf_counter() - t0,
    )


def full_grid_simulations(spec: PlanSpec, cands: Sequence[Candidate]) -> int:
    """Simulations the full grid would run: every configuration at every rung."""
    total = 0
    for c in cands:
        total += len(ladder(bounds(spec, c).capacity.rate, spec.rate_tol, spec.rate_range))
    return total * spec.seeds


@dataclass(frozen=True, slots=True)
class Plan:
    """A finished search: every configuration's outcome, ranked."""

    spec: PlanSpec
    outcomes: tuple[Outcome, ...]  #: best first
    simulations: int
    full_grid: int
    wall_s: float
    jobs: int  #: workers the backend ran on
    backend: str = "process"  #: where the searches ran (:mod:`.backends`)
    reruns: int = 0  #: configurations submitted again after losing their worker

    @property
    def feasible(self) -> tuple[Outcome, ...]:
        return tuple(o for o in self.outcomes if o.goodput > 0)

    @property
    def best(self) -> Outcome | None:
        f = self.feasible
        return f[0] if f else None


def rank_key(o: Outcome) -> tuple[Any, ...]:
    """Best first: goodput per GPU, then a lower TTFT at it, fewer GPUs, the name."""
    ttft = o.at_goodput.ttft_p if o.at_goodput is not None else math.inf
    return (-o.goodput_per_gpu, ttft, o.candidate.gpus, o.candidate)


def plan_configuration(args: tuple[PlanSpec, Candidate]) -> Outcome:
    """One backend task: prune or bisect one configuration (top level, so worker
    processes and Ray workers can import it)."""
    spec, cand = args
    return search_candidate(spec, cand)


def _cost(spec: PlanSpec, cand: Candidate) -> float:
    """Heavier first: more instances, and pull before push (its steps stall)."""
    return cand.num_prefill + cand.num_decode + 0.5 * parse_mode(cand.mode)[0].is_pull


def run_plan(spec: PlanSpec, *, jobs: int = 1, backend: str = "process",
             ray_address: str | None = None, progress: TextIO | None = sys.stderr,
             evaluate: Callable[[SimConfig, int], Sample] | None = None) -> Plan:
    """Search every configuration of ``spec`` on ``backend`` (:mod:`.backends`:
    ``process``, ``jobs`` worker processes; ``ray``, the cluster at ``ray_address`` or
    a local instance of ``jobs`` CPUs), each task one whole configuration; with
    ``progress``, a tqdm bar there. ``evaluate`` replaces the simulator (this process
    only; for tests). The plan is the same whatever the backend and the workers."""
    from tqdm import tqdm  # type: ignore[import-untyped]

    from .backends import open_backend

    t0 = time.perf_counter()
    cands = candidates(spec)
    todo = sorted(cands, key=lambda c: (-_cost(spec, c), c))
    full = full_grid_simulations(spec, cands)
    jobs = max(1, min(jobs, len(todo)))
    runner = None
    if evaluate is None:
        runner = open_backend(backend, jobs=jobs, ray_address=ray_address)
        jobs = runner.workers
    else:
        backend, jobs = "process", 1
    bar = tqdm(total=len(todo), file=progress, disable=progress is None, unit="config",
               desc=f"plan [{backend}, {jobs} worker{'s' if jobs > 1 else ''}]",
               mininterval=0.5, dynamic_ncols=True)

    def on_rerun(n: int, why: str) -> None:
        if progress is not None:
            bar.write(f"{why}: {n} configuration(s) submitted again", file=progress)

    results: Generator[tuple[int, Outcome], None, None]
    if runner is not None:
        results = runner.run(plan_configuration, [(spec, c) for c in todo],
                             on_rerun=on_rerun, label=lambda i: todo[i].label)
    else:
        ev = evaluate
        assert ev is not None
        results = ((i, search_candidate(spec, c, ev)) for i, c in enumerate(todo))
    outcomes: list[Outcome] = []
    sims = 0
    try:
        for _, o in results:
            outcomes.append(o)
            sims += o.simulations
            bar.set_postfix_str(f"{sims} sims; {_status(o)}", refresh=False)
            bar.update(1)
    finally:
        bar.close()
        results.close()  # interrupted: the backend stops its workers and tasks first
        if runner is not None:
            runner.close()
    if len(outcomes) != len(todo):  # a backend never drops one; guard the claim
        raise RuntimeError(f"{len(todo) - len(outcomes)} configurations came back missing")
    outcomes.sort(key=rank_key)
    return Plan(spec=spec, outcomes=tuple(outcomes), simulations=sims, full_grid=full,
                wall_s=time.perf_counter() - t0, jobs=jobs, backend=backend,
                reruns=runner.reruns if runner is not None else 0)


def grid_best(plan: Plan, evaluate: Callable[[SimConfig, int], Sample] = simulate
              ) -> tuple[Candidate | None, int]:
    """The best configuration the full grid would find -- every configuration at every
    rung of its ladder, goodput the highest rung that meets the SLO, ranked as
    :func:`rank_key` ranks -- and the simulations it took to find it.

    Only rungs that could decide it are simulated: a rung whose rate per GPU is below
    ``plan``'s best goodput per GPU cannot beat it, and a pruned configuration meets
    the SLO at no rate. Each configuration's rungs are tried from the top down to that
    level, stopping at the first that passes (its grid goodput). Checks a search
    against the brute force without paying for all of it."""
    spec = plan.spec
    floor = plan.best.goodput_per_gpu if plan.best is not None else 0.0
    sims = 0
    found: list[tuple[Any, ...]] = []
    for o in plan.outcomes:
        if o.pruned is not None:
            continue
        c = o.candidate
        for r in reversed(ladder(o.bounds.capacity.rate, spec.rate_tol, spec.rate_range)):
            if r / c.gpus < floor * (1 - 1e-12):
                break
            v = judge(evaluate(sim_config(spec, c, r), spec.seeds), spec.slo)
            sims += spec.seeds
            if v.meets(spec.slo):
                found.append((-r / c.gpus, v.ttft_p, c.gpus, c))
                break
    return (min(found)[-1] if found else None), sims


def _status(o: Outcome) -> str:
    if o.pruned is not None:
        return f"{o.candidate.label} pruned"
    if o.goodput > 0:
        return f"{o.candidate.label} {o.goodput:.3g} req/s"
    return f"{o.candidate.label} misses the SLO"


__all__ = [
    "PRUNE_MARGIN_S", "TRACE_HEADROOM", "Bounds", "Candidate", "Outcome", "Plan", "PlanError",
    "PlanSpec", "allowed_tps", "bounds", "candidates", "full_grid_simulations", "grid_best",
    "highest_passing", "ladder", "plan_configuration", "profile_at", "rank_key",
    "resolve_tps", "run_plan", "scaled_trace", "search_candidate", "sim_config",
]
