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

Only the standard library and :mod:`pushkv.vllm.testing` are used.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .testing import (
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    metric,
    sse_events,
)

#: Short protocol timeouts, so that failure paths end within seconds.
#: Handshakes take seconds on a loaded machine; the lease outlasts one.
FAST = {"lease_s": 30.0, "heartbeat_s": 1.0, "window_s": 20.0, "fence_grace_s": 4.0,
        "handshake_timeout_s": 20.0, "peer_confirm_s": 1.0}
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

    ``leave_after``: the client disconnects on purpose after that many seconds
    (or, streamed, after that many tenths of the answer's events).
    """
    started = time.monotonic()
    patience = timeout_s if leave_after is None or stream else leave_after
    req = urllib.request.Request(url + "/v1/completions",
                                 data=_body(model, tokens, len(expect), stream),
                                 headers={"Content-Type": "application/json"})

    def done(kind: str, status: int = 0, detail: str = "") -> Outcome:
        return Outcome(kind, status, time.monotonic() - started, detail[:300], started)

    try:
        with urllib.request.urlopen(req, timeout=patience) as resp:
            if not stream:
                answer = json.loads(resp.read())
                got = list(answer["choices"][0]["token_ids"])
                return done("correct" if got == expect else "wrong", resp.status,
                            "" if got == expect else f"got {got}, expected {expect}")
            got = []
            for events, event in enumerate(sse_events(resp), start=1):
                if "error" in event:
                    return done("clear_error", 200, str(event["error"]))
                got += event["choices"][0].get("token_ids") or []
                if leave_after is not None and events >= max(1, int(leave_after * 10)):
                    return done("left", 200)
            if leave_after is not None:
                return done("left", 200)
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
            return done("left" if leave_after is not None else "hung")
        return done("unclear", 0, repr(exc))
    except TimeoutError:
        return done("left" if leave_after is not None else "hung")
    except (OSError, ValueError, KeyError, IndexError) as exc:
        return done("unclear", 0, repr(exc))


@dataclass
class Job:
    tokens: list[int]
    expect: list[int]
    stream: bool = False
    leave_after: float | None = None


class Load:
    """Client threads sending ``jobs`` through ``url`` until they are used up."""

    def __init__(self, url: str, model: str, jobs: Sequence[Job], *, clients: int,
                 timeout_s: float) -> None:
        self.url, self.model, self.timeout_s = url, model, timeout_s
        self._jobs = list(jobs)
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
                job = self._jobs.pop()
            out = request(self.url, self.model, job.tokens, job.expect, stream=job.stream,
                          timeout_s=self.timeout_s, leave_after=job.leave_after)
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


@dataclass
class Instance:
    name: str
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
    proxies: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def add(self, name: str, role: str, cpu: int, policy: str = "fail",
            **extra: Any) -> Instance:
        kv = kv_transfer_config("kv_producer" if role == "prefill" else "kv_consumer", name,
                                policy=policy, **{**FAST, **extra})
        spec = ServerSpec(model=self.model, port=free_port(), cpu=cpu, kv_config=kv)
        inst = Instance(name, spec, Server(spec, self.logs / f"{name}.log"))
        self.instances[name] = inst
        return inst

    def plain(self, cpu: int) -> Server:
        return Server(ServerSpec(model=self.model, port=free_port(), cpu=cpu),
                      self.logs / "plain.log")

    def start(self, *names: str, timeout_s: float = 300.0) -> None:
        for n in names:
            self.instances[n].server.start()
        for n in names:
            self.instances[n].server.wait_healthy(timeout_s)

    def proxy(self, prefill: Sequence[str], decode: Sequence[str], *flags: str,
              timeout_s: float = 30.0) -> str:
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
        with (self.logs / f"proxy-{len(self.proxies)}.log").open("ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.proxies.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: healthy(url), 60, f"proxy {url} healthy")
        return url

    # ---------------------------------------------------------- faults

    def kill(self, name: str) -> None:
        self.instances[name].server.kill()

    def freeze(self, name: str) -> None:
        proc = self.instances[name].server.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        proc = self.instances[name].server.proc
        assert proc is not None
        os.killpg(proc.pid, signal.SIGCONT)

    def restart(self, name: str, timeout_s: float = 300.0) -> None:
        inst = self.instances[name]
        inst.server.kill()
        inst.restarts += 1
        inst.server = Server(inst.spec, self.logs / f"{name}-{inst.restarts}.log")
        inst.server.start().wait_healthy(timeout_s)

    # ----------------------------------------------------------- state

    def live(self) -> list[Instance]:
        return [i for i in self.instances.values() if i.server.alive()]

    def usage(self, name: str) -> float:
        text = get_text(self.instances[name].url + "/metrics")
        return metric(text, "vllm:kv_cache_usage_perc")

    def counter(self, name: str, metric_name: str, **labels: str) -> float:
        return metric(get_text(self.instances[name].url + "/metrics"), metric_name, **labels)

    def threads(self, name: str) -> int:
        """Threads of every process of the instance (its process group)."""
        proc = self.instances[name].server.proc
        assert proc is not None
        return group_threads(proc.pid)

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Every live instance holds no KV block (nothing held, nothing lent)."""
        names = [i.name for i in self.live()]
        wait_for(lambda: all(self.usage(n) == 0 for n in names), timeout_s,
                 "every live instance idle: " + ", ".join(
                     f"{n}={self.usage(n)}" for n in names))

    def stop(self) -> None:
        for proc in self.proxies:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        self.proxies.clear()
        for inst in self.instances.values():
            if inst.server.proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(inst.server.proc.pid, signal.SIGCONT)
            inst.server.stop()


def group_threads(pgid: int) -> int:
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # fields after the name: state, ppid, pgrp, ...
            total += int(fields[17])  # num_threads
    return total


def healthy(url: str) -> bool:
    try:
        get_text(url + "/health", timeout=5)
        return True
    except OSError:
        return False


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {timeout_s} s: {what}")
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
