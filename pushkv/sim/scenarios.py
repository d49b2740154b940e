"""Named what-if scenarios: each a small grid of runs and the table it prints.

Every scenario's docstring says what it shows. Run one (or all) with::

    python -m pushkv.sim.scenarios prefix-hit
    python -m pushkv.sim.scenarios --all

The tables in ``docs/sim.md`` are this module's output.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import multiprocessing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..protocol import FailurePolicy
from .packing import SIM_PACKING
from .profile import DEFAULT, Profile
from .profile import markdown as profile_markdown
from .scenario import (
    DECODE_FAILOVERS,
    Dispatch,
    FaultConfig,
    ProtocolSettings,
    SimConfig,
    TransferMode,
)
from .sweep import default_jobs, run_point
from .workload import WorkloadConfig

Cell = Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class Scenario:
    """Rows of labelled configs; ``cell`` renders one result."""

    name: str
    doc: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, tuple[SimConfig, ...]], ...]
    cell: Cell


def _doc(fn: Callable[[], Scenario]) -> str:
    return inspect.cleandoc(fn.__doc__ or "")


def _latency(res: dict[str, Any]) -> str:
    return f"{res['mean_ttft_ms']:,.0f} / {res['mean_tpot_ms']:.2f}"


def _ttft(res: dict[str, Any]) -> str:
    return f"{res['mean_ttft_ms']:,.0f}"


def _outcome(res: dict[str, Any]) -> str:
    e = res["pushkv"]
    return (f"{res['completed']} ok, {res['failed']} failed, {e['recomputed']} recomputed, "
            f"{e['leaked_blocks']} leaked; TTFT {res['mean_ttft_ms']:,.0f}")


def _point(mode: str, qps: float, input_len: int, profile: Profile = DEFAULT,
           **kw: Any) -> SimConfig:
    dispatch = Dispatch.SEQUENTIAL if mode == "push-seq" else Dispatch.CONCURRENT
    m = TransferMode.PUSH if mode == "push-seq" else TransferMode(mode)
    workload = kw.pop("workload", None) or WorkloadConfig(request_rate=qps, input_len=input_len)
    return SimConfig(mode=m, dispatch=dispatch, profile=profile, workload=workload, **kw)


def _with(**sections: dict[str, Any]) -> Profile:
    changes = {k: dataclasses.replace(getattr(DEFAULT, k), **v) for k, v in sections.items()}
    return dataclasses.replace(DEFAULT, **changes).validate()


HEADLINE = ("pull", "push")
HEAD_COLS = ("pull: TTFT / TPOT (ms)", "push: TTFT / TPOT (ms)")


def _headline_rows(label: str, profile: Profile) -> tuple[str, tuple[SimConfig, ...]]:
    return label, tuple(_point(m, 8, 16384, profile) for m in HEADLINE)


def prefix_hit() -> Scenario:
    """The assumption that makes 540 ms possible: prefill prefix-cache hits.

    Full 16k prefills at 8 QPS need more compute than a TP8 H200 node has, so
    without hits the prefill queue grows for the whole run and both modes'
    TTFT is seconds; the post's figures need most of each prompt served from
    the prefill instance's prefix cache. 8 QPS, 16k input, 100 prompts.
    """
    rows = tuple(_headline_rows(f"prefix hit {h:.0%}", _with(prefill={"prefix_hit_fraction": h}))
                 for h in (0.0, 0.5, 0.75, 0.9, 0.95))
    return Scenario("prefix-hit", _doc(prefix_hit), HEAD_COLS, rows, _latency)


def fragmentation() -> Scenario:
    """Fragmentation sets the descriptor count, hence pull's stall and the wire time.

    A fresh allocator gives one descriptor per region (128 per rank): pull's
    stall is tiny and pull is close to push. The more scattered the blocks,
    the longer pull's inline posting and the slower the wire for both.
    8 QPS, 16k input.
    """
    rows = tuple(
        _headline_rows(f"fragmentation {f:g}", _with(prefill={"fragmentation": f},
                                                     decode={"fragmentation": f}))
        for f in (0.0, 0.02, 0.05, 0.1))
    return Scenario("fragmentation", _doc(fragmentation), HEAD_COLS, rows, _latency)


def post_cost() -> Scenario:
    """Per-descriptor posting cost across the measured 2.4-3.9 us range. 8 QPS, 16k input."""
    rows = tuple(
        _headline_rows(f"{us:g} us per descriptor",
                       _with(network={"post_per_descriptor_s": us * 1e-6}))
        for us in (2.4, 2.8, 3.2, 3.9))
    return Scenario("post-cost", _doc(post_cost), HEAD_COLS, rows, _latency)


def rate_coupling() -> Scenario:
    """Pull's stall ties its TPOT at 4 QPS to its TTFT at 8 QPS (16k input).

    Every admitted request stalls the decode loop once, by its posting time,
    so pull's extra TPOT grows with the admission rate times that time. At
    8 QPS decode is slot-bound and the same stall also sets how fast slots
    turn over, hence the queue and TTFT. Whatever makes the 4 QPS TPOT reach
    the post's 10.4 ms within 20% (8.3 ms) pushes the 8 QPS TTFT past its
    20% too. Rows: posting cost per descriptor, and whether the decode loop
    posts after the step's forward launch (vLLM >= 0.29) or before it.
    """
    cols = ("pull 4 QPS: TTFT / TPOT (ms)", "pull 8 QPS: TTFT / TPOT (ms)")
    rows = tuple(
        (f"{us:g} us per descriptor, {where}", tuple(
            _point("pull", q, 16384, _with(network={"post_per_descriptor_s": us * 1e-6},
                                           decode={"inline_post": where}))
            for q in (4, 8)))
        for where in ("after-forward", "before-forward") for us in (2.4, 2.8, 3.2, 3.6, 3.9))
    return Scenario("rate-coupling", _doc(rate_coupling), cols, rows, _latency)


def decode_slots() -> Scenario:
    """The max-num-seqs 8 slot effect: with more decode slots pull's TTFT collapses.

    The stall lengthens every step, so each request holds its slot longer;
    with 8 slots new requests queue for one. More slots remove the queue
    while the stall (and TPOT) remain. 8 QPS, 16k input.
    """
    rows = tuple(_headline_rows(f"max_num_seqs {n}", _with(decode={"max_num_seqs": n}))
                 for n in (8, 16, 32))
    return Scenario("decode-slots", _doc(decode_slots), HEAD_COLS, rows, _latency)


def num_prompts() -> Scenario:
    """Fewer or more prompts per point: the overloaded pull point never reaches a steady state.

    100 prompts at 8 QPS is 12.5 s of arrivals; pull's decode is past its
    capacity, so its queue (and mean TTFT) grows with the length of the run.
    """
    rows = tuple(
        (f"{n} prompts", tuple(
            _point(m, 8, 16384, workload=WorkloadConfig(request_rate=8, input_len=16384,
                                                        num_prompts=n))
            for m in HEADLINE))
        for n in (50, 100, 200))
    return Scenario("num-prompts", _doc(num_prompts), HEAD_COLS, rows, _latency)


def modes() -> Scenario:
    """Pull, pull with a background poster, push, and push behind a sequential router.

    Moving pull's posting to a decode background thread recovers nearly all of
    push's gain: on the installed NIXL the poster holds the interpreter lock for
    a small share of a post (``network.post_gil_fraction``, measured by
    ``python -m pushkv.transports.calibrate``; transfer() releases it), so the
    decode loop hardly waits for it; one holding the lock throughout would
    recover little (the gil table). Push's poster lives on prefill. A
    sequential router costs push the overlap of decode's admission and
    registration with prefill -- a few ms where decode has free slots, little
    behind a full slot queue -- because the protocol writes only once the
    whole prompt is prefilled.
    """
    labels = ("pull", "pull-async", "push", "push-seq")
    rows = tuple(
        (f"{q:g} QPS, {n // 1024}k", tuple(_point(m, q, n) for m in labels))
        for q, n in ((1, 4096), (4, 16384), (8, 8192), (8, 16384)))
    return Scenario("modes", _doc(modes), tuple(f"{m}: TTFT / TPOT (ms)" for m in labels),
                    rows, _latency)


def router() -> Scenario:
    """Push behind a sequential router, with proxy hops of 0.5 ms and of 5 ms. Cells: TTFT.

    The sequential router sends the decode leg only after the prefill leg's
    HTTP answer: decode admits the request, allocates and registers only then
    (behind any slot queue), and the write waits for that registration. 5 ms
    hops stand for a slower proxy and API server round trip, for every mode.
    """
    slow = _with(network={"router_hop_s": 5e-3})
    modes = ("pull", "push", "push-seq")
    cols = (*(f"{m} (ms)" for m in modes), *(f"{m}, 5 ms hops (ms)" for m in modes))
    rows = tuple(
        (f"{q:g} QPS, {n // 1024}k", (*(_point(m, q, n) for m in modes),
                                      *(_point(m, q, n, slow) for m in modes)))
        for q, n in ((1, 1024), (1, 16384), (4, 16384), (8, 8192), (8, 16384)))
    return Scenario("router", _doc(router), cols, rows, _ttft)


def faults() -> Scenario:
    """Faults: the protocol's timeouts and the decode failure policy, per mode.

    2 QPS, 4k input, 100 prompts; registration window 2 s (grace 1 s) so that
    lost messages resolve quickly; deaths are noticed after 1 s.
    """
    short = {"window_s": 2.0, "fence_grace_s": 1.0}
    cases = (
        ("5% registrations lost, fail", FaultConfig(drop_register=0.05), FailurePolicy.FAIL, 1),
        ("5% registrations lost, recompute", FaultConfig(drop_register=0.05),
         FailurePolicy.RECOMPUTE, 1),
        ("5% notifications lost, recompute", FaultConfig(drop_notify=0.05),
         FailurePolicy.RECOMPUTE, 1),
        ("prefill dies at 20 s, recompute", FaultConfig(kill_prefill_at=20.0),
         FailurePolicy.RECOMPUTE, 1),
        ("decode-0 of 2 dies at 20 s", FaultConfig(kill_decode_at=20.0), FailurePolicy.FAIL, 2),
    )
    rows = tuple(
        (label, tuple(
            _point(m, 2, 4096, faults=f, num_decode=nd,
                   protocol=ProtocolSettings(policy=pol, **short))
            for m in HEADLINE))
        for label, f, pol, nd in cases)
    return Scenario("faults", _doc(faults), ("pull", "push"), rows, _outcome)


def _failover(res: dict[str, Any]) -> str:
    e = res["pushkv"]
    return (f"{res['completed']} ok, {res['failed']} failed, {e.get('failovers', 0)} moved, "
            f"{e.get('prompt_tokens_recomputed', 0):,} prompt tokens again; "
            f"TTFT {res['mean_ttft_ms']:,.0f} / p99 {res['p99_ttft_ms']:,.0f}")


def failover() -> Scenario:
    """Decode failover: decode-0 of 2 dies at 20 s and the router fails its requests,
    retries them from scratch (prefill computes the prompt again), or re-targets their
    held KV to decode-1 (protocol rule 12, ``retarget_hold_s`` 5 s). 1P2D push on the
    published profile, 8 QPS, 300 prompts of 16k input and 64 output tokens, deaths
    noticed after 1 s; a request already streaming fails under every policy. Cells:
    outcomes, requests moved, prompt tokens prefill computed again, TTFT mean and p99
    (ms)."""
    wl = WorkloadConfig(request_rate=8, input_len=16384, output_len=64, num_prompts=300)
    rows = tuple(
        (policy, (_point("push", 8, 16384, workload=wl, num_decode=2,
                         faults=FaultConfig(kill_decode_at=20.0, decode_failover=policy),
                         protocol=ProtocolSettings(policy=FailurePolicy.RECOMPUTE,
                                                   retarget_hold_s=5.0)),))
        for policy in DECODE_FAILOVERS)
    return Scenario("failover", _doc(failover), ("1P2D push",), rows, _failover)


def xpyd() -> Scenario:
    """Several instances: the router spreads requests; rates scale with the pairs. 16k input."""
    rows = tuple(
        (f"{x}P{y}D, {q} QPS", tuple(_point(m, q, 16384, num_prefill=x, num_decode=y)
                                     for m in HEADLINE))
        for x, y, q in ((1, 1, 8), (2, 2, 16), (1, 2, 8), (2, 1, 8)))
    return Scenario("xpyd", _doc(xpyd), HEAD_COLS, rows, _latency)


def gil() -> Scenario:
    """The price of a background poster, by the share of a post that holds its process's
    interpreter lock (measured on NIXL 1.5.1: about 0.3%; transfer() releases it): near
    0, pull-async's decode reader costs the decode loop little; held throughout, it
    stalls the loop almost as pull does. Push's writer, on prefill, costs decode
    nothing. 8 QPS, 16k input; cells are TTFT / TPOT in ms."""
    modes = ("pull", "pull-async", "push")
    return Scenario(
        "gil", _doc(gil), tuple(f"{m}: TTFT / TPOT (ms)" for m in modes),
        tuple((f"lock held for {f:.0%} of the posting", tuple(
            _point(m, 8, 16384, _with(network={"post_gil_fraction": f})) for m in modes))
            for f in (1.0, 0.5, 0.0)),
        _latency,
    )


def rank_skew() -> Scenario:
    """TP rank skew: every rank's transfer takes (1 + X) times the representative's, X
    exponential with the given mean; READY waits for the slowest of 8 ranks (H_8 = 2.7
    times the mean late) and pull's inline posting step for its slowest poster."""
    return Scenario(
        "rank-skew", _doc(rank_skew), HEAD_COLS,
        tuple(_headline_rows(f"mean skew {x:.0%}", _with(network={"rank_skew": x}))
              for x in (0.0, 0.05, 0.1, 0.2)),
        _latency,
    )


def _descriptors(res: dict[str, Any]) -> str:
    return (f"{res['mean_ttft_ms']:,.0f} / {res['mean_tpot_ms']:.2f} / "
            f"{res['pushkv']['descriptors_mean']:,.0f}")


def allocator() -> Scenario:
    """Descriptor counts from the pools' history: vLLM frees a request's blocks in reverse
    order and reuses uncached (decode) blocks first, so a warm decode cache hands out
    descending runs that merge with nothing. 8 QPS, 16k; cells are TTFT / TPOT (ms) /
    descriptors per transfer and rank."""
    cols = tuple(f"{m}: TTFT / TPOT / descriptors" for m in HEADLINE)
    rows = []
    for label, alloc, frag in (("static shuffle, fragmentation 0.05 (default)", "static", 0.05),
                               ("history, fresh pools", "history", 0.0),
                               ("history, warm pools (0.05)", "history", 0.05)):
        prof = _with(prefill={"allocator": alloc, "fragmentation": frag},
                     decode={"allocator": alloc, "fragmentation": frag})
        rows.append((label, tuple(_point(m, 8, 16384, prof) for m in HEADLINE)))
    return Scenario("allocator", _doc(allocator), cols, tuple(rows), _descriptors)


def control() -> Scenario:
    """The control plane's price: time per message on each end, and a handshake at first
    contact (2 s) paid by the run's first transfer instead of a warm-up request. 1 QPS
    and 8 QPS, 16k input; cells are TTFT / TPOT in ms."""
    rows = []
    for label, ctl in (("messages free, met before the run", {"message_send_s": 0.0,
                                                               "message_recv_s": 0.0}),
                       ("30 us per message and end (default)", {}),
                       ("300 us per message and end", {"message_send_s": 3e-4,
                                                      "message_recv_s": 3e-4}),
                       ("first contact in the run (2 s handshake)",
                        {"handshake_before_run": False})):
        prof = _with(control=ctl) if ctl else DEFAULT
        rows.append((label, tuple(_point(m, q, 16384, prof)
                                  for q in (1, 8) for m in HEADLINE)))
    cols = tuple(f"{m}, {q} QPS" for q in (1, 8) for m in HEADLINE)
    return Scenario("control", _doc(control), cols, tuple(rows), _latency)


def memory() -> Scenario:
    """Decode memory pressure: a decode pool of 8 x 16k prompts' worth of blocks, so the
    8 running requests' growth needs more than is free. Preempting the newest running
    request (vLLM) recomputes it on decode; 'reissue' first preempts a push transfer
    still in flight and registers it again. 8 QPS, 16k input; cells: outcomes."""
    m, g, d = DEFAULT.model, DEFAULT.gpu, DEFAULT.decode
    per_block = m.kv_bytes_per_token(d.tp) * d.block_size
    blocks = 8 * 16384 // d.block_size + 16
    reserve = g.memory_bytes * d.gpu_memory_utilization - m.weight_bytes_per_gpu(d.tp) - (
        blocks + 0.5) * per_block
    rows = tuple(
        (f"preemption {p}", tuple(
            _point(mode, 8, 16384, _with(decode={"preemption": p,
                                                 "activation_reserve_bytes": reserve}))
            for mode in HEADLINE))
        for p in ("off", "recompute", "reissue"))
    return Scenario("memory", _doc(memory), HEADLINE, rows, _preempted)


def _preempted(res: dict[str, Any]) -> str:
    e = res["pushkv"]
    return (f"TTFT {res['mean_ttft_ms']:,.0f} / TPOT {res['mean_tpot_ms']:.2f}; "
            f"{e['preempted']} preempted, {e['recomputed']} recomputed, "
            f"{e['leaked_blocks']} leaked")


def sharing() -> Scenario:
    """Two prefill instances writing into one decode node share its NICs fairly (different
    posters); one poster's transfers leave in order. 2P1D, 8 QPS, 16k; TTFT / TPOT."""
    return Scenario(
        "sharing", _doc(sharing), HEAD_COLS,
        tuple((f"{s} sharing", tuple(_point(m, 8, 16384, _with(network={"sharing": s}),
                                            num_prefill=2) for m in HEADLINE))
              for s in ("fair", "fifo")),
        _latency,
    )


def _packing_cell(res: dict[str, Any]) -> str:
    e = res["pushkv"]
    share = e["prefill_post_ms"] / max(e["prefill_busy_s"] * 1000, 1e-9)
    return f"{res['mean_ttft_ms']:,.0f} / {res['mean_tpot_ms']:.2f} / {share:.1%}"


def packing() -> Scenario:
    """Packed writes chosen by the transports' cost model: gather into staging on the
    prefill GPU, a few 16 MiB descriptors, scatter on decode. On EFA (3 us per
    descriptor) a fragmented 16k request's 100k+ descriptors cost far more thread time
    than two device copies at 1 TB/s, so the model packs; a contiguous cache stays
    direct. 8 QPS, 16k input; cells are TTFT / TPOT (ms) / the prefill writer thread's
    posting time as a share of the prefill engine's busy time (above 100%: the writer
    posts longer than the engine computes, and writes queue)."""
    modes = ("never", "auto")
    rows = []
    for f in (0.0, 0.05, 0.2):
        prof = _with(prefill={"fragmentation": f}, decode={"fragmentation": f})
        rows.append((f"fragmentation {f:g}", tuple(
            _point("push", 8, 16384, prof, packing=dataclasses.replace(SIM_PACKING, mode=m))
            for m in modes)))
    return Scenario("packing", _doc(packing),
                    tuple(f"push, pack {m}: TTFT / TPOT / post share" for m in modes),
                    tuple(rows), _packing_cell)


SCENARIOS: dict[str, Callable[[], Scenario]] = {
    "prefix-hit": prefix_hit, "fragmentation": fragmentation, "post-cost": post_cost,
    "rate-coupling": rate_coupling, "decode-slots": decode_slots,
    "num-prompts": num_prompts, "modes": modes, "router": router, "faults": faults,
    "failover": failover,
    "xpyd": xpyd, "gil": gil, "rank-skew": rank_skew, "allocator": allocator,
    "control": control, "memory": memory, "sharing": sharing, "packing": packing,
}


def mean_result(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The numeric fields of several runs' results (top level and ``pushkv``), averaged;
    counts that come out whole stay integers."""
    def avg(vals: list[Any]) -> Any:
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            return vals[0]
        m = sum(vals) / len(vals)
        if all(isinstance(v, int) for v in vals):
            return int(m) if m == int(m) else round(m, 1)
        return m

    first = results[0]
    out = {k: avg([r[k] for r in results]) for k in first if k != "pushkv"}
    out["pushkv"] = {k: avg([r["pushkv"][k] for r in results]) for k in first["pushkv"]}
    return out


def run_scenario(s: Scenario, jobs: int = 1, seeds: int = 1) -> str:
    """Run every config of ``s`` (each over ``seeds`` iterations, averaged) and return
    its markdown table."""
    flat = [dataclasses.replace(c, iteration=i) for _, cfgs in s.rows for c in cfgs
            for i in range(seeds)]
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            texts = [p.text for p in pool.map(run_point, flat)]
    else:
        texts = [run_point(c).text for c in flat]
    loaded = [json.loads(t) for t in texts]
    results = iter(mean_result(loaded[i:i + seeds]) for i in range(0, len(loaded), seeds))
    lines = ["| | " + " | ".join(s.columns) + " |", "|---" * (len(s.columns) + 1) + "|"]
    for label, cfgs in s.rows:
        lines.append(f"| {label} | " + " | ".join(s.cell(next(results)) for _ in cfgs) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pushkv.sim.scenarios",
                                description="Run named what-if scenarios; print tables.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"scenarios to run: {', '.join(SCENARIOS)}")
    p.add_argument("--all", action="store_true", help="run every scenario")
    p.add_argument("--profile-table", action="store_true",
                   help="print the default profile's parameters with their sources")
    p.add_argument("--jobs", type=int, default=default_jobs(), help="worker processes")
    p.add_argument("--seeds", type=int, default=5,
                   help="iterations per cell; cells show their means (default 5)")
    args = p.parse_args(argv)
    names = list(SCENARIOS) if args.all else args.names
    if args.profile_table:
        print(profile_markdown())
        if not names:
            return 0
    if not names:
        p.error("name a scenario or pass --all")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r} (choose from {', '.join(SCENARIOS)})")
    for name in names:
        s = SCENARIOS[name]()
        print(f"### {name}\n\n{s.doc}\n\n{run_scenario(s, args.jobs, args.seeds)}\n")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
