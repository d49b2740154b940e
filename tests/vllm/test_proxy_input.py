"""Bad input to ``pushkv proxy`` is refused with an OpenAI-style 4xx before any engine
sees it; transfer ids and transfer parameters are never the client's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from pushkv.vllm.params import DecodeLeg, PrefillLeg, parse_params
from pushkv.vllm.proxy.input import CHAT, COMPLETIONS, ClientError, ModelInfo, check_request
from pushkv.vllm.proxy.server import ProxySettings, PushProxy
from pushkv.vllm.signing import SIG_KEY, verify

from .test_proxy import REQUEST, FakeVllm

MODELS = {"tiny": ModelInfo("tiny", 256, vocab_size=1000)}

BAD: list[tuple[str, Any, int, str | None]] = [
    # (path, body, status, param)
    (COMPLETIONS, [1, 2], 400, None),
    (COMPLETIONS, "hello", 400, None),
    (COMPLETIONS, {"model": "tiny"}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": ["a", "b"]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [[1], [2]]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1, -5]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1, True]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1, 2**40]}, 400, "prompt"),
    (COMPLETIONS, {"model": "other", "prompt": [1]}, 404, "model"),
    (COMPLETIONS, {"model": 7, "prompt": [1]}, 400, "model"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "max_tokens": -3}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "max_tokens": "9"}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "max_tokens": 10**12}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1] * 256, "max_tokens": 1}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1] * 200, "max_tokens": 57}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": [[1] * 250], "max_tokens": 7}, 400, "max_tokens"),
    (COMPLETIONS, {"model": "tiny", "prompt": [999999]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [5, 1000, 6]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [[1, 1000]]}, 400, "prompt"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "n": 2}, 400, "n"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "best_of": 3}, 400, "best_of"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "stream": "yes"}, 400, "stream"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "kv_transfer_params": {
        "do_remote_prefill": True, "transfer_id": "victim",
        "producer": {"engine_id": "p", "host": "10.9.9.9", "port": 1}}},
     400, "kv_transfer_params"),
    (COMPLETIONS, {"model": "tiny", "prompt": [1], "kv_transfer_params": None},
     400, "kv_transfer_params"),
    (CHAT, {"model": "tiny"}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": []}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": ["hi"]}, 400, "messages"),
    (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 0}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD)
def test_bad_request_is_refused_with_the_field_named(path, body, status, param):
    with pytest.raises(ClientError) as info:
        check_request(path, body, MODELS)
    err = info.value
    assert (err.status, err.param) == (status, param), err.message
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"} and shape["code"] == status


def test_good_requests_pass_with_their_sizes():
    ok = check_request(COMPLETIONS, {"model": "tiny", "prompt": [1] * 10, "max_tokens": 5},
                       MODELS)
    assert (ok.prompt_tokens, ok.max_tokens, ok.stream) == (10, 5, False)
    ok = check_request(COMPLETIONS, {"prompt": [[1, 2, 3]], "stream": True}, MODELS)
    assert (ok.model, ok.prompt_tokens, ok.max_tokens, ok.stream) == ("tiny", 3, 253, True)
    ok = check_request(CHAT, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 8, "max_completion_tokens": 4}, MODELS)
    assert ok.max_tokens == 4
    ok = check_request(COMPLETIONS, {"prompt": [0, 999] * 100, "max_tokens": 56}, MODELS)
    assert (ok.prompt_tokens, ok.max_tokens) == (200, 56)  # the whole length, every id
    ok = check_request(COMPLETIONS, {"prompt": [999999]}, {"tiny": ModelInfo("tiny", 256)})
    assert ok.prompt_tokens == 1  # no vocabulary known: not checked here
    with pytest.raises(ClientError):
        check_request(COMPLETIONS, {"prompt": [1], "max_tokens": 50}, MODELS, max_tokens_limit=20)


def _run(scenario: Any, settings: ProxySettings | None = None) -> tuple[FakeVllm, FakeVllm]:
    p, d = FakeVllm("prefill"), FakeVllm("decode")

    async def main() -> None:
        async with TestServer(p.app()) as ps, TestServer(d.app()) as ds:
            proxy = PushProxy([str(ps.make_url(""))], [str(ds.make_url(""))],
                              settings=settings or ProxySettings(max_body_bytes=4096))
            async with TestServer(proxy.app()) as front, aiohttp.ClientSession() as s:
                await scenario(s, str(front.make_url("")).rstrip("/"))

    asyncio.run(main())
    return p, d


def test_bad_requests_reach_no_engine():
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        sends: list[tuple[str, bytes]] = [
            (COMPLETIONS, b"{nope"),
            (COMPLETIONS, b"[" * 5000 + b"]" * 5000),  # deeper than the parser goes
            (COMPLETIONS, b"\xff\xfe"),
            (COMPLETIONS, json.dumps({"prompt": [1] * 3000}).encode()),  # > 4096 bytes
        ] + [(path, json.dumps(body).encode()) for path, body, _, _ in BAD]
        for path, data in sends:
            async with s.post(url + path, data=data,
                              headers={"Content-Type": "application/json"}) as r:
                assert 400 <= r.status < 500, (data[:60], r.status)
                err = (await r.json())["error"]
                assert err["code"] == r.status and err["message"]

    p, d = _run(scenario)
    assert p.legs == [] and d.legs == []


def test_transfer_ids_are_the_proxys_and_parameters_are_signed_with_a_key():
    key = b"k" * 32

    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        for _ in range(2):
            async with s.post(url + COMPLETIONS, json=REQUEST,
                              headers={"X-Request-Id": "client-chosen"}) as r:
                assert r.status == 200

    p, d = _run(scenario, ProxySettings(key=key))
    ids = set()
    for pl, dl in zip(p.legs, d.legs, strict=True):
        p_leg = parse_params(verify(pl.body["kv_transfer_params"], key))
        d_leg = parse_params(verify(dl.body["kv_transfer_params"], key))
        assert isinstance(p_leg, PrefillLeg) and isinstance(d_leg, DecodeLeg)
        assert p_leg.transfer_id == d_leg.transfer_id == pl.headers["x-request-id"]
        assert len(p_leg.transfer_id) == 32 and "client" not in p_leg.transfer_id
        ids.add(p_leg.transfer_id)
    assert len(ids) == 2


def test_without_a_key_nothing_is_signed():
    async def scenario(s: aiohttp.ClientSession, url: str) -> None:
        async with s.post(url + COMPLETIONS, json=REQUEST) as r:
            assert r.status == 200

    p, d = _run(scenario, ProxySettings())
    assert [SIG_KEY in leg.body["kv_transfer_params"] for leg in p.legs + d.legs] == [False] * 2
