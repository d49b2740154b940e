"""Drive bench_e2e.sh: deployments phase by phase (the plain server kept up, each
connector's pair in turn), modes alternating, latency and outputs checked against
the plain server in the same round.

In each phase, for each iteration, every mode (rows of :data:`modes.MODES`, order rotated each
iteration) serves the same fresh prompts twice: **sequentially** (one request
at a time) and **concurrently** (all at once). Every request is streamed; the
client records its latency, TTFT, TPOT and output tokens, which must equal the
plain server's. Then, optionally (``--serve-qps``), ``vllm bench serve`` runs
against each router mode and the plain server.

Output (``--out``): ``latency.json`` (every request), ``timeline/<mode>/``
(pushkv.timeline marks of routers and clients; ``timeline/<deployment>/``: the
servers'), ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json`` of ``vllm bench serve``,
``logs/``. The last line printed is one JSON object (see :func:`verdict`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import select
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import Client, Result, Target  # noqa: E402
from modes import DEFAULT_MODES, MODES, SPIN_S, Mode, RouterArgs  # noqa: E402
from router_modes import router_verdict  # noqa: E402

from pushkv import timeline  # noqa: E402
from pushkv.hostprobe import process_cpu_s  # noqa: E402
from pushkv.vllm.testing import (  # noqa: E402
    CPU_TUNING,
    Server,
    ServerSpec,
    free_port,
    kv_transfer_config,
    wait_up,
    write_tiny_llama,
    write_word_tokenizer,
)

THROTTLE = CPU_TUNING  # its sitecustomize: vLLM's NIXL agents, core, busy loop, timeline
#: every server's idle keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s by default)
KEEP_ALIVE_S = "3600"


def nixl_config(connector: str, role: str, engine_id: str) -> dict[str, Any]:
    return {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu",
            "engine_id": engine_id, "kv_connector_extra_config": {"backends": ["UCX"]}}


class Deployment:
    """The servers of one connector (or the plain server)."""

    def __init__(self, kind: str, model: str, out: Path, *, max_model_len: int,
                 delay_us: int, plain_cores: str = "0,1", spin_s: str = SPIN_S) -> None:
        self.kind, self.model, self.out = kind, model, out
        self.spin_s = spin_s
        self.plain_cores = plain_cores
        self.max_model_len, self.delay_us = max_model_len, delay_us
        self.timeline_dir = out / "timeline" / kind
        self.servers: list[Server] = []
        self.side_port = 0

    def spec(self, cpu: int, kv: dict[str, Any] | None = None,
             env: dict[str, str] | None = None) -> ServerSpec:
        # An idle keep-alive connection survives a frozen turn (--phases turns): with
        # uvicorn's 5 s, a thawed server closed the connection its next request was
        # already on its way over. Latency is the same either way.
        env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": KEEP_ALIVE_S} | dict(env or {})
        return ServerSpec(model=self.model, port=free_port(), cpu=cpu, kv_config=kv,
                          tokenizer=True, prefix_caching=False,
                          max_model_len=self.max_model_len, env=env,
                          spin_s=self.spin_s or None)  # every server alike

    def start(self) -> None:
        logs = self.out / "logs"
        if self.kind == "plain":
            # one replica per core: the same cores a pair's prefill and decode use
            cores = [int(c) for c in self.plain_cores.split(",")]
            self.servers = [Server(self.spec(c), logs / f"plain-{c}.log") for c in cores]
        elif self.kind == "pushkv":
            extra = {"progress_delay_us": self.delay_us, "timeline_dir": str(self.timeline_dir)}
            # every server process records from its start (the API server's pauses too)
            env = {"PUSHKV_BENCH_TIMELINE_DIR": str(self.timeline_dir)}
            p = self.spec(0, kv_transfer_config("kv_producer", "prefill-0", **extra), env)
            d = self.spec(1, kv_transfer_config("kv_consumer", "decode-0", **extra), env)
            self.servers = [Server(p, logs / "pushkv-prefill.log"),
                            Server(d, logs / "pushkv-decode.log")]
        else:
            connector = "NixlConnector" if self.kind == "nixl-pull" else "NixlPushConnector"
            self.side_port = free_port()
            env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                   # what vLLM sets itself when NIXL is imported after it (the throttle
                   # imports NIXL first)
                   "UCX_RCACHE_MAX_UNRELEASED": "1024",
                   "PUSHKV_BENCH_NIXL_DELAY_US": str(self.delay_us),
                   "PUSHKV_BENCH_TIMELINE_DIR": str(self.timeline_dir),
                   "PYTHONPATH": os.pathsep.join(
                       p for p in (str(THROTTLE), str(ROOT), os.environ.get("PYTHONPATH"))
                       if p)}
            p = self.spec(0, nixl_config(connector, "kv_producer", "prefill-0"),
                          env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.side_port),
                                 "PUSHKV_BENCH_KEEP_CORE": "0"})
            d = self.spec(1, nixl_config(connector, "kv_consumer", "decode-0"),
                          env | {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                 "PUSHKV_BENCH_KEEP_CORE": "1"})
            self.servers = [Server(p, logs / f"{self.kind}-prefill.log"),
                            Server(d, logs / f"{self.kind}-decode.log")]
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_healthy(600)  # a busy machine starts vLLM slowly

    @property
    def prefill(self) -> Server:
        return self.servers[0]

    @property
    def decode(self) -> Server:
        return self.servers[-1]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


class Endpoint:
    """A mode ready to serve: its target, and its router process if any."""

    def __init__(self, mode: Mode, dep: Deployment, out: Path) -> None:
        self.mode, self.dep = mode, dep
        self.timeline_dir = out / "timeline" / mode.name
        self.router: subprocess.Popen[bytes] | None = None
        dispatch = mode.client_dispatch
        url = dep.decode.url
        if mode.router is not None:
            port = free_port()
            cmd = mode.router(RouterArgs(
                prefill_url=dep.prefill.url, decode_url=dep.decode.url, port=port,
                prefill_side_port=dep.side_port, timeline_dir=str(self.timeline_dir)))
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            with (out / "logs" / f"{mode.name}-router.log").open("ab") as log:
                self.router = subprocess.Popen(cmd, env=env, stdout=log,
                                               stderr=subprocess.STDOUT,
                                               start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            wait_up(url, f"{mode.name}: router")
        replicas = tuple(s.url for s in dep.servers) if dep.kind == "plain" else ()
        self.target = Target(url=url, dispatch=dispatch, prefill_url=dep.prefill.url,
                             prefill_side_port=dep.side_port, replicas=replicas)

    def router_cpu_s(self) -> float:
        """CPU time the router process used so far (NaN without one)."""
        return process_cpu_s(self.router.pid) if self.router is not None else float("nan")

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            os.killpg(self.router.pid, signal.SIGINT)
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.router.pid, signal.SIGKILL)
                self.router.wait(5)


class Freezer:
    """One deployment's processes stopped while another deployment's turn runs
    (``--phases turns``): ``SIGSTOP`` to its routers' and servers' process groups (each
    started in a session of its own), ``SIGCONT`` to thaw, servers first. A stopped
    process takes no CPU, so an idle pair costs its neighbours nothing (an idle
    ``NixlPushConnector`` pair slowed a plain server beside it 1.4-1.75x here) while the
    connectors still take turns seconds apart, not phases minutes apart. As a context
    manager: thawed inside, frozen again on the way out."""

    def __init__(self, dep: Deployment, eps: list[Endpoint]) -> None:
        self.servers = [s.proc.pid for s in dep.servers if s.proc is not None]
        self.routers = [ep.router.pid for ep in eps if ep.router is not None]
        self.frozen = False

    def _signal(self, pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:  # a process that died is reported by its requests
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)

    def freeze(self) -> None:
        self._signal(self.routers, signal.SIGSTOP)  # before a router can see its servers stop
        self._signal(self.servers, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        self._signal(self.servers, signal.SIGCONT)
        self._signal(self.routers, signal.SIGCONT)
        self.frozen = False

    def __enter__(self) -> Freezer:
        self.thaw()
        return self

    def __exit__(self, *exc: object) -> None:
        self.freeze()


def prompts(n: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(5, 995) for _ in range(length)] for _ in range(n)]


async def run_mode(client: Client, ep: Endpoint, batch: list[list[int]], max_tokens: int,
                   concurrent: bool) -> list[Result]:
    """Serve ``batch`` through ``ep``; each result's ``router_cpu_ms`` is its share of the
    CPU time the router process used meanwhile (kernel ticks: exact only on average)."""
    timeline.configure(None)
    timeline.configure(ep.timeline_dir, f"client-{ep.mode.name}")
    cpu0 = ep.router_cpu_s()
    try:
        if concurrent:
            got = list(await asyncio.gather(*(client.request(ep.target, p, max_tokens)
                                              for p in batch)))
        else:
            got = [await client.request(ep.target, p, max_tokens) for p in batch]
    finally:
        timeline.configure(None)
    share = (ep.router_cpu_s() - cpu0) * 1e3 / max(1, len(got))
    for r in got:
        r.router_cpu_ms = share
    return got


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def finite(x: float, digits: int = 3) -> float | None:
    """``x`` rounded, or None (JSON null) when it could not be measured."""
    return round(x, digits) if x == x and abs(x) != float("inf") else None


def paired_overheads(records: list[dict[str, Any]], mode: str, base: str,
                     load: str) -> dict[tuple[str, int], list[float]]:
    """Per round (phase, iteration): ``mode``'s median latency minus ``base``'s in that
    round, one value per round, or one per prompt in an interleaved sequential round.
    With ``--phases turns`` ``base`` served each deployment's turn of a round apart, and
    a mode pairs with ``base``'s requests of its own turn."""
    per: dict[tuple[str, str, int, int, str], list[float]] = {}
    for r in records:
        if r["load"] == load and r["mode"] in (mode, base):
            per.setdefault((r["mode"], r["phase"], r["iter"], r.get("slot", -1),
                            r.get("turn") or ""), []).append(r["latency_ms"])
    out: dict[tuple[str, int], list[float]] = {}
    for (m, ph, it, sl, turn), v in sorted(per.items()):
        if m == mode and (base, ph, it, sl, turn) in per:
            out.setdefault((ph, it), []).append(
                median(v) - median(per[base, ph, it, sl, turn]))
    return out


def _draws(keys: list[tuple[str, int]], draws: int, seed: int
           ) -> Iterator[list[tuple[str, int]]]:
    """``draws`` resamples of ``keys`` with replacement (the bootstrap's draws)."""
    rng = random.Random(seed)
    for _ in range(draws):
        yield [keys[rng.randrange(len(keys))] for _ in keys]


def _ci95(values: list[float]) -> tuple[float, float]:
    return timeline.percentile(values, 0.025), timeline.percentile(values, 0.975)


def bootstrap_ratio(records: list[dict[str, Any]], ours: str, theirs: str, base: str,
                    load: str, *, draws: int = 2000, seed: int = 0
                    ) -> tuple[float, float] | None:
    """95% interval of median(ours - base) / median(theirs - base) over rounds drawn
    with replacement (rounds, not requests, are the independent unit: a round's
    requests share the machine's state). Rounds both modes served (one phase) are
    drawn together, keeping what the two share; otherwise (``--phases each``) each
    mode's rounds are drawn on their own. None with fewer than 3 rounds of each."""
    a = paired_overheads(records, ours, base, load)
    b = paired_overheads(records, theirs, base, load)
    together = set(a) == set(b)
    ra, rb = sorted(a), sorted(b)
    if min(len(ra), len(rb)) < 3:
        return None
    picks_b = _draws(rb, draws, seed + 1)
    ratios: list[float] = []
    for pick_a in _draws(ra, draws, seed):
        pick_b = pick_a if together else next(picks_b)
        den = median([x for k in pick_b for x in b[k]])
        if den > 0:
            ratios.append(median([x for k in pick_a for x in a[k]]) / den)
    if len(ratios) < draws // 2:  # vLLM push's overhead is not clearly positive
        return None
    return _ci95(ratios)


def bootstrap_overhead(records: list[dict[str, Any]], mode: str, base: str, load: str, *,
                       draws: int = 2000, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of the median of ``mode``'s overhead over ``base`` (rounds drawn with
    replacement, as in :func:`bootstrap_ratio`). None with fewer than 3 rounds."""
    a = paired_overheads(records, mode, base, load)
    if len(a) < 3:
        return None
    return _ci95([median([x for k in pick for x in a[k]])
                  for pick in _draws(sorted(a), draws, seed)])


def verdict(records: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """The run's one JSON object: per-mode medians and pushkv's overhead ratios.

    A mode's overhead is paired: its median latency in a round minus the plain
    server's in the same round (same phase, same prompts), the median over rounds;
    in an interleaved sequential round, its latency for each prompt minus plain's for
    the same prompt a moment apart, the median over every prompt of every round.
    ``..._ci95``: the ratio's 95% interval over rounds (:func:`bootstrap_ratio`)."""

    def paired(mode: str, base: str, load: str) -> list[float]:
        """Per round (slot -1), or per prompt of an interleaved round."""
        return [x for v in paired_overheads(records, mode, base, load).values() for x in v]

    def run_medians(mode: str, load: str, key: str) -> list[float]:
        groups: dict[tuple[str, int], list[float]] = {}
        for r in records:
            if r["mode"] == mode and r["load"] == load:
                groups.setdefault((r["phase"], r["iter"]), []).append(r[key])
        return [median(v) for v in groups.values()]

    out: dict[str, Any] = {}
    for load in ("seq", "conc"):
        push = median(paired("push-client", "plain", load))
        vllm = median(paired("vllm-push-client", "plain", load))
        out[f"overhead_ratio_vs_vllm_push_{load}"] = finite(push / vllm) if vllm else None
        lo_hi = bootstrap_ratio(records, "push-client", "vllm-push-client", "plain", load)
        out[f"overhead_ratio_vs_vllm_push_{load}_ci95"] = (
            [finite(x) for x in lo_hi] if lo_hi else None)
        out[f"overhead_ms_{load}"] = {m: finite(median(paired(m, "plain", load)), 2)
                                      for m in modes if m != "plain"
                                      and paired(m, "plain", load)}
    for load in ("seq", "conc"):
        # The plain baseline runs a replica per core (--plain-cores); with one plain
        # server on one core, concurrent load makes plain slower than both pairs, the
        # overheads negative and their ratio meaningless; the latencies' ratio still
        # says which connector is faster.
        ours = median(run_medians("push-client", load, "latency_ms"))
        theirs = median(run_medians("vllm-push-client", load, "latency_ms"))
        out[f"latency_ratio_vs_vllm_push_{load}"] = finite(ours / theirs) if theirs else None
    # what pushkv proxy adds over the client dispatching itself; push-asyncio: on
    # asyncio's loop (reported only when that mode ran)
    for mode, key in (("push", "proxy_hop"), ("push-asyncio", "proxy_hop_asyncio")):
        if mode == "push" or paired(mode, "push-client", "seq"):
            out[f"{key}_ms"] = finite(median(paired(mode, "push-client", "seq")), 2)
            hop = bootstrap_overhead(records, mode, "push-client", "seq")
            out[f"{key}_ms_ci95"] = [finite(x, 2) for x in hop] if hop else None
    # the router's CPU per request, a mean (ticks of 10 ms, so one request's is 0 or 10)
    cpu = {m: [x for r in records if r["mode"] == m
               and (x := r.get("router_cpu_ms")) is not None and x == x] for m in modes}
    out["router_cpu_ms_per_request"] = {m: round(statistics.fmean(v), 2)
                                        for m, v in cpu.items() if v}
    for key in ("latency_ms", "ttft_ms", "tpot_ms"):
        out[f"median_{key}"] = {f"{m}_{ld}": round(median(run_medians(m, ld, key)), 2)
                                for m in modes for ld in ("seq", "conc")
                                if run_medians(m, ld, key)}
    out |= router_verdict({(m, ld): median(run_medians(m, ld, "latency_ms"))
                           for m in modes for ld in ("seq", "conc")})
    out["outputs_identical_to_plain"] = all(r["same_as_plain"] for r in records)
    out["rounds"] = len({(r["phase"], r["iter"]) for r in records})
    return out


def latency_table(summary: dict[str, Any], modes: list[str]) -> str:
    lines = ["| mode | load | latency (ms) | TTFT (ms) | TPOT (ms) |", "|---|---|---|---|---|"]
    for m in modes:
        for ld in ("seq", "conc"):
            k = f"{m}_{ld}"
            if k in summary["median_latency_ms"]:
                lines.append(f"| {m} | {ld} | {summary['median_latency_ms'][k]:.1f} | "
                             f"{summary['median_ttft_ms'][k]:.1f} | "
                             f"{summary['median_tpot_ms'][k]:.2f} |")
    return "\n".join(lines)


def timeline_report(out: Path, modes: list[str]) -> str:
    """Median / p90 of every timeline segment, per mode (router/client marks joined with
    their deployment's server marks by request id)."""
    stats: dict[str, dict[str, dict[str, float]]] = {}
    for name in modes:
        mode = MODES[name]
        own = timeline.read(out / "timeline" / name)
        ids = {m.transfer_id for m in own}
        server = [m for m in timeline.read(out / "timeline" / mode.deployment)
                  if m.transfer_id in ids]
        segs = timeline.segments(timeline.by_request(own + server))
        stats[name] = {k: {"median": median(v), "p90": timeline.percentile(v, 0.9),
                           "n": len(v)} for k, v in segs.items()}
    (out / "timeline.json").write_text(json.dumps(stats, indent=1))
    return timeline.table(stats)


#: ``vllm bench serve`` through vLLM's own entry point (see bench_serve.py)
BENCH_SERVE = (sys.executable, str(ROOT / "benchmarks" / "e2e" / "bench_serve.py"))


def bench_serve_env() -> dict[str, str]:
    """The client's environment, in a process of its own or kept up: offline, pushkv
    importable."""
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


class BenchClient:
    """``vllm bench serve`` kept up in one process for many runs
    (``bench_serve.py --jobs-from-stdin``): importing vLLM and torch, about ten
    seconds of this machine's cores, is paid once, not before every point and
    gauge. The runs are vLLM's own benchmark code as before, each with its flags,
    its seed and a fresh event loop. A client that dies or overruns a run is
    stopped and the run fails; the next run starts a fresh one. ``timeline_dir``: the
    client's garbage-collector pauses are recorded there (:mod:`pushkv.timeline`). As a
    context manager: stopped on the way out."""

    def __init__(self, *, timeout_s: float = 600.0, timeline_dir: Path | None = None) -> None:
        self.timeout_s, self.timeline_dir = timeout_s, timeline_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self._reply: Any = None
        self.runs = 0

    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [*BENCH_SERVE, "--jobs-from-stdin", str(write_fd),
                 *([str(self.timeline_dir)] if self.timeline_dir else [])],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=(write_fd,), env=bench_serve_env())
        finally:
            os.close(write_fd)
        self._reply = os.fdopen(read_fd, "r")

    @property
    def pid(self) -> int | None:
        """The client process's, while one is up."""
        return self.proc.pid if self.proc is not None else None

    def run(self, argv: list[str], log: Path) -> bool:
        """One ``vllm bench serve`` with ``argv``, its output appended to ``log``;
        True when it returned (the result file tells how its requests went)."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self._start()
        assert self.proc is not None and self.proc.stdin is not None
        self.runs += 1
        try:
            self.proc.stdin.write((json.dumps({"argv": argv, "log": str(log)}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # the client died between runs
            self.stop()
            return False
        ready, _, _ = select.select([self._reply], [], [], self.timeout_s)
        line = self._reply.readline() if ready else ""
        if not line:  # overran or died: this run failed, the next one starts afresh
            self.stop()
            return False
        return bool(json.loads(line).get("ok"))

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
        if self._reply is not None:
            self._reply.close()
            self._reply = None

    def __enter__(self) -> BenchClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def bench_serve(url: str, model: str, out: Path, name: str, *, qps: str, input_len: int,
                output_len: int, num_prompts: int, seed: int, log: Path,
                extra: tuple[str, ...] = (), client: BenchClient | None = None) -> bool:
    """``vllm bench serve`` (random dataset, ``--ignore-eos``) against ``url``, its result
    in ``out/name``; ``extra``: more of its flags; ``client``: run it there (kept up),
    else in a process of its own. True when every request completed."""
    flags = ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
             "--model", model, "--tokenizer", model, "--dataset-name", "random",
             "--random-input-len", str(input_len), "--random-output-len", str(output_len),
             "--random-range-ratio", "0", "--num-prompts", str(num_prompts),
             "--request-rate", qps, "--ignore-eos", "--seed", str(seed), "--disable-tqdm",
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
             "--save-result", "--result-dir", str(out), "--result-filename", name, *extra]
    if client is not None:
        returned = client.run(flags, log)
    else:
        cmd = [*BENCH_SERVE, *flags]
        with log.open("ab") as f:
            f.write(f"\n$ {' '.join(cmd)}\n".encode())
            f.flush()
            done = subprocess.run(cmd, env=bench_serve_env(), stdout=f,
                                  stderr=subprocess.STDOUT, timeout=600)
        returned = done.returncode == 0
    if not returned or not (out / name).exists():
        return False
    result = json.loads((out / name).read_text())
    return int(result.get("failed", 0)) == 0 and int(result.get("completed", 0)) == num_prompts


def rotated(xs: list[str], k: int) -> list[str]:
    """``xs`` started at its ``k``-th item (mod its length): whose turn comes first."""
    k %= len(xs)
    return xs[k:] + xs[:k]


class Stage:
    """The one deployment that runs (``--phases turns``), every other one frozen, the
    plain server's included. Before a mode serves, :meth:`enter` makes its deployment
    the running one: it freezes the one that ran and thaws this one, and ``settle``
    sends the thawed deployment's first request per mode (it pays for the pause:
    timers overdue, connections woken). So plain's requests run with every pair
    stopped, and no connector's idle pair slows the baseline its overhead is taken
    against: a thawed, idle ``NixlPushConnector`` pair slowed plain's requests by 2-8 ms
    here, which made vLLM push's overhead look that much smaller."""

    def __init__(self, freezers: dict[str, Freezer], modes: dict[str, list[str]],
                 settle: Callable[[str], Awaitable[None]]) -> None:
        self.freezers, self.modes, self.settle = freezers, modes, settle
        self.running: str | None = None
        self.thaws = 0

    def freeze_all(self) -> None:
        for freezer in self.freezers.values():
            freezer.freeze()
        self.running = None

    def thaw_all(self) -> None:
        for freezer in self.freezers.values():
            freezer.thaw()
        self.running = None

    async def enter(self, kind: str) -> None:
        """``kind``'s deployment running, every other frozen; a no-op if it already runs."""
        if kind == self.running:
            return
        if self.running is not None:
            self.freezers[self.running].freeze()
        self.running = None
        self.freezers[kind].thaw()
        self.running = kind
        self.thaws += 1
        for name in self.modes[kind]:
            await self.settle(name)

    def order(self, names: list[str], k: int) -> list[str]:
        """``names`` kept together by deployment, the deployments' order and each one's
        modes rotated by ``k``: one thaw per deployment, not one per mode."""
        kind_of = {n: kind for kind, ns in self.modes.items() for n in ns}
        kinds = list(dict.fromkeys(kind_of[n] for n in names))
        return [n for kind in rotated(kinds, k)
                for n in rotated([m for m in names if kind_of[m] == kind], k)]


async def serve_round(client: Client, eps: dict[str, Endpoint], names: list[str],
                      args: argparse.Namespace, load: str, batch: list[list[int]], it: int,
                      phase: str, failures: list[str], turn: str | None = None,
                      stage: Stage | None = None) -> list[dict[str, Any]]:
    """One round of ``load`` ("seq" or "conc"): every mode of ``names`` (the first in
    ``names`` leads; order as given) serves ``batch``; the records, each output checked
    against plain's. ``turn``: the deployment whose turn it is (``--phases turns``),
    kept in each record so that a mode pairs with plain's requests of its own turn;
    ``stage``: each mode's deployment is made the only one running before it serves."""

    async def serve(name: str, part: list[list[int]]) -> list[Result]:
        if stage is not None:
            await stage.enter(eps[name].dep.kind)
        return await run_mode(client, eps[name], part, args.output_len, load == "conc")

    n = len(batch)
    got: dict[str, list[Result]] = {}
    slots: list[int] = [-1] * n
    tag = f"[{phase}{'/' + turn if turn else ''} iter {it}]"
    if load == "seq" and args.interleave:
        # request by request: every mode serves prompt i (in an order rotated per prompt)
        # before any serves prompt i+1, so the machine's drift reaches every mode alike
        # and each pair of latencies is a few hundred milliseconds apart
        got = {name: [] for name in names}
        slots = list(range(n))
        dead: set[str] = set()
        for i, p in enumerate(batch):
            for name in rotated(names, i) if stage is None else stage.order(names, i):
                if name in dead:
                    continue
                try:
                    got[name] += await serve(name, [p])
                except Exception as exc:
                    failures.append(f"{name} {load} round {it}: {exc!r:.200}")
                    print(f"{tag} {name:18s} {load:4s} FAILED: {exc!r:.200}", flush=True)
                    dead.add(name)
        for name in dead:
            got.pop(name)
        for name, results in got.items():
            lat = median([r.latency_s * 1e3 for r in results])
            print(f"{tag} {name:18s} {load:4s} median {lat:7.1f} ms (interleaved)",
                  flush=True)
    else:
        for name in names:
            try:
                got[name] = await serve(name, batch)
            except Exception as exc:  # reported; the other modes still run
                failures.append(f"{name} {load} round {it}: {exc!r:.200}")
                print(f"{tag} {name:18s} {load:4s} FAILED: {exc!r:.200}", flush=True)
                continue
            lat = median([r.latency_s * 1e3 for r in got[name]])
            print(f"{tag} {name:18s} {load:4s} median {lat:7.1f} ms", flush=True)
    records: list[dict[str, Any]] = []
    reference = got.get("plain")
    for name, results in got.items():
        bad = 0
        for i, (p, r) in enumerate(zip(batch, results, strict=True)):
            same = reference is not None and r.tokens == reference[i].tokens
            bad += not same
            rec = {"mode": name, "load": load, "iter": it, "phase": phase, "slot": slots[i],
                   "prompt_len": len(p), "latency_ms": r.latency_s * 1e3,
                   "ttft_ms": r.ttft_s * 1e3, "tpot_ms": r.tpot_s * 1e3,
                   "tokens": len(r.tokens), "router_cpu_ms": r.router_cpu_ms,
                   "same_as_plain": same}
            if turn is not None:
                rec["turn"] = turn
            records.append(rec)
        if bad:
            print(f"{tag} {name}: {bad} outputs differ from plain's (or plain failed)",
                  flush=True)
    return records


async def discovered(client: Client, ep: Endpoint) -> None:
    """A client-dispatched pushkv mode knows its prefill's endpoint (asked once)."""
    if ep.target.dispatch == "pushkv" and ep.target.endpoint is None:
        await client.discover(ep.target)


async def warm(client: Client, eps: list[Endpoint], args: argparse.Namespace,
               rng: random.Random) -> None:
    """Handshakes, first allocations, and a concurrent batch of the measured size and
    length, so the engines have met every batch size before the first round (the first
    rounds were the slowest of a run without it)."""
    for ep in eps:
        await discovered(client, ep)
        batch = prompts(2 + args.conc_requests, args.input_len, rng)
        await run_mode(client, ep, batch[:2], 4, concurrent=False)
        await run_mode(client, ep, batch[2:], args.output_len, concurrent=True)


async def measure(args: argparse.Namespace, eps: dict[str, Endpoint], model: str,
                  phase: str, rng: random.Random, failures: list[str],
                  turns: dict[str, Freezer] | None = None) -> list[dict[str, Any]]:
    """Every round of one phase. With ``turns`` (``--phases turns``: deployment -> its
    :class:`Freezer`, plain's too), the pairs take turns within each round (order
    rotated per round): in a pair's turn its modes and plain serve the round's prompts,
    each with only its own deployment running (:class:`Stage`); the records carry the
    ``turn``. Every deployment runs again when the rounds are done."""
    names = list(eps)
    records: list[dict[str, Any]] = []

    def modes_of(kind: str) -> list[str]:
        return [n for n in names if eps[n].dep.kind == kind]

    async with Client(model) as client:
        async def settle(name: str) -> None:
            await discovered(client, eps[name])
            await run_mode(client, eps[name], prompts(1, args.input_len, rng), 2, False)

        stage = None if turns is None else Stage(
            turns, {kind: modes_of(kind) for kind in turns}, settle)
        try:
            if stage is None:
                await warm(client, list(eps.values()), args, rng)
            else:
                stage.freeze_all()
                for kind in stage.freezers:
                    await stage.enter(kind)
                    await warm(client, [eps[n] for n in modes_of(kind)], args, rng)
            for it in range(args.iters):
                batches = [(load, prompts(n, args.input_len, rng))
                           for load, n in (("seq", args.seq_requests),
                                           ("conc", args.conc_requests))
                           if n > 0]  # e.g. --seq-requests 0: concurrent rounds only
                if stage is None:
                    order = rotated(names, it)
                    for load, batch in batches:
                        records += await serve_round(client, eps, order, args, load, batch,
                                                     it, phase, failures)
                    continue
                for kind in rotated([k for k in stage.freezers if k != "plain"], it):
                    order = stage.order([n for n in names
                                         if eps[n].dep.kind in ("plain", kind)], it)
                    for load, batch in batches:
                        records += await serve_round(client, eps, order, args, load, batch,
                                                     it, phase, failures, turn=kind,
                                                     stage=stage)
        finally:  # a failed warm-up included: nothing is left stopped
            if stage is not None:
                stage.thaw_all()
    return records


def serve(args: argparse.Namespace, eps: dict[str, Endpoint], model: str, out: Path,
          status: dict[str, str]) -> None:
    """``vllm bench serve`` against the router modes (and plain) of this phase."""
    for name, ep in eps.items():
        if ep.target.dispatch != "router":
            continue
        for qps in args.serve_qps.split(","):
            fname = f"{name}_qps{qps}_in{args.input_len}_out{args.output_len}_iter0.json"
            if (out / fname).exists():
                continue  # plain: once per run
            ok = bench_serve(ep.target.url, model, out, fname, qps=qps,
                             input_len=args.input_len, output_len=args.output_len,
                             num_prompts=args.serve_prompts, seed=args.seed,
                             log=out / "logs" / f"{name}-bench.log")
            print(f"[{name}] vllm bench serve qps {qps}: {'ok' if ok else 'FAILED'}",
                  flush=True)
            if not ok:
                status[name] = f"vllm bench serve failed at qps {qps}"


#: Deployments ``--phases auto`` puts up at once: the ratio the benchmark is about
#: (pushkv against vLLM's push connector) then pairs both with the same plain rounds.
PAIRED = ("pushkv", "nixl-push")


def plan_phases(spec: str, kinds: list[str]) -> list[list[str]]:
    """The deployments up at once, phase by phase (see ``--phases``)."""
    base = [k for k in kinds if k == "plain"]
    if spec in ("all", "turns"):  # turns: all up at once, one thawed at a time
        return [kinds]
    if spec == "auto":  # the two push connectors side by side, anything else alone
        together = [k for k in kinds if k in PAIRED]
        alone = [[k] for k in kinds if k != "plain" and k not in PAIRED]
        return [[*base, *g] for g in ([together] if together else []) + alone] or [base]
    if spec == "each":
        return [[*base, k] for k in kinds if k != "plain"] or [base]
    groups = [[k for k in g.split("+") if k] for g in spec.split(",")]
    named = [k for g in groups for k in g]
    unknown = sorted(set(named) - set(kinds) - {"plain"})
    missing = [k for k in kinds if k != "plain" and k not in named]
    if unknown or missing or len(named) != len(set(named)):
        raise SystemExit(f"--phases {spec!r}: name each deployment of the chosen modes "
                         f"({', '.join(k for k in kinds if k != 'plain')}) once"
                         + (f"; unknown: {', '.join(unknown)}" if unknown else ""))
    return [[*base, *(k for k in g if k != "plain")] for g in groups]


def pooled_verdict(dirs: list[Path]) -> dict[str, Any]:
    """:func:`verdict` over the rounds of several runs (each run's phases kept apart)."""
    records: list[dict[str, Any]] = []
    modes: list[str] = []
    for i, d in enumerate(dirs):
        path = d / "latency.json"
        if not path.is_file():
            raise SystemExit(f"--verdict-of: {path} does not exist")
        for r in json.loads(path.read_text()):
            records.append(dict(r, phase=f"{r['phase']}@{i}"))
            if r["mode"] not in modes:
                modes.append(r["mode"])
    out = verdict(records, [m for m in MODES if m in modes])
    out["runs"] = [str(d) for d in dirs]
    return out


def cycle_phases(phases: list[list[str]], cycles: int) -> list[tuple[int, list[str]]]:
    """The phases ``cycles`` times, every other time in reverse order (A B, B A, A B...),
    so that a machine drifting over the run reaches the first and the last phase alike."""
    if cycles < 1:
        raise SystemExit(f"--cycles must be at least 1, got {cycles}")
    return [(c, ph) for c in range(cycles) for ph in (phases if c % 2 == 0 else phases[::-1])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "e2e")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"comma separated, from: {', '.join(MODES)}")
    p.add_argument("--iters", type=int, default=3, help="alternating rounds of every mode")
    p.add_argument("--seq-requests", type=int, default=8)
    p.add_argument("--conc-requests", type=int, default=8)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--delay-us", type=int, default=100,
                   help="sleep of every NIXL progress thread between polls, all modes alike")
    p.add_argument("--plain-cores", default="0,1",
                   help="the plain baseline: one plain server per core listed, requests "
                   "spread over them in turn (default: one on each core a pair uses, so "
                   "both run on the same two cores; '0': one server, as before)")
    p.add_argument("--spin-s", default=SPIN_S,
                   help="cap how long every vLLM server's processes busy-loop on their "
                   "shared-memory queues after a message (vLLM: 1 s) before sleeping "
                   "(default 2 ms: on 2 cores, a second of spinning by every server that "
                   "served lately takes the CPU from the one serving now); empty: vLLM's")
    p.add_argument("--no-interleave", dest="interleave", action="store_false",
                   help="sequential load: each mode serves its whole batch in turn (default: "
                   "request by request, every mode serving prompt i before prompt i+1)")
    p.add_argument("--cycles", type=int, default=1,
                   help="run the phases this many times, every other time in reverse order "
                   "(each a fresh start of its servers), so drift reaches every phase alike")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-qps", default="",
                   help="also run `vllm bench serve` at these rates (comma separated) "
                   "against the router modes and plain; empty: skip")
    p.add_argument("--serve-prompts", type=int, default=16)
    p.add_argument("--phases", default="each",
                   help="each (default): the plain server plus one connector's servers at a "
                   "time (modes alternate within a phase), so no connector is measured "
                   "beside another one's idle cost (an idle NixlPushConnector pair slowed a "
                   "plain server next to it by 40-100%% here); auto: the plain server with "
                   "pushkv's and vLLM push's pairs at once, then with each other connector's; "
                   "all: every deployment at once; turns: every deployment up at once, "
                   "but each round's requests served deployment by deployment (order "
                   "rotated per round), plain in each pair's turn, every request with "
                   "only its own deployment running and the others stopped (SIGSTOP: no "
                   "CPU), so the connectors are measured seconds apart and no idle "
                   "neighbour slows a mode or plain (about 18 GiB for plain, pushkv and "
                   "vLLM push); or "
                   "groups of deployments, e.g. 'pushkv+nixl-pull,nixl-push' (the plain "
                   "server is in every group): modes of one group alternate round by round")
    p.add_argument("--verdict-of", type=Path, nargs="+", metavar="DIR",
                   help="run nothing: the JSON verdict of the latency.json of these earlier "
                   "runs' --out directories, their rounds pooled")
    args = p.parse_args()
    if args.verdict_of:
        print(json.dumps(pooled_verdict(args.verdict_of)))
        return 0
    out: Path = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    model = out / "tiny-llama"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    names = args.modes.split(",")
    for name in names:
        if name not in MODES:
            raise SystemExit(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    max_len = -(-(args.input_len + args.output_len + 64) // 256) * 256
    kinds = list(dict.fromkeys(MODES[n].deployment for n in names))
    # "each": the plain server stays up and the connectors' deployments come up one
    # at a time (7 vLLM servers at once need about 21 GiB); "all": everything at once.
    phases = cycle_phases(plan_phases(args.phases, kinds), args.cycles)
    deps: dict[str, Deployment] = {}
    eps: dict[str, Endpoint] = {}
    status: dict[str, str] = {}
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    measured: list[str] = []
    rng = random.Random(args.seed)
    try:
        for cycle, phase in phases:
            for kind in phase:
                if kind in deps:
                    continue
                dep = Deployment(kind, str(model), out, max_model_len=max_len,
                                 delay_us=args.delay_us, plain_cores=args.plain_cores,
                                 spin_s=args.spin_s)
                t0 = time.monotonic()
                try:
                    dep.start()
                except Exception as exc:  # a baseline that does not start is reported
                    status[kind] = f"did not start: {exc}"
                    print(f"[{kind}] {status[kind]}", flush=True)
                    dep.stop()
                    continue
                deps[kind] = dep
                print(f"[{kind}] up in {time.monotonic() - t0:.0f} s", flush=True)
            eps = {}
            for name in names:
                dep = deps.get(MODES[name].deployment)
                if dep is not None and MODES[name].deployment in phase:
                    try:
                        eps[name] = Endpoint(MODES[name], dep, out)
                    except Exception as exc:
                        status[name] = f"router did not start: {exc}"
                        print(f"[{name}] {status[name]}", flush=True)
            label = "+".join(phase) + (f"#{cycle}" if args.cycles > 1 else "")
            turns = None
            if args.phases == "turns":
                turns = {kind: Freezer(deps[kind], [ep for ep in eps.values()
                                                    if ep.dep.kind == kind])
                         for kind in phase if kind in deps}
            try:
                try:
                    records += asyncio.run(measure(args, eps, str(model), label, rng, failures,
                                                   turns))
                except Exception as exc:  # e.g. a warm-up failed: the next phase still runs
                    status[label] = f"failed: {exc!r:.300}"
                    print(f"[{label}] {status[label]}", flush=True)
                if args.serve_qps:
                    serve(args, eps, str(model), out, status)
            finally:
                for freezer in (turns or {}).values():
                    freezer.thaw()  # a stopped process would not hear the stop
                for ep in eps.values():
                    ep.stop()
                for kind in phase:
                    if kind != "plain" and kind in deps:
                        deps.pop(kind).stop()
            measured += [n for n in eps if n not in measured]
            partial = verdict(records, [n for n in names if n in measured])
            (out / "summary.json").write_text(json.dumps(partial, indent=1))  # so far
    finally:
        for dep in deps.values():
            dep.stop()
    (out / "latency.json").write_text(json.dumps(records))
    measured = [n for n in names if n in measured]
    summary = verdict(records, measured)
    summary["status"] = status or "ok"
    if failures:
        summary["failed_rounds"] = failures
    print()
    print(latency_table(summary, measured))
    print()
    print(timeline_report(out, measured))
    print()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    ok = not status and not failures and summary["outputs_identical_to_plain"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
