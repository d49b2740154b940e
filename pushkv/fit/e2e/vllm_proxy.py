"""A minimal router for vLLM's own NIXL connectors, the baselines of bench_e2e.sh.

* ``--mode pull`` (``NixlConnector``): the prefill leg runs first with
  ``max_tokens=1`` and ``do_remote_decode``; its answer's ``kv_transfer_params``
  (the prefill's block ids and address) are handed to the decode leg, which
  reads the KV.
* ``--mode vllm-push`` (``NixlPushConnector``): both legs at once under one
  ``X-Request-Id``; the decode leg is told the prefill engine's id and side
  channel, which this router is given on the command line.

Only ``/v1/completions`` is routed (what ``vllm bench serve`` sends), streaming
or not. Errors of either leg are returned as they came.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from pushkv import timeline


class Router:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.session: aiohttp.ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                             connector=aiohttp.TCPConnector(limit=0))

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def models(self, request: web.Request) -> web.Response:
        assert self.session is not None
        async with self.session.get(self.args.decode + "/v1/models") as r:
            return web.json_response(await r.json(), status=r.status)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        received = time.monotonic()
        body = await request.json()
        rid = uuid.uuid4().hex  # 32 hex digits: the servers' timeline marks find it
        timeline.mark(rid, "received", received)
        timeline.mark(rid, "legs_sent")
        headers = {"X-Request-Id": rid}
        prefill = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False})
        prefill.pop("stream_options", None)
        prefill.pop("min_tokens", None)
        if self.args.mode == "pull":
            async with self.session.post(self.args.prefill + "/v1/completions", json=prefill,
                                         headers=headers) as r:
                answer = await r.json()
                if r.status != 200:
                    return web.json_response(answer, status=r.status)
            decode = dict(body, kv_transfer_params=answer.get("kv_transfer_params"))
            return await self.relay(request, decode, headers, rid)
        decode = dict(body, kv_transfer_params={
            "do_remote_prefill": True, "remote_engine_id": self.args.prefill_engine_id,
            "remote_host": self.args.prefill_host, "remote_port": self.args.prefill_port,
            "tp_size": 1, "pp_size": 1, "remote_request_id": rid, "transfer_mode": "push"})
        leg = asyncio.create_task(self.post_prefill(prefill, headers))
        try:
            return await self.relay(request, decode, headers, rid)
        finally:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(leg, 60)

    async def post_prefill(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        assert self.session is not None
        async with self.session.post(self.args.prefill + "/v1/completions", json=body,
                                     headers=headers) as r:
            await r.read()

    async def relay(self, request: web.Request, body: dict[str, Any],
                    headers: dict[str, str], rid: str) -> web.StreamResponse:
        assert self.session is not None
        async with self.session.post(self.args.decode + "/v1/completions", json=body,
                                     headers=headers) as r:
            if not body.get("stream") or r.status != 200:
                return web.Response(body=await r.read(), status=r.status,
                                    content_type=r.content_type)
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            first, last = True, time.monotonic()
            async for chunk in r.content.iter_any():
                if first:
                    timeline.mark(rid, "first_token")
                    first = False
                if b"[DONE]" not in chunk:
                    last = time.monotonic()
                await out.write(chunk)
            timeline.mark(rid, "last_token", last)
            await out.write_eof()
            timeline.mark(rid, "answer_sent")
            return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mode", choices=("pull", "vllm-push"), required=True)
    p.add_argument("--prefill", required=True, help="prefill base URL")
    p.add_argument("--decode", required=True, help="decode base URL")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill-engine-id", default="prefill-0")
    p.add_argument("--prefill-host", default="127.0.0.1")
    p.add_argument("--prefill-port", type=int, default=0,
                   help="the prefill server's VLLM_NIXL_SIDE_CHANNEL_PORT (push mode)")
    p.add_argument("--timeline-dir", default="", help="record pushkv.timeline marks here")
    args = p.parse_args()
    timeline.configure(args.timeline_dir, "router")
    router = Router(args)
    app = web.Application()
    app.router.add_post("/v1/completions", router.completions)
    app.router.add_get("/health", router.health)
    app.router.add_get("/v1/models", router.models)
    app.on_startup.append(router.start)
    app.on_cleanup.append(router.stop)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None,
                handler_cancellation=True)


if __name__ == "__main__":
    main()
