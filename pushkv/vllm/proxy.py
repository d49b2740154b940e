"""The push-mode proxy: an OpenAI-compatible router in front of prefill and decode instances.

For each request it picks a prefill (producer) and a decode (consumer)
instance, creates the transfer id, and sends **both legs at once**: the
prefill leg computes the prompt with ``max_tokens=1`` and holds its KV for the
transfer; the decode leg registers its blocks with the producer straight away
and streams the answer back to the client. Neither leg waits for the other.

* A producer's side channel (engine id, host, port) is learnt once, by a
  discovery request answered by its connector, and refreshed from every
  prefill answer.
* An error of either leg reaches the client as an HTTP error (the decode
  instance's own status, or 502 for a failed prefill), and the other leg is
  cancelled. Once tokens stream, the KV has landed: a later prefill-leg
  error is ignored, and a broken decode stream ends with an SSE error event.
* A client that goes away cancels both legs: their connections are closed,
  which makes vLLM abort the requests; the connectors then cancel and fence
  the transfer.

Only aiohttp and the standard library are imported here (not vLLM, not torch),
so ``pushkv proxy`` starts fast and runs anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from .params import ENDPOINT_KEY, DecodeLeg, Discover, Endpoint, ParamsError, PrefillLeg

logger = logging.getLogger("pushkv.proxy")
T = TypeVar("T")

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
#: Request headers passed on to both legs.
_FORWARDED = ("Authorization", "X-Request-Priority")


class LegError(Exception):
    """One leg failed; carries the HTTP answer to give the client."""

    def __init__(self, leg: str, status: int, body: Any) -> None:
        super().__init__(f"{leg} leg failed with HTTP {status}")
        self.leg = leg
        self.status = status
        self.body = body

    def response(self) -> web.Response:
        body = self.body
        if not isinstance(body, dict) or "error" not in body:
            body = _error_body(f"{self.leg} instance failed: {body}", self.status)
        return web.json_response(body, status=self.status, headers={"X-PushKV-Leg": self.leg})


def _error_body(message: str, status: int, kind: str = "BadGateway") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


@dataclass(eq=False)
class Instance:
    """One upstream vLLM server."""

    url: str
    role: str
    inflight: int = 0
    served: int = 0
    endpoint: Endpoint | None = None  #: producers: their pushkv side channel
    model: str | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class PushProxy:
    """The router: holds the instances and one HTTP client session."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *,
                 timeout_s: float = 600.0, connect_timeout_s: float = 10.0) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        self.prefill = [Instance(u.rstrip("/"), "prefill") for u in prefill]
        self.decode = [Instance(u.rstrip("/"), "decode") for u in decode]
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self.stats = {"requests": 0, "errors": 0, "cancelled": 0}

    # ------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT, self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=False))
        for inst in self.prefill:  # best effort: a producer may come up later
            with contextlib.suppress(LegError):
                await self._endpoint(inst)

    async def _stop(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy is not started")
        return self._session

    # ------------------------------------------------------- choosing

    def _pick(self, pool: list[Instance]) -> Instance:
        """The least busy instance; ties go round robin."""
        low = min(i.inflight for i in pool)
        idle = [i for i in pool if i.inflight == low]
        return idle[next(self._rr) % len(idle)]

    async def _model(self, inst: Instance) -> str:
        if inst.model is None:
            status, body = await self._get_json(inst, "/v1/models")
            try:
                inst.model = str(body["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise LegError(inst.role, 502, f"{inst.url}/v1/models answered {status}: "
                               f"{body!r}") from None
        return inst.model

    async def _endpoint(self, inst: Instance, refresh: bool = False) -> Endpoint:
        """The producer's side channel, asked for once with a discovery request."""
        async with inst.lock:
            if inst.endpoint is not None and not refresh:
                return inst.endpoint
            body = {"model": await self._model(inst), "prompt": [1], "max_tokens": 1,
                    "kv_transfer_params": Discover().to_params()}
            status, answer = await self._post_json(inst, COMPLETIONS, body, {})
            if status != 200:
                raise LegError("prefill", 502 if status >= 500 else status, answer)
            try:
                params = answer.get("kv_transfer_params") or {}
                inst.endpoint = Endpoint.from_json(params[ENDPOINT_KEY], "discovery answer")
            except (AttributeError, KeyError, ParamsError) as exc:
                raise LegError("prefill", 502, f"{inst.url} is not a pushkv producer "
                               f"(discovery answered {answer!r}: {exc})") from None
            logger.info("producer %s: engine %s, side channel %s:%d", inst.url,
                        inst.endpoint.engine_id, inst.endpoint.host, inst.endpoint.port)
            return inst.endpoint

    # ---------------------------------------------------- upstream I/O

    async def _get_json(self, inst: Instance, path: str) -> tuple[int, Any]:
        try:
            async with self.session.get(inst.url + path,
                                        timeout=aiohttp.ClientTimeout(total=30)) as resp:
                return resp.status, await _read_json(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(inst.role, 502, f"{inst.url} unreachable: {exc!r}") from None

    async def _post_json(self, inst: Instance, path: str, body: dict[str, Any],
                         headers: dict[str, str]) -> tuple[int, Any]:
        try:
            async with self.session.post(inst.url + path, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                                         ) as resp:
                return resp.status, await _read_json(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError(inst.role, 502, f"{inst.url} failed: {exc!r}") from None

    # ------------------------------------------------------- handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def models(self, request: web.Request) -> web.Response:
        status, body = await self._get_json(self.decode[0], "/v1/models")
        return web.json_response(body, status=status)

    async def health(self, request: web.Request) -> web.Response:
        async def one(inst: Instance) -> bool:
            try:
                async with self.session.get(inst.url + "/health",
                                            timeout=aiohttp.ClientTimeout(total=5)) as resp:
                    return resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                return False

        pools = self.prefill + self.decode
        ok = await asyncio.gather(*(one(i) for i in pools))
        status = {i.url: good for i, good in zip(pools, ok, strict=True)}
        up = any(ok[: len(self.prefill)]) and any(ok[len(self.prefill):])
        return web.json_response({"healthy": up, "instances": status, **self.stats},
                                 status=200 if up else 503)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return web.json_response(_error_body("request body is not JSON", 400,
                                                 "BadRequestError"), status=400)
        if not isinstance(body, dict):
            return web.json_response(_error_body("request body must be an object", 400,
                                                 "BadRequestError"), status=400)
        self.stats["requests"] += 1
        prefill, decode = self._pick(self.prefill), self._pick(self.decode)
        prefill.inflight += 1
        decode.inflight += 1
        try:
            return await self._dispatch(request, path, body, prefill, decode)
        except LegError as exc:
            self.stats["errors"] += 1
            logger.warning("%s: %s", exc, exc.body)
            return exc.response()
        except asyncio.CancelledError:
            self.stats["cancelled"] += 1
            raise
        finally:
            prefill.inflight -= 1
            decode.inflight -= 1
            prefill.served += 1
            decode.served += 1

    async def _dispatch(self, request: web.Request, path: str, body: dict[str, Any],
                        prefill: Instance, decode: Instance) -> web.StreamResponse:
        endpoint = await self._endpoint(prefill)
        transfer_id = uuid.uuid4().hex
        headers = {k: request.headers[k] for k in _FORWARDED if k in request.headers}
        headers["X-Request-Id"] = transfer_id
        p_body = _prefill_body(body, path, PrefillLeg(transfer_id=transfer_id))
        d_body = dict(body, kv_transfer_params=DecodeLeg(
            transfer_id=transfer_id, producer=endpoint).to_params())
        stream = bool(body.get("stream"))
        started = time.monotonic()
        p_task = asyncio.create_task(self._prefill_leg(prefill, path, p_body, headers))
        d_resp: aiohttp.ClientResponse | None = None
        try:
            d_resp = await self._open_decode(decode, path, d_body, headers, p_task)
            if stream:
                return await self._relay_stream(request, d_resp, p_task)
            return await self._relay_body(d_resp, p_task)
        finally:
            if not p_task.done():
                p_task.cancel()
            with contextlib.suppress(BaseException):
                await p_task
            if d_resp is not None:
                d_resp.close()  # a no-op when fully read; otherwise aborts the leg
            logger.debug("transfer %s done in %.3f s", transfer_id, time.monotonic() - started)

    async def _prefill_leg(self, inst: Instance, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> None:
        status, answer = await self._post_json(inst, path, body, headers)
        if status != 200:
            raise LegError("prefill", status if 400 <= status < 500 else 502, answer)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if isinstance(params, dict) and ENDPOINT_KEY in params:
            with contextlib.suppress(ParamsError):
                inst.endpoint = Endpoint.from_json(params[ENDPOINT_KEY])

    async def _open_decode(self, inst: Instance, path: str, body: dict[str, Any],
                           headers: dict[str, str],
                           p_task: asyncio.Task[None]) -> aiohttp.ClientResponse:
        """Send the decode leg; fail fast if the prefill leg fails first."""
        async def post() -> aiohttp.ClientResponse:
            return await self.session.post(
                inst.url + path, json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))

        open_task = asyncio.create_task(post())
        try:
            await asyncio.wait({open_task, p_task}, return_when=asyncio.FIRST_COMPLETED)
            _raise_if_failed(p_task)
            try:
                resp = await open_task
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise LegError("decode", 502, f"{inst.url} failed: {exc!r}") from None
        except BaseException:
            open_task.cancel()
            with contextlib.suppress(BaseException):
                (await open_task).close()
            raise
        if resp.status != 200:
            answer = await _read_json(resp)
            resp.close()
            raise LegError("decode", resp.status, answer)
        return resp

    async def _relay_body(self, d_resp: aiohttp.ClientResponse,
                          p_task: asyncio.Task[None]) -> web.Response:
        data = await _decode_unless_prefill_fails(d_resp.read(), p_task)
        return web.Response(body=data, status=200,
                            content_type=d_resp.content_type or "application/json")

    async def _relay_stream(self, request: web.Request, d_resp: aiohttp.ClientResponse,
                            p_task: asyncio.Task[None]) -> web.StreamResponse:
        events = _sse_events(d_resp)

        async def next_event() -> bytes:
            return await anext(events, b"")

        head = await _decode_unless_prefill_fails(next_event(), p_task)
        error = _sse_error(head)
        if error is not None:  # the decode leg failed before its first token
            raise LegError("decode", int(error.get("code") or 500), {"error": error})
        out = web.StreamResponse(status=200, headers={
            "Content-Type": d_resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        await out.prepare(request)
        await out.write(head)
        # Tokens are flowing: the KV has landed, so a late failure of the prefill
        # leg (its answer lost, its server gone) no longer matters.
        try:
            async for event in events:
                await out.write(event)
        except (aiohttp.ClientError, TimeoutError) as exc:
            await _write_sse_error(out, f"decode stream broke: {exc!r}", 502)
            return out
        await out.write_eof()
        return out


async def _decode_unless_prefill_fails(read: Awaitable[T], p_task: asyncio.Task[None]) -> T:
    """Await a read of the decode leg; if the prefill leg fails first, raise its error
    (the decode leg would otherwise wait for KV that never comes)."""
    task = asyncio.ensure_future(read)
    try:
        await asyncio.wait({task, p_task}, return_when=asyncio.FIRST_COMPLETED)
        _raise_if_failed(p_task)
        try:
            return await task
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise LegError("decode", 502, f"decode stream broke: {exc!r}") from None
    finally:
        if not task.done():
            task.cancel()


def _raise_if_failed(task: asyncio.Task[None]) -> None:
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        raise exc


async def _read_json(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


async def _sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream stream cut into whole SSE events (each ending in a blank line)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while (cut := buf.find(b"\n\n")) >= 0:
            yield buf[: cut + 2]
            buf = buf[cut + 2:]
    if buf:
        yield buf


def _sse_error(event: bytes) -> dict[str, Any] | None:
    """The error object of an SSE ``data: {"error": ...}`` event, else None."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                data = json.loads(line[5:].strip())
            except ValueError:
                return None
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                return dict(data["error"])
    return None


async def _write_sse_error(out: web.StreamResponse, message: str, code: int) -> None:
    with contextlib.suppress(ConnectionError):
        await out.write(b"data: " + json.dumps(_error_body(message, code)).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()


def _prefill_body(body: dict[str, Any], path: str, leg: PrefillLeg) -> dict[str, Any]:
    """The prefill leg: the same prompt, one token, no stream."""
    out = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=leg.to_params())
    if path == CHAT:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    return out


# ------------------------------------------------------------------ CLI


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``pushkv proxy`` to the ``pushkv`` command line."""
    p = subparsers.add_parser(
        "proxy", help="OpenAI-compatible push-mode router for vLLM prefill/decode instances",
        description="Route each request to a prefill and a decode vLLM instance running "
        "PushKVConnector, sending both legs at once with a shared transfer id.",
    )
    p.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="URL",
                   help="base URL of a prefill (kv_producer) instance; repeatable")
    p.add_argument("--decode", nargs="+", action="extend", required=True, metavar="URL",
                   help="base URL of a decode (kv_consumer) instance; repeatable")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a leg may take before it is abandoned")
    p.add_argument("--log-level", default="INFO", help="logging level")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    proxy = PushProxy(args.prefill, args.decode, timeout_s=args.timeout)
    logger.info("push proxy on %s:%d: prefill %s, decode %s", args.host, args.port,
                args.prefill, args.decode)
    web.run_app(proxy.app(), host=args.host, port=args.port, handler_cancellation=True,
                print=None, access_log=None)
    return 0
