"""The run's verdict: per-mode medians, paired overheads over the plain server, their
ratios and 95% intervals over rounds, and the tables printed at the end of a run."""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pushkv import timeline

from .modes import MODES
from .router_modes import router_verdict


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def finite(x: float, digits: int = 3) -> float | None:
    """``x`` rounded, or None (JSON null) when it could not be measured."""
    return round(x, digits) if x == x and abs(x) != float("inf") else None


def paired_overheads(records: list[dict[str, Any]], mode: str, base: str,
                     load: str) -> dict[tuple[str, int], list[float]]:
    """Per round (phase, iteration): ``mode``'s median latency minus ``base``'s in that
    round, one value per round, or one per prompt in an interleaved sequential round.
    With ``--phases turns`` ``base`` served each deployment's turn of a round apart, and
    a mode pairs with ``base``'s requests of its own turn."""
    per: dict[tuple[str, str, int, int, str], list[float]] = {}
    for r in records:
        if r["load"] == load and r["mode"] in (mode, base):
            per.setdefault((r["mode"], r["phase"], r["iter"], r.get("slot", -1),
                            r.get("turn") or ""), []).append(r["latency_ms"])
    out: dict[tuple[str, int], list[float]] = {}
    for (m, ph, it, sl, turn), v in sorted(per.items()):
        if m == mode and (base, ph, it, sl, turn) in per:
            out.setdefault((ph, it), []).append(
                median(v) - median(per[base, ph, it, sl, turn]))
    return out


def _draws(keys: list[tuple[str, int]], draws: int, seed: int
           ) -> Iterator[list[tuple[str, int]]]:
    """``draws`` resamples of ``keys`` with replacement (the bootstrap's draws)."""
    rng = random.Random(seed)
    for _ in range(draws):
        yield [keys[rng.randrange(len(keys))] for _ in keys]


def _ci95(values: list[float]) -> tuple[float, float]:
    return timeline.percentile(values, 0.025), timeline.percentile(values, 0.975)


def bootstrap_ratio(records: list[dict[str, Any]], ours: str, theirs: str, base: str,
                    load: str, *, draws: int = 2000, seed: int = 0
                    ) -> tuple[float, float] | None:
    """95% interval of median(ours - base) / median(theirs - base) over rounds drawn
    with replacement (rounds, not requests, are the independent unit: a round's
    requests share the machine's state). Rounds both modes served (one phase) are
    drawn together, keeping what the two share; otherwise (``--phases each``) each
    mode's rounds are drawn on their own. None with fewer than 3 rounds of each."""
    a = paired_overheads(records, ours, base, load)
    b = paired_overheads(records, theirs, base, load)
    together = set(a) == set(b)
    ra, rb = sorted(a), sorted(b)
    if min(len(ra), len(rb)) < 3:
        return None
    picks_b = _draws(rb, draws, seed + 1)
    ratios: list[float] = []
    for pick_a in _draws(ra, draws, seed):
        pick_b = pick_a if together else next(picks_b)
        den = median([x for k in pick_b for x in b[k]])
        if den > 0:
            ratios.append(median([x for k in pick_a for x in a[k]]) / den)
    if len(ratios) < draws // 2:  # vLLM push's overhead is not clearly positive
        return None
    return _ci95(ratios)


def bootstrap_overhead(records: list[dict[str, Any]], mode: str, base: str, load: str, *,
                       draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of the median of ``mode``'s overhead over ``base`` (rounds drawn with
    replacement, as in :func:`bootstrap_ratio`). None with fewer than 3 rounds."""
    a = paired_overheads(records, mode, base, load)
    if len(a) < 3:
        return None
    return _ci95([median([x for k in pick for x in a[k]])
                  for pick in _draws(sorted(a), draws, seed)])


def round_latencies(records: list[dict[str, Any]], mode: str, load: str
                    ) -> dict[tuple[str, int], list[float]]:
    """``mode``'s latencies (ms) of ``load``, per round (phase, iteration)."""
    out: dict[tuple[str, int], list[float]] = {}
    for r in records:
        if r["mode"] == mode and r["load"] == load:
            out.setdefault((r["phase"], r["iter"]), []).append(r["latency_ms"])
    return out


def latency_ratio(records: list[dict[str, Any]], ours: str, theirs: str, load: str, *,
                  draws: int = 2000, seed: int = 0
                  ) -> tuple[float, tuple[float, float] | None, int]:
    """The median over rounds of ``ours``' round median latency over the same of
    ``theirs``, its 95% interval (rounds both served drawn with replacement, each draw
    keeping a round's two medians together: they shared the machine's state; None
    with fewer than 3 such rounds), and the rounds counted. NaN without rounds."""
    a = round_latencies(records, ours, load)
    b = round_latencies(records, theirs, load)
    keys = sorted(set(a) & set(b))
    if not keys:
        return float("nan"), None, 0

    def ratio(pick: list[tuple[str, int]]) -> float:
        return median([median(a[k]) for k in pick]) / median([median(b[k]) for k in pick])

    point = ratio(keys)
    if len(keys) < 3:
        return point, None, len(keys)
    return point, _ci95([ratio(pick) for pick in _draws(keys, draws, seed)]), len(keys)


def router_intervals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Behind vllm-router: pushkv over vLLM pull per load (``router_pushkv_vs_pull_<load>``:
    the latency ratio, :func:`latency_ratio`, with ``_ci95``), the same of pushkv forced
    to push behind the router (``router_pushkv_push_vs_pull_<load>``) and of pushkv's own
    proxy (``proxy_pushkv_vs_router_pull_<load>``) over vLLM pull, when they ran, each
    one's overhead over plain as a ratio with its interval (``..._overhead_ratio``:
    :func:`bootstrap_ratio`), and ``router_rounds`` (rounds both router modes served)."""
    out: dict[str, Any] = {}
    rounds = 0
    for load in ("seq", "conc"):
        for ours, key in (("router-pushkv", "router_pushkv_vs_pull"),
                          ("router-pushkv-push", "router_pushkv_push_vs_pull"),
                          ("push", "proxy_pushkv_vs_router_pull")):
            point, ci, n = latency_ratio(records, ours, "router-pull", load)
            if not n:
                continue
            rounds = max(rounds, n) if ours == "router-pushkv" else rounds
            out[f"{key}_{load}"] = finite(point)
            out[f"{key}_{load}_ci95"] = [finite(x) for x in ci] if ci else None
            ov = bootstrap_ratio(records, ours, "router-pull", "plain", load)
            pa = [x for v in paired_overheads(records, ours, "plain", load).values()
                  for x in v]
            pb = [x for v in paired_overheads(records, "router-pull", "plain", load).values()
                  for x in v]
            den = median(pb)
            out[f"{key}_{load}_overhead_ratio"] = finite(median(pa) / den) if pa and den and \
                den > 0 else None
            out[f"{key}_{load}_overhead_ratio_ci95"] = [finite(x) for x in ov] if ov else None
    if rounds:
        # overall: the sequential load (one request at a time: the transfer is on
        # every request's critical path)
        out["router_pushkv_vs_pull"] = out.get("router_pushkv_vs_pull_seq")
        out["router_rounds"] = rounds
    return out


def verdict(records: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """The run's one JSON object: per-mode medians and pushkv's overhead ratios.

    A mode's overhead is paired: its median latency in a round minus the plain
    server's in the same round (same phase, same prompts), the median over rounds;
    in an interleaved sequential round, its latency for each prompt minus plain's for
    the same prompt a moment apart, the median over every prompt of every round.
    ``..._ci95``: the ratio's 95% interval over rounds (:func:`bootstrap_ratio`)."""

    def paired(mode: str, base: str, load: str) -> list[float]:
        """Per round (slot -1), or per prompt of an interleaved round."""
        return [x for v in paired_overheads(records, mode, base, load).values() for x in v]

    def run_medians(mode: str, load: str, key: str) -> list[float]:
        groups: dict[tuple[str, int], list[float]] = {}
        for r in records:
            if r["mode"] == mode and r["load"] == load:
                groups.setdefault((r["phase"], r["iter"]), []).append(r[key])
        return [median(v) for v in groups.values()]

    out: dict[str, Any] = {}
    for load in ("seq", "conc"):
        push = median(paired("push-client", "plain", load))
        vllm = median(paired("vllm-push-client", "plain", load))
        out[f"overhead_ratio_vs_vllm_push_{load}"] = finite(push / vllm) if vllm else None
        lo_hi = bootstrap_ratio(records, "push-client", "vllm-push-client", "plain", load)
        out[f"overhead_ratio_vs_vllm_push_{load}_ci95"] = (
            [finite(x) for x in lo_hi] if lo_hi else None)
        out[f"overhead_ms_{load}"] = {m: finite(median(paired(m, "plain", load)), 2)
                                      for m in modes if m != "plain"
                                      and paired(m, "plain", load)}
    for load in ("seq", "conc"):
        # The plain baseline runs a replica per core (--plain-cores); with one plain
        # server on one core, concurrent load makes plain slower than both pairs, the
        # overheads negative and their ratio meaningless; the latencies' ratio still
        # says which connector is faster.
        ours = median(run_medians("push-client", load, "latency_ms"))
        theirs = median(run_medians("vllm-push-client", load, "latency_ms"))
        out[f"latency_ratio_vs_vllm_push_{load}"] = finite(ours / theirs) if theirs else None
    # what pushkv proxy adds over the client dispatching itself; push-asyncio: on
    # asyncio's loop (reported only when that mode ran)
    for mode, key in (("push", "proxy_hop"), ("push-asyncio", "proxy_hop_asyncio")):
        if mode == "push" or paired(mode, "push-client", "seq"):
            out[f"{key}_ms"] = finite(median(paired(mode, "push-client", "seq")), 2)
            hop = bootstrap_overhead(records, mode, "push-client", "seq")
            out[f"{key}_ms_ci95"] = [finite(x, 2) for x in hop] if hop else None
    # the router's CPU per request, a mean (ticks of 10 ms, so one request's is 0 or 10)
    cpu = {m: [x for r in records if r["mode"] == m
               and (x := r.get("router_cpu_ms")) is not None and x == x] for m in modes}
    out["router_cpu_ms_per_request"] = {m: round(statistics.fmean(v), 2)
                                        for m, v in cpu.items() if v}
    for key in ("latency_ms", "ttft_ms", "tpot_ms"):
        out[f"median_{key}"] = {f"{m}_{ld}": round(median(run_medians(m, ld, key)), 2)
                                for m in modes for ld in ("seq", "conc")
                                if run_medians(m, ld, key)}
    out |= router_verdict({(m, ld): median(run_medians(m, ld, "latency_ms"))
                           for m in modes for ld in ("seq", "conc")})
    out |= router_intervals(records)
    out["outputs_identical_to_plain"] = all(r["same_as_plain"] for r in records)
    out["rounds"] = len({(r["phase"], r["iter"]) for r in records})
    return out


def latency_table(summary: dict[str, Any], modes: list[str]) -> str:
    lines = ["| mode | load | latency (ms) | TTFT (ms) | TPOT (ms) |", "|---|---|---|---|---|"]
    for m in modes:
        for ld in ("seq", "conc"):
            k = f"{m}_{ld}"
            if k in summary["median_latency_ms"]:
                lines.append(f"| {m} | {ld} | {summary['median_latency_ms'][k]:.1f} | "
                             f"{summary['median_ttft_ms'][k]:.1f} | "
                             f"{summary['median_tpot_ms'][k]:.2f} |")
    return "\n".join(lines)


def timeline_report(out: Path, modes: list[str]) -> str:
    """Median / p90 of every timeline segment, per mode (router/client marks joined with
    their deployment's server marks by request id)."""
    stats: dict[str, dict[str, dict[str, float]]] = {}
    for name in modes:
        mode = MODES[name]
        own = timeline.read(out / "timeline" / name)
        ids = {m.transfer_id for m in own}
        server = [m for m in timeline.read(out / "timeline" / mode.deployment)
                  if m.transfer_id in ids]
        segs = timeline.segments(timeline.by_request(own + server))
        stats[name] = {k: {"median": median(v), "p90": timeline.percentile(v, 0.9),
                           "n": len(v)} for k, v in segs.items()}
    (out / "timeline.json").write_text(json.dumps(stats, indent=1))
    return timeline.table(stats)


def pooled_verdict(dirs: list[Path]) -> dict[str, Any]:
    """:func:`verdict` over the rounds of several runs (each run's phases kept apart)."""
    records: list[dict[str, Any]] = []
    modes: list[str] = []
    for i, d in enumerate(dirs):
        path = d / "latency.json"
        if not path.is_file():
            raise SystemExit(f"--verdict-of: {path} does not exist")
        for r in json.loads(path.read_text()):
            records.append(dict(r, phase=f"{r['phase']}@{i}"))
            if r["mode"] not in modes:
                modes.append(r["mode"])
    out = verdict(records, [m for m in MODES if m in modes])
    out["runs"] = [str(d) for d in dirs]
    return out
