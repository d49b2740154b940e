"""Heterogeneous tensor parallelism end to end: a prefill server and a decode
server of different TP sizes, real vLLM CPU engines, NIXL between them.

The tiny Llama here has 2 KV heads (``TINY_LLAMA_2KV``), so at TP 2 each rank
holds one head and at TP 1 one rank holds both: prefill TP 1 -> decode TP 2
splits every block's heads between two consumer ranks (each expects one
notification), decode TP 2 <- ... and prefill TP 2 -> decode TP 1 has two producer
ranks write their head into the one consumer rank (which expects two). A TP 2
server runs two worker processes, one per core. Greedy outputs must equal a
plain TP 1 server's, and the decode server must have computed none of the prompt.

CPU. On this 2-core machine the test failed before its servers capped vLLM's
busy loop: vLLM's worker and engine processes spin (``sched_yield``) for 1 s
after every shared-memory queue message, and an engine with a request waiting
for KV (the decode request for its transfer, the prefill request holding its
blocks) keeps stepping, so five processes spun on two cores for as long as the
handshake waited. The consumer's card was not lost: its TCP connection to the
producer rank's side channel was accepted, but the producer's ZeroMQ I/O thread
(pinned, as every thread of a vLLM CPU worker, to the worker's core) did not
answer the ZeroMQ handshake within its 30 s, over and over, so the card reached
the rank after the consumer's 150 s handshake timeout (or never); accepting it
(loading the consumer's NIXL metadata: 9 ms between idle processes) took 33-67 s. Every server here
runs with ``ServerSpec(spin_s=SPIN_S)`` (2 ms, ``pushkv/vllm/cpu_tuning``, as
in the benchmarks), and the handshake takes a fraction of a second. A TP > 1
worker also compiles (torch.compile) its vocabulary-parallel embedding's input
mask on its first forward, so every server serves one plain request before the
proxy starts; the protocol timeouts are the defaults with a handshake timeout of
minutes, not the e2e test's seconds, and the proxy gives a health probe 30 s
(its default, 2 s, once took a busy prefill server out of rotation), so a slow
machine is not taken for a broken one.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.vllm.testing import (
    SPIN_S,
    TINY_LLAMA_2KV,
    Server,
    ServerSpec,
    free_port,
    kv_transfer_config,
    post_json,
    running,
    write_tiny_llama,
)

from .test_e2e import Cluster, body, prompt, start_proxy, stop_proxy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.hetero]

#: Partial block, exact block, several blocks.
LENGTHS = (7, 32, 75, 140)
BS = 32
#: Room for a rank's first handshake on a loaded machine (see the module docs).
TIMEOUTS = {"handshake_timeout_s": 150.0, "lease_s": 150.0}
#: TP 2 servers start slower (two workers on two shared cores).
START_S = 300.0
#: The client's and the proxy's bound on one request.
REQUEST_S = 240.0
#: The proxy's bound on one health probe: a server answering late is busy, not dead.
PROBE_S = 30.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2kv"), config=TINY_LLAMA_2KV)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hetero-tp-logs")


def completion(url: str, model: str, tokens: list[int], timeout_s: float = 60.0) -> list[int]:
    status, answer = post_json(url + "/v1/completions", body(model, tokens), timeout=timeout_s)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def prompts(salt: int) -> list[list[int]]:
    return [prompt(n, salt * 100 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference(model: Path, logs: Path) -> dict[tuple[int, ...], list[int]]:
    plain = Server(ServerSpec(model=str(model), port=free_port(), cpu=0, spin_s=SPIN_S),
                   logs / "plain.log")
    out = {}
    with running(plain):
        for salt in (1, 2):
            for tokens in prompts(salt):
                out[tuple(tokens)] = completion(plain.url, str(model), tokens)
    return out


def spec(model: Path, role: str, engine_id: str, tp: int, cpu: int) -> ServerSpec:
    extra = ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"} if tp > 1 else {}
    return ServerSpec(model=str(model), port=free_port(), cpu=cpu, extra_args=extra, env=env,
                      kv_config=kv_transfer_config(role, engine_id, **TIMEOUTS), spin_s=SPIN_S)


@pytest.fixture(params=[(1, 2), (2, 1)], ids=["prefill-tp1-decode-tp2", "prefill-tp2-decode-tp1"])
def cluster(request: pytest.FixtureRequest, model: Path, logs: Path,
            reference: object) -> Iterator[Cluster]:
    p_tp, d_tp = request.param
    name = f"p{p_tp}d{d_tp}"
    p_spec = spec(model, "kv_producer", f"prefill-{name}", p_tp, 0)
    d_spec = spec(model, "kv_consumer", f"decode-{name}", d_tp, 1)
    prefill = Server(p_spec, logs / f"{name}-prefill.log")
    decode = Server(d_spec, logs / f"{name}-decode.log")
    with running(prefill, decode, timeout_s=START_S):
        for server in (prefill, decode):  # first forwards (and their compiles) happen here
            completion(server.url, str(model), prompt(9, 999))
        proc, url = start_proxy(prefill.url, decode.url, logs / f"{name}-proxy.log",
                                "--timeout", str(REQUEST_S), "--health-timeout", str(PROBE_S))
        try:
            yield Cluster(str(model), prefill, decode, url, d_spec, logs)
        finally:
            stop_proxy(proc)


def test_outputs_equal_a_plain_server_across_tp_sizes(cluster: Cluster, reference) -> None:
    c = cluster
    salt = 1 if c.decode_spec.extra_args else 2  # fresh prompts for each pair
    batch = prompts(salt)
    ext0 = c.counter(c.decode, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer")
    local0 = c.counter(c.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    with cf.ThreadPoolExecutor(len(batch)) as pool:
        outputs = list(pool.map(lambda t: completion(c.proxy_url, c.model, t,
                                                     timeout_s=REQUEST_S), batch))
    for tokens, got in zip(batch, outputs, strict=True):
        assert got == reference[tuple(tokens)], f"prompt of {len(tokens)} tokens"
    c.wait_idle()
    assert c.counter(c.decode, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") - ext0 == sum(LENGTHS)
    assert c.counter(c.decode, "vllm:prompt_tokens_by_source_total",
                     source="local_compute") == local0
    assert c.counter(c.decode, "pushkv:transfers_failed_total") == 0
