"""Heterogeneous tensor parallelism end to end: a prefill server and a decode
server of different TP sizes, real vLLM CPU engines, NIXL between them.

The tiny Llama here has 2 KV heads (``TINY_LLAMA_2KV``), so at TP 2 each rank
holds one head and at TP 1 one rank holds both: prefill TP 1 -> decode TP 2
splits every block's heads between two consumer ranks (each expects one
notification), decode TP 2 <- ... and prefill TP 2 -> decode TP 1 has two producer
ranks write their head into the one consumer rank (which expects two). A TP 2
server runs two worker processes, one per core. Greedy outputs must equal a
plain TP 1 server's, and the decode server must have computed none of the prompt.
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
    TINY_LLAMA_2KV,
    Server,
    ServerSpec,
    free_port,
    kv_transfer_config,
    running,
    write_tiny_llama,
)

from .test_e2e import FAST, Cluster, completion, prompt, start_proxy, stop_proxy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl, pytest.mark.hetero]

#: Partial block, exact block, several blocks.
LENGTHS = (7, 32, 75, 140)
BS = 32


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2kv"), config=TINY_LLAMA_2KV)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hetero-tp-logs")


def prompts(salt: int) -> list[list[int]]:
    return [prompt(n, salt * 100 + i) for i, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def reference(model: Path, logs: Path) -> dict[tuple[int, ...], list[int]]:
    plain = Server(ServerSpec(model=str(model), port=free_port(), cpu=0), logs / "plain.log")
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
                      kv_config=kv_transfer_config(role, engine_id, **FAST))


@pytest.fixture(params=[(1, 2), (2, 1)], ids=["prefill-tp1-decode-tp2", "prefill-tp2-decode-tp1"])
def cluster(request: pytest.FixtureRequest, model: Path, logs: Path,
            reference: object) -> Iterator[Cluster]:
    p_tp, d_tp = request.param
    name = f"p{p_tp}d{d_tp}"
    p_spec = spec(model, "kv_producer", f"prefill-{name}", p_tp, 0)
    d_spec = spec(model, "kv_consumer", f"decode-{name}", d_tp, 1)
    prefill = Server(p_spec, logs / f"{name}-prefill.log")
    decode = Server(d_spec, logs / f"{name}-decode.log")
    with running(prefill, decode):
        proc, url = start_proxy(prefill.url, decode.url, logs / f"{name}-proxy.log")
        try:
            yield Cluster(str(model), prefill, decode, url, d_spec, logs)
        finally:
            stop_proxy(proc)


@pytest.mark.xfail(strict=True, reason="a TP 2 server's ranks do not all answer the "
                   "handshake: the consumer times out on one producer rank (p2d1: rank 1; "
                   "p1d2: rank 0 for both consumer ranks), though every rank listens on the "
                   "address discovery advertises")
def test_outputs_equal_a_plain_server_across_tp_sizes(cluster: Cluster, reference) -> None:
    c = cluster
    salt = 1 if c.decode_spec.extra_args else 2  # fresh prompts for each pair
    batch = prompts(salt)
    ext0 = c.counter(c.decode, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer")
    local0 = c.counter(c.decode, "vllm:prompt_tokens_by_source_total", source="local_compute")
    with cf.ThreadPoolExecutor(len(batch)) as pool:
        outputs = list(pool.map(lambda t: completion(c.proxy_url, c.model, t), batch))
    for tokens, got in zip(batch, outputs, strict=True):
        assert got == reference[tuple(tokens)], f"prompt of {len(tokens)} tokens"
    c.wait_idle()
    assert c.counter(c.decode, "vllm:prompt_tokens_by_source_total",
                     source="external_kv_transfer") - ext0 == sum(LENGTHS)
    assert c.counter(c.decode, "vllm:prompt_tokens_by_source_total",
                     source="local_compute") == local0
    assert c.counter(c.decode, "pushkv:transfers_failed_total") == 0
