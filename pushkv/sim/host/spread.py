"""Host times around their medians: the spread of the frontends' and hand-offs' times.

The connector keys (:mod:`pushkv.fit.measure_connector`) are medians: a leg's time in
its API server, a prefill answer's way out, a scheduler-to-worker hand-off, the
progress threads' polls. On shared CPU cores each is right-skewed -- most requests pay
about the median, some pay several times it while their process waits for a core -- so
a model paying the median every time gives the right median of one segment but too
small a mean, and a sum of medians below the median of the sums.

With ``host.spread`` (multipliers, equally likely) each time a request pays one
of those host times it pays it times a multiplier drawn at random (one stream per run,
seeded like the others); empty, it pays the median every time. The multipliers are
measured (:func:`pushkv.fit.measure_connector.host_spread`): each request's time in each
keyed segment over that key's median, pooled over the keys, at evenly spaced quantiles.
Draws are independent across segments and requests: a stall that holds a process for
several segments of one request is not modelled as one.

Where a host time is a job on the frontends' shared CPU queue (``host.frontend_cores``)
only the part up to the median is work there (:meth:`Spread.split`); the part above it is
waiting -- a process stalled for a core holds none -- paid after the job, outside the
queue. So a long draw delays its own request, not every request queued behind it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class Spread:
    """``spread(seconds)``: ``seconds`` times one of ``multipliers`` drawn at random, or
    ``seconds`` itself without multipliers (and for 0, drawing nothing)."""

    def __init__(self, multipliers: Sequence[float] = (),
                 rng: np.random.Generator | None = None) -> None:
        self.multipliers = tuple(float(m) for m in multipliers)
        self._rng = rng if rng is not None else np.random.default_rng(0)

    def __call__(self, seconds: float) -> float:
        work, wait = self.split(seconds)
        return work + wait

    def split(self, seconds: float) -> tuple[float, float]:
        """One draw of ``seconds`` as (work, wait): ``seconds`` x min(m, 1) and
        ``seconds`` x max(m - 1, 0) for the drawn multiplier m."""
        if not self.multipliers or seconds <= 0:
            return seconds, 0.0
        m = self.multipliers[int(self._rng.integers(len(self.multipliers)))]
        return seconds * min(m, 1.0), seconds * max(m - 1.0, 0.0)

    @property
    def mean(self) -> float:
        """The multipliers' mean (1 without): what the spread does to a mean host time."""
        return float(np.mean(self.multipliers)) if self.multipliers else 1.0


#: No spread: every host time is its median.
NONE = Spread()
