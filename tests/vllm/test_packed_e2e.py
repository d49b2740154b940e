"""End to end with packed writes: real vLLM CPU servers, ``pack`` forced to "always".

The decode server has a small block pool (``--num-gpu-blocks-override``) and is
warmed with local requests first: vLLM frees a request's blocks in reverse order
to the tail of its free queue, so once the fresh head of the queue is used up
the transfers' destination blocks come in descending, non-contiguous ids -- a
fragmented cache, one run per block. Every transfer is then gathered into the
prefill server's staging memory, written in one descriptor into the decode
server's, and scattered into those blocks by the decode side before READY.
Greedy outputs must equal a plain server's, the decode side must count the
scatters (and more runs than scatters: the destinations were fragmented), and
no staging may stay lent afterwards.
"""

from __future__ import annotations

import concurrent.futures as cf
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
    poll,
    running,
)

from .test_e2e import FAST, completion, prompt, start_proxy, stop_proxy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.nixl]

BLOCKS = 48  #: the decode server's pool (block size 32)
WARM = [prompt(200, 300 + i) for i in range(6)]  #: 6 x 7 blocks of the pool's head
LENGTHS = (33, 64, 97, 150, 200)
PROMPTS = [prompt(n, 400 + i) for i, n in enumerate(LENGTHS)]
PACK = {"pack": "always", "staging_bytes": 64 << 20}


def _counter(server: Server, name: str, **labels: str) -> float:
    return metric(get_text(server.url + "/metrics"), name, **labels)


def test_packed_writes_into_a_fragmented_cache_equal_a_plain_server(
        tiny_model: Path, tmp_path: Path) -> None:
    model = str(tiny_model)
    plain = Server(ServerSpec(model=model, port=free_port(), cpu=0), tmp_path / "plain.log")
    with running(plain):
        reference = [completion(plain.url, model, t) for t in PROMPTS]
    prefill = Server(ServerSpec(model=model, port=free_port(), cpu=0, kv_config=(
        kv_transfer_config("kv_producer", "prefill-0", **FAST, **PACK))),
        tmp_path / "prefill.log")
    decode = Server(ServerSpec(model=model, port=free_port(), cpu=1, kv_config=(
        kv_transfer_config("kv_consumer", "decode-0", **FAST, **PACK)),
        extra_args=("--num-gpu-blocks-override", str(BLOCKS))), tmp_path / "decode.log")
    with running(prefill, decode):
        for tokens in WARM:  # computed by the decode server itself: its pool turns over
            completion(decode.url, model, tokens, max_tokens=1)
        proc, url = start_proxy(prefill.url, decode.url, tmp_path / "proxy.log")
        try:
            with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
                outputs = list(pool.map(lambda t: completion(url, model, t), PROMPTS))
        finally:
            stop_proxy(proc)
        assert outputs == reference
        # Every prompt token of the batch came from a transfer, every transfer packed.
        assert _counter(decode, "vllm:prompt_tokens_by_source_total",
                        source="external_kv_transfer") == sum(LENGTHS)
        assert _counter(prefill, "pushkv:writes_packed_total") == len(PROMPTS)
        assert _counter(decode, "pushkv:writes_scattered_total") == len(PROMPTS)
        assert _counter(decode, "pushkv:runs_scattered_total") > len(PROMPTS)  # fragmented
        assert _counter(decode, "pushkv:transfers_failed_total") == 0
        lent = poll(lambda: _counter(decode, "pushkv:staging_bytes_lent"),
                    lambda v: v == 0, 30)
        assert lent == 0
        usage = poll(lambda: (_counter(prefill, "vllm:kv_cache_usage_perc"),
                              _counter(decode, "vllm:kv_cache_usage_perc")),
                     lambda u: u == (0, 0), 30)
        assert usage == (0, 0)
