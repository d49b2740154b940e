"""The simulator profile's connector keys, from a real pushkv pair's timeline.

A plain vLLM server (what :mod:`pushkv.fit.measure` times otherwise) cannot show
what a disaggregated request pays on the connector servers: each leg's way through
its instance's API server while two servers and the client share the cores, a
token's way back, the hand-offs between a step's scheduler and its worker. The
:mod:`pushkv.timeline` marks of a real pushkv pair show them segment by segment;
:func:`connector_keys` turns their medians into the engine keys of
:data:`pushkv.sim.sections.CONNECTOR_KEYS` (``python -m pushkv.fit.measure
--connector-timeline DIR ... [--base PROFILE]``).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..sim.host import SHARED_CPU
from ..sim.profile import Profile, ProfileError, profile_from_dict
from .cpu_profile import MeasurementError

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


def _median_s(segs: dict[str, list[float]], name: str, needed: str) -> float:
    values = segs.get(name)
    if not values:
        raise MeasurementError(f"the timeline has no request with both marks of {name!r} "
                               f"(needed for {needed})")
    med = statistics.median(values) / 1000
    if not math.isfinite(med):
        raise MeasurementError(f"{name!r}: the median is not finite ({med!r})")
    return med


def _check_share(share: float) -> None:
    if not (math.isfinite(share) and 0 < share <= 1):
        raise MeasurementError(f"the timeline's CPU share must be in (0, 1], got {share!r}")


def connector_steps(requests: dict[str, dict[str, float]], profile: Profile, *,
                    input_len: int, output_len: int, share: float = 1.0
                    ) -> dict[str, dict[str, float]]:
    """The engines' step overheads as the connector servers ran them (requests of
    ``input_len`` prompt tokens and ``output_len`` output tokens, as the run sent them):
    prefill -- median('prefill sees -> prefill finished'), one step, less the profile's
    ``step_token_s`` per prompt token; decode -- median('first token -> last token') /
    (output_len - 1), less its ``step_token_s``; ``step_python_s`` the same (as
    :func:`pushkv.fit.cpu_profile.profile_data` sets it); ``x share``."""
    from .. import timeline

    _check_share(share)
    if input_len < 1 or output_len < 2:
        raise MeasurementError("step times need prompts of 1 token or more and 2 output "
                               f"tokens or more, got {input_len} and {output_len}")
    segs = timeline.segments(requests)
    pre = _median_s(segs, "prefill sees -> prefill finished", "the prefill step")
    dec = _median_s(segs, "first token -> last token", "the decode step") / (output_len - 1)
    p_over = max(0.0, pre - profile.prefill.step_token_s * input_len) * share
    d_over = max(0.0, dec - profile.decode.step_token_s) * share
    return {"prefill": {"prefill_step_overhead_s": p_over, "step_python_s": p_over},
            "decode": {"decode_step_overhead_s": d_over, "step_python_s": d_over}}


#: lone requests :func:`lone_steps` simulates a round, its most rounds, and how close
#: (relative) a simulated step segment must come to its key to stop
LONE_REQUESTS = 8
LONE_ROUNDS = 6
LONE_TOLERANCE = 0.002
#: the step each of :func:`lone_steps`'s segments times: (side, overhead key, segment)
_STEP_SEGMENTS = (("prefill", "prefill_step_overhead_s", "prefill sees -> prefill finished"),
                  ("decode", "decode_step_overhead_s", "first token -> last token"))


def _lone_segments(profile: Profile, *, mode: str, input_len: int, output_len: int,
                   gap_s: float) -> dict[str, float]:
    """Medians of the step segments of :data:`LONE_REQUESTS` requests simulated alone
    with ``profile``, ``gap_s`` apart (evenly), in seconds."""
    from .. import timeline
    from ..sim.marks import Timeline
    from ..sim.runner import run
    from ..sim.scenario import SimConfig, TransferMode
    from ..sim.workload import WorkloadConfig

    marks = Timeline()
    run(SimConfig(mode=TransferMode(mode), profile=profile, workload=WorkloadConfig(
        request_rate=1.0 / gap_s, burstiness=1e6, input_len=input_len, output_len=output_len,
        num_prompts=LONE_REQUESTS)), timeline=marks)
    segs = timeline.segments(marks.requests)
    out = {seg: statistics.median(segs[seg]) / 1000 for _, _, seg in _STEP_SEGMENTS
           if segs.get(seg)}
    ends = [max(m.values()) - min(m.values()) for m in marks.requests.values() if m]
    out["request"] = max(ends) if ends else 0.0
    return out


def _lone_gap(profile: Profile, *, mode: str, input_len: int, output_len: int) -> float:
    """How far apart :func:`lone_steps` sends its requests so each runs alone: four
    times the longest of them sent a second apart."""
    first = _lone_segments(profile, mode=mode, input_len=input_len, output_len=output_len,
                           gap_s=1.0)
    return max(1e-3, 4.0 * first["request"])


def lone_steps(profile: Profile, *, mode: str, input_len: int, output_len: int) -> Profile:
    """``profile`` with its engines' step overheads set so that a request simulated
    alone on the machine's shared cores (``host.cores``, one pool or the engines pinned
    as ``host.pinned`` says) steps as it does on cores of its own: the same medians of
    'prefill sees -> prefill finished' and 'first token -> last token'. A gauge's step
    keys (:func:`connector_steps`) are a lone request's wall times, which already hold
    the work the request itself brings beside its step (the loop that holds it stepping,
    its tokens' way out through the frontends); on shared cores the model adds that work
    again, so here it is taken out of the steps once, by a secant iteration on each
    overhead (at most :data:`LONE_ROUNDS` rounds of :data:`LONE_REQUESTS` requests, each
    alone, to :data:`LONE_TOLERANCE`). ``step_python_s`` keeps its share of the
    overhead. A step that the beside-work alone makes longer than its key stays at 0
    overhead. ``profile`` itself without shared cores."""
    import dataclasses

    if not profile.host.cores:
        return profile
    if output_len < 2:
        raise MeasurementError(f"a lone decode step needs 2 output tokens or more, "
                               f"got {output_len}")
    own = dataclasses.replace(profile, host=dataclasses.replace(
        profile.host, cores=0, pinned=False)).validate()
    gap = _lone_gap(own, mode=mode, input_len=input_len, output_len=output_len)
    target = _lone_segments(own, mode=mode, input_len=input_len, output_len=output_len,
                            gap_s=gap)
    # segment per unit of overhead: its steps at first, then the secant's
    slope = {"prefill": 1.0, "decode": float(output_len - 1)}
    last: dict[str, tuple[float, float]] = {}
    fitted = profile
    for _ in range(LONE_ROUNDS):
        got = _lone_segments(fitted, mode=mode, input_len=input_len, output_len=output_len,
                             gap_s=gap)
        changes: dict[str, dict[str, float]] = {}
        for side, key, seg in _STEP_SEGMENTS:
            want, have = target.get(seg), got.get(seg)
            if want is None or have is None or abs(have - want) <= LONE_TOLERANCE * want:
                continue
            table = getattr(fitted, side)
            now = getattr(table, key)
            if side in last and last[side][0] != now:
                secant = (have - last[side][1]) / (now - last[side][0])
                if secant > 0:
                    slope[side] = secant
            last[side] = (now, have)
            over = max(0.0, now + (want - have) / slope[side])
            if over != now:
                python = table.step_python_s * over / now if now > 0 else 0.0
                changes[side] = {key: over, "step_python_s": min(python, over)}
        if not changes:
            break
        fitted = dataclasses.replace(fitted, **{side: dataclasses.replace(
            getattr(fitted, side), **kv) for side, kv in changes.items()}).validate()
    return fitted


def _besides(profile: Profile) -> dict[str, float]:
    """What ``profile`` already puts in a keyed segment, by key (0 if not named)."""
    net, d = profile.network, profile.decode
    return {"ingest_s": net.router_hop_s,
            "return_s": d.decode_step_overhead_s + d.step_token_s + net.router_hop_s,
            "notify_wait_s": net.wire_latency_s + net.control_latency_s + net.post_fixed_s}


def connector_keys(requests: dict[str, dict[str, float]], profile: Profile, *,
                   share: float = 1.0,
                   segments: dict[tuple[str, str], tuple[str, ...]] | None = None
                   ) -> dict[str, dict[str, float]]:
    """The connector keys from a real pair's timeline (``requests``: per request id, each
    mark's time, :func:`pushkv.fit.segments.load`), against ``profile``, the plain-server
    profile they extend: a key is the median of its segments (summed), less what the
    profile already puts there -- ``network.router_hop_s`` for ``ingest_s``; one decode
    step of one sequence and the hop for ``return_s`` -- taken as 0 if that leaves less,
    then scaled to a core of one's own (``x share``, the share a probe met during the
    run; 1: as measured). ``segments``: the keys to take (default every one,
    :data:`CONNECTOR_SEGMENTS`). MeasurementError when a segment is missing or not
    finite."""
    from .. import timeline

    _check_share(share)
    segs = timeline.segments(requests)
    less = _besides(profile)
    out: dict[str, dict[str, float]] = {}
    for (side, key), names in (segments or CONNECTOR_SEGMENTS).items():
        total = sum(_median_s(segs, name, f"{side}.{key}") for name in names)
        out.setdefault(side, {})[key] = max(0.0, total - less.get(key, 0.0)) * share
    return out


#: the keys ``host.spread`` acts on (a token's ``decode.return_s`` is paid once
#: per token, not per request, and stays its median)
SPREAD_KEYS = tuple(k for k in CONNECTOR_SEGMENTS if k != ("decode", "return_s"))


def host_spread(requests: dict[str, dict[str, float]], profile: Profile, *,
                quantiles: int = 20) -> tuple[float, ...]:
    """``host.spread`` from a real pair's timeline: for each key of
    :data:`SPREAD_KEYS` whose median is above 0 (the key of :func:`connector_keys`, as
    measured, share 1), each request's time in the key's segments, less what the model
    puts there besides, over that median; pooled over the keys, each key weighing its
    median (its requests' ratios share that weight), so that the multipliers' mean is the
    keyed times' mean total over their medians' total -- a key of a tenth of a
    millisecond whose ratios run to 40 weighs a tenth of one of a millisecond; then the
    weighted distribution's ``quantiles`` evenly spaced quantiles ((i + 1/2) /
    quantiles). MeasurementError with fewer than two such times or ``quantiles``
    outside 1..MAX_SPREAD."""
    from .. import timeline
    from ..sim.host.profile import MAX_SPREAD

    if not 1 <= quantiles <= MAX_SPREAD:
        raise MeasurementError(f"host spread quantiles must be in 1..{MAX_SPREAD}, "
                               f"got {quantiles}")
    keys = connector_keys(requests, profile)
    less = _besides(profile)
    per_request = [timeline.segments({"r": req}) for req in requests.values()]
    weighted: list[tuple[float, float]] = []  # (ratio, weight)
    for side, key in SPREAD_KEYS:
        med = keys[side][key]
        if med <= 0:
            continue
        names = CONNECTOR_SEGMENTS[side, key]
        ratios = []
        for segs in per_request:
            if all(segs.get(n) for n in names):
                total = sum(segs[n][0] for n in names) / 1000
                ratios.append(max(0.0, total - less.get(key, 0.0)) / med)
        weighted += [(r, med / len(ratios)) for r in ratios]
    if len(weighted) < 2 or not all(math.isfinite(r) for r, _ in weighted):
        raise MeasurementError(f"the timeline gives {len(weighted)} finite host times: too "
                               "few for a spread")
    weighted.sort()
    whole = sum(w for _, w in weighted)
    out, acc, i = [], 0.0, 0
    for j in range(quantiles):  # the smallest ratio whose cumulative weight reaches q
        q = (j + 0.5) / quantiles * whole
        while i < len(weighted) - 1 and acc + weighted[i][1] < q:
            acc += weighted[i][1]
            i += 1
        out.append(round(weighted[i][0], 4))
    return tuple(out)


def pull_keys(requests: dict[str, dict[str, float]], profile: Profile, *,
              share: float = 1.0) -> dict[str, dict[str, float]]:
    """The key only a pull pair's timeline shows (vLLM's NixlConnector behind a sequential
    router): ``prefill.return_s``, the prefill leg's answer on its way out of the prefill
    instance -- median('prefill finished -> decode sees') less what the model puts there,
    the answer's hop back to the router, the decode leg's hop out and the decode API
    server's ``decode.ingest_s`` (so ``profile`` must hold the connector keys already);
    0 if that leaves less; ``x share``. MeasurementError without such requests."""
    _check_share(share)
    gaps = [(r["decode_seen"] - r["prefill_finished"]) * 1e3 for r in requests.values()
            if "decode_seen" in r and "prefill_finished" in r]
    med = _median_s({"prefill finished -> decode sees": gaps},
                    "prefill finished -> decode sees", "prefill.return_s")
    less = 2 * profile.network.router_hop_s + profile.decode.ingest_s
    return {"prefill": {"return_s": max(0.0, med - less) * share}}


#: (profile key, segments) that a pull pair's timeline shows too (vLLM's NixlConnector
#: behind a sequential router: its decode leg leaves after the prefill's answer, so
#: 'legs out -> decode sees' holds the whole prefill and no push mark exists)
PULL_SEGMENTS = {k: v for k, v in CONNECTOR_SEGMENTS.items()
                 if k in (("prefill", "ingest_s"), ("decode", "return_s"))}


def gauge_keys(requests: dict[str, dict[str, float]], profile: Profile, *, mode: str,
               input_len: int, output_len: int) -> dict[str, dict[str, float]]:
    """A point's engine and host keys from the lone requests its own pair served just
    before and after it at the point's lengths (a *gauge*: on a machine whose speed
    moves between minutes, the profile the point ran under). ``requests``: per request
    id its marks (the router's and the pair's, :func:`pushkv.fit.segments.load`), only
    those that ran alone are taken. The step overheads first (:func:`connector_steps`),
    then, for ``mode`` "push", every connector key (:func:`connector_keys`); for "pull",
    the keys its timeline shows (:data:`PULL_SEGMENTS`, against the same subtractions)
    and ``prefill.return_s`` (:func:`pull_keys`, against ``profile``'s
    ``decode.ingest_s``): a pull pair shows none of the push-only keys, which stay
    ``profile``'s. MeasurementError when a segment is missing."""
    from .segments import alone

    if mode not in ("push", "pull"):
        raise MeasurementError(f"a gauge is for mode 'push' or 'pull', not {mode!r}")
    reqs = alone(requests)
    steps = connector_steps(reqs, profile, input_len=input_len, output_len=output_len)
    try:
        stepped = profile_from_dict(steps, base=profile)  # type: ignore[arg-type]
    except ProfileError as exc:
        raise MeasurementError(f"the gauge's steps make no valid profile: {exc}") from exc
    keys = connector_keys(reqs, stepped, segments=PULL_SEGMENTS if mode == "pull" else None)
    if mode == "pull":
        keys["prefill"] |= pull_keys(reqs, stepped)["prefill"]
    out = {side: dict(t) for side, t in steps.items()}
    for side, table in keys.items():
        out.setdefault(side, {}).update(table)
    return out


def client_hop(points: Sequence[tuple[dict[str, dict[str, float]], Sequence[float], float]]
               ) -> float:
    """``network.client_hop_s`` from runs through a router: per point, the router's
    requests (per request id its marks, :func:`pushkv.fit.segments.load` of the router's
    directory for that point), the client's end-to-end latencies in the order it sent
    them (a ``vllm bench serve`` result file's ``latencies``) and the share of a core the
    point met. The router's requests, in the order they were ``received``, are the
    client's; for each that ran alone, the client's latency less the router's
    'legs out -> answer sent', ``x share``; the median of them all (s).
    MeasurementError when a point's counts differ or no request ran alone."""
    from .segments import alone

    gaps: list[float] = []
    for requests, latencies, share in points:
        _check_share(share)
        order = sorted(requests, key=lambda k: requests[k].get("received", math.inf))
        if len(order) != len(latencies):
            raise MeasurementError(f"the router saw {len(order)} requests, the client "
                                   f"sent {len(latencies)}: cannot pair them")
        lone = alone(requests)
        for rid, lat in zip(order, latencies, strict=True):
            r = lone.get(rid)
            if r is not None and "legs_sent" in r and "answer_sent" in r:
                gaps.append((lat - (r["answer_sent"] - r["legs_sent"])) * 1e3 * share)
    return _median_s({"client": gaps}, "client", "network.client_hop_s")


def client_first(points: Sequence[tuple[dict[str, dict[str, float]], dict[str, Any]]]
                 ) -> float:
    """``network.client_first_s`` from runs through a router whose requests went one at
    a time: per point, the router's requests (per request id its marks) and the
    client's result (a ``vllm bench serve`` result file: ``completed``,
    ``mean_ttft_ms``, ``mean_e2el_ms``). The router's mean 'first token -> answer sent'
    less the client's mean 'first token -> last token': how much later the first
    output reaches the client than a later one does, beyond the router's marks. The
    mean over the points, at least 0 (s). MeasurementError when a point's counts differ
    or a figure is missing or not finite."""
    got: list[float] = []
    for requests, result in points:
        spans = [r["answer_sent"] - r["first_token"] for r in requests.values()
                 if "first_token" in r and "answer_sent" in r]
        done = result.get("completed")
        if not spans or done != len(spans):
            raise MeasurementError(f"the router saw {len(spans)} answered requests, the "
                                   f"client completed {done!r}: cannot pair them")
        ttft, e2e = result.get("mean_ttft_ms"), result.get("mean_e2el_ms")
        if not all(isinstance(x, (int, float)) and math.isfinite(x) for x in (ttft, e2e)):
            raise MeasurementError(f"the client's mean TTFT and end-to-end latency must "
                                   f"be finite numbers, got {ttft!r} and {e2e!r}")
        got.append(statistics.fmean(spans) - (e2e - ttft) / 1000)  # type: ignore[operator]
    if not got:
        raise MeasurementError("no point to measure network.client_first_s from")
    return max(0.0, statistics.fmean(got))


def with_connector_keys(data: dict[str, Any], keys: dict[str, dict[str, float]]
                        ) -> dict[str, Any]:
    """``data`` (a profile's tables) with ``keys`` merged in (a key there is replaced),
    validated."""
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
        "  see pushkv.fit.measure_connector.connector_keys for what each subtracts.",
    ]




def extend(data: dict[str, Any], head: Sequence[str], dirs: Sequence[str | Path], *,
           window: tuple[float, float] | None = None, alone_only: bool = True,
           steps: Sequence[int] | None = None, share: float = 1.0, spread: int = 0
           ) -> tuple[dict[str, Any], list[str]]:
    """A profile's tables and header lines, extended from the timeline in ``dirs`` (the
    router's or client's first): its requests (in ``window``; only those that ran alone
    unless not ``alone_only``), with ``steps`` = (input, output length) first the step
    overheads (:func:`connector_steps`), then the connector keys, and with ``spread``
    the keys' spread at that many quantiles (:func:`host_spread`)."""
    from .segments import alone, load

    reqs = load(dirs, window)
    if alone_only:
        reqs = alone(reqs)
    head = list(head)
    if steps:
        got = connector_steps(reqs, profile_from_dict(data), input_len=steps[0],
                              output_len=steps[1], share=share)
        data = with_connector_keys(data, got)
        head.append("Engine step overheads replaced by the connector servers' "
                    "(pushkv.fit.measure_connector.connector_steps): " + ", ".join(
                        f"{side}.{k} {v * 1e3:.3f} ms" for side, t in got.items()
                        for k, v in t.items() if k != "step_python_s") + ".")
    keys = connector_keys(reqs, profile_from_dict(data), share=share)
    head = [*head, *connector_header(dirs, len(reqs), share, keys)]
    if spread:
        multipliers = host_spread(reqs, profile_from_dict(data), quantiles=spread)
        host: dict[str, Any] = {"model": SHARED_CPU, "spread": list(multipliers)}
        keys = {**keys, "host": host}
        head.append(f"host.spread at {spread} quantiles from the same requests "
                    f"(host_spread): mean {sum(multipliers) / spread:.2f}, median "
                    f"{multipliers[spread // 2]:.2f}, largest {multipliers[-1]:.2f}.")
    return with_connector_keys(data, keys), head


def extend_router(data: dict[str, Any], head: Sequence[str], *,
                  pull_dirs: Sequence[str | Path] = (),
                  client: tuple[str | Path, str | Path] | None = None, share: float = 1.0,
                  client_window: Sequence[float] | None = None
                  ) -> tuple[dict[str, Any], list[str]]:
    """A profile's tables and header lines with the router's keys: ``prefill.return_s``
    from a pull pair's timeline in ``pull_dirs`` (the router's or client's first; the
    requests that ran alone; :func:`pull_keys`, against ``data``'s hops and ingestion),
    ``network.client_hop_s`` from ``client`` = (the router's timeline directory, the
    ``vllm bench serve`` result file of the run it holds -- or of the run in
    ``client_window``; :func:`client_hop`)."""
    import json

    from .segments import alone, load

    head = list(head)
    if pull_dirs:
        reqs = alone(load(pull_dirs))
        keys = pull_keys(reqs, profile_from_dict(data), share=share)
        data = with_connector_keys(data, keys)
        head.append(f"prefill.return_s {keys['prefill']['return_s'] * 1e3:.3f} ms from the "
                    f"pushkv.timeline marks of {len(reqs)} requests of a real pull pair in "
                    + " ".join(str(d) for d in pull_dirs) + " (pull_keys).")
    if client is not None:
        router, result = client
        try:
            latencies = json.loads(Path(result).read_text())["latencies"]
        except (KeyError, TypeError, ValueError) as exc:
            raise MeasurementError(f"{result}: no 'latencies' list of a vllm bench serve "
                                   f"result ({exc!r})") from exc
        win = (client_window[0], client_window[1]) if client_window else None
        hop = client_hop([(load([router], win), latencies, share)])
        data = with_connector_keys(data, {"network": {"client_hop_s": hop}})
        head.append(f"network.client_hop_s {hop * 1e3:.3f} ms from {result} against the "
                    f"router's marks in {router} (client_hop).")
    return data, head


def wake_beside(by_flight: dict[int, Sequence[float]], *, quantiles: int = 100
                ) -> tuple[float, ...]:
    """``host.wake_beside_s`` from wake-ups by requests in flight
    (:func:`pushkv.fit.segments.wakes_by_flight`): at ``quantiles`` evenly spaced
    quantiles, those with two or more in flight less those with exactly one -- the
    extra a woken process waits beside another request over what a lone request's own
    hand-offs met (which its keys hold) -- each at least 0. Empty where either group
    has no wake-up. MeasurementError for ``quantiles`` outside 1..MAX_SPREAD."""
    from ..sim.host.profile import MAX_SPREAD
    from .cores import quantiles as at_quantiles

    if not 1 <= quantiles <= MAX_SPREAD:
        raise MeasurementError(f"wake quantiles must be in 1..{MAX_SPREAD}, got {quantiles}")
    one = list(by_flight.get(1, ()))
    more = [w for n, got in by_flight.items() if n >= 2 for w in got]
    if not one or not more:
        return ()
    return tuple(max(0.0, b - a) for a, b in zip(
        at_quantiles(one, quantiles), at_quantiles(more, quantiles), strict=True))


class KeyNoise:
    """How far one key's gauges, taken one after another over a run, tell its points
    apart: ``mean`` over the gauges; ``noise_var``, the variance one gauge's estimate has
    from its few lone requests -- half the mean squared difference of successive gauges
    (von Neumann's estimator: a drift slower than the gauges' spacing cancels in it, so
    it counts sampling noise, and a faster one only as more noise); ``drift_var``, what
    the gauges vary by beyond that noise (their variance less ``noise_var``, at least 0)."""

    __slots__ = ("drift_var", "mean", "noise_var")

    def __init__(self, values: Sequence[float]) -> None:
        if len(values) < MIN_GAUGES:
            raise MeasurementError(f"a key's noise needs {MIN_GAUGES} gauges or more, "
                                   f"got {len(values)}")
        xs = [float(v) for v in values]
        if not all(math.isfinite(x) for x in xs):
            raise MeasurementError(f"a gauge's key is not finite: {xs}")
        self.mean = statistics.fmean(xs)
        self.noise_var = statistics.fmean((b - a) ** 2 for a, b in itertools.pairwise(xs)) / 2
        self.drift_var = max(0.0, statistics.pvariance(xs) - self.noise_var)

    def weight(self, gauges: int) -> float:
        """The share of a point's own deviation from ``mean`` to keep when its estimate
        pools ``gauges`` gauges: drift / (drift + noise / gauges) -- 0 where the gauges
        differ by noise alone, near 1 where they move far more than their noise (and 1
        where they do not differ at all)."""
        noise = self.noise_var / max(1, gauges)
        return 1.0 if self.drift_var + noise == 0 else self.drift_var / (self.drift_var + noise)

    def shrink(self, value: float, gauges: int) -> float:
        """``value`` (a point's estimate from ``gauges`` gauges) shrunk toward ``mean``."""
        return self.mean + self.weight(gauges) * (value - self.mean)

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "drift_var": self.drift_var, "noise_var": self.noise_var}

    @classmethod
    def of(cls, got: dict[str, float]) -> KeyNoise:
        """The estimate :meth:`as_dict` wrote."""
        out = cls.__new__(cls)
        out.mean, out.drift_var, out.noise_var = (
            float(got["mean"]), float(got["drift_var"]), float(got["noise_var"]))
        return out


#: the fewest successive gauges a key's noise is estimated from; with fewer, a point's
#: keys are its own gauges' as measured
MIN_GAUGES = 3


def key_noise(gauges: Sequence[dict[str, dict[str, float]]]
              ) -> dict[tuple[str, str], KeyNoise]:
    """Per (table, key) its :class:`KeyNoise` over ``gauges`` -- each gauge's keys
    (:func:`gauge_keys` of its lone requests alone), in the order they ran, for one mode
    and length -- for the keys at least :data:`MIN_GAUGES` of them hold (successive
    among those). Empty with fewer gauges."""
    names = sorted({(t, k) for g in gauges for t, kv in g.items() for k in kv})
    out: dict[tuple[str, str], KeyNoise] = {}
    for t, k in names:
        xs = [g[t][k] for g in gauges if k in g.get(t, {})]
        if len(xs) >= MIN_GAUGES:
            out[(t, k)] = KeyNoise(xs)
    return out


def shrink_keys(keys: dict[str, dict[str, float]], noise: dict[tuple[str, str], KeyNoise],
                *, gauges: int = 2) -> dict[str, dict[str, float]]:
    """A point's keys (:func:`gauge_keys` of its ``gauges`` gauges' lone requests) each
    shrunk toward its mode's and length's mean over the run by how far the gauges can
    tell points apart (:meth:`KeyNoise.shrink`, an empirical-Bayes estimate of the key
    the point ran under); keys without a noise estimate as they are. A copy."""
    return {t: {k: noise[(t, k)].shrink(v, gauges) if (t, k) in noise else v
                for k, v in kv.items()} for t, kv in keys.items()}
