"""Where a request's hand-off into decode's API server goes: the accounting.

``benchmarks/bench_handoff_waits.py`` runs a real pushkv push pair behind its router,
sends short requests alone and beside a long streaming one, and samples every
thread's ``schedstat`` of the router, decode's API server, decode's engine and
prefill's instance every ~2 ms (:class:`pushkv.hostprobe.ThreadReader` under
:class:`pushkv.fit.sim_vs_real.deployment.SchedSamples`). This is what it makes of
them: each short request's 'legs out -> decode arrives' (:data:`SEGMENT`,
:func:`handoffs`), what each part's threads ran and waited on a run queue around it
(:func:`bracket`, :func:`by_part`), and how many of decode's API server's threads
waited around the slow ones (:func:`api_wait_share`).
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence

#: a sample: when, and per thread id (run ns, run-queue wait ns, slices)
Sample = tuple[float, dict[str, tuple[int, int, int]]]
#: the segment this measures (:data:`pushkv.timeline.SEGMENTS`)
SEGMENT = ("legs_sent", "decode_arrived")


def bracket(samples: Sequence[Sample], t0: float, t1: float) -> tuple[int, int]:
    """The indices of the last sample at or before ``t0`` and the first at or after
    ``t1`` (the nearest where none is): samples at least as far apart as the interval
    (further where the sampler itself waited for a core)."""
    times = [t for t, _ in samples]
    return (max(0, bisect.bisect_right(times, t0) - 1),
            min(len(samples) - 1, bisect.bisect_left(times, t1)))


def by_part(samples: Sequence[Sample], names: Mapping[str, tuple[str, str]],
            t0: float, t1: float) -> dict[str, tuple[float, float]]:
    """Per part, the seconds its threads ran and waited on a run queue over the
    :func:`bracket` of ``t0``-``t1``. Parts that did neither are left out."""
    if not samples:
        return {}
    i, j = bracket(samples, t0, t1)
    a, b = samples[i][1], samples[j][1]
    out: dict[str, list[float]] = {}
    for tid, (run, wait, _) in b.items():
        if tid not in a or tid not in names:
            continue
        d_run, d_wait = (run - a[tid][0]) / 1e9, (wait - a[tid][1]) / 1e9
        if d_run > 0 or d_wait > 0:
            got = out.setdefault(names[tid][0], [0.0, 0.0])
            got[0] += d_run
            got[1] += d_wait
    return {part: (v[0], v[1]) for part, v in out.items()}


def stats_ms(xs: Sequence[float]) -> dict[str, float]:
    """Mean, median, p90 and the largest of ``xs`` (seconds), in ms."""
    got = sorted(xs)
    if not got:
        return {"n": 0}
    return {"n": len(got), "mean": round(statistics.fmean(got) * 1e3, 2),
            "median": round(statistics.median(got) * 1e3, 2),
            "p90": round(got[min(len(got) - 1, int(0.9 * len(got)))] * 1e3, 2),
            "max": round(got[-1] * 1e3, 2)}


def handoffs(requests: Mapping[str, Mapping[str, float]],
             sent: Sequence[tuple[str, float, float]]) -> dict[str, list[tuple[float, float]]]:
    """Per group of ``sent`` ((group, t0, t1): a short request's send and answer), the
    (legs out, decode arrives) of the one request whose legs went out in its window;
    windows with none or several (a retried leg) are skipped."""
    out: dict[str, list[tuple[float, float]]] = {}
    for group, t0, t1 in sent:
        got = [r for r in requests.values()
               if all(k in r for k in SEGMENT) and t0 <= r[SEGMENT[0]] <= t1]
        if len(got) == 1:
            out.setdefault(group, []).append((got[0][SEGMENT[0]], got[0][SEGMENT[1]]))
    return out


def api_wait_share(slow: Sequence[tuple[float, float]], samples: Sequence[Sample],
                   names: Mapping[str, tuple[str, str]], part: str = "decode_api") -> float:
    """Over the slow hand-offs' :func:`bracket` s, how many of ``part``'s threads
    waited on a run queue on average (their wait over the brackets' time; 1: one thread
    waiting throughout; 0 without samples or hand-offs)."""
    total = waited = 0.0
    for t0, t1 in slow:
        if not samples:
            break
        i, j = bracket(samples, t0, t1)
        total += samples[j][0] - samples[i][0]
        waited += by_part(samples, names, t0, t1).get(part, (0.0, 0.0))[1]
    return waited / total if total > 0 else 0.0
