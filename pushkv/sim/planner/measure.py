"""One simulated point of a plan: what its requests saw, and how many met the SLO.

:func:`simulate` runs :func:`pushkv.sim.runner.run` on one configuration at one
rate for each seed and keeps, per request, its TTFT, its TPOT and the time its
KV took after prefill answered; :func:`judge` turns that into SLO attainment
(DistServe's: the fraction of requests meeting both the TTFT and the TPOT SLO;
a failed request meets neither) and the percentiles the plan reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..scenario import SimConfig


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets: TTFT and TPOT at ``percentile``, met when at least
    ``attainment`` of the requests meet both."""

    ttft_s: float
    tpot_s: float
    percentile: float = 90.0
    attainment: float = 0.9


@dataclass(frozen=True, slots=True)
class Sample:
    """Per request, over every seed of one point: ``inf`` for a failed request's TTFT
    and TPOT, 0 for the TPOT of a one-token output (vLLM leaves it out: it meets any
    TPOT SLO); ``kv_wait`` is the time from prefill's answer reaching the router to the
    KV in place on decode (``nan`` where unknown)."""

    rate: float
    ttft: tuple[float, ...]
    tpot: tuple[float, ...]
    kv_wait: tuple[float, ...]
    wall_s: float


@dataclass(frozen=True, slots=True)
class Verdict:
    """How one point fared against the SLO."""

    rate: float
    attainment: float  #: fraction meeting both
    ttft_attainment: float  #: fraction meeting the TTFT SLO
    tpot_attainment: float  #: fraction meeting the TPOT SLO
    ttft_p: float  #: TTFT at the SLO's percentile (s; failed requests count as inf)
    tpot_p: float
    transfer_share: float  #: mean KV wait after prefill over mean TTFT (successful requests)
    failed: int
    requests: int

    def meets(self, slo: SLO) -> bool:
        return self.attainment >= slo.attainment

    @property
    def binding(self) -> str:
        """Which SLO holds attainment down here: the one fewer requests meet."""
        if self.ttft_attainment < self.tpot_attainment:
            return "ttft"
        if self.tpot_attainment < self.ttft_attainment:
            return "tpot"
        return "both"


def simulate(cfg: SimConfig, seeds: int) -> Sample:
    """Run ``cfg`` for iterations ``0 .. seeds-1`` (each its own random streams)."""
    import dataclasses

    from ..runner import run

    ttft: list[float] = []
    tpot: list[float] = []
    kv_wait: list[float] = []
    wall = 0.0
    for it in range(seeds):
        r = run(dataclasses.replace(cfg, iteration=it))
        wall += r.wall_s
        res = r.result
        for i, req in enumerate(sorted(r.requests, key=lambda q: q.spec.index)):
            if res["errors"][i] or res["output_lens"][i] == 0:
                ttft.append(math.inf)
                tpot.append(math.inf)
                kv_wait.append(math.nan)
                continue
            t, lat, n = res["ttfts"][i], res["latencies"][i], res["output_lens"][i]
            ttft.append(t)
            tpot.append((lat - t) / (n - 1) if n > 1 else 0.0)
            ok = req.kv_ready_at is not None and req.prefill_done_at is not None
            kv_wait.append(max(0.0, req.kv_ready_at - req.prefill_done_at)  # type: ignore[operator]
                           if ok else math.nan)
    return Sample(rate=cfg.workload.request_rate, ttft=tuple(ttft), tpot=tuple(tpot),
                  kv_wait=tuple(kv_wait), wall_s=wall)


def judge(sample: Sample, slo: SLO) -> Verdict:
    """SLO attainment and the reported figures of one point."""
    ttft = np.asarray(sample.ttft, dtype=float)
    tpot = np.asarray(sample.tpot, dtype=float)
    n = len(ttft)
    t_ok = ttft <= slo.ttft_s
    p_ok = tpot <= slo.tpot_s
    ok = np.isfinite(ttft)
    waits = np.asarray(sample.kv_wait, dtype=float)
    known = ok & np.isfinite(waits)
    share = (float(np.mean(waits[known]) / np.mean(ttft[known]))
             if known.any() and np.mean(ttft[known]) > 0 else math.nan)
    return Verdict(
        rate=sample.rate,
        attainment=float(np.mean(t_ok & p_ok)) if n else 0.0,
        ttft_attainment=float(np.mean(t_ok)) if n else 0.0,
        tpot_attainment=float(np.mean(p_ok)) if n else 0.0,
        ttft_p=_pct(ttft, slo.percentile),
        tpot_p=_pct(tpot, slo.percentile),
        transfer_share=share,
        failed=int(n - ok.sum()),
        requests=n,
    )


def _pct(values: np.ndarray, q: float) -> float:
    """The q-th percentile, ``inf`` when it falls among failed requests ("lower":
    a value some request saw)."""
    if not len(values):
        return math.inf
    return float(np.percentile(values, q, method="higher"))


__all__ = ["SLO", "Sample", "Verdict", "judge", "simulate"]
