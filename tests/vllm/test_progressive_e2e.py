"""End to end, for each ``push_granularity``: real vLLM servers, PushKVConnector
on both, NIXL (UCX, host memory) between them, ``pushkv proxy`` in front.

Prompts are long enough for several chunked-prefill steps: the prefill server
computes at most :data:`BUDGET` tokens a step. One plain server (same chunking,
no connector) gives the reference greedy outputs and is stopped. One decode
server serves the whole module; each granularity gets its own prefill server
(a new engine id) and proxy, and its own fresh prompts (the decode server's
prefix cache would otherwise skip the transfer). The tests prove that outputs
equal the reference, that the decode server computed no prompt token itself,
and that with ``chunk`` and ``layer`` KV was written before prefill finished.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv import timeline
from pushkv.protocol import new_incarnation
from pushkv.vllm.params import ENDPOINT_KEY, DecodeLeg, Discover, Endpoint, PrefillLeg
from pushkv.vllm.testing import (
    Server,
    ServerSpec,
    free_port,
    get_text,
    kv_transfer_config,
    metric,
    poll,
    post_json,
    running,
    stream_token_ids,
)

from .test_e2e import start_proxy, stop_proxy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.nixl,
]

GRANULARITIES = ("request", "chunk", "layer")
MAX_MODEL_LEN = 2048
#: The prefill server's --max-num-batched-tokens: a 2000-token prompt takes 16 steps.
BUDGET = 128
LENGTHS = (40, 300, 1100, 2000)
MAX_TOKENS = 8
FAST = {"lease_s": 10.0, "heartbeat_s": 1.0, "window_s": 8.0, "fence_grace_s": 2.0,
        "handshake_timeout_s": 5.0, "peer_confirm_s": 1.0}
#: Prompt salts: each (granularity, sub-case) its own fresh prompts.
CASES = {"concurrent": 1, "streamed": 2, "registered_first": 3}


def prompt(n: int, salt: int) -> list[int]:
    return [(salt * 131 + 7 * i) % 990 + 5 for i in range(n)]


def batch(granularity: str, case: str) -> list[list[int]]:
    salt = 1000 * (GRANULARITIES.index(granularity) + 1) + 100 * CASES[case]
    return [prompt(n, salt + i) for i, n in enumerate(LENGTHS)]


def registered_first_prompt(granularity: str) -> list[int]:
    """The longest prompt (16 prefill steps), sent with its registration first."""
    return batch(granularity, "registered_first")[-1]


def body(model: str, tokens: list[int], **kw: object) -> dict[str, object]:
    return {"model": model, "prompt": tokens, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, **kw}


def completion(url: str, model: str, tokens: list[int]) -> list[int]:
    status, answer = post_json(url + "/v1/completions", body(model, tokens), timeout=120)
    assert status == 200, answer
    return list(answer["choices"][0]["token_ids"])


def spec(model: str, cpu: int, kv_config: dict[str, object] | None = None,
         chunked: bool = False) -> ServerSpec:
    extra = ("--max-num-batched-tokens", str(BUDGET)) if chunked else ()
    return ServerSpec(model=model, port=free_port(), cpu=cpu, kv_config=kv_config,
                      max_model_len=MAX_MODEL_LEN, extra_args=extra)


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("progressive-e2e-logs")


@pytest.fixture(scope="module")
def reference(tiny_model: Path, logs: Path) -> dict[tuple[int, ...], list[int]]:
    """Greedy outputs of one plain server chunking as the prefill servers do."""
    model = str(tiny_model)
    out = {}
    with running(Server(spec(model, 0, chunked=True), logs / "plain.log")) as (plain,):
        for g in GRANULARITIES:
            for case in ("concurrent", "streamed"):
                for tokens in batch(g, case):
                    out[tuple(tokens)] = completion(plain.url, model, tokens)
            tokens = registered_first_prompt(g)
            out[tuple(tokens)] = completion(plain.url, model, tokens)
    return out


@pytest.fixture(scope="module")
def decode(tiny_model: Path, logs: Path, reference: object) -> Iterator[Server]:
    server = Server(spec(str(tiny_model), 1, kv_transfer_config(
        "kv_consumer", "decode-0", **FAST)), logs / "decode.log")
    with running(server):
        yield server


@dataclass
class Deployment:
    granularity: str
    model: str
    prefill: Server
    decode: Server
    proxy_url: str
    timeline: Path  #: the prefill server's timeline marks

    def counter(self, server: Server, name: str, **labels: str) -> float:
        return metric(get_text(server.url + "/metrics"), name, **labels)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        def usage() -> tuple[float, float]:
            return (self.counter(self.prefill, "vllm:kv_cache_usage_perc"),
                    self.counter(self.decode, "vllm:kv_cache_usage_perc"))

        assert poll(usage, lambda u: u == (0, 0), timeout_s) == (0, 0)


@pytest.fixture(scope="module", params=GRANULARITIES)
def deployment(request: pytest.FixtureRequest, tiny_model: Path, logs: Path,
               decode: Server) -> Iterator[Deployment]:
    g = request.param
    model = str(tiny_model)
    tl = logs / "timeline" / g
    prefill = Server(spec(model, 0, kv_transfer_config(
        "kv_producer", f"prefill-{g}", push_granularity=g, timeline_dir=str(tl), **FAST),
        chunked=True), logs / f"prefill-{g}.log")
    with running(prefill):
        proc, url = start_proxy(prefill.url, decode.url, logs / f"proxy-{g}.log")
        try:
            yield Deployment(g, model, prefill, decode, url, tl)
        finally:
            stop_proxy(proc)


def check_pushed(c: Deployment, send: object, case: str,
                 reference: dict[tuple[int, ...], list[int]]) -> None:
    """Send a batch with ``send(prompts)``: outputs equal the reference, every prompt
    token reached the decode server by the transfer, and (chunk, layer) the prefill
    reported its KV in ranges."""
    ext = "vllm:prompt_tokens_by_source_total"
    ext0 = c.counter(c.decode, ext, source="external_kv_transfer")
    local0 = c.counter(c.decode, ext, source="local_compute")
    ranges0 = c.counter(c.prefill, "pushkv:ranges_reported_total")
    released0 = c.counter(c.prefill, "pushkv:sources_released_total")
    prompts = batch(c.granularity, case)
    outputs = send(prompts)  # type: ignore[operator]
    for tokens, got in zip(prompts, outputs, strict=True):
        assert got == reference[tuple(tokens)], f"prompt of {len(tokens)} tokens"
    c.wait_idle()
    assert c.counter(c.decode, ext, source="external_kv_transfer") - ext0 == sum(LENGTHS)
    assert c.counter(c.decode, ext, source="local_compute") == local0
    assert poll(lambda: c.counter(c.prefill, "pushkv:sources_released_total") - released0,
                lambda n: n == len(LENGTHS), 30) == len(LENGTHS)
    assert c.counter(c.decode, "pushkv:transfers_failed_total") == 0
    ranges = poll(lambda: c.counter(c.prefill, "pushkv:ranges_reported_total") - ranges0,
                  lambda n: c.granularity == "request" or n >= len(LENGTHS), 30)
    if c.granularity == "request":
        assert ranges == 0
    else:
        assert ranges >= len(LENGTHS)


def test_concurrent_batch_equals_a_plain_server_and_streamed_out_during_prefill(
        deployment, reference):
    c = deployment

    def send(prompts: list[list[int]]) -> list[list[int]]:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda t: completion(c.proxy_url, c.model, t), prompts))

    check_pushed(c, send, "concurrent", reference)


def test_streamed_requests_one_at_a_time_equal_a_plain_server(deployment, reference):
    c = deployment

    def send(prompts: list[list[int]]) -> list[list[int]]:
        return [stream_token_ids(c.proxy_url, body(c.model, t, stream=True), timeout=120)
                for t in prompts]

    check_pushed(c, send, "streamed", reference)


def test_kv_leaves_while_prefill_runs_once_registered_only_when_streamed(
        deployment, reference):
    # The decode leg goes first and the prefill leg only once the producer holds the
    # registration, so the only race left is a range's write (a few ms) against the
    # remaining 15 of 16 prefill steps. With both legs at once (the tests above) the
    # registration can arrive after a short prefill ended; that is correct, not early.
    c = deployment
    tokens = registered_first_prompt(c.granularity)
    tid = uuid.uuid4().hex
    incarnation = new_incarnation(random.Random(tid))
    _, found = post_json(c.prefill.url + "/v1/completions", body(
        c.model, [1], max_tokens=1, kv_transfer_params=Discover().to_params()), timeout=60)
    producer = Endpoint.from_json(found["kv_transfer_params"][ENDPOINT_KEY])
    tl = c.timeline

    def marks() -> dict[str, float]:
        return timeline.by_request(timeline.read(tl)).get(tid, {})

    with cf.ThreadPoolExecutor(1) as pool:
        decode_leg = pool.submit(post_json, c.decode.url + "/v1/completions", body(
            c.model, tokens, kv_transfer_params=DecodeLeg(
                transfer_id=tid, producer=producer, incarnation=incarnation).to_params()),
            120)
        assert "registration_received" in poll(
            marks, lambda m: "registration_received" in m, 60), marks()
        status, answer = post_json(c.prefill.url + "/v1/completions", body(
            c.model, tokens, max_tokens=1, kv_transfer_params=PrefillLeg(
                transfer_id=tid, incarnation=incarnation).to_params()), timeout=120)
        assert status == 200, answer
        status, answer = decode_leg.result(timeout=120)
    assert status == 200, answer
    assert list(answer["choices"][0]["token_ids"]) == reference[tuple(tokens)]
    m = poll(marks, lambda m: {"prefill_finished", "write_posted"} <= set(m), 30)
    assert {"prefill_finished", "write_posted"} <= set(m), m
    # by_request keeps each event's first time: the first write posted against the end
    # (its completion waits for UCX's progress, which on a loaded 2-core machine can
    # trail the prefill's last steps: the whole suite once saw it 1 step late)
    wrote_during_prefill = m["write_posted"] < m["prefill_finished"]
    assert wrote_during_prefill == (c.granularity != "request"), m
    # and the connector's metric says so (vLLM exports it with its periodic stats)
    early = poll(lambda: c.counter(c.prefill, "pushkv:bytes_before_prefill_end_total"),
                 lambda n: c.granularity == "request" or n > 0, 30)
    assert (early > 0) == (c.granularity != "request"), early
    c.wait_idle()
