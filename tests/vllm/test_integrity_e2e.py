"""End to end on real vLLM CPU servers: with the decode side corrupting one
landed transfer in ten (``integrity_inject``), greedy outputs still equal a
plain server's for every request, the corruption counter equals the injected
count, and the decode server recomputed exactly the corrupted requests
(``kv_load_failure_policy`` recompute) and took every other prompt token from
the transfer."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.vllm.testing import (
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    metric,
    post_json,
    running,
)

from .test_e2e import FAST, proxy_healthy, start_proxy, stop_proxy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

N = 20  #: requests; the injector corrupts one landed write in ten: the 1st and the 11th
EVERY = 10
LENGTH = 64  #: two whole blocks of 32: one write per request
MAX_TOKENS = 8


def _prompt(i: int) -> list[int]:
    return [(i * 977 + 13 * k) % 990 + 5 for k in range(LENGTH)]


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
        return [_completion(plain.url, str(tiny_model), _prompt(i)) for i in range(N)]


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
    for i, (want, out) in enumerate(zip(reference, got, strict=True)):
        assert out == want, f"request {i}"
    injected = N // EVERY
    # The metrics catch up with the last step's report.
    end = time.monotonic() + 30
    while _counter(decode, "pushkv:ranges_checked_total") < N and time.monotonic() < end:
        time.sleep(0.2)
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
