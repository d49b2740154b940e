"""The simulator profile's connector keys, from a real pushkv pair's timeline.

A plain vLLM server (what :mod:`pushkv.sim.measure` times otherwise) cannot show
what a disaggregated request pays on the connector servers: each leg's way through
its instance's API server while two servers and the client share the cores, a
token's way back, the hand-offs between a step's scheduler and its worker. The
:mod:`pushkv.timeline` marks of a real pushkv pair show them segment by segment;
:func:`connector_keys` turns their medians into the engine keys of
:data:`pushkv.sim.profile.CONNECTOR_KEYS` (``python -m pushkv.sim.measure
--connector-timeline DIR ... [--base PROFILE]``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .measure import MeasurementError
from .profile import Profile, ProfileError, profile_from_dict

#: (profile key, segments whose medians it takes) -- see :func:`connector_keys`.
CONNECTOR_SEGMENTS = {
    ("prefill", "ingest_s"): ("legs out -> prefill sees",),
    ("decode", "ingest_s"): ("legs out -> decode sees",),
    ("decode", "return_s"): ("decode step -> first token",),
    ("decode", "order_handoff_s"): ("registration shipped -> handed",),
    ("decode", "event_handoff_s"): ("notification -> ready",),
    ("decode", "admit_lag_s"): ("ready -> scheduler knows", "scheduler knows -> decode step"),
    ("network", "notify_wait_s"): ("write posted -> notification",),
}


def connector_keys(requests: dict[str, dict[str, float]], profile: Profile, *,
                   share: float = 1.0) -> dict[str, dict[str, float]]:
    """The connector keys from a real pair's timeline (``requests``: per request id, each
    mark's time, :func:`pushkv.sim.segments.load`), against ``profile``, the plain-server
    profile they extend: a key is the median of its segments (summed), less what the
    profile already puts there -- ``network.router_hop_s`` for ``ingest_s``; one decode
    step of one sequence and the hop for ``return_s`` -- taken as 0 if that leaves less,
    then scaled to a core of one's own (``x share``, the share a probe met during the
    run; 1: as measured). MeasurementError when a segment is missing or not finite."""
    from .. import timeline

    if not (math.isfinite(share) and 0 < share <= 1):
        raise MeasurementError(f"the timeline's CPU share must be in (0, 1], got {share!r}")
    segs = timeline.segments(requests)
    hop = profile.network.router_hop_s
    step = profile.decode.decode_step_overhead_s + profile.decode.step_token_s
    net = profile.network
    less = {"ingest_s": hop, "return_s": step + hop,
            "notify_wait_s": net.wire_latency_s + net.control_latency_s + net.post_fixed_s}
    out: dict[str, dict[str, float]] = {}
    for (side, key), names in CONNECTOR_SEGMENTS.items():
        total = 0.0
        for name in names:
            values = segs.get(name)
            if not values:
                raise MeasurementError(f"the timeline has no request with both marks of "
                                       f"{name!r} (needed for {side}.{key})")
            med = statistics.median(values) / 1000
            if not math.isfinite(med):
                raise MeasurementError(f"{name!r}: the median is not finite ({med!r})")
            total += med
        out.setdefault(side, {})[key] = max(0.0, total - less.get(key, 0.0)) * share
    return out


def with_connector_keys(data: dict[str, Any], keys: dict[str, dict[str, float]]
                        ) -> dict[str, Any]:
    """``data`` (a profile's tables) with ``keys`` merged in, validated."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    for side, table in keys.items():
        out.setdefault(side, {}).update(table)
    try:
        profile_from_dict(out)
    except ProfileError as exc:
        raise MeasurementError(f"the connector keys make no valid profile: {exc}") from exc
    return out


def connector_header(dirs: Sequence[str | Path], n: int, share: float,
                     keys: dict[str, dict[str, float]]) -> list[str]:
    return [
        f"Connector keys from the pushkv.timeline marks of {n} requests of a real pushkv "
        "pair in", "  " + " ".join(str(d) for d in dirs) + f" (CPU share {share:g}):",
        "  " + ", ".join(f"{side}.{k} {v * 1e3:.3f} ms" for side, t in keys.items()
                         for k, v in t.items()) + ";",
        "  see pushkv.sim.measure_connector.connector_keys for what each subtracts.",
    ]


