"""The push proxy against small stand-in vLLM servers (aiohttp), for the paths that
are slow or hard to provoke with real engines: a leg failing in each way, a client
leaving mid-flight, both legs overlapping in time. The real engines are exercised
end to end in test_e2e.py."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pushkv.vllm.params import (
    ENDPOINT_KEY,
    POLICY_KEY,
    VOCAB_KEY,
    DecodeLeg,
    Endpoint,
    PrefillLeg,
    parse_params,
)
from pushkv.vllm.proxy.cli import EventLoopError, new_event_loop
from pushkv.vllm.proxy.server import PushProxy

ENDPOINT = Endpoint(engine_id="prefill-x", host="10.0.0.1", port=5601)


@dataclass
class Leg:
    """What one stand-in server saw of one leg."""

    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float
    answered: float | None = None
    cancelled: bool = False


@dataclass
class FakeVllm:
    """A stand-in vLLM server; ``behave`` decides each leg's fate."""

    role: str
    delay_s: float = 0.0
    status: int = 200
    stream_error: bool = False
    stream_error_code: Any = 500  #: the "code" of the error event (vLLM's is an int)
    legs: list[Leg] = field(default_factory=list)
    discoveries: int = 0
    healthy: bool = True  #: False: /health answers 503
    hang: bool = False  #: True: /health and every leg wait forever (a stopped process)
    fail_legs: int = 0  #: the first this many legs are answered 500
    drop_legs: int = 0  #: the first this many legs are read, then their connection closed
    policy: str = "fail"
    probes: int = 0
    #: The role its connector runs: "" (the fake's own), "kv_producer", "kv_consumer",
    #: or "none" (no connector: discovery parameters come back null, as from vLLM).
    kv_role: str = ""

    @property
    def endpoint(self) -> Endpoint:
        """What its connector tells a discovery request."""
        role = self.kv_role or ("kv_producer" if self.role == "prefill" else "kv_consumer")
        return replace(ENDPOINT, role=role.removeprefix("kv_"))

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "tiny", "max_model_len": 256}]})

    async def health(self, request: web.Request) -> web.Response:
        self.probes += 1
        if self.hang:
            await asyncio.Event().wait()
        return web.Response(status=200 if self.healthy else 503)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params")
        if params and params.get("pushkv_discover"):
            self.discoveries += 1
            if self.kv_role == "none":
                return web.json_response({"choices": [{"text": ""}],
                                          "kv_transfer_params": None})
            return web.json_response({"choices": [{"text": ""}], "kv_transfer_params": {
                ENDPOINT_KEY: self.endpoint.to_json(), POLICY_KEY: self.policy,
                VOCAB_KEY: 1000}})
        leg = Leg(body=body, headers={k.lower(): v for k, v in request.headers.items()},
                  arrived=time.monotonic())
        self.legs.append(leg)
        try:
            await asyncio.sleep(self.delay_s)
            if self.hang:
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            leg.cancelled = True
            raise
        leg.answered = time.monotonic()
        if len(self.legs) <= self.drop_legs:  # accepted, then dropped (a crash)
            assert request.transport is not None
            request.transport.close()
            return web.Response()
        if len(self.legs) <= self.fail_legs:
            return web.json_response({"error": {"message": "Internal server error",
                                                "type": "InternalServerError", "code": 500}},
                                     status=500)
        if self.status != 200:
            return web.json_response({"error": {"message": f"{self.role} says no",
                                                "type": "X", "code": self.status}},
                                     status=self.status)
        if not body.get("stream"):
            return web.json_response({"id": "cmpl-1", "choices": [
                {"text": " w5 w6 w7", "token_ids": [5, 6, 7], "finish_reason": "length"}]})
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        if self.stream_error:
            error = {"message": "Internal server error", "type": "InternalServerError",
                     "code": self.stream_error_code}
            await out.write(b"data: " + json.dumps({"error": error}).encode() + b"\n\n")
        else:
            head = {"id": "cmpl-1", "object": "text_completion", "created": 1,
                    "model": body.get("model")}
            for tok in (5, 6, 7):  # as vLLM streams a completion
                choice = {"index": 0, "text": f" w{tok}", "token_ids": [tok],
                          "finish_reason": "length" if tok == 7 else None}
                await out.write(b"data: " + json.dumps({**head, "choices": [choice]}).encode()
                                + b"\n\n")
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
                await out.write(b"data: " + json.dumps({**head, "choices": [], "usage": usage})
                                .encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out


Scenario = Callable[[str, FakeVllm, FakeVllm], Awaitable[None]]


def run(prefill: FakeVllm, decode: FakeVllm, scenario: Scenario, loop: str = "") -> None:
    """Run ``scenario`` against a proxy in front of the two fakes (on ``pushkv proxy
    --event-loop``'s ``loop`` if given, else asyncio.run's)."""
    async def main() -> None:
        async with TestServer(prefill.app()) as p, TestServer(decode.app()) as d:
            proxy = PushProxy([str(p.make_url(""))], [str(d.make_url(""))], timeout_s=30)
            async with TestServer(proxy.app()) as front:
                await scenario(str(front.make_url("")).rstrip("/"), prefill, decode)

    if not loop:
        asyncio.run(main())
        return
    with asyncio.Runner(loop_factory=lambda: new_event_loop(loop)) as runner:
        assert type(runner.get_loop()).__module__.split(".")[0] == loop
        runner.run(main())


REQUEST = {"model": "tiny", "prompt": [11, 12, 13], "max_tokens": 3, "temperature": 0}


async def post(url: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        raw = await r.read()
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw
        return r.status, data, dict(r.headers)


def test_both_legs_run_at_once_with_one_transfer_id():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        status, body, _ = await post(url, REQUEST)
        assert status == 200 and body["choices"][0]["text"] == " w5 w6 w7"
        (pl,), (dl,) = p.legs, d.legs
        assert dl.arrived < pl.answered  # the decode leg did not wait for the prefill
        p_leg, d_leg = parse_params(pl.body["kv_transfer_params"]), parse_params(
            dl.body["kv_transfer_params"])
        assert isinstance(p_leg, PrefillLeg) and isinstance(d_leg, DecodeLeg)
        assert p_leg.transfer_id == d_leg.transfer_id == pl.headers["x-request-id"]
        assert d_leg.producer == ENDPOINT
        assert (pl.body["max_tokens"], pl.body["stream"]) == (1, False)
        assert dl.body["max_tokens"] == 3 and dl.body["prompt"] == REQUEST["prompt"]
        assert p.discoveries == 1

    run(FakeVllm("prefill", delay_s=0.3), FakeVllm("decode", delay_s=0.5), scenario)


@pytest.mark.parametrize("loop", ["", "uvloop", "asyncio"])
def test_streaming_relays_every_event(loop):
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        async with aiohttp.ClientSession() as s, s.post(
                url + "/v1/completions", json=dict(REQUEST, stream=True)) as r:
            assert r.status == 200
            text = (await r.read()).decode()
        assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n")
        assert p.legs[0].body["stream"] is False and "stream_options" not in p.legs[0].body

    run(FakeVllm("prefill"), FakeVllm("decode"), scenario, loop)


def test_the_proxy_takes_uvloop_when_it_is_installed_and_says_so_when_asked_without_it(
        monkeypatch):
    import uvloop

    loop = new_event_loop("auto")
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now fails
    loop = new_event_loop("auto")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
    with pytest.raises(EventLoopError, match="uvloop is not installed"):
        new_event_loop("uvloop")
    with pytest.raises(EventLoopError, match="unknown event loop 'trio'"):
        new_event_loop("trio")


def test_prefill_error_is_returned_and_cancels_the_decode_leg():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        status, body, headers = await post(url, REQUEST)
        assert status == 400 and "prefill says no" in body["error"]["message"]
        assert headers["X-PushKV-Leg"] == "prefill"
        await asyncio.sleep(0.1)
        assert d.legs[0].cancelled

    run(FakeVllm("prefill", status=400), FakeVllm("decode", delay_s=5), scenario)


def test_prefill_server_error_becomes_bad_gateway():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        status, _, headers = await post(url, dict(REQUEST, stream=True))
        assert status == 502 and headers["X-PushKV-Leg"] == "prefill"
        await asyncio.sleep(0.1)
        assert d.legs[0].cancelled

    run(FakeVllm("prefill", status=500), FakeVllm("decode", delay_s=5), scenario)


def test_decode_error_is_returned_and_cancels_the_prefill_leg():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        status, body, headers = await post(url, REQUEST)
        assert status == 503 and "decode says no" in body["error"]["message"]
        assert headers["X-PushKV-Leg"] == "decode"
        await asyncio.sleep(0.1)
        assert p.legs[0].cancelled

    run(FakeVllm("prefill", delay_s=5), FakeVllm("decode", status=503), scenario)


def test_decode_stream_failing_before_its_first_token_is_an_http_error():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        status, body, headers = await post(url, dict(REQUEST, stream=True))
        assert status == 500 and headers["X-PushKV-Leg"] == "decode"
        assert "Internal server error" in body["error"]["message"]

    run(FakeVllm("prefill"), FakeVllm("decode", stream_error=True), scenario)


def test_a_stream_error_event_with_an_odd_code_is_still_a_clear_http_error():
    # Was a bare "500 Internal Server Error" page: int("overloaded") raised in the proxy.
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        status, body, headers = await post(url, dict(REQUEST, stream=True))
        assert status == 500 and headers["X-PushKV-Leg"] == "decode"
        assert "Internal server error" in body["error"]["message"]

    run(FakeVllm("prefill"),
        FakeVllm("decode", stream_error=True, stream_error_code="overloaded"), scenario)


def test_client_leaving_cancels_both_legs():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(url + "/v1/completions", json=REQUEST))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        await asyncio.sleep(0.3)
        assert p.legs[0].cancelled and d.legs[0].cancelled

    run(FakeVllm("prefill", delay_s=5), FakeVllm("decode", delay_s=5), scenario)


def test_unreachable_producer_is_unavailable_under_the_fail_policy():
    async def main() -> None:
        d = FakeVllm("decode")
        async with TestServer(d.app()) as ds:
            proxy = PushProxy(["http://127.0.0.1:9"], [str(ds.make_url(""))], timeout_s=5)
            async with TestServer(proxy.app()) as front:
                status, body, _ = await post(str(front.make_url("")).rstrip("/"), REQUEST)
        assert status == 503 and "no prefill instance" in body["error"]["message"]
        assert d.legs == []

    asyncio.run(main())


def test_health_reports_every_instance():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            assert r.status == 200
            body = await r.json()
        assert body["healthy"] is True and all(body["instances"].values())

    run(FakeVllm("prefill"), FakeVllm("decode"), scenario)


def test_bad_json_is_a_client_error():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                        data=b"{nope") as r:
            assert r.status == 400
        assert p.legs == [] and d.legs == []

    run(FakeVllm("prefill"), FakeVllm("decode"), scenario)


def test_chat_leg_caps_completion_tokens():
    async def scenario(url: str, p: FakeVllm, d: FakeVllm) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 9, "stream_options": {"include_usage": True}}
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions",
                                                        json=body) as r:
            assert r.status == 200
        assert p.legs[0].body["max_completion_tokens"] == 1
        assert "stream_options" not in p.legs[0].body
        assert d.legs[0].body["max_completion_tokens"] == 9

    run(FakeVllm("prefill"), FakeVllm("decode"), scenario)


def test_importing_the_proxy_does_not_import_vllm_or_torch():
    import subprocess
    import sys

    code = ("import sys, pushkv.vllm.proxy, pushkv.cli; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


class _Pieces:
    """An upstream body arriving in the given pieces (aiohttp's ``content.iter_any``)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.content = self
        self._pieces = pieces

    async def iter_any(self):  # type: ignore[no-untyped-def]
        while self._pieces:
            yield self._pieces.pop(0)


@pytest.mark.parametrize("pieces", [
    [b"data: {\"a\": 1}\n\ndata: {\"b\": 2}\n\ndata: [DONE]\n\n"],  # all in one piece
    [b"data: {\"a\"", b": 1}\n", b"\ndata: {\"b\": 2}\n\n", b"data: [DONE]\n\n"],  # split
    [b"data: {\"a\": 1}\n\n", b"data: {\"b\": 2}\n\ndata: [DONE]\n\n"],
    [b"data: {\"a\": 1}"],  # a stream cut before its first event ended
])
def test_the_relay_reads_one_whole_first_event_then_passes_the_rest_on_unchanged(pieces):
    from pushkv.vllm.proxy.sse import carries_tokens, sse_head_then_chunks

    body = b"".join(pieces)

    async def relay() -> list[bytes]:
        return [p async for p in sse_head_then_chunks(_Pieces(list(pieces)))]  # type: ignore[arg-type]

    out = asyncio.run(relay())
    assert b"".join(out) == body  # nothing lost, nothing reordered
    head = out[0]
    assert head == body[: body.find(b"\n\n") + 2] if b"\n\n" in body else head == body
    assert carries_tokens(head)
    assert not carries_tokens(b"data: [DONE]\n\n")
    assert carries_tokens(b"data: {\"b\": 2}\n\ndata: [DONE]\n\n")
