"""The failover drill: a decode instance killed and restarted at random moments under load.

1 prefill and 2 decode vLLM CPU servers with PushKVConnector behind one
``pushkv proxy`` (``benchmarks/bench_failover.py`` is its command line). Clients
send fresh token-id prompts (streamed and not), each checked token by token
against a plain server's greedy output, while a killer thread, at ``kills``
points spread over the run (each at a random moment up to half a second after
its point), kills a decode instance that is in rotation (``SIGKILL`` of its
process group) and restarts it. While it restarts, clients go on up to a margin
past the kill point (half the share between points) and wait there; the next
kill comes once the instance is back in rotation and the clients have passed the
next point, so every kill lands while requests flow. The same drill can run with
resumes off (``--resumes 0``: a broken stream ends with an error event) for
comparison, and with ``--failover retarget`` (a decode leg lost before the
answer goes, as the same transfer, to the other decode instance) against
``retry`` on the same prompts and kill moments (the same seed).

What is reported (:meth:`DrillReport.figures`):

* ``client_errors`` -- requests answered with an error, or none, or cut off;
  ``wrong_tokens`` -- answers that differ from the plain server's;
* ``failovers`` -- the proxy's failovers, by stage (``before_answer``: retried as a
  new transfer; ``mid_stream``: resumed);
* ``latency_p50_ms``, ``latency_p99_ms`` -- a correct answer's time, sent to
  complete (streamed: to its last event);
* ``resume_p99_ms`` -- the gap a resumed answer met (last token before the break to
  the first after; a stream's client sees it, an assembled non-streamed answer is
  that much later), from the proxy's log;
* ``prompt_recompute_share`` -- prompt tokens sent to prefill again by failovers
  before the answer began, over the prompt tokens of every request: the prefill
  load such failovers add (the prefill's prefix cache may serve part of it; its
  own counts are in ``prefill_tokens``);
* ``prefill_excess_share`` -- prompt tokens the prefill instance computed beyond
  the requests' prompts (its ``local_compute`` count less every prompt's length),
  over the prompt tokens: what failovers before the answer and resumed streams
  cost it after its prefix cache (every prompt is fresh, so nothing else is).

Uses the fleet and the checked client of :mod:`pushkv.vllm.chaos`.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pushkv.vllm.chaos import Fleet, Job, Load, Outcome, p99, request, wait_for
from pushkv.vllm.testing import get_text, metric

#: The proxy's log line for a resumed stream, or a non-streamed answer assembled from
#: one (server.py), with the gap in ms.
_RESUMED = re.compile(r"(?:stream|non-streamed answer) resumed on \S+ after \d+ tokens: "
                      r"a ([0-9.]+) ms gap"
                      r"(?:, ([0-9.]+) ms after the break was seen)?")
DECODES = ("decode-1", "decode-2")


@dataclass(frozen=True, kw_only=True)
class DrillSettings:
    """One drill's shape."""

    requests: int = 1000  #: requests sent through the proxy
    kills: int = 10  #: decode instances killed (and restarted) during the run
    clients: int = 4  #: concurrent clients
    stream: float = 0.7  #: share of streamed requests
    timeout_s: float = 120.0  #: a client's patience (and the proxy's bound)
    resumes: int = 2  #: the proxy's --resumes (0: broken streams end with an error)
    failover: str = "retry"  #: the proxy's --failover (retry or retarget)
    bind: str = "arrival"  #: the proxy's --bind (arrival or late)

    def __post_init__(self) -> None:
        if self.requests < 1 or self.clients < 1 or self.kills < 0:
            raise ValueError("requests and clients must be >= 1, kills >= 0")
        if self.kills >= self.requests:
            raise ValueError("kills must be fewer than requests")
        if self.failover not in ("retry", "retarget"):
            raise ValueError(f"failover must be retry or retarget, got {self.failover!r}")
        if self.bind not in ("arrival", "late"):
            raise ValueError(f"bind must be arrival or late, got {self.bind!r}")


@dataclass
class DrillReport:
    outcomes: list[Outcome]
    kills: int
    prompt_tokens: int  #: of every request sent
    proxy: dict[str, float]  #: the proxy's failover counters
    resume_gaps_ms: list[float]  #: the client's gap: last token before to first after
    #: from the proxy seeing the break to the first token after
    resume_after_break_ms: list[float] = field(default_factory=list)
    prefill_tokens: dict[str, float] = field(default_factory=dict)  #: computed, cache hits

    def figures(self) -> dict[str, Any]:
        kinds = Load.summary(self.outcomes)
        before = self.proxy.get("prompt_tokens_before_answer", 0.0)
        served = [o.latency_s * 1000 for o in self.outcomes if o.kind == "correct"]
        return {
            "requests": len(self.outcomes),
            "outcomes": dict(kinds),
            "client_errors": sum(n for k, n in kinds.items() if k not in ("correct", "wrong")),
            "wrong_tokens": kinds.get("wrong", 0),
            "kills": self.kills,
            "latency_p50_ms": round(_quantile(served, 0.5), 1),
            "latency_p99_ms": round(p99(served), 1),
            "failovers": int(self.proxy.get("failovers", 0)),
            "failovers_before_answer": int(self.proxy.get("before_answer", 0)),
            "failovers_mid_stream": int(self.proxy.get("mid_stream", 0)),
            "resumes_logged": len(self.resume_gaps_ms),
            "resume_p50_ms": round(_quantile(self.resume_gaps_ms, 0.5), 1),
            "resume_p99_ms": round(p99(self.resume_gaps_ms), 1),
            "resume_after_break_p99_ms": round(p99(self.resume_after_break_ms), 1),
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_resent_before_answer": int(before),
            "prompt_tokens_resent_mid_stream": int(
                self.proxy.get("prompt_tokens_mid_stream", 0)),
            "prompt_recompute_share": round(before / self.prompt_tokens, 4)
            if self.prompt_tokens else 0.0,
            "prefill_excess_share": round(
                (self.prefill_tokens.get("local_compute", 0.0) - self.prompt_tokens)
                / self.prompt_tokens, 4) if self.prompt_tokens and self.prefill_tokens else 0.0,
            "failovers_source_released": int(self.proxy.get("source_released", 0)),
            "prefill_tokens": self.prefill_tokens,
        }


def _quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def jobs_for(refs: Sequence[tuple[list[int], list[int]]], stream: float,
             rng: random.Random) -> list[Job]:
    """One job per (prompt, greedy output), streamed with probability ``stream``."""
    return [Job(list(tokens), list(ref), stream=rng.random() < stream) for tokens, ref in refs]


def kill_points(requests: int, kills: int, rng: random.Random) -> list[int]:
    """Where in the run (requests handed out) each kill comes: one per equal share,
    at a random place in its middle half."""
    share = requests / (kills + 1)
    return sorted(int(share * (i + 1) + rng.uniform(-share / 4, share / 4))
                  for i in range(kills))


def _prefill_counts(fleet: Fleet) -> dict[str, float]:
    text = get_text(fleet.instances["prefill-1"].url + "/metrics")
    return {source: metric(text, "vllm:prompt_tokens_by_source_total", source=source)
            for source in ("local_compute", "local_cache_hit")}


def _proxy_counts(url: str) -> dict[str, float]:
    text = get_text(url + "/metrics")
    out = {"failovers": metric(text, "pushkv_proxy_failover_causes_total"),
           "source_released": metric(text, "pushkv_proxy_failover_causes_total",
                                     cause="source_released")}
    for stage in ("before_answer", "mid_stream"):
        out[stage] = metric(text, "pushkv_proxy_failover_causes_total", stage=stage)
        out[f"prompt_tokens_{stage}"] = metric(
            text, "pushkv_proxy_failover_prompt_tokens_total", stage=stage)
    return out


def drill(fleet: Fleet, url: str, jobs: Sequence[Job], settings: DrillSettings,
          rng: random.Random, proxy_log: str = "",
          progress: Callable[[str], None] | None = None) -> DrillReport:
    """Run ``jobs`` through the proxy at ``url`` while decode instances are killed and
    restarted (see the module's docstring). ``proxy_log``: the proxy's log file, read
    for the resume gaps."""
    points = kill_points(len(jobs), settings.kills, rng)
    lock = threading.Lock()
    state = {"handed": 0, "killed": 0}
    outcomes: list[Outcome] = []
    failures: list[BaseException] = []
    prefill0 = _prefill_counts(fleet)
    log0 = _log_size(proxy_log)

    margin = max(2 * settings.clients, len(jobs) // (2 * (settings.kills + 1)))

    def gate() -> int:  # clients wait here while the last victim restarts
        done = state["killed"]
        return points[done] + margin if done < len(points) else len(jobs)

    def client() -> None:
        while True:
            with lock:
                i = state["handed"]
                if i >= len(jobs):
                    return
                if i >= gate():
                    i = -1
                else:
                    state["handed"] = i + 1
            if i < 0:
                time.sleep(0.05)  # held at the next kill point
                continue
            job = jobs[i]
            out = request(url, fleet.model, job.tokens, job.expect, stream=job.stream,
                          timeout_s=settings.timeout_s)
            with lock:
                outcomes.append(out)

    def killer() -> None:
        try:
            for n, point in enumerate(points, start=1):
                def reached(p: int = point) -> bool:
                    return state["handed"] >= p

                wait_for(reached, 3600, f"kill point {point}")
                time.sleep(rng.uniform(0.0, 0.5))  # a random moment of the requests in flight
                victim = rng.choice([d for d in DECODES if fleet.in_rotation(url, d)])
                fleet.kill(victim)
                if progress is not None:
                    progress(f"kill {n}/{len(points)}: {victim} at request {state['handed']}, "
                             f"{dict(Load.summary(outcomes))}")
                fleet.restart(victim)
                def back(v: str = victim) -> bool:
                    return fleet.in_rotation(url, v)

                wait_for(back, 300, f"{victim} back in rotation")
                with lock:
                    state["killed"] += 1
        except BaseException as exc:
            failures.append(exc)
            with lock:
                state["killed"] = len(points)  # let the clients finish

    threads = [threading.Thread(target=client, daemon=True) for _ in range(settings.clients)]
    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kt.join()
    if failures:
        raise RuntimeError(f"the killer failed: {failures[0]!r}") from failures[0]
    prefill1 = _prefill_counts(fleet)
    gaps = _gaps(proxy_log, log0)
    return DrillReport(
        outcomes=outcomes, kills=len(points),
        prompt_tokens=sum(len(j.tokens) for j in jobs), proxy=_proxy_counts(url),
        resume_gaps_ms=[g for g, _ in gaps], resume_after_break_ms=[b for _, b in gaps if b],
        prefill_tokens={k: prefill1[k] - prefill0[k] for k in prefill0})


def _log_size(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return f.seek(0, 2)
    except OSError:
        return 0


def _gaps(path: str, start: int) -> list[tuple[float, float]]:
    """(gap, time since the break was seen) in ms of every resume the proxy logged."""
    if not path:
        return []
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [(float(m.group(1)), float(m.group(2) or 0.0)) for m in _RESUMED.finditer(text)]
