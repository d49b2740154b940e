"""End to end on real vLLM CPU servers: with the decode side corrupting one
landed transfer in ten (``integrity_inject``), greedy outputs still equal a
plain server's for every request, the corruption counter equals the injected
count, and the decode server recomputed exactly the corrupted requests
(``kv_load_failure_policy`` recompute) and took every other prompt token from
the transfer -- pushed behind ``pushkv proxy``, and pulled behind
``vllm-router`` (the prefill's answer relays its seal, and every read is checked
against it)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

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
)

from .test_e2e import FAST, proxy_healthy, start_proxy, stop_proxy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

N = 20  #: requests; the injector corrupts one landed write in ten: the 1st and the 11th
EVERY = 10
LENGTH = 64  #: two whole blocks of 32: one write per request
MAX_TOKENS = 8


def _prompt(i: int) -> list[int]:
    return [(i * 977 + 13 * k) % 990 + 5 for k in range(LENGTH)]


#: Prompts that extend two of the router's by a block: the decode server holds their
#: first two blocks in its prefix cache and pulls only the remainder.
LONGER = [_prompt(N + i) + [(i * 31 + 7 * k) % 990 + 5 for k in range(32)] for i in range(2)]


def _completion(url: str, model: str, tokens: list[int]) -> list[int]:
    status, answer = post_json(url + "/v1/completions", {
        "model": model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True}, timeout=120)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("integrity-logs")


@pytest.fixture(scope="module")
def reference(tiny_model: Path, logs: Path) -> list[list[int]]:
    plain = Server(ServerSpec(model=str(tiny_model), port=free_port(), cpu=0),
                   logs / "plain.log")
    with running(plain):
        # the proxy's requests, then the router's (fresh prompts: no decode-side hit)
        return [_completion(plain.url, str(tiny_model), t)
                for t in [_prompt(i) for i in range(2 * N)] + LONGER]


@pytest.fixture(scope="module")
def servers(tiny_model: Path, logs: Path, reference: object
            ) -> Iterator[tuple[Server, Server, str]]:
    model = str(tiny_model)
    p_spec = ServerSpec(model=model, port=free_port(), cpu=0, kv_config=kv_transfer_config(
        "kv_producer", "prefill-0", integrity="on", **FAST))
    d_spec = ServerSpec(model=model, port=free_port(), cpu=1, kv_config=kv_transfer_config(
        "kv_consumer", "decode-0", policy="recompute", integrity="on",
        integrity_inject=f"flip,neighbour,stale,zero:{EVERY}", **FAST))
    prefill, decode = Server(p_spec, logs / "prefill.log"), Server(d_spec, logs / "decode.log")
    with running(prefill, decode):
        proc, url = start_proxy(prefill.url, decode.url, logs / "proxy.log")
        try:
            assert proxy_healthy(url)
            yield prefill, decode, url
        finally:
            stop_proxy(proc)


def _counter(server: Server, name: str, **labels: str) -> float:
    return metric(get_text(server.url + "/metrics"), name, **labels)


def test_corrupt_transfers_are_recomputed_and_outputs_equal_a_plain_server(
        servers, reference, tiny_model, logs):
    _prefill, decode, url = servers
    model = str(tiny_model)
    local0 = _counter(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    ext0 = _counter(decode, "vllm:prompt_tokens_by_source_total",
                    source="external_kv_transfer")
    # Two at a time: concurrent legs, and a bounded load on two cores.
    with cf.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda i: _completion(url, model, _prompt(i)), range(N)))
    for i, (want, out) in enumerate(zip(reference[:N], got, strict=True)):
        assert out == want, f"request {i}"
    injected = N // EVERY
    # The metrics catch up with the last step's report.
    poll(lambda: _counter(decode, "pushkv:ranges_checked_total"), lambda n: n >= N, 30)
    assert _counter(decode, "pushkv:ranges_checked_total") == N
    assert _counter(decode, "pushkv:ranges_injected_total") == injected
    assert _counter(decode, "pushkv:ranges_corrupt_total") == injected
    assert _counter(decode, "pushkv:transfers_failed_by_reason_total",
                    reason="CORRUPT") == injected
    # Exactly the corrupted requests were computed by the decode server itself.
    local = _counter(decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    ext = _counter(decode, "vllm:prompt_tokens_by_source_total",
                   source="external_kv_transfer")
    assert local - local0 == injected * LENGTH
    assert ext - ext0 == (N - injected) * LENGTH
    # One structured line per corrupt transfer: transfer, rank, range and both digests.
    lines = [json.loads(line.split("pushkv transfer failed ", 1)[1])
             for line in (logs / "decode.log").read_text().splitlines()
             if "pushkv transfer failed " in line]
    corrupt = [d for d in lines if d["reason"] == "CORRUPT"]
    assert len(corrupt) == injected, lines
    for d in corrupt:
        assert d["policy"] == "recompute" and d["rank"] == 0 and d["transfer_id"]
        # the range as the connector's layout counts it (vLLM's CPU cache: whole blocks)
        assert re.search(r"write tokens \[\d+, \d+\) layers \[0, 2\) failed its digest "
                         r"check: producer [0-9a-f]{16}, landed [0-9a-f]{16}$", d["detail"]), d


def test_pulls_behind_vllm_router_are_checked_against_the_relayed_seals(
        servers, reference, tiny_model, logs):
    """Behind vllm-router the prefill publishes (pull); its answer carries the
    source's seal, the router passes it to the decode leg, and every read is checked
    against it: the injected reads fail CORRUPT and are recomputed, the others are
    served from the transfer."""
    if not Path(ROUTER).exists():
        pytest.skip("vllm-router is not installed (pip install vllm-router==0.1.17)")
    prefill, decode, _ = servers
    model = str(tiny_model)
    names = ("ranges_checked", "ranges_injected", "ranges_corrupt", "transfers_pulled",
             "ranges_unchecked")

    def counts() -> dict[str, float]:
        out = {n: _counter(decode, f"pushkv:{n}_total") for n in names}
        out["CORRUPT"] = _counter(decode, "pushkv:transfers_failed_by_reason_total",
                                  reason="CORRUPT")
        for source in ("local_compute", "external_kv_transfer", "local_cache_hit"):
            out[source] = _counter(decode, "vllm:prompt_tokens_by_source_total", source=source)
        out["published"] = _counter(prefill, "pushkv:sources_published_total")
        out["seals_late"] = _counter(prefill, "pushkv:seals_late_total")
        return out

    proc, url = start_router([prefill.url], decode.url, "round_robin", logs / "router.log")
    try:
        before = counts()
        with cf.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda i: _completion(url, model, _prompt(i)),
                                range(N, 2 * N)))
        for i, (want, out) in enumerate(zip(reference[N:2 * N], got, strict=True)):
            assert out == want, f"request {N + i}"
        after = _settled(counts, before, N)
        # The remainder after a cached prefix: each read is checked against the
        # digests the prefill rank gives for exactly that part (side channel).
        for tokens, want in zip(LONGER, reference[2 * N:], strict=True):
            assert _completion(url, model, tokens) == want
        longer = _settled(counts, after, len(LONGER))
    finally:
        stop_router(proc)
    p = {k: longer[k] - after[k] for k in after}
    # the decode server had the first two blocks of each: only the third was pulled
    assert p["local_cache_hit"] == 2 * LENGTH and p["transfers_pulled"] == len(LONGER), p
    assert p["ranges_checked"] == len(LONGER), p
    assert p["ranges_unchecked"] == 0 and p["ranges_corrupt"] == p["ranges_injected"], p
    d = {k: after[k] - before[k] for k in after}
    # one read per request (one producer rank, two whole blocks), every one checked:
    # any N in a row hold N / EVERY of the injector's picks
    injected = N // EVERY
    assert d["published"] == d["transfers_pulled"] == d["ranges_checked"] == N, d
    assert d["ranges_injected"] == d["ranges_corrupt"] == d["CORRUPT"] == injected, d
    assert d["seals_late"] == 0, d
    # exactly the corrupted requests were computed by the decode server itself
    assert d["local_compute"] == injected * LENGTH, d
    assert d["external_kv_transfer"] == (N - injected) * LENGTH, d


def _settled(counts, before: dict[str, float], n: int) -> dict[str, float]:
    """The counters once ``n`` more reads were checked (the metrics catch up with the
    last step's report)."""
    return poll(counts, lambda c: c["ranges_checked"] - before["ranges_checked"] >= n, 30)
