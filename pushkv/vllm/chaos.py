"""Chaos and soak on real vLLM servers: a fleet, a load of checked clients, faults.

Used by ``tests/vllm/test_chaos.py`` and ``benchmarks/bench_chaos.py``.

* :class:`Fleet` starts vLLM servers with ``PushKVConnector`` (prefill and decode
  instances, by name) and ``pushkv proxy`` processes in front of chosen ones;
  it kills (``SIGKILL``), freezes (``SIGSTOP``), thaws and restarts instances.
* :func:`request` sends one completion through a proxy, streamed or not, and
  classifies what came back against the expected greedy tokens: ``correct``,
  ``clear_error`` (an HTTP error with an OpenAI-style body, or an SSE error
  event), ``wrong`` (an answer that differs), ``hung`` (no answer nor error
  within the client's patience), ``unclear`` (a broken connection without an
  error), or ``left`` (the client itself disconnected on purpose).
* :class:`Load` runs client threads over a list of prompts until they are used up.
* :func:`soak` drives one long load through a proxy and reports what it left
  behind: KV blocks still held or lent per instance, resident memory after the
  warm-up and at the end, p99 latency per window, threads idle and at the end.
  ``benchmarks/bench_chaos.py`` runs it with thousands of requests, the test
  suite with a few dozen.

Only the standard library, :mod:`pushkv.vllm.testing` and the ``/proc`` readings of
:mod:`pushkv.hostprobe` are used.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..hostprobe import group_rss_kib, group_threads
from .testing import (
    PROCESS_GROUP,
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    metric,
    sse_events,
)
from .trend import trend

#: Short protocol timeouts, so that failure paths end within seconds.
#: Handshakes take seconds on a loaded machine; the lease outlasts one.
FAST = {"lease_s": 30.0, "heartbeat_s": 1.0, "window_s": 20.0, "fence_grace_s": 4.0,
        "handshake_timeout_s": 20.0, "peer_confirm_s": 1.0}
#: Environment of every server of a fleet: the model runs in vLLM's engine-core process
#: (the uniprocess executor, as on a GPU with TP 1) instead of a worker process fed
#: through vLLM's shared-memory ring, whose readers busy-wait for a second after
#: every step: four servers' spinning stalled each other on two cores. Without a
#: worker process vLLM binds no OpenMP threads; one thread each leaves the cores to
#: the scheduler.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
#: KV cache of each server: 4,096 blocks of 32 tokens of the tiny model, ample for
#: the loads here (1 GiB would be 32,768 blocks for NIXL to register, per server).
KV_CACHE_BYTES = 128 << 20
#: The longest a server may take to come up: 30-60 s here when quiet, but four
#: starting together beside other people's servers took more than 300 s once.
STARTUP_S = 900.0
#: What a connector logs, followed by one JSON object, for each failed transfer.
FAILED_LINE = "pushkv transfer failed "
#: Keys of that JSON object.
FAILED_KEYS = frozenset({"transfer_id", "incarnation", "attempt", "request_id", "reason",
                         "detail", "engine_id", "rank", "policy"})
#: Proxy flags for fast failover.
PROXY_FLAGS = ("--health-interval", "0.5", "--health-timeout", "1.5", "--unhealthy-after",
               "2", "--backoff-max", "2")


def prompt(n: int, salt: int) -> list[int]:
    """A token-id prompt of ``n`` tokens; different salts give different prompts."""
    rng = random.Random(salt)
    return [rng.randrange(5, 995) for _ in range(n)]


@dataclass
class Outcome:
    kind: str  #: correct, clear_error, wrong, hung, unclear, left
    status: int = 0
    latency_s: float = 0.0
    detail: str = ""
    started: float = 0.0  #: time.monotonic() when the request was sent


def _body(model: str, tokens: list[int], max_tokens: int, stream: bool) -> bytes:
    return json.dumps({"model": model, "prompt": tokens, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                       "stream": stream}).encode()


def request(url: str, model: str, tokens: list[int], expect: list[int], *, stream: bool,
            timeout_s: float, leave_after: float | None = None) -> Outcome:
    """One completion through the proxy at ``url``, classified against ``expect``.

    ``leave_after``: the client disconnects on purpose, not streamed after that
    many seconds without the answer, streamed after that many events of it.
    """
    started = time.monotonic()
    patience = timeout_s if leave_after is None or stream else leave_after
    req = urllib.request.Request(url + "/v1/completions",
                                 data=_body(model, tokens, len(expect), stream),
                                 headers={"Content-Type": "application/json"})

    def done(kind: str, status: int = 0, detail: str = "") -> Outcome:
        return Outcome(kind, status, time.monotonic() - started, detail[:300], started)

    left = "left" if leave_after is not None and not stream else "hung"  # on a timeout
    try:
        with urllib.request.urlopen(req, timeout=patience) as resp:
            if not stream:
                answer = json.loads(resp.read())
                got = list(answer["choices"][0]["token_ids"])
                return done("correct" if got == expect else "wrong", resp.status,
                            "" if got == expect else f"got {got}, expected {expect}")
            got, lines = [], _Lines(resp)
            for events, event in enumerate(sse_events(lines), start=1):
                if "error" in event:
                    return done("clear_error", 200, str(event["error"]))
                got += event["choices"][0].get("token_ids") or []
                if leave_after is not None and events >= max(1, int(leave_after)):
                    return done("left", 200)
            if not lines.done:  # the stream broke off without an error event
                return done("unclear", 200, f"stream ended without [DONE] after {got}")
            return done("correct" if got == expect else "wrong", 200,
                        "" if got == expect else f"got {got}, expected {expect}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            err = json.loads(raw)["error"]
            clear = bool(err["message"]) and int(err["code"]) == exc.code
        except (ValueError, KeyError, TypeError):
            clear = False
        return done("clear_error" if clear else "unclear", exc.code, raw.decode(errors="replace"))
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return done(left)
        return done("unclear", 0, repr(exc))
    except TimeoutError:
        return done(left)
    except (OSError, ValueError, KeyError, IndexError, http.client.HTTPException) as exc:
        return done("unclear", 0, repr(exc))


class _Lines:
    """The lines of a streamed answer; ``done`` once its ``data: [DONE]`` came."""

    def __init__(self, resp: Any) -> None:
        self._resp, self.done = resp, False

    def __iter__(self) -> Any:
        for line in self._resp:
            if line.strip() == b"data: [DONE]":
                self.done = True
            yield line


@dataclass
class Job:
    tokens: list[int]
    expect: list[int]
    stream: bool = False
    #: The client leaves on purpose: seconds (not streamed) or events (streamed).
    leave_after: float | None = None


class Load:
    """Client threads sending ``jobs`` through ``url`` until they are used up."""

    def __init__(self, url: str, model: str, jobs: Sequence[Job], *, clients: int,
                 timeout_s: float) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._jobs = deque(jobs)
        self._lock = threading.Lock()
        self.outcomes: list[Outcome] = []
        self._threads = [threading.Thread(target=self._client, daemon=True)
                         for _ in range(clients)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def _client(self) -> None:
        while True:
            with self._lock:
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            try:
                out = request(self.url, self.model, job.tokens, job.expect, stream=job.stream,
                              timeout_s=self.timeout_s, leave_after=job.leave_after)
            except Exception as exc:  # a client thread never dies silently
                out = Outcome("unclear", detail=repr(exc)[:300], started=time.monotonic())
            with self._lock:
                self.outcomes.append(out)

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def join(self, timeout_s: float) -> list[Outcome]:
        end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise AssertionError("clients still running: a request outlived its timeout")
        return list(self.outcomes)

    @staticmethod
    def summary(outcomes: Sequence[Outcome]) -> Counter[str]:
        return Counter(o.kind for o in outcomes)


# ------------------------------------------------------------------ fleet


@dataclass(kw_only=True)
class _Spec(ServerSpec):
    """A server of a fleet: its KV cache sized in bytes (``--kv-cache-memory-bytes``),
    so without ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, which vLLM would apply instead)."""

    def environ(self) -> dict[str, str]:
        env = super().environ()
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        return env


@dataclass
class Instance:
    name: str
    role: str  #: prefill or decode
    spec: ServerSpec
    server: Server
    restarts: int = 0

    @property
    def url(self) -> str:
        return self.server.url


@dataclass
class Fleet:
    """vLLM servers with PushKVConnector and proxies, on this machine."""

    model: str
    logs: Path
    instances: dict[str, Instance] = field(default_factory=dict)
    proxies: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)  #: by URL
    _proxies_started: int = 0

    def _spec(self, cpu: int, kv_config: dict[str, Any] | None = None) -> ServerSpec:
        return _Spec(model=self.model, port=free_port(), cpu=cpu, kv_config=kv_config,
                     extra_args=("--kv-cache-memory-bytes", str(KV_CACHE_BYTES)),
                     env=ENGINE_ENV)

    def add(self, name: str, role: str, cpu: int, policy: str = "fail",
            **extra: Any) -> Instance:
        """A prefill or decode instance (not started), with default side-channel
        settings: every instance binds free ports of its own."""
        kv = kv_transfer_config("kv_producer" if role == "prefill" else "kv_consumer", name,
                                policy=policy, **{**FAST, **extra})
        spec = self._spec(cpu, kv)
        inst = Instance(name, role, spec, Server(spec, self.logs / f"{name}.log"))
        self.instances[name] = inst
        return inst

    def plain(self, cpu: int) -> Server:
        """A server without a connector: the reference."""
        return Server(self._spec(cpu), self.logs / "plain.log")

    def start(self, *names: str, timeout_s: float = STARTUP_S) -> None:
        for n in names:
            self.instances[n].server.start()
        self.wait_healthy(*names, timeout_s=timeout_s)

    def wait_healthy(self, *names: str, timeout_s: float = STARTUP_S) -> None:
        for n in names:
            self.instances[n].server.wait_healthy(timeout_s)

    def proxy(self, prefill: Sequence[str], decode: Sequence[str], *flags: str,
              timeout_s: float = 30.0) -> str:
        """Start ``pushkv proxy`` over the named instances; its URL once healthy."""
        port = free_port()
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "pushkv.cli", "proxy", "--port", str(port),
                "--request-timeout", str(timeout_s), *PROXY_FLAGS, *flags]
        for n in prefill:
            argv += ["--prefill", self.instances[n].url]
        for n in decode:
            argv += ["--decode", self.instances[n].url]
        url = f"http://127.0.0.1:{port}"
        self._proxies_started += 1
        with (self.logs / f"proxy-{self._proxies_started}.log").open("ab") as out:
            self.proxies[url] = subprocess.Popen(argv, env=env, stdout=out,
                                                 stderr=subprocess.STDOUT,
                                                 process_group=PROCESS_GROUP)
        wait_for(lambda: healthy(url), 60, f"proxy {url} healthy")
        return url

    def close_proxy(self, url: str) -> None:
        proc = self.proxies.pop(url)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    def in_rotation(self, url: str, name: str) -> bool:
        """Whether the proxy at ``url`` has instance ``name`` in rotation."""
        return metric(get_text(url + "/metrics"), "pushkv_proxy_instance_up",
                      url=self.instances[name].url) == 1

    # ---------------------------------------------------------- faults

    def kill(self, name: str) -> None:
        """SIGKILL every process of the instance at once (a crash)."""
        self.instances[name].server.kill()

    def freeze(self, name: str) -> None:
        """SIGSTOP every process of the instance (a hang: its sockets stay open)."""
        proc = self.instances[name].server.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        proc = self.instances[name].server.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGCONT)

    def restart(self, name: str, timeout_s: float = STARTUP_S) -> None:
        """Start the instance again (killed first if it still runs), same settings."""
        self.respawn(name)
        self.instances[name].server.wait_healthy(timeout_s)

    def respawn(self, name: str) -> None:
        """Start the instance again (killed first if it still runs), same settings,
        without waiting for it (:meth:`wait_healthy`)."""
        inst = self.instances[name]
        inst.server.kill()
        inst.restarts += 1
        inst.server = Server(inst.spec, self.logs / f"{name}-{inst.restarts}.log")
        inst.server.start()

    # ----------------------------------------------------------- state

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.server.alive()]

    def usage(self, name: str) -> float:
        return metric(get_text(self.instances[name].url + "/metrics"),
                      "vllm:kv_cache_usage_perc")

    def counter(self, name: str, metric_name: str, **labels: str) -> float:
        return metric(get_text(self.instances[name].url + "/metrics"), metric_name, **labels)

    def blocks(self, name: str) -> int:
        """KV blocks the instance's engine still references: on a producer, blocks held
        for a push; on a consumer, blocks lent to a registration (or a running request)."""
        return referenced_blocks(get_text(self.instances[name].url + "/metrics"))

    def all_blocks(self) -> dict[str, int]:
        return {i.name: self.blocks(i.name) for i in self.live()}

    def wait_idle(self, timeout_s: float = 90.0) -> dict[str, int]:
        """Wait until every live instance references no KV block; the counts seen
        last (raises with them when the deadline passes first)."""
        seen: dict[str, int] = {}

        def idle() -> bool:
            seen.update(self.all_blocks())
            return not any(seen.values())

        wait_for(idle, timeout_s, lambda: f"every live instance idle: blocks {seen}")
        return seen

    def failure_lines(self, name: str) -> list[dict[str, Any]]:
        """The JSON record of every failed-transfer line in the instance's log (since
        its last start)."""
        text = self.instances[name].server.log_path.read_text(errors="replace")
        return [json.loads(line.split(FAILED_LINE, 1)[1])
                for line in text.splitlines() if FAILED_LINE in line]

    def threads(self, name: str) -> int:
        """Threads of every process of the instance (its process group)."""
        proc = self.instances[name].server.proc
        assert proc is not None
        return group_threads(proc.pid)

    def all_threads(self) -> dict[str, int]:
        return {i.name: self.threads(i.name) for i in self.live()}

    def wait_threads(self, idle: dict[str, int], timeout_s: float = 60.0) -> dict[str, int]:
        """Wait until each instance of ``idle`` runs no more threads than it did there."""
        seen: dict[str, int] = {}

        def back() -> bool:
            seen.update({n: self.threads(n) for n in idle})
            return all(seen[n] <= idle[n] for n in idle)

        wait_for(back, timeout_s, lambda: f"threads back to idle {idle}: now {seen}")
        return seen

    def groups(self) -> dict[str, int]:
        """Process group of every live instance and proxy, by name (proxies by URL)."""
        out = {i.name: i.server.proc.pid for i in self.live() if i.server.proc is not None}
        return out | {url: p.pid for url, p in self.proxies.items() if p.poll() is None}

    def stop(self) -> None:
        for url in list(self.proxies):
            self.close_proxy(url)
        for inst in self.instances.values():
            if inst.server.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(inst.server.proc.pid, signal.SIGCONT)
            inst.server.stop()


def referenced_blocks(metrics_text: str) -> int:
    """KV blocks in use, from a vLLM server's ``/metrics`` (usage x number of blocks)."""
    usage = metric(metrics_text, "vllm:kv_cache_usage_perc")
    found = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', metrics_text,
                      re.MULTILINE)
    if found is None:
        raise AssertionError("no vllm:cache_config_info with num_gpu_blocks in /metrics")
    return round(usage * int(found.group(1)))


def healthy(url: str) -> bool:
    try:
        get_text(url + "/health", timeout=5)
        return True
    except OSError:
        return False


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> None:
    """Poll ``cond`` until it holds; AssertionError saying ``what`` past the deadline."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > end:
            text = what() if callable(what) else what
            raise AssertionError(f"not reached within {timeout_s} s: {text}")
        time.sleep(0.2)


def warm(url: str, model: str, jobs: Sequence[Job], timeout_s: float = 240.0) -> None:
    """Send ``jobs`` one at a time until each is answered exactly (the first requests
    of a pair of instances pay their handshake, slow on a loaded machine)."""
    end = time.monotonic() + timeout_s
    for job in jobs:
        while True:
            out = request(url, model, job.tokens, job.expect, stream=False,
                          timeout_s=max(1.0, end - time.monotonic()))
            if out.kind == "correct":
                break
            if out.kind == "wrong" or time.monotonic() > end:
                raise AssertionError(f"warm-up failed: {out}")


def references(url: str, model: str, prompts: Sequence[list[int]], max_tokens: int,
               workers: int = 4) -> list[list[int]]:
    """Greedy outputs of a plain server for ``prompts``."""
    from concurrent.futures import ThreadPoolExecutor

    def one(tokens: list[int]) -> list[int]:
        req = urllib.request.Request(url + "/v1/completions",
                                     data=_body(model, tokens, max_tokens, False),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            return list(json.loads(resp.read())["choices"][0]["token_ids"])

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, prompts))


# ------------------------------------------------------------------- soak


def soak_jobs(refs: Sequence[tuple[list[int], list[int]]], rng: random.Random, *,
              leave: float = 0.1, stream: float = 0.4, min_out: int = 4) -> list[Job]:
    """A job per (prompt, greedy output) of ``refs``: a random output length (the
    greedy output's prefix), streamed or not, and ``leave`` of them (rounded) from
    clients that disconnect at a random point. Every other leaver streams and leaves
    after a random number of its events (before the end); the others leave after a
    random wait of 5 to 150 ms (most answers take longer; one that comes first is
    taken and checked, and the outcome says so)."""
    leavers = sorted(rng.sample(range(len(refs)), round(leave * len(refs))))
    leaving = {i: j % 2 == 0 for j, i in enumerate(leavers)}  # index -> streamed
    jobs = []
    for i, (tokens, ref) in enumerate(refs):
        k = rng.randint(min(min_out, len(ref)), len(ref))
        streamed = leaving.get(i, rng.random() < stream)
        after: float | None = None
        if i in leaving:
            after = float(rng.randint(1, k)) if streamed else rng.uniform(0.005, 0.15)
        jobs.append(Job(list(tokens), list(ref[:k]), stream=streamed, leave_after=after))
    return jobs


def p99(values: Sequence[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


@dataclass
class SoakReport:
    """What a soak left behind and how it went."""

    outcomes: list[Outcome]
    warmed: int  #: requests counted as the warm-up
    rss_warm_kib: dict[str, int]  #: per instance and proxy, right after the warm-up
    rss_end_kib: dict[str, int]  #: the same, at the end (load over, instances idle)
    rss_max_kib: int  #: the highest total seen in between
    p99_s: list[float]  #: p99 latency of requests served in full, per window after warm-up
    threads_idle: dict[str, int]  #: per instance, idle before the soak
    threads_end: dict[str, int]  #: per instance, idle after it
    blocks_end: dict[str, int]  #: KV blocks still referenced per instance at the end

    @property
    def leaked_blocks(self) -> int:
        return sum(self.blocks_end.values())

    @property
    def bad(self) -> list[Outcome]:
        """Outcomes that are neither correct, a clear error, nor a client that left."""
        return [o for o in self.outcomes if o.kind not in ("correct", "clear_error", "left")]

    def figures(self) -> dict[str, Any]:
        warm, end = sum(self.rss_warm_kib.values()), sum(self.rss_end_kib.values())
        first, last = (self.p99_s[0], self.p99_s[-1]) if self.p99_s else (0.0, 0.0)
        return {
            "requests": len(self.outcomes),
            "outcomes": dict(Load.summary(self.outcomes)),
            "leaked_blocks": self.leaked_blocks,
            "blocks_end": self.blocks_end,
            "rss_warm_mib": round(warm / 1024, 1), "rss_end_mib": round(end / 1024, 1),
            "rss_ratio": round(end / warm, 4) if warm else 0.0,
            "rss_max_ratio": round(self.rss_max_kib / warm, 4) if warm else 0.0,
            "rss_ratio_by_process": {k: round(self.rss_end_kib.get(k, 0) / v, 4)
                                     for k, v in self.rss_warm_kib.items() if v},
            "p99_ms_first": round(1000 * first, 1), "p99_ms_last": round(1000 * last, 1),
            "p99_ms_windows": [round(1000 * v, 1) for v in self.p99_s],
            # rising = a Mann-Kendall trend over every window (pushkv.vllm.trend)
            "p99_trend": trend([1000 * v for v in self.p99_s]).figures(),
            "threads_idle": self.threads_idle, "threads_end": self.threads_end,
        }


def _until(cond: Callable[[], bool], timeout_s: float) -> bool:
    try:
        wait_for(cond, timeout_s, "")
        return True
    except AssertionError:
        return False


def soak(fleet: Fleet, url: str, model: str, jobs: Sequence[Job], *, clients: int,
         timeout_s: float, windows: int = 10, warm_fraction: float = 0.1,
         progress: Callable[[str], None] | None = None) -> SoakReport:
    """Run ``jobs`` through the proxy at ``url`` with ``clients`` concurrent clients.

    Call it with the fleet warmed up and idle (every pair handshaken): the threads
    each instance runs then are its idle value. Resident memory of every instance
    and proxy is taken once the first ``warm_fraction`` of the requests is answered,
    at each tenth of the run, and at the end; latencies of the requests after the
    warm-up, in the order they were sent, make ``windows`` windows. At the end the
    instances get time (polled, 90 s at most) to release every block and to end the
    threads the load started; what is left is reported, never hidden.
    """
    threads_idle = fleet.all_threads()
    groups = fleet.groups()

    def rss() -> dict[str, int]:
        by_pgid = group_rss_kib(list(groups.values()))
        return {name: by_pgid[pgid] for name, pgid in groups.items()}

    n = len(jobs)
    warmed = max(1, int(n * warm_fraction))
    deadline = timeout_s * (n // max(1, clients) + 2)
    load = Load(url, model, jobs, clients=clients, timeout_s=timeout_s).start()
    wait_for(lambda: load.done >= warmed, deadline, "the soak's warm-up")
    rss_warm = rss()
    rss_max = sum(rss_warm.values())
    for tenth in range(1, 11):
        wait_for(lambda t=tenth: load.done >= n * t // 10, deadline, "the soak's requests")
        now = rss()
        rss_max = max(rss_max, sum(now.values()))
        if progress is not None:
            progress(f"{load.done}/{n} answered, {dict(Load.summary(load.outcomes))}, rss MiB "
                     + ", ".join(f"{k}={v / 1024:.0f}" for k, v in now.items()))
    outcomes = load.join(timeout_s * 2)
    blocks: dict[str, int] = {}

    def idle() -> bool:
        blocks.update(fleet.all_blocks())
        return not any(blocks.values())

    _until(idle, 90)
    threads_end: dict[str, int] = {}

    def back() -> bool:
        threads_end.update({k: fleet.threads(k) for k in threads_idle})
        return all(threads_end[k] <= v for k, v in threads_idle.items())

    _until(back, 60)
    rss_end = rss()
    rss_max = max(rss_max, sum(rss_end.values()))
    after = sorted(outcomes, key=lambda o: o.started)[warmed:]
    k = max(1, min(windows, len(after)))
    cuts = [len(after) * i // k for i in range(k + 1)]
    p99s = [p99([o.latency_s for o in after[cuts[i]:cuts[i + 1]] if o.kind == "correct"])
            for i in range(k)]
    return SoakReport(outcomes, warmed, rss_warm, rss_end, rss_max, p99s, threads_idle,
                      threads_end, blocks)
