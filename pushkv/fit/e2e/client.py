"""The benchmark's client: sends streamed completions and times them.

Two ways to reach a P/D deployment:

* through a router (``url``): one streamed request, the router does the rest;
* **client dispatch**: the client sends both legs itself, exactly as each
  connector expects them -- ``pushkv`` (both legs at once, one transfer id, the
  producer's side channel learnt once by a discovery request), ``vllm-push``
  (both legs at once under one ``X-Request-Id``), ``vllm-pull`` (the prefill leg
  first, then the decode leg with its answer's ``kv_transfer_params``).

Each request yields a :class:`Result`: client-side latency, TTFT, TPOT and the
output token ids (checked against a plain server's by the caller). With
:mod:`pushkv.timeline` recording, client-dispatched requests mark ``legs_sent``,
``first_token`` and ``last_token`` under their transfer (request) id.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pushkv import timeline
from pushkv.protocol import new_incarnation
from pushkv.vllm.params import ENDPOINT_KEY, DecodeLeg, Discover, Endpoint, PrefillLeg

COMPLETIONS = "/v1/completions"
_RNG = random.Random(os.urandom(16))


@dataclass
class Result:
    latency_s: float
    ttft_s: float
    tpot_s: float
    tokens: list[int] = field(default_factory=list)
    router_cpu_ms: float = float("nan")  #: the router's CPU for it (rounds.run_mode sets it)


@dataclass
class Target:
    """Where and how a mode's requests go."""

    url: str  #: the router (dispatch "router") or the decode server (client dispatch)
    dispatch: str = "router"  #: "router", "pushkv", "vllm-push" or "vllm-pull"
    prefill_url: str = ""
    prefill_engine_id: str = "prefill-0"
    prefill_side_port: int = 0  #: vllm-push: the prefill's VLLM_NIXL_SIDE_CHANNEL_PORT
    endpoint: Endpoint | None = None  #: pushkv: learnt by :meth:`Client.discover`
    #: plain: the replicas a router-dispatched request goes to in turn (else ``url``)
    replicas: tuple[str, ...] = ()
    sent: int = 0


def _prefill_body(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    out = dict(body, max_tokens=1, stream=False, kv_transfer_params=params)
    out.pop("stream_options", None)
    return out


class Client:
    def __init__(self, model: str) -> None:
        self.model = model
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=300),
            connector=aiohttp.TCPConnector(limit=0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.session is not None:
            await self.session.close()

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True,
                "stream": True}

    async def discover(self, target: Target) -> None:
        """pushkv: the producer's endpoint (once, off the measured path)."""
        assert self.session is not None
        body = {"model": self.model, "prompt": [1], "max_tokens": 1,
                "kv_transfer_params": Discover().to_params()}
        async with self.session.post(target.prefill_url + COMPLETIONS, json=body) as r:
            answer = await r.json()
        target.endpoint = Endpoint.from_json(answer["kv_transfer_params"][ENDPOINT_KEY])

    async def _post(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        assert self.session is not None
        async with self.session.post(url + COMPLETIONS, json=body, headers=headers) as r:
            answer = await r.json()
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {answer}")
            return answer

    async def _stream(self, url: str, body: dict[str, Any], headers: dict[str, str],
                      t0: float, rid: str) -> Result:
        assert self.session is not None
        tokens: list[int] = []
        first = last = 0.0
        async with self.session.post(url + COMPLETIONS, json=body, headers=headers) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"{url}: {event['error']}")
                got = event["choices"][0].get("token_ids") or []
                if got:
                    last = time.monotonic()
                    if not tokens:
                        first = last
                        if rid:
                            timeline.mark(rid, "first_token", first)
                    tokens += got
        if rid:
            timeline.mark(rid, "last_token", last)
        tpot = (last - first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
        return Result(latency_s=last - t0, ttft_s=first - t0, tpot_s=tpot, tokens=tokens)

    async def request(self, target: Target, prompt: list[int], max_tokens: int) -> Result:
        body = self.body(prompt, max_tokens)
        rid = uuid.uuid4().hex
        headers = {"X-Request-Id": rid}
        t0 = time.monotonic()
        if target.dispatch == "router":
            url = target.url
            if target.replicas:
                url = target.replicas[target.sent % len(target.replicas)]
                target.sent += 1
            return await self._stream(url, body, {}, t0, "")
        if target.dispatch == "pushkv":
            assert target.endpoint is not None, "discover() first"
            inc = new_incarnation(_RNG)
            p_body = _prefill_body(body, PrefillLeg(transfer_id=rid, incarnation=inc)
                                   .to_params())
            d_body = dict(body, kv_transfer_params=DecodeLeg(
                transfer_id=rid, producer=target.endpoint, incarnation=inc).to_params())
            return await self._both(target, p_body, d_body, headers, t0, rid)
        if target.dispatch == "vllm-push":
            p_body = _prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False})
            d_body = dict(body, kv_transfer_params={
                "do_remote_prefill": True, "remote_engine_id": target.prefill_engine_id,
                "remote_host": "127.0.0.1", "remote_port": target.prefill_side_port,
                "tp_size": 1, "pp_size": 1, "remote_request_id": rid, "transfer_mode": "push"})
            return await self._both(target, p_body, d_body, headers, t0, rid)
        if target.dispatch == "vllm-pull":
            p_body = _prefill_body(body, {"do_remote_decode": True, "do_remote_prefill": False})
            timeline.mark(rid, "legs_sent", t0)
            answer = await self._post(target.prefill_url, p_body, headers)
            d_body = dict(body, kv_transfer_params=answer.get("kv_transfer_params"))
            return await self._stream(target.url, d_body, headers, t0, rid)
        raise ValueError(f"unknown dispatch {target.dispatch!r}")

    async def _both(self, target: Target, p_body: dict[str, Any], d_body: dict[str, Any],
                    headers: dict[str, str], t0: float, rid: str) -> Result:
        timeline.mark(rid, "legs_sent", t0)
        prefill = asyncio.ensure_future(self._post(target.prefill_url, p_body, headers))
        try:
            result = await self._stream(target.url, d_body, headers, t0, rid)
        finally:
            await asyncio.wait({prefill}, timeout=60)
        prefill.result()  # a failed prefill leg fails the request
        return result
