"""A plan for people and for scripts: the ranked table, the recommendation and why,
the JSON, and the Pareto plot of goodput per GPU against TTFT."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .search import Outcome, Plan


def _ms(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.0f}%"


def table(plan: Plan, top: int | None = None) -> str:
    """The ranked table: feasible configurations by goodput per GPU, then those that
    met the SLO at no rate tried, then the pruned ones."""
    p = plan.spec.slo.percentile
    pw = f"p{p:g}"
    head = (f"{'#':>3}  {'config':<22} {'GPUs':>4}  {'goodput':>8}  {'per GPU':>7}  "
            f"{pw + ' TTFT':>9}  {pw + ' TPOT':>9}  {'binds':<8} {'KV wait':>7}  {'sims':>4}")
    lines = [head, "-" * len(head)]
    rows = plan.outcomes if top is None else plan.outcomes[:top]
    for i, o in enumerate(rows, 1):
        v = o.at_goodput
        if o.pruned is not None:
            tail = f"pruned: {o.pruned}"
            lines.append(f"{i:>3}  {o.candidate.label:<22} {o.candidate.gpus:>4}  {tail}")
            continue
        if v is None:
            f = o.first_fail
            tail = (f"misses the SLO at {o.points[0].rate:.3g} req/s already "
                    f"(attainment {_pct(f.attainment if f else None)}, {o.binding})")
            lines.append(f"{i:>3}  {o.candidate.label:<22} {o.candidate.gpus:>4}  {tail}")
            continue
        lines.append(
            f"{i:>3}  {o.candidate.label:<22} {o.candidate.gpus:>4}  {o.goodput:>8.3g}  "
            f"{o.goodput_per_gpu:>7.3g}  {_ms(v.ttft_p):>6} ms  {_ms(v.tpot_p):>6} ms  "
            f"{o.binding:<8} {_pct(v.transfer_share):>7}  {o.simulations:>4}")
    if top is not None and len(plan.outcomes) > top:
        lines.append(f"... {len(plan.outcomes) - top} more (--top 0 shows all)")
    return "\n".join(lines)


def _twin(plan: Plan, o: Outcome) -> Outcome | None:
    """The same topology under the best other mode."""
    for other in plan.outcomes:
        c = other.candidate
        if (c.mode != o.candidate.mode and c.num_prefill == o.candidate.num_prefill
                and c.num_decode == o.candidate.num_decode and c.tp == o.candidate.tp):
            return other
    return None


def recommendation(plan: Plan) -> dict[str, Any] | None:
    """The winner, the runner-up, and the reasons it won, in words and figures."""
    best = plan.best
    if best is None:
        return None
    slo = plan.spec.slo
    v = best.at_goodput
    assert v is not None
    reasons = [f"the highest goodput per GPU: {best.goodput_per_gpu:.3g} req/s/GPU "
               f"({best.goodput:.3g} req/s on {best.candidate.gpus} GPUs)"]
    feasible = plan.feasible
    runner = feasible[1] if len(feasible) > 1 else None
    if runner is not None:
        ratio = best.goodput_per_gpu / runner.goodput_per_gpu
        rv = runner.at_goodput
        if ratio < 1.005 and rv is not None:  # a tie on goodput: won on TTFT (rank_key)
            reasons.append(f"tied with the runner-up, {runner.candidate.label}, on goodput "
                           f"per GPU, and a lower p{slo.percentile:g} TTFT there "
                           f"({_ms(v.ttft_p)} ms against {_ms(rv.ttft_p)})")
        else:
            reasons.append(f"{ratio:.2f}x the runner-up, {runner.candidate.label} "
                           f"({runner.goodput_per_gpu:.3g}/GPU)")
    if best.binding == "capacity":
        reasons.append("it meets the SLO up to its capacity bound "
                       f"({best.bounds.capacity.side} side)")
    else:
        name = {"ttft": "TTFT", "tpot": "TPOT", "both": "TTFT and TPOT"}[best.binding]
        reasons.append(f"above it the {name} SLO binds")
    twin = _twin(plan, best)
    if twin is not None:
        tv = twin.at_goodput
        if twin.goodput > 0 and tv is not None:
            words = [] if twin is runner else [
                f"{twin.candidate.label} reaches {twin.goodput_per_gpu:.3g}/GPU "
                f"(this one {best.goodput / twin.goodput:.2f}x its goodput)"]
            if math.isfinite(tv.transfer_share) and math.isfinite(v.transfer_share):
                words.append(f"with {twin.candidate.mode} the KV wait after prefill is "
                             f"{_pct(tv.transfer_share)} of TTFT at its goodput rate, "
                             f"{_pct(v.transfer_share)} here")
            reasons.extend(words)
        elif twin.pruned is not None:
            reasons.append(f"{twin.candidate.label} cannot meet the SLO ({twin.pruned})")
        else:
            reasons.append(f"{twin.candidate.label} misses the SLO at every rate tried")
    return {
        "config": _config(best),
        "goodput_rps": best.goodput,
        "goodput_per_gpu": best.goodput_per_gpu,
        f"p{slo.percentile:g}_ttft_s": v.ttft_p,
        f"p{slo.percentile:g}_tpot_s": v.tpot_p,
        "binding": best.binding,
        "runner_up": _config(runner) if runner is not None else None,
        "reason": "; ".join(reasons),
    }


def _config(o: Outcome) -> dict[str, Any]:
    c = o.candidate
    return {"label": c.label, "mode": c.mode, "pack": c.pack, "num_prefill": c.num_prefill,
            "num_decode": c.num_decode, "tp": c.tp, "gpus": c.gpus}


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None  # JSON has no inf / nan


def _verdict(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    return {"rate_rps": v.rate, "attainment": v.attainment,
            "ttft_attainment": v.ttft_attainment, "tpot_attainment": v.tpot_attainment,
            "ttft_p_s": _num(v.ttft_p), "tpot_p_s": _num(v.tpot_p),
            "transfer_share": _num(v.transfer_share), "failed": v.failed,
            "requests": v.requests}


def to_json(plan: Plan) -> dict[str, Any]:
    """Everything the plan found, for scripts (``pushkv plan --json``)."""
    s = plan.spec
    w = s.workload
    return {
        "profile": s.profile.name,
        "workload": {"input_len": w.input_len, "output_len": w.output_len,
                     "num_prompts": w.num_prompts, "burstiness": w.burstiness,
                     "arrivals": w.arrivals, "seed": w.seed, "seeds": s.seeds,
                     "trace": None if s.trace is None else {
                         "name": s.trace.name, "requests": len(s.trace.requests),
                         "mean_rate_rps": s.trace.mean_rate}},
        "slo": {"ttft_s": s.slo.ttft_s, "tpot_s": s.slo.tpot_s,
                "percentile": s.slo.percentile, "attainment": s.slo.attainment},
        "budget_gpus": s.gpus,
        "search": {"modes": list(s.modes), "rate_tol": s.rate_tol,
                   "rate_range": s.rate_range},
        "configurations": len(plan.outcomes),
        "pruned": sum(o.pruned is not None for o in plan.outcomes),
        "simulations_run": plan.simulations,
        "full_grid_simulations": plan.full_grid,
        "wall_s": plan.wall_s,
        "jobs": plan.jobs,
        "backend": plan.backend,
        "reruns": plan.reruns,
        "recommended": recommendation(plan),
        "ranked": [
            {**_config(o), "goodput_rps": o.goodput, "goodput_per_gpu": o.goodput_per_gpu,
             "binding": o.binding, "pruned": o.pruned,
             "ttft_floor_s": o.bounds.ttft_floor, "tpot_floor_s": o.bounds.tpot_floor,
             "capacity_rps": o.bounds.capacity.rate,
             "at_goodput": _verdict(o.at_goodput), "first_fail": _verdict(o.first_fail),
             "rates_simulated": [v.rate for v in o.points], "simulations": o.simulations}
            for o in plan.outcomes
        ],
    }


def pareto(plan: Plan) -> list[Outcome]:
    """Feasible configurations no other beats on both goodput per GPU (higher) and
    TTFT at its goodput rate (lower), by ascending TTFT."""
    pts = sorted((o for o in plan.feasible if o.at_goodput is not None),
                 key=lambda o: (o.at_goodput.ttft_p, -o.goodput_per_gpu))  # type: ignore[union-attr]
    front: list[Outcome] = []
    for o in pts:
        if not front or o.goodput_per_gpu > front[-1].goodput_per_gpu:
            front.append(o)
    return front


_COLOURS = {"pull": "tab:red", "push": "tab:blue", "pull-async": "tab:orange",
            "push-seq": "tab:green", "auto": "tab:purple", "auto-seq": "tab:brown"}


def plot_pareto(plan: Plan, out: str | Path) -> Path:
    """Goodput per GPU against TTFT at the goodput rate, one point per feasible
    configuration, the Pareto front joined and labelled. Writes a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slo = plan.spec.slo
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for mode in plan.spec.modes:
        pts = [o for o in plan.feasible if o.candidate.mode == mode and o.at_goodput]
        ax.scatter([o.at_goodput.ttft_p for o in pts],  # type: ignore[union-attr]
                   [o.goodput_per_gpu for o in pts], label=mode,
                   color=_COLOURS.get(mode), alpha=0.75)
    front = pareto(plan)
    if front:
        ax.plot([o.at_goodput.ttft_p for o in front],  # type: ignore[union-attr]
                [o.goodput_per_gpu for o in front], color="black", lw=1, ls="--",
                label="Pareto front")
        for o in front:
            ax.annotate(o.candidate.label, (o.at_goodput.ttft_p,  # type: ignore[union-attr]
                                            o.goodput_per_gpu),
                        textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(slo.ttft_s, color="grey", lw=0.8, ls=":", label="TTFT SLO")
    ax.set_xlabel(f"p{slo.percentile:g} TTFT at the goodput rate (s)")
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title(f"{plan.spec.profile.name}: in={plan.spec.workload.input_len} "
                 f"out={plan.spec.workload.output_len}, SLO TTFT {slo.ttft_s:g} s "
                 f"TPOT {slo.tpot_s:g} s @ {100 * slo.attainment:g}%", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["pareto", "plot_pareto", "recommendation", "table", "to_json"]
