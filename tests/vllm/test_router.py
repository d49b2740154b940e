"""End to end behind vllm-router: real vLLM CPU servers with PushKVConnector, NIXL
between them, and ``vllm-router --vllm-pd-disaggregation --kv-connector nixl`` in
front, unchanged.

A plain server (started with the others) gives the reference greedy outputs and is
stopped; two
prefill servers (``prefill-0`` with the default ``direction``, ``prefill-1``
forced to ``push``) and one decode server start once for the module, and three
routers (cheap: one Rust process each) front them: 1P1D over ``prefill-0``
(sequential dispatch: the KV is pulled by the decode side's reader thread),
1P1D over ``prefill-1`` (the override: pushed), and 2P1D with ``power_of_two``
over both. Outputs must equal the plain server's, for concurrent and
sequential clients, streamed and not, and the decode server must have
computed none of the prompt tokens. ``prefill-0`` and the decode server record
their timeline: a pull behind the router meets every hop of
:data:`pushkv.fit.e2e.pull_timeline.PULL_HOPS`, in order.
"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pushkv.fit.e2e.pull_timeline import out_of_order, pulls

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.vllm.testing import (
    ROUTER,
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    metric,
    poll,
    post_json,
    running,
    start_router,
    stop_router,
    stream_token_ids,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

if not Path(ROUTER).exists():
    pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17)",
                allow_module_level=True)

BS = 32
LENGTHS = (5, 31, 32, 33, 64, 97, 150, 200)
MAX_TOKENS = 8
FAST = {"lease_s": 10.0, "heartbeat_s": 1.0, "window_s": 8.0, "fence_grace_s": 2.0,
        "handshake_timeout_s": 5.0, "peer_confirm_s": 1.0}
#: Fresh prompts per test (a decode-side prefix hit would skip the transfer).
#: A loaded 2-core machine starts a server in 30 s, a contended one in minutes.
STARTUP_S = 420.0
SALTS = {"seq": 11, "stream": 12, "push": 13, "two_concurrent": 14, "two_stream": 15}


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 131 + 7 * i) % 990 + 5 for i in range(n)]


def batch(salt: int) -> list[list[int]]:
    return [prompt(n, salt * 100 + i) for i, n in enumerate(LENGTHS)]


def body(model: str, tokens: list[int], **kw: object) -> dict[str, object]:
    return {"model": model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def completion(url: str, model: str, tokens: list[int]) -> list[int]:
    status, answer = post_json(url + "/v1/completions", body(model, tokens), timeout=120)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def streamed(url: str, model: str, tokens: list[int]) -> list[int]:
    return stream_token_ids(url, body(model, tokens, stream=True), timeout=120)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router-logs")




@dataclass
class Fleet:
    model: str
    prefills: tuple[Server, Server]
    decode: Server
    routers: dict[str, str]  #: "pull" (1P1D), "push" (1P1D), "two" (2P1D) -> URL
    reference: dict[tuple[int, ...], list[int]]  #: the plain server's greedy outputs
    timeline_dir: Path  #: prefill-0's and the decode server's timeline marks

    def counter(self, server: Server, name: str, **labels: str) -> float:
        return metric(get_text(server.url + "/metrics"), name, **labels)

    def counters(self) -> dict[str, float]:
        d, (p0, p1) = self.decode, self.prefills
        return {
            "external": self.counter(d, "vllm:prompt_tokens_by_source_total",
                                     source="external_kv_transfer"),
            "local": self.counter(d, "vllm:prompt_tokens_by_source_total",
                                  source="local_compute"),
            "pulled": self.counter(d, "pushkv:transfers_pulled_total"),
            "registered": self.counter(d, "pushkv:transfers_registered_total"),
            # rule 11: every read (pull) or write (push) checked against its digest
            "checked": self.counter(d, "pushkv:ranges_checked_total"),
            "seals_late": sum(self.counter(p, "pushkv:seals_late_total") for p in (p0, p1)),
            "failed": self.counter(d, "pushkv:transfers_failed_total"),
            "published": sum(self.counter(p, "pushkv:sources_published_total")
                             for p in (p0, p1)),
            "pushed": sum(self.counter(p, "pushkv:pushes_started_total") for p in (p0, p1)),
            "released": sum(self.counter(p, "pushkv:sources_released_total") for p in (p0, p1)),
        }

    def wait_released(self, before: dict[str, float], n: int) -> dict[str, float]:
        """Every prefill's KV released (the reads' or writes' completions reached it)."""
        return poll(self.counters, lambda now: now["released"] - before["released"] >= n, 30)


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, logs: Path) -> Iterator[Fleet]:
    model = str(tiny_model)
    marks = logs / "timeline"
    plain = Server(ServerSpec(model=model, port=free_port(), cpu=1), logs / "plain.log")
    specs = [
        ServerSpec(model=model, port=free_port(), cpu=0, kv_config=kv_transfer_config(
            "kv_producer", "prefill-0", timeline_dir=str(marks), **FAST)),
        ServerSpec(model=model, port=free_port(), cpu=0, kv_config=kv_transfer_config(
            "kv_producer", "prefill-1", direction="push", **FAST)),
        ServerSpec(model=model, port=free_port(), cpu=1, kv_config=kv_transfer_config(
            "kv_consumer", "decode-0", timeline_dir=str(marks), **FAST)),
    ]
    servers = [Server(s, logs / f"{name}.log")
               for s, name in zip(specs, ("prefill-0", "prefill-1", "decode"), strict=True)]
    p0, p1, d = servers
    procs: list[subprocess.Popen[bytes]] = []
    with running(plain, *servers, timeout_s=STARTUP_S):  # all start at once
        reference = {tuple(t): completion(plain.url, model, t)
                     for salt in SALTS.values() for t in batch(salt)}
        plain.stop()
        try:
            routers = {}
            for name, prefills, policy in (("pull", [p0.url], "round_robin"),
                                           ("push", [p1.url], "round_robin"),
                                           ("two", [p0.url, p1.url], "power_of_two")):
                proc, url = start_router(prefills, d.url, policy, logs / f"router-{name}.log")
                procs.append(proc)
                routers[name] = url
            yield Fleet(model, (p0, p1), d, routers, reference, marks)
        finally:
            for proc in procs:
                stop_router(proc)


def run_batch(fleet: Fleet, router: str, salt: str, *, concurrent: bool, stream: bool
              ) -> tuple[dict[str, float], dict[str, float]]:
    url, reference = fleet.routers[router], fleet.reference
    prompts = batch(SALTS[salt])
    call = streamed if stream else completion
    before = fleet.counters()
    if concurrent:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            outputs = list(pool.map(lambda t: call(url, fleet.model, t), prompts))
    else:
        outputs = [call(url, fleet.model, t) for t in prompts]
    for tokens, got in zip(prompts, outputs, strict=True):
        assert got == reference[tuple(tokens)], f"prompt of {len(tokens)} tokens"
    after = fleet.wait_released(before, len(prompts))
    # The decode server computed none of the prompt tokens: all came from the transfer.
    assert after["external"] - before["external"] == sum(LENGTHS)
    assert after["local"] == before["local"]
    assert after["failed"] == before["failed"]
    assert after["released"] - before["released"] == len(prompts)
    assert after["seals_late"] == before["seals_late"]
    return before, after


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before[key]


def test_1p1d_sequential_client_pulls(fleet):
    seen = set(pulls(fleet.timeline_dir))
    before, after = run_batch(fleet, "pull", "seq", concurrent=False, stream=False)
    n = len(LENGTHS)
    assert delta(before, after, "pulled") == n and delta(before, after, "published") == n
    assert delta(before, after, "registered") == 0 and delta(before, after, "pushed") == 0
    # Each read was checked against the seal the prefill's answer relayed (rule 11)
    assert delta(before, after, "checked") == n
    # Every pull recorded every hop from the prefill's answer to the decode step, in
    # order (the marks are written by the time the outputs came back: the last,
    # decode_scheduled, precedes the request's first decode step).
    new = {k: v for k, v in pulls(fleet.timeline_dir).items() if k not in seen}
    assert len(new) == n, sorted(new)
    for tid, marks in new.items():
        assert out_of_order(marks) == [], (tid, marks)


def test_1p1d_concurrent_streamed_clients_pull(fleet):
    before, after = run_batch(fleet, "pull", "stream", concurrent=True, stream=True)
    assert delta(before, after, "pulled") == delta(before, after, "checked") == len(LENGTHS)


def test_1p1d_direction_push_override_pushes_behind_the_router(fleet):
    before, after = run_batch(fleet, "push", "push", concurrent=True, stream=False)
    n = len(LENGTHS)
    assert delta(before, after, "registered") == n and delta(before, after, "pushed") == n
    assert delta(before, after, "pulled") == 0


def test_2p1d_power_of_two_concurrent_clients(fleet):
    before, after = run_batch(fleet, "two", "two_concurrent", concurrent=True, stream=False)
    # Each transfer went the way its prefill server chose: pulled from prefill-0,
    # pushed from prefill-1.
    assert delta(before, after, "pulled") == delta(before, after, "published")
    assert delta(before, after, "registered") == delta(before, after, "pushed")
    assert delta(before, after, "pulled") + delta(before, after, "registered") == len(LENGTHS)


def test_2p1d_power_of_two_sequential_streamed_client(fleet):
    before, after = run_batch(fleet, "two", "two_stream", concurrent=False, stream=True)
    assert delta(before, after, "pulled") + delta(before, after, "registered") == len(LENGTHS)
