"""What a running real deployment spends, measured from outside while a point runs.

A deployment (:mod:`pushkv.fit.e2e.deployment`'s ``Deployment`` and ``Endpoint``, duck-typed
here: ``dep.prefill.proc``, ``dep.decode.proc``, ``ep.router``) is cut into its
:func:`parts` -- prefill's instance, decode's without its API server, decode's API
server, the router -- and each part read through :mod:`pushkv.hostprobe`: run-queue
waits (:func:`runq_waits`, :func:`per_request`), how its pinned and floating threads
were scheduled over a point (:class:`SchedSamples`, :func:`threads_line`), its
garbage-collector pauses (:func:`gc_pauses`), its engine loop's steps and its worker's
model runs (:func:`engine_spans`); and each leg's intake, from its API server to its
engine loop (:func:`intake`). Around them: the span a point loaded the
deployment (:func:`load_span`), the time an engine's loop had a lone request in hand
(:func:`active_s`, what ``cores_busy`` is taken over), and what the servers' own vLLM
metrics say of a point's steps (:func:`server_metrics`, :func:`engine_steps`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ... import timeline
from ...hostprobe import (
    ThreadSched,
    group_pids,
    group_runq_wait_s,
    group_thread_sched,
    runq_wait_s,
    thread_sched,
)
from ...vllm.testing import get_text
from .. import segments
from ..timings import metric_sums
from .runs import MODES


def parts(dep: Any, ep: Any, of_process: Callable[[int], Any],
          of_groups: Callable[[list[int]], Any]) -> dict[str, Any]:
    """A per-process measure of the deployment's parts (``of_process(pid)``, summed
    over process groups by ``of_groups(pgids)``; anything with ``-``: seconds, thread
    schedules, sets of pids): ``prefill``, its instance; ``decode``, decode's instance
    without its API server; ``decode_api``; and ``router``, where the mode has one."""
    api = dep.decode.proc.pid  # decode's API server: the group's leader
    out = {"prefill": of_groups([dep.prefill.proc.pid]),
           "decode": of_groups([api]) - of_process(api), "decode_api": of_process(api)}
    if ep.router is not None:
        out["router"] = of_process(ep.router.pid)
    return out


def part_pids(dep: Any, ep: Any, client_pid: int | None) -> dict[str, list[int]]:
    """The processes of each of the deployment's :func:`parts` now, and the client's."""

    out = {part: sorted(pids) for part, pids in parts(
        dep, ep, lambda pid: frozenset({pid}), lambda pgids: frozenset(group_pids(pgids))
    ).items()}
    if client_pid:
        out["client"] = [client_pid]
    return out


def gc_pauses(dirs: Sequence[Path], span: Sequence[float],
              pids: dict[str, list[int]]) -> dict[str, dict[str, float]]:
    """Per part (``pids``: part -> its processes), the garbage-collector pauses its
    processes recorded under ``dirs`` (:func:`pushkv.timeline.read_pauses`) within
    ``span`` (``time.monotonic()``): their time (``ms``, clipped to the span), how many
    (``n``) and the longest (``max_ms``). A pause stops every thread of its process."""

    out = {part: {"ms": 0.0, "n": 0, "max_ms": 0.0} for part in pids}
    for part, p in _by_part(dirs, pids, timeline.read_pauses):
        if p.t1 <= span[0] or p.t0 >= span[1]:
            continue
        ms = (min(p.t1, span[1]) - max(p.t0, span[0])) * 1e3
        got = out[part]
        got["ms"] = round(got["ms"] + ms, 3)
        got["n"] += 1
        got["max_ms"] = round(max(got["max_ms"], ms), 3)
    return out


def _by_part(dirs: Sequence[Path], pids: dict[str, list[int]],
             read: Callable[[Path], list[timeline.Pause]]
             ) -> Iterator[tuple[str, timeline.Pause]]:
    """Each interval ``read`` finds under ``dirs`` (pauses or spans) recorded by a
    process of a part (``pids``: part -> its processes), with its part."""
    part_of = {pid: part for part, ps in pids.items() for pid in ps}
    for d in dirs:
        if d.is_dir():
            for x in read(d):
                part = part_of.get(x.pid)
                if part is not None:
                    yield part, x


def gc_line(gc: dict[str, dict[str, float]]) -> str:
    """:func:`gc_pauses` in one line."""
    return "garbage-collector pauses (ms / count / longest ms): " + ", ".join(
        f"{part} {x['ms']:.1f}/{x['n']}/{x['max_ms']:.1f}" for part, x in gc.items())


def intake(dirs: Sequence[Path], window: Sequence[float]) -> dict[str, float]:
    """The mean of each of a leg's intake segments (ms, :data:`pushkv.timeline.INTAKE_SEGMENTS`:
    arrives -> sent -> queued -> taken -> sees, each side) over the requests whose legs
    left within ``window``, where both marks were recorded (the marks inside vLLM need
    the benchmark's instrumentation, ``pushkv/vllm/cpu_tuning``)."""
    dirs = [d for d in dirs if d.is_dir()]
    if not dirs:
        return {}
    segs = timeline.segments(segments.load(dirs, (window[0], window[1])))
    return {name: round(sum(segs[name]) / len(segs[name]), 3)
            for name, _, _ in timeline.INTAKE_SEGMENTS if name in segs}


def intake_line(got: dict[str, float]) -> str:
    """:func:`intake` in one line, prefill's segments then decode's."""
    return "intake (ms, mean): " + ", ".join(f"{name} {ms:.1f}" for name, ms in got.items())


def engine_spans(dirs: Sequence[Path], span: Sequence[float],
                 pids: dict[str, list[int]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per part (``pids``: part -> its processes), its engine loop's steps and its
    worker's model runs (``step`` and ``forward`` spans, :func:`pushkv.timeline.read_spans`)
    that began within ``span``: how many (``n``), their mean and p90 (ms) and the share
    of the span they took (``busy``)."""
    got: dict[str, dict[str, list[float]]] = {}
    for part, s in _by_part(dirs, pids, timeline.read_spans):
        if span[0] <= s.t0 < span[1]:
            got.setdefault(part, {}).setdefault(s.kind, []).append((s.t1 - s.t0) * 1e3)
    length_ms = max(1e-9, (span[1] - span[0]) * 1e3)
    return {part: {kind: {"n": len(v), "mean_ms": round(sum(v) / len(v), 3),
                          "p90_ms": round(timeline.percentile(v, 0.9), 3),
                          "busy": round(sum(v) / length_ms, 3)}
                   for kind, v in sorted(kinds.items())}
            for part, kinds in got.items()}


def spans_line(got: dict[str, dict[str, dict[str, float]]]) -> str:
    """:func:`engine_spans` in one line."""
    return "engine spans (n / mean / p90 ms / busy): " + ", ".join(
        f"{part} " + " ".join(f"{kind} {x['n']}/{x['mean_ms']:.2f}/{x['p90_ms']:.2f}/"
                              f"{x['busy']:.2f}" for kind, x in kinds.items())
        for part, kinds in got.items())


def runq_waits(dep: Any, ep: Any) -> dict[str, float]:
    """Seconds the deployment's :func:`parts` have waited on a run queue so far,
    runnable but not running (:func:`pushkv.hostprobe.runq_wait_s`)."""

    return parts(dep, ep, runq_wait_s, group_runq_wait_s)


def sched_parts(dep: Any, ep: Any) -> dict[str, Any]:
    """How the threads of each of the deployment's :func:`parts` have been scheduled so
    far, pinned and floating apart (:class:`pushkv.hostprobe.ThreadSched`)."""

    return parts(dep, ep, lambda pid: thread_sched(pid) or ThreadSched(), group_thread_sched)


class SchedSamples:
    """While open, a background thread takes ``sample()`` (:func:`sched_parts`) every
    ``period_s``; :meth:`over` tells what the threads did between two instants. The
    first sample is taken on entering, before what it brackets starts, the last on
    closing."""

    def __init__(self, sample: Callable[[], dict[str, Any]], period_s: float = 0.25) -> None:
        self.sample, self.period_s = sample, period_s
        self.samples: list[tuple[float, dict[str, Any]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sched-samples", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append((time.monotonic(), self.sample()))
        self.samples.append((time.monotonic(), self.sample()))

    def __enter__(self) -> SchedSamples:
        self.samples.append((time.monotonic(), self.sample()))
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def over(self, t0: float, t1: float) -> dict[str, dict[str, dict[str, float]]]:
        """Each part's pinned and floating threads from the last sample at or before
        ``t0`` to the first at or after ``t1`` (the nearest ones where none is): the
        cores they kept busy (``cores``, CPU seconds a second), how many waited on a run
        queue (``waiting``, seconds a second) and each wake-up's wait
        (``wait_per_wakeup_ms``). Empty without two samples."""
        if len(self.samples) < 2:
            return {}
        before = [s for s in self.samples if s[0] <= t0] or self.samples[:1]
        after = [s for s in self.samples if s[0] >= t1] or self.samples[-1:]
        (a, first), (b, last) = before[-1], after[0]
        if b <= a:
            return {}
        out: dict[str, dict[str, dict[str, float]]] = {}
        for part, got in last.items():
            if part not in first:
                continue
            d = got - first[part]
            out[part] = {cls: {"cores": round(x.run_s / (b - a), 3),
                               "waiting": round(x.wait_s / (b - a), 3),
                               "wait_per_wakeup_ms": round(x.wait_s * 1e3 / x.slices, 3)
                               if x.slices > 0 else 0.0}
                         for cls, x in (("pinned", d.pinned), ("floating", d.floating))}
        return out


def threads_line(threads: dict[str, dict[str, dict[str, float]]]) -> str:
    """:meth:`SchedSamples.over` in one line: per part, pinned and floating threads'
    cores busy / threads waiting / wait a wake-up (ms)."""
    return "threads (cores busy / waiting / ms a wake-up): " + ", ".join(
        f"{part} " + " ".join(
            f"{cls} {x['cores']:.2f}/{x['waiting']:.2f}/{x['wait_per_wakeup_ms']:.2f}"
            for cls, x in by.items() if x["cores"] or x["waiting"])
        for part, by in threads.items())


def load_span(real: Path, mode: str, window: Sequence[float]) -> tuple[float, float] | None:
    """From the first to the last timeline mark of the requests of ``mode``'s point
    recorded within ``window`` (``time.monotonic()``): when the point loaded the
    deployment (its window also holds the client's start). None without marks."""

    name, deployment = MODES[mode]
    dirs = [real / "timeline" / name, real / "timeline" / deployment]
    if not all(d.is_dir() for d in dirs):
        return None
    marks = [t for req in segments.load(dirs, (window[0], window[1])).values()
             for t in req.values()]
    return (min(marks), max(marks)) if marks else None


def per_request(before: dict[str, float], after: dict[str, float],
                requests: int) -> dict[str, float]:
    """Each part's wait between two :func:`runq_waits`, in ms a request."""
    return {k: round((after[k] - before[k]) * 1e3 / max(1, requests), 3)
            for k in before if k in after}


#: The span of a lone request an engine's loop has it in hand, by side and mode: from
#: the scheduler's first look at it until it stops stepping for it -- prefill when its
#: KV has left (push: the write completed; pull: decode's scheduler knows the read
#: done, when the producer's notification lands too), decode at its last token.
ACTIVE = {("prefill", "push"): ("prefill_seen", "write_completed"),
          ("prefill", "pull"): ("prefill_seen", "ready_scheduled"),
          ("decode", "push"): ("decode_seen", "last_token"),
          ("decode", "pull"): ("decode_seen", "last_token")}


def active_s(requests: dict[str, dict[str, float]], side: str, mode: str) -> float:
    """Seconds the ``side`` engine's loop had ``requests`` in hand (:data:`ACTIVE`)."""
    start, end = ACTIVE[side, mode]
    return sum(r[end] - r[start] for r in requests.values() if start in r and end in r)


def server_metrics(dep: Any) -> dict[str, dict[str, float]]:
    """The vLLM metrics' sums and counts of the deployment's two servers."""

    return {side: metric_sums(get_text(srv.url + "/metrics"))
            for side, srv in (("prefill", dep.prefill), ("decode", dep.decode))}


def engine_steps(before: dict[str, dict[str, float]],
                 after: dict[str, dict[str, float]]) -> dict[str, float]:
    """What the real servers' own metrics say of one point: the prefill server's mean
    prefill time per request, the decode server's mean time per output token."""
    def delta(side: str, key: str) -> float:
        return after[side][f"vllm:{key}"] - before[side][f"vllm:{key}"]

    n = delta("prefill", "request_prefill_time_seconds_count")
    tokens = (delta("decode", "request_generation_tokens_sum")
              - delta("decode", "request_generation_tokens_count"))
    return {"prefill_step_s": delta("prefill", "request_prefill_time_seconds_sum") / n
            if n else 0.0,
            "decode_token_s": delta("decode", "request_decode_time_seconds_sum") / tokens
            if tokens else 0.0}
