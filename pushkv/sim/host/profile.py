"""The profile's ``[host]`` section: which host model runs, and its keys.

``host.model`` names the model (:func:`pushkv.sim.host.host_model` builds it):

* ``"dedicated"`` (default) -- every engine and frontend process has cores of its own,
  as on the GPU nodes of the default profile: no host code runs, and every other key
  of this section must keep its default;
* ``"shared-cpu"`` -- the engines, their API servers, the router and the client share
  one machine's cores (the CPU deployments ``pushkv.fit`` measures): the keys below.

Per-side keys sit in the sub-tables ``[host.prefill]`` and ``[host.decode]``.
This module needs no SimPy: profiles load with numpy alone.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: the names ``host.model`` may take
MODELS = ("dedicated", "shared-cpu")
DEDICATED, SHARED_CPU = MODELS

#: Processes woken on the way (see ``HostSide.wake_s``): vLLM V1 on CPU runs an
#: API server, an engine core and a worker process per instance.
ENGINE_WAKES = 2  #: a request or finished transfer reaching an idle engine: core, worker
HOP_WAKES = 2  #: a router hop: the relay process and the receiving API server
RETURN_WAKES = 3  #: a token to the client: decode's API server, the relay, the client

#: with ``host.pinned``, the core each side's engine loop runs on
PINNED_CORE = {"prefill": 0, "decode": 1}

#: the process the router's and client's relay of tokens runs under (an API server's is
#: its engine's id, ``prefill-0``)
RELAY = "relay"


def engine_process(side: str) -> str:
    """The process an engine loop's work is on the host's cores (its steps, its empty
    steps): one a side, as each side's engine has a core of its own."""
    return f"{side} engine"


def beside_process(side: str) -> str:
    """The process the work beside ``side``'s steps is (its engine core's other threads,
    transport threads; ``cores_busy``)."""
    return f"{side} beside"

#: the most multipliers ``host.spread`` may hold
MAX_SPREAD = 1000
#: the longest wait ``host.wake_beside_s`` may hold (s): a wake-up later than this is
#: a process stopped, not one waiting for a core
MAX_WAKE_S = 10.0
#: the fastest ``cpu_speed`` against the profile's measurement a machine may have
MAX_SPEED = 100.0
#: the most cores one stepping engine may keep busy (``cores_busy``)
MAX_CORES_BUSY = 64.0

PROBE = ("on a shared CPU machine measured per run by a probe process on each core "
         "(pushkv.fit.cores.CoreProbe), see benchmarks/bench_sim_vs_real.py")


def _f(default: Any, help: str, source: str) -> Any:
    return field(default=default, metadata={"help": help, "source": source})


@dataclass(frozen=True, kw_only=True)
class HostSide:
    """One side's (prefill's or decode's) processes on the shared host."""

    cpu_share: float = _f(
        1.0,
        "fraction of a CPU core this engine's processes get while they are runnable (other "
        "work on the same cores takes the rest): its host times -- step overheads, "
        "step_token_s, step_python_s, the connector keys -- last 1 / cpu_share as long; "
        "posting, control messages and router hops, which run on both sides' cores, by "
        "the mean of the two sides' shares (1: a core of its own; "
        "pushkv.sim.host.shared_cpu.on_shared_cores)",
        "1 on dedicated hosts; " + PROBE + " (CPU time / wall time of 1 ms bursts)",
    )
    cpu_speed: float = _f(
        1.0,
        "how fast this engine's cores run now against when the profile's host times were "
        "measured (a probe's rate of fixed work per CPU second, now over then): the host "
        "times cpu_share stretches last 1 / (cpu_share x cpu_speed) as long; the posting, "
        "messages and hops by the mean of the two sides' products",
        "1: as measured; on a shared machine whose host runs it slower or faster from one "
        "minute to the next, measured per point by the same probe against the profile's "
        "host.probe_speed (benchmarks/bench_sim_vs_real.py)",
    )
    cores_busy: float = _f(
        1.0,
        "cores an active engine keeps busy, its step's own included: beside the worker "
        "that runs the step, vLLM's engine core polls for its result, transport threads "
        "run (on prefill the API server too). With host.cores every step of dt seconds "
        "adds (cores_busy - 1) x dt of work to the host's shared cores, which it does not "
        "wait for, and with steps_while_holding a loop that holds a request keeps this "
        "many cores busy (1: the step alone)",
        "1 on dedicated hosts; on a shared CPU machine measured per deployment by "
        "benchmarks/bench_sim_vs_real.py: the CPU time (/proc) of the instance's processes "
        "(decode: but its API server, which host.token_work_s counts) over lone requests, "
        "less what they use idle, over the time the engine had each in hand in the "
        "timeline (stepping it or holding it for its transfer)",
    )
    steps_while_holding: bool = _f(
        False,
        "the engine loop keeps stepping while a request of its waits on a transfer -- "
        "prefill holding a finished prompt's KV until it is pushed or read, decode "
        "awaiting its KV -- so with host.cores an engine that has nothing to compute but "
        "holds such a request keeps cores_busy cores of the host busy (as spinners, "
        "pushkv.sim.host.cores), and a real step takes the place of the empty ones "
        "(false: an engine with nothing to compute sleeps)",
        "vLLM 0.32 v1/engine/core.py steps while has_work(): the scheduler's "
        "has_requests() counts a request waiting for remote KV and a finished one held "
        "for the connector's delayed cleanup (v1/core/sched/scheduler.py "
        "has_finished_requests); cores_busy then measured over lone requests' stepping "
        "and holding time by benchmarks/bench_sim_vs_real.py",
    )
    wake_s: float = _f(
        0.0,
        "run-queue delay of a woken process of this engine on an oversubscribed core: "
        "between becoming runnable (a request, a message, a finished step's output) and "
        "running. A request reaching an idle engine wakes ENGINE_WAKES processes (vLLM's "
        "engine core and its worker), a router hop HOP_WAKES (the relay and the receiving "
        "API server; the mean of both sides' delays), a token's way back to the client "
        "RETURN_WAKES (decode's API server, the relay, the client), a control message or "
        "notification, and a background posting thread's job, one (0: a core of its own)",
        "0 on dedicated hosts; " + PROBE,
    )


@dataclass(frozen=True, kw_only=True)
class HostProfile:
    """The host the engines and frontends run on, and the model of it."""

    model: str = _f(
        DEDICATED,
        "the host model: 'dedicated' -- every engine and frontend process has cores of "
        "its own and no host code runs (every other host key keeps its default); "
        "'shared-cpu' -- they share one machine's cores: the keys of this section",
        "deployment: 'dedicated' for the GPU nodes of the post; 'shared-cpu' for the CPU "
        "profiles pushkv.fit measures",
    )
    cores: int = _f(
        0,
        "CPU cores the engines' steps and the frontends' jobs share on one host: with "
        "c >= 1 each is work on one processor-sharing pool, every runnable piece "
        "advancing at min(1, c / runnable), so a step that runs while the other engine "
        "steps and a frontend streams lasts longer (pushkv.sim.host.cores); 0: every piece "
        "at full speed, a core each",
        "deployment: the machine's cores (a 2-core development machine, where a P/D "
        "pair, its API servers, the router and the client all run, has 2)",
    )
    pinned: bool = _f(
        False,
        "engines pinned to a core each (needs cores >= 2): prefill's loop -- its steps and "
        "its empty steps while it holds a request -- runs on core 0, decode's on core 1, "
        "and every other piece (a frontend job, the work beside a step) floats: it starts "
        "on an idle core if there is one, else on a core drawn at random, and stays "
        "there, so a floating piece that lands beside a stepping engine halves its pace "
        "until it ends (pushkv.sim.host.cores.PinnedCores); false: one pool, any piece "
        "on any core",
        "deployment: vLLM's CPU worker binds its OpenMP threads, the engine loop's "
        "among them, to VLLM_CPU_OMP_THREADS_BIND's cores (OMP_PLACES, OMP_PROC_BIND=true; "
        "vllm/utils/ompmultiprocessing.py, vLLM 0.32), which the servers pushkv.fit runs "
        "set to a core each; a waking task takes an idle core when there is one "
        "(select_idle_sibling, Linux kernel/sched/fair.c), else its previous or its "
        "waker's core by load averages the model does not have, so it draws (weaker "
        "than the shortest queue); placed pieces never move, where the kernel moves a "
        "waiting one to a core falling idle (weaker)",
    )
    frontend_cores: int = _f(
        0,
        "cores the frontend processes (each instance's API server, the router, the "
        "client) share: with n >= 1 a leg's ingest_s and every output token's "
        "decode.return_s are service times of one FIFO queue of n servers, so legs wait "
        "behind the tokens still streaming and tokens pile up when they come faster than "
        "the frontends pass them on (pushkv.sim.host.frontend); 0: those times are "
        "delays, the frontends never busy",
        "deployment: with both cores of a 2-core machine pinned to an engine the "
        "frontends float; 1 is the one core's worth they get while decode steps "
        "(docs/sim.md, 'The frontends as a queue')",
    )
    token_work_s: float = _f(
        0.0,
        "frontend work one output token costs on its way out (decode's API server, the "
        "router and the client passing it on): with frontend_cores a token's job on the "
        "frontend queue takes this long, the rest of its way out (decode.return_s, the "
        "hops) is latency, so a lone token arrives as before; 0: the job takes return_s",
        "0: return_s; on a shared CPU machine measured per deployment by "
        "benchmarks/bench_sim_vs_real.py: the CPU time (/proc) of decode's API server, the "
        "router and the client over lone requests, less their idle rate, per output token",
    )
    token_api_s: float = _f(
        0.0,
        "the part of token_work_s decode's API server spends: with it each API server "
        "is a loop of its own (a FIFO server, its work on the host's cores) where its "
        "legs' intake and its answers queue, and a token's way out is two jobs -- one "
        "of its decode API server's loop, which every token reaching that loop while "
        "the job still waits for its turn joins (of any request; a request's tokens "
        "merging into one chunk, up to merge_tokens), then the relay of the job's "
        "chunks through the router and the client on the frontend queue, for the rest "
        "of token_work_s (pushkv.sim.host.frontend; needs frontend_cores and "
        "merge_tokens > 1); 0: the frontend queue serves everything, a token's whole "
        "way out one job there, merging with its request's tokens waiting there",
        "0; on a shared CPU machine measured per deployment by "
        "benchmarks/bench_sim_vs_real.py: decode's API server's CPU time (/proc) per "
        "output token over lone requests, less its idle rate",
    )
    token_item_s: float = _f(
        0.0,
        "what of token_work_s a token still costs when it shares its processes' "
        "wake-ups with other tokens (with token_api_s): token_api_item_s in its API "
        "server's job, the rest in the relay's, a chunk joining a waiting relay job",
        "0; measured per deployment by benchmarks/bench_sim_vs_real.py: the frontends' "
        "CPU time per output token over rounds of 8 requests sent at once, whose tokens "
        "leave decode in the same steps (F), against lone requests' (L): (8 F - L) / 7 "
        "(docs/sim.md, 'A wake-up shared')",
    )
    token_api_item_s: float = _f(
        0.0,
        "the part of token_item_s decode's API server spends: what a token joining its "
        "API server's waiting job adds to it (with token_api_s)",
        "0; measured with token_item_s, decode's API server's CPU time alone",
    )
    probe_speed: float = _f(
        0.0,
        "the probe's rate of fixed work per CPU second on the engine's core while this "
        "profile's engine times were measured (pushkv.fit.cores.CoreProbe.speed): the "
        "reference a later run's cpu_speed is taken against; 0: not recorded",
        "written by pushkv.fit.measure",
    )
    spread: tuple[float, ...] = _f(
        (),
        "multipliers, equally likely, of the host times the connector keys give as "
        "medians (prefill/decode ingest_s, prefill.return_s, decode.order_handoff_s, "
        "event_handoff_s, admit_lag_s, network.notify_wait_s): each time a request pays "
        "one it pays it times a multiplier drawn at random (pushkv.sim.host.spread); "
        "empty: the median every time",
        "measured: a real pair's timeline, each request's keyed segment over its median, "
        "pooled, at evenly spaced quantiles (pushkv.fit.measure_connector.host_spread; "
        "docs/sim.md, 'Host times around their medians')",
    )
    wake_beside_s: tuple[float, ...] = _f(
        (),
        "extra run-queue waits (s), equally likely, of a frontend process woken while "
        "other requests are in flight, over what one woken beside none meets (which the "
        "keys, measured on lone requests, hold): a frontend job (a leg's ingest, a "
        "prefill answer, a token's way out) that wakes its process (an instance's API "
        "server, none of whose jobs is pending) while another request is in flight waits "
        "one, drawn at random, before its turn on the frontend queue, holding no core; a "
        "request's later tokens wait behind it; the router, woken by a request while "
        "another is in flight, takes it up after one too, drawn from a stream of its "
        "own, and requests reaching it meanwhile wait with it (pushkv.sim.host.frontend; "
        "needs frontend_cores); empty: no extra wait",
        "measured: the core probe's wake-ups during a run's points against their "
        "timelines, the quantiles of those with two or more requests in flight less the "
        "same quantiles of those with one, pooled over the run "
        "(pushkv.fit.segments.wakes_by_flight, measure_connector.wake_beside, "
        "pushkv.fit.sim_vs_real.keys.wake_beside_of; docs/sim.md, 'A woken frontend beside "
        "another request')",
    )
    merge_tokens: int = _f(
        0,
        "the most output tokens of one request one frontend job carries: a token that "
        "reaches the frontend queue while an earlier token of its request still waits "
        "there for its turn joins that token's job, up to this many, and they leave as "
        "one chunk for one job's service, as vLLM's API server merges a streamed "
        "request's outputs while its handler is behind (pushkv.sim.host.frontend; needs "
        "frontend_cores); 0 (or 1): every token a job of its own, however far the "
        "frontends are behind",
        "vLLM 0.32 source, vllm/v1/engine/output_processor.py, RequestOutputCollector.put "
        "('RequestOutputs are merged if the producer gets ahead of the consumer', no "
        "bound: https://github.com/vllm-project/vllm/blob/v0.32.0/vllm/v1/engine/"
        "output_processor.py); 0 by default, so that earlier profiles' outputs stand; "
        "benchmarks/bench_sim_vs_real.py sets the output length (all of a request's "
        "tokens; --no-merge-tokens: 0)",
    )
    prefill: HostSide = field(default_factory=HostSide,
                              metadata={"help": "the prefill instances' processes"})
    decode: HostSide = field(default_factory=HostSide,
                             metadata={"help": "the decode instances' processes"})


#: Keys that were in other sections before the host model had its own: a profile that
#: still sets one there is refused with the key's place in ``[host]``.
MOVED: dict[str, dict[str, str]] = {
    "control": {"host_cores": "cores", "frontend_cores": "frontend_cores",
                "probe_speed": "probe_speed", "host_spread": "spread",
                "wake_beside_s": "wake_beside_s"},
    "prefill": {k: f"prefill.{k}" for k in ("cpu_share", "cpu_speed", "cores_busy",
                                            "steps_while_holding", "wake_s")},
    "decode": {**{k: f"decode.{k}" for k in ("cpu_share", "cpu_speed", "cores_busy",
                                             "steps_while_holding", "wake_s")},
               "token_work_s": "token_work_s"},
}


def moved_message(section: str, key: str) -> str | None:
    """Why ``section.key`` is refused when it moved to ``[host]``, else None."""
    new = MOVED.get(section, {}).get(key)
    if new is None:
        return None
    table, _, name = new.rpartition(".")
    where = f"[host.{table}] {name}" if table else f"[host] {name}"
    return (f"{section}.{key} is a host key now: write it as {where} (host.{new}), with "
            f"[host] model = \"{SHARED_CPU}\"")


class HostError(ValueError):
    """A ``[host]`` value no host could have (the profile raises it as its own error)."""


def validate_host(h: HostProfile) -> None:
    """Raise :class:`HostError` on an impossible ``[host]`` value."""
    if h.model not in MODELS:
        raise HostError(f"host.model must be one of {', '.join(MODELS)}, got {h.model!r}")
    for name in ("cores", "frontend_cores", "merge_tokens"):
        v = getattr(h, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise HostError(f"host.{name} must be an integer >= 0, got {v!r}")
    if not isinstance(h.pinned, bool):
        raise HostError(f"host.pinned must be true or false, got {h.pinned!r}")
    for name in ("probe_speed", "token_work_s", "token_api_s", "token_item_s",
                 "token_api_item_s"):
        if getattr(h, name) < 0:
            raise HostError(f"host.{name} must be >= 0, got {getattr(h, name)}")
    if len(h.spread) > MAX_SPREAD:
        raise HostError(f"host.spread must hold at most {MAX_SPREAD} multipliers, got "
                        f"{len(h.spread)}")
    if any(m < 0 for m in h.spread):
        raise HostError(f"host.spread multipliers must be >= 0, got {min(h.spread)}")
    if len(h.wake_beside_s) > MAX_SPREAD:
        raise HostError(f"host.wake_beside_s must hold at most {MAX_SPREAD} waits, got "
                        f"{len(h.wake_beside_s)}")
    if bad := [w for w in h.wake_beside_s if not 0 <= w <= MAX_WAKE_S]:
        raise HostError(f"host.wake_beside_s waits must be in [0, {MAX_WAKE_S}] s, got "
                        f"{bad[0]}")
    for side in ("prefill", "decode"):
        s: HostSide = getattr(h, side)
        if not 0 < s.cpu_share <= 1:
            raise HostError(f"host.{side}.cpu_share must be in (0, 1], got {s.cpu_share}")
        if not 0 < s.cpu_speed <= MAX_SPEED:
            raise HostError(f"host.{side}.cpu_speed must be in (0, {MAX_SPEED}], got "
                            f"{s.cpu_speed}")
        if not 1 <= s.cores_busy <= MAX_CORES_BUSY:
            raise HostError(f"host.{side}.cores_busy must be in [1, {MAX_CORES_BUSY}], got "
                            f"{s.cores_busy}")
        if s.wake_s < 0:
            raise HostError(f"host.{side}.wake_s must be >= 0, got {s.wake_s}")
    if h.model == DEDICATED:  # it runs no host code: a key set for it would be ignored
        for name, value in _leaves(h, ""):
            if name != "model" and value != _leaf(HostProfile(), name):
                raise HostError(f"host.{name} is a key of the shared-cpu host model: set "
                                f"[host] model = \"{SHARED_CPU}\" (the dedicated model runs "
                                "no host code)")
    if h.pinned and h.cores < len(PINNED_CORE):
        raise HostError(f"host.pinned needs host.cores >= {len(PINNED_CORE)} (a core for "
                        f"each side's engine), got {h.cores}")


def _leaves(obj: Any, prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out += _leaves(v, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, v))
    return out


def _leaf(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
