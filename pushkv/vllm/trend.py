"""Is a series rising? A trend test for soak figures (p99 latency per window).

A ratio of the last window to the first says little: a p99 of a few hundred
requests is two or three requests' latency, and on a shared machine one window
can be twice its neighbours with nothing wrong. What a soak must rule out is a
*trend*: latency that keeps growing with the requests served (a leak, a queue
that never drains). So the question is put to every window at once:

* **Mann-Kendall**: ``S`` = (pairs ``i < j`` with ``x_j > x_i``) minus (pairs
  with ``x_j < x_i``). Under "no trend" every order of the values is equally
  likely; the one-sided p-value is the chance of an ``S`` at least this large.
  Without ties it is exact: ``S = n(n-1)/2 - 2 * inversions`` and the number
  of permutations of ``n`` with ``k`` inversions is a Mahonian number. With ties
  the normal approximation with the tie-corrected variance (Kendall 1975) is used.
* **Theil-Sen**: the median of the pairwise slopes ``(x_j - x_i) / (j - i)``,
  robust to a few outliers; ``rise`` is that slope over the run (``n - 1``
  windows) as a fraction of the series' median.

A series is *rising* when the test rejects "no trend" at ``alpha`` (one-sided,
increasing). The slope is reported beside it, so a reader sees how much.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

#: One-sided significance of a rise.
ALPHA = 0.05


@dataclass(frozen=True)
class Trend:
    """The trend of one series."""

    n: int
    s: int  #: Mann-Kendall statistic
    p_rising: float  #: one-sided p-value of an increasing trend
    slope: float  #: Theil-Sen slope, per step
    rise: float  #: slope * (n - 1) / median of the series (0 when the median is 0)
    alpha: float = ALPHA

    @property
    def rising(self) -> bool:
        return self.p_rising < self.alpha

    def figures(self) -> dict[str, float | int | bool]:
        return {"n": self.n, "mann_kendall_s": self.s, "p_rising": round(self.p_rising, 4),
                "theil_sen_slope": round(self.slope, 3), "rise_pct": round(100 * self.rise, 1),
                "rising": self.rising}


def _mahonian(n: int) -> list[int]:
    """Permutations of ``n`` items by number of inversions (index = inversions)."""
    counts = [1]
    for m in range(2, n + 1):  # insert the m-th item: it adds 0 .. m-1 inversions
        nxt = [0] * (len(counts) + m - 1)
        for k, c in enumerate(counts):
            for extra in range(m):
                nxt[k + extra] += c
        counts = nxt
    return counts


def mann_kendall_s(values: Sequence[float]) -> int:
    n = len(values)
    return sum((values[j] > values[i]) - (values[j] < values[i])
               for i in range(n) for j in range(i + 1, n))


def p_rising(values: Sequence[float]) -> float:
    """One-sided p-value of "the series increases" against "every order equally likely"."""
    n = len(values)
    if n < 2:
        return 1.0
    s = mann_kendall_s(values)
    ties = [t for t in Counter(values).values() if t > 1]
    if not ties:
        pairs = n * (n - 1) // 2
        counts = _mahonian(n)
        # S >= s  <=>  inversions <= (pairs - s) / 2
        limit = (pairs - s) // 2
        return sum(counts[: limit + 1]) / math.factorial(n)
    var = (n * (n - 1) * (2 * n + 5) - sum(t * (t - 1) * (2 * t + 5) for t in ties)) / 18
    if var <= 0:
        return 1.0
    z = (s - 1) / math.sqrt(var) if s > 0 else 0.0 if s == 0 else (s + 1) / math.sqrt(var)
    return 0.5 * math.erfc(z / math.sqrt(2))


def theil_sen(values: Sequence[float]) -> float:
    n = len(values)
    slopes = [(values[j] - values[i]) / (j - i) for i in range(n) for j in range(i + 1, n)]
    return statistics.median(slopes) if slopes else 0.0


def trend(values: Sequence[float], alpha: float = ALPHA) -> Trend:
    """The trend of ``values`` (in the order they were measured)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    if any(not math.isfinite(v) for v in values):
        raise ValueError("a trend needs finite values")
    vals = [float(v) for v in values]
    n = len(vals)
    slope = theil_sen(vals)
    mid = statistics.median(vals) if vals else 0.0
    rise = slope * (n - 1) / mid if mid and n > 1 else 0.0
    return Trend(n=n, s=mann_kendall_s(vals), p_rising=p_rising(vals), slope=slope,
                 rise=rise, alpha=alpha)


__all__ = ["ALPHA", "Trend", "mann_kendall_s", "p_rising", "theil_sen", "trend"]
