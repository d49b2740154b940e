"""The push-mode proxy: an OpenAI-compatible router in front of prefill and decode instances.

For each request it picks a prefill (producer) and a decode (consumer)
instance, creates the transfer id, and sends **both legs at once**: the
prefill leg computes the prompt with ``max_tokens=1`` and holds its KV for the
transfer; the decode leg registers its blocks with the producer straight away
and streams the answer back to the client. Neither leg waits for the other.

* **Input.** A request is checked before any engine sees it
  (:mod:`.input`): malformed bodies, a wrong model, absurd lengths and
  client-supplied ``kv_transfer_params`` get an OpenAI-style 4xx. Transfer ids
  are made here (random, 128 bits); a client never chooses one.
* **Health.** Every instance is probed (:mod:`.pool`); one whose probes fail,
  or that refuses a connection or times out, leaves rotation and is probed
  again with back-off. What happens to one request (an error answer, a
  request dropped after the instance accepted it) takes an instance out only
  when a health check asked then fails too (:mod:`.failover`). Instances are
  chosen by least outstanding work.
* **Roles.** At start and whenever an instance comes back into rotation, a
  discovery request checks that it runs PushKVConnector in its role (producer
  behind ``--prefill``, consumer behind ``--decode``); one that does not is
  kept out with one log line naming the fix, and ``/health`` says why.
* **Failover** (:mod:`.failover`). A leg that no engine accepted (its instance
  could not be reached, left rotation or was drained while the leg waited), or
  that an engine broke off and whose instance is then found gone, fails over:
  before the answer began, as the ``failover`` policy says (``retry``: a new
  transfer on other instances); a completion after k tokens is **resumed** on
  another decode instance (:mod:`.resume`): a streamed one, or a non-streamed
  one, which the proxy asks of the decode instance as a stream and answers as
  one body (:mod:`.assemble`). A request an engine
  failed on while it stays healthy is never sent to another: it may be a
  poison request that would make the next engine fail too; the client is told
  which instance failed and what it said. When no producer is left, the
  decode instance's ``kv_load_failure_policy`` decides: ``recompute`` serves
  the request on the decode instance alone; ``fail`` answers 503/502.
* **Drain** (:mod:`.drain`): ``POST /admin/drain?instance=URL`` gives an
  instance no new leg and moves the requests waiting on it.
* **Bound.** A client gets its answer or a clear error within
  ``request_timeout_s`` (504, or an SSE error event once streaming began).
* A client that goes away cancels both legs: their connections are closed,
  which makes vLLM abort the requests; the connectors then end the transfer.
* With a shared key, every ``kv_transfer_params`` sent is signed
  (:mod:`pushkv.vllm.signing`); ``/metrics`` serves Prometheus metrics (:mod:`.metrics`).

Only aiohttp, prometheus_client and the standard library are imported here (not
vLLM, not torch), so ``pushkv proxy`` starts fast and runs anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from pushkv import timeline
from pushkv.protocol import new_incarnation

from ..params import (
    ENDPOINT_KEY,
    DecodeLeg,
    Endpoint,
    ParamsError,
    PrefillLeg,
)
from .assemble import AssemblyError, assemble, streamed, why_not
from .assemble import events as whole_events
from .drain import Admin
from .failover import BEFORE_ANSWER as BEFORE
from .failover import MID_STREAM, SOURCE_RELEASED, Failover, Reissue
from .input import CHAT, COMPLETIONS, Checked, ClientError, check_request
from .input import error_body as _error_body
from .legs import (
    OUT_OF_ROTATION,
    ClientGone,
    LegError,
    Watch,
    describe,
    prefill_body,
    unreachable,
)
from .metrics import CONTENT_TYPE, ProxyMetrics
from .pool import Instance, Pool
from .resume import NotResumable, Tap, complete, continuation, decode_body
from .settings import KEY_ENV, LATE, ProxySettings
from .sse import read_json, sse_error, sse_head_then_chunks, write_sse_error
from .upstream import Upstream

logger = logging.getLogger("pushkv.proxy")
__all__ = ["KEY_ENV", "LegError", "ProxySettings", "PushProxy", "describe", "unreachable"]

#: Draws incarnations; seeded from the OS, never from time.
_RNG = random.Random(os.urandom(16))
#: Request headers passed on to both legs.
_FORWARDED = ("Authorization", "X-Request-Priority")


@dataclass(eq=False)
class _Request:
    """One client request while it is routed."""

    request: web.Request
    path: str
    checked: Checked
    started: float
    body: dict[str, Any] = field(default_factory=dict)  #: the current attempt's request
    tap: Tap | None = None  #: a streamed answer: what the client received
    out: web.StreamResponse | None = None  #: set once the answer began
    first_byte: float | None = None
    transfer_id: str = ""  #: the current attempt's (timeline marks)
    retries: int = 0  #: sent again before the answer began
    reissued: bool = False  #: sent as a new transfer after a re-target found no source
    prefill_used: Instance | None = None  #: the last attempt's prefill instance
    decode_used: Instance | None = None  #: the decode instance its last decode leg went to
    resumes: int = 0  #: streams resumed elsewhere
    #: a non-streamed answer assembled from a streamed decode leg (:mod:`.assemble`)
    assembled: bool = False
    events: list[bytes] = field(default_factory=list)  #: its events so far, all legs

    @property
    def began(self) -> bool:
        """Whether the answer began: a byte of it reached the client, or (an assembled
        answer) the decode leg produced its first token."""
        return self.out is not None or (self.assembled and self.tap is not None
                                        and self.tap.legs > 0)


class PushProxy:
    """The router: holds the instances, their health and one HTTP client session."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *,
                 settings: ProxySettings | None = None,
                 timeout_s: float | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode instance")
        settings = settings or ProxySettings()
        if timeout_s is not None:
            settings = ProxySettings(**{**settings.__dict__, "request_timeout_s": timeout_s})
        self.settings = settings
        self.pool = Pool(prefill, decode, settings.health)
        self.metrics = ProxyMetrics()
        self.pool.listeners.append(lambda inst, up: self.metrics.instance(inst))
        for inst in self.pool.all:
            self.metrics.instance(inst)
        self.failover = Failover(settings.failover, self.pool, self.metrics,
                                 settings.health.timeout_s)
        self.admin = Admin(self.pool, self.metrics)
        self.upstream = Upstream(self.pool, settings, self.metrics)
        self._watcher: asyncio.Task[None] | None = None

    @property
    def prefill(self) -> list[Instance]:
        return self.pool.prefill

    @property
    def decode(self) -> list[Instance]:
        return self.pool.decode

    # ------------------------------------------------------------ app

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.settings.max_body_bytes)
        app.router.add_post(COMPLETIONS, self.completions)
        app.router.add_post(CHAT, self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/metrics", self.serve_metrics)
        self.admin.add_routes(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.upstream.open()
        # Each instance must run pushkv's connector in its role before it serves;
        # one that cannot be asked now is out of rotation until a probe can.
        async def check(inst: Instance) -> None:
            try:
                why = await self.upstream.verify(inst)
            except LegError as exc:
                if inst.up:  # reachable (else it is out already), but it did not answer
                    self.pool.mark_down(inst, f"a discovery request failed: {exc.message:.300}")
                return
            if why:
                self.pool.refuse(inst, why)

        await asyncio.gather(*(check(i) for i in self.pool.all))
        self._watcher = asyncio.create_task(self.pool.watch(self.upstream.probe))

    async def _stop(self, app: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.upstream.close()

    # ------------------------------------------------------- handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def list_models(self, request: web.Request) -> web.Response:
        inst = self.pool.pick("decode") or self.decode[0]
        try:
            status, body = await self.upstream.get_json(inst, "/v1/models")
        except LegError as exc:
            return exc.response()
        return web.json_response(body, status=status)

    async def health(self, request: web.Request) -> web.Response:
        """200 when requests can be served (an instance of each role in rotation); why
        each instance out of rotation is out, and why the proxy cannot serve."""
        body: dict[str, Any] = {"healthy": True,
                                "instances": {i.url: i.up for i in self.pool.all}}
        out = {i.url: i.why for i in self.pool.all if not i.up}
        if out:
            body["out_of_rotation"] = out
        drained = [i.url for i in self.pool.all if i.drained]
        if drained:
            body["drained"] = drained
        for role in ("decode", "prefill"):
            if not any(i.serving for i in self.pool.of(role)):
                body["healthy"] = False
                body["reason"] = f"no {role} instance is in rotation"
                break
        return web.json_response(body, status=200 if body["healthy"] else 503)

    async def serve_metrics(self, request: web.Request) -> web.Response:
        for inst in self.pool.all:
            self.metrics.instance(inst)
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _read(self, request: web.Request, path: str) -> Checked:
        if (request.content_length or 0) > self.settings.max_body_bytes:
            raise ClientError(413, f"request body is larger than "
                              f"{self.settings.max_body_bytes} bytes")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ClientError(413, f"request body is larger than "
                              f"{self.settings.max_body_bytes} bytes") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise ClientError(400, "request body is not valid JSON") from None
        if not self.upstream.models:
            for inst in [i for i in self.decode if i.up] or self.decode:
                with contextlib.suppress(LegError):
                    await self.upstream.learn_models(inst)
                    break
        return check_request(path, body, self.upstream.models, self.settings.max_tokens_limit)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        started = time.monotonic()
        try:
            checked = await self._read(request, path)
        except ClientError as exc:
            self.metrics.requests.labels("client_error").inc()
            return web.json_response(exc.body(), status=exc.status)
        req = _Request(request, path, checked, started, body=checked.body)
        if checked.stream:  # token ids asked for where a break can be resumed
            resumable = bool(self.settings.resumes) and path == COMPLETIONS
            req.tap = Tap(client_ids=not resumable or bool(checked.body.get("return_token_ids")),
                          keep=resumable)
        elif self.settings.resumes:  # answered from a streamed decode leg, if it can be
            why = why_not(checked.body, path)
            if why:
                self.metrics.assembled.labels("passed_through").inc()
            else:
                req.assembled = True
                req.tap = Tap(client_ids=bool(checked.body.get("return_token_ids")))
        task = asyncio.create_task(self._route(req))
        try:
            done, _ = await asyncio.wait({task}, timeout=self.settings.request_timeout_s)
        except asyncio.CancelledError:
            self._client_left(req)
            task.cancel()
            raise
        if not done:  # the bound passed: end the request with a clear error
            task.cancel()
            await asyncio.wait({task}, timeout=5.0)
            self.metrics.requests.labels("timeout").inc()
            message = f"no answer within the proxy's bound of {self.settings.request_timeout_s} s"
            logger.warning("request timed out: %s", message)
            if req.out is not None:
                await write_sse_error(req.out, message, 504)
                return req.out
            return web.json_response(_error_body(message, 504), status=504)
        try:
            resp = task.result()
        except LegError as exc:
            outcome = "client_error" if 400 <= exc.status < 500 else (
                "unavailable" if exc.status == 503 else "upstream_error")
            self.metrics.requests.labels(outcome).inc()
            logger.warning("request failed: %.500s", exc.message)
            if req.out is not None:  # the answer began: end it with an error event
                await write_sse_error(req.out, f"{exc.message:.500}", exc.status)
                return req.out
            return exc.response()
        except ConnectionError:  # the client left while its answer was written
            self._client_left(req)
            return req.out or web.Response(status=499)
        except Exception as exc:
            # Anything unforeseen still ends with a clear error, never a bare 500 page
            # or a stream cut without one.
            self.metrics.requests.labels("upstream_error").inc()
            logger.exception("request failed in the proxy")
            message = f"the proxy failed to route the request: {exc!r:.300}"
            if req.out is not None:
                await write_sse_error(req.out, message, 500)
                return req.out
            return web.json_response(_error_body(message, 500), status=500)
        self.metrics.requests.labels("ok").inc()
        end = time.monotonic()
        self.metrics.ttft.observe((req.first_byte or end) - started)
        self.metrics.latency.observe(end - started)
        return resp

    def _client_left(self, req: _Request) -> None:
        self.metrics.requests.labels("cancelled").inc()
        if req.transfer_id:
            timeline.mark(req.transfer_id, "client_left")

    # ------------------------------------------------------- routing

    async def _route(self, req: _Request) -> web.StreamResponse:
        """Attempts on chosen instances; fails over as :mod:`.failover` says: a retry
        before the answer began, a resumed stream after."""
        avoid: dict[str, list[Instance]] = {"prefill": [], "decode": []}
        last: LegError | None = None
        while True:
            decode = self.pool.pick("decode", avoid["decode"])
            if decode is None:
                raise last or LegError("decode", 503, _error_body(
                    "no decode instance is in rotation", 503))
            # A decode leg that failed leaves the prompt's full blocks in its prefill
            # instance's prefix cache: the next attempt goes there when it serves.
            prefill = self.pool.pick("prefill", avoid["prefill"], prefer=req.prefill_used)
            if prefill is None:
                return await self._decode_alone(req, decode, "no prefill instance is in "
                                                "rotation", last)
            try:
                return await self._attempt(req, prefill, decode, avoid["decode"])
            except Reissue as why:
                if req.reissued:  # once only
                    raise why.exc from None
                req.reissued = True
                avoid["decode"] += why.lost
                self.metrics.retries.inc()
                self.failover.record(BEFORE, why.exc, SOURCE_RELEASED,
                                     req.checked.prompt_tokens)
            except LegError as exc:
                failed = prefill if exc.leg == "prefill" else (req.decode_used or decode)
                cause = await self.failover.cause(exc, failed, self.upstream.session)
                if not cause:
                    raise
                if exc.dropped:  # found gone: not the request's fault
                    exc = self.failover.gone_error(exc, failed)
                last = exc
                avoid[exc.leg].append(failed)
                if req.began:  # the answer began: resume it, or end it
                    if await self._resume(req, exc, cause):
                        continue
                    assert req.out is not None
                    return req.out
                if req.retries >= self.settings.retries:
                    if exc.leg == "prefill":
                        return await self._decode_alone(req, decode, str(exc), exc)
                    raise exc from None
                req.retries += 1
                self.metrics.retries.inc()
                self.failover.record(BEFORE, exc, cause, req.checked.prompt_tokens)
                if self.pool.pick(exc.leg, avoid[exc.leg]) not in (None, failed):
                    self.metrics.failovers.labels(exc.leg).inc()

    async def _resume(self, req: _Request, exc: LegError, cause: str) -> bool:
        """After a streamed (or assembled) answer broke: True when the request goes on
        as a continuation (:attr:`_Request.body`); False when the answer was ended here
        (every token came). Raises ``exc`` when it cannot go on."""
        assert req.tap is not None
        if complete(req.tap, req.checked.body):
            if req.assembled:  # the stream broke after its last token: end it here
                if not req.tap.done:
                    req.events.append(b"data: [DONE]")
                prompt = len(req.tap.prompt_ids or ())
                n = len(req.tap.tokens)
                req.out = self._answer(req, {"prompt_tokens": prompt, "completion_tokens": n,
                                             "total_tokens": prompt + n})
                return False
            assert req.out is not None
            await req.out.write(b"data: [DONE]\n\n")
            await req.out.write_eof()
            return False
        if req.resumes >= self.settings.resumes:
            raise exc
        try:
            body = continuation(req.checked.body, req.path, req.tap)
        except NotResumable as why:
            logger.info("a stream is not resumed (%s) after: %s", why, exc.message)
            raise exc from None
        req.resumes += 1
        req.body = body
        req.tap.broken_at = time.monotonic()
        self.failover.record(MID_STREAM, exc, cause, len(body["prompt"]))
        return True

    async def _decode_alone(self, req: _Request, decode: Instance, why: str,
                            exc: LegError | None = None) -> web.StreamResponse:
        """No producer could serve: the decode instance's failure policy decides."""
        if await self.upstream.policy(decode) != "recompute":
            if exc is not None:
                raise exc
            raise LegError("prefill", 503, _error_body(why, 503))
        self.metrics.recomputed.inc()
        logger.info("serving a request on decode instance %s alone: %s", decode.url, why)
        with self._busy(decode, req.checked.prompt_tokens + req.checked.max_tokens):
            return await self._relay(req, decode, self._decode_body(req, None),
                                     self._headers(req, None),
                                     Watch(self.pool, self.upstream.failed, decode))

    def _headers(self, req: _Request, transfer_id: str | None) -> dict[str, str]:
        headers = {k: req.request.headers[k] for k in _FORWARDED if k in req.request.headers}
        if transfer_id is not None:
            headers["X-Request-Id"] = transfer_id
        return headers

    @contextlib.contextmanager
    def _busy(self, inst: Instance, work: int) -> Iterator[None]:
        inst.inflight += 1
        inst.work += work
        self.metrics.instance(inst)
        try:
            yield
        finally:
            inst.inflight -= 1
            inst.work -= work
            inst.served += 1
            self.metrics.instance(inst)

    def _decode_body(self, req: _Request, params: dict[str, Any] | None) -> dict[str, Any]:
        body = streamed(req.body) if req.assembled else req.body
        body = decode_body(body, req.path) if self.settings.resumes else body
        return body if params is None else dict(body, kv_transfer_params=params)

    async def _attempt(self, req: _Request, prefill: Instance, decode: Instance,
                       avoid: Sequence[Instance] = ()) -> web.StreamResponse:
        chk = req.checked
        endpoint = await self.upstream.endpoint(prefill)
        transfer_id = uuid.uuid4().hex
        incarnation = new_incarnation(_RNG)
        headers = self._headers(req, transfer_id)
        p_body = prefill_body(req.body, req.path, self.upstream.sign(
            PrefillLeg(transfer_id=transfer_id, incarnation=incarnation).to_params()))
        d_body = self._decode_body(req, self.upstream.sign(DecodeLeg(
            transfer_id=transfer_id, producer=endpoint, incarnation=incarnation).to_params()))
        req.transfer_id = transfer_id
        req.prefill_used = prefill
        timeline.mark(transfer_id, "received", req.started)
        tried = [decode]
        with self._busy(prefill, chk.prompt_tokens):
            timeline.mark(transfer_id, "legs_sent")
            p_task = asyncio.create_task(self._prefill_leg(prefill, req.path, p_body, headers))
            try:
                if self.settings.bind == LATE:
                    await self._prefill_answered(p_task, prefill)
                    decode = self.pool.pick("decode", avoid) or decode
                    tried = [decode]
                while True:
                    req.decode_used = decode
                    try:
                        with self._busy(decode, chk.prompt_tokens + chk.max_tokens):
                            return await self._relay(
                                req, decode, d_body, headers,
                                Watch(self.pool, self.upstream.failed, decode, p_task, prefill))
                    except LegError as exc:
                        if len(tried) > 1 and await self.failover.released(
                                exc, decode, req.began, self.upstream.session):
                            raise Reissue(exc, prefill, tried[:-1]) from None
                        # retarget: the same decode leg (same transfer, same params) to
                        # another decode instance while the producer holds the source.
                        if not self.failover.retargets(exc, req.began) or \
                                req.retries >= self.settings.retries:
                            raise
                        cause = await self.failover.cause(exc, decode, self.upstream.session)
                        other = self.pool.pick("decode", tried)
                        if not cause or other is None or other in tried:
                            raise
                        req.retries += 1
                        self.failover.record(BEFORE, exc, cause, 0)
                        decode = other
                        tried.append(other)
                        # rule 12: the same transfer, at the next engine's turn
                        d_body = self._decode_body(req, self.upstream.sign(DecodeLeg(
                            transfer_id=transfer_id, producer=endpoint,
                            incarnation=incarnation, target=len(tried) - 1).to_params()))
            finally:
                if not p_task.done():
                    p_task.cancel()
                    self.metrics.legs.labels("prefill", "cancelled").inc()
                with contextlib.suppress(BaseException):
                    await p_task

    async def _prefill_answered(self, p_task: asyncio.Task[None], prefill: Instance) -> None:
        """Wait for the prefill leg's answer (``bind`` late): its error, or the prefill
        instance going out of rotation first, fails the attempt."""
        down = asyncio.ensure_future(prefill.down.wait())
        try:
            await asyncio.wait({p_task, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            down.cancel()
        if not p_task.done():
            raise LegError("prefill", 502, f"prefill instance {prefill.url} went out of "
                           "rotation", cause=OUT_OF_ROTATION)
        p_task.result()  # its LegError, if it failed

    async def _prefill_leg(self, inst: Instance, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> None:
        status, answer = await self.upstream.post_json(inst, path, body, headers)
        if status != 200:
            raise self.upstream.leg_error(inst, status, answer)
        self.metrics.legs.labels("prefill", "ok").inc()
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if isinstance(params, dict) and ENDPOINT_KEY in params:
            with contextlib.suppress(ParamsError):
                inst.endpoint = Endpoint.from_json(params[ENDPOINT_KEY])

    async def _relay(self, req: _Request, decode: Instance, body: dict[str, Any],
                     headers: dict[str, str], watch: Watch) -> web.StreamResponse:
        """Send the decode leg and relay its answer, unless the attempt fails first."""
        d_resp = await watch.race(self._open_decode(decode, req.path, body, headers))
        try:
            if req.checked.stream or req.assembled:
                return await self._relay_stream(req, d_resp, watch)
            data = await watch.race(d_resp.read())
            self.metrics.legs.labels("decode", "ok").inc()
            req.first_byte = time.monotonic()
            timeline.mark(req.transfer_id, "last_token", req.first_byte)
            req.out = web.Response(body=data, status=200,
                                   content_type=d_resp.content_type or "application/json")
            return req.out
        finally:
            d_resp.close()  # a no-op when fully read; otherwise aborts the leg

    def _answer(self, req: _Request, usage: dict[str, Any] | None = None) -> web.Response:
        """The client's one non-streamed body, assembled from the events kept."""
        try:
            body = assemble(req.events, usage)
        except AssemblyError as exc:
            self.metrics.assembled.labels("failed").inc()
            assert req.decode_used is not None
            if exc.error is not None:
                code = exc.error.get("code")
                status = code if isinstance(code, int) and 400 <= code < 600 else 500
                raise self.upstream.leg_error(req.decode_used, status,
                                              {"error": exc.error}) from None
            raise self.upstream.poisoned(req.decode_used, 502, f"sent a stream the proxy "
                                         f"could not assemble into one answer: {exc}") from None
        self.metrics.assembled.labels("ok").inc()
        req.first_byte = time.monotonic()
        timeline.mark(req.transfer_id, "answer_sent", req.first_byte)
        return web.json_response(body)

    async def _open_decode(self, inst: Instance, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> aiohttp.ClientResponse:
        try:
            resp = await self.upstream.session.post(
                inst.url + path, json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s))
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.legs.labels("decode", "failed").inc()
            raise self.upstream.failed(inst, exc) from None
        if resp.status != 200:
            answer = await read_json(resp)
            resp.close()
            raise self.upstream.leg_error(inst, resp.status, answer)
        return resp

    async def _relay_stream(self, req: _Request, d_resp: aiohttp.ClientResponse,
                            watch: Watch) -> web.StreamResponse:
        """Relay a streamed answer through its :class:`Tap` (whole events only); a
        continuation's events go on the same client stream."""
        tap = req.tap
        assert tap is not None
        events = sse_head_then_chunks(d_resp)
        head = await watch.race(anext(events, b""))
        error = sse_error(head)
        if error is not None:  # the decode leg failed before its first token
            code = error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            raise self.upstream.leg_error(watch.decode, status, {"error": error})
        if not head.strip():
            self.metrics.legs.labels("decode", "failed").inc()
            raise self.upstream.poisoned(watch.decode, 502, "ended its stream before a token")
        now = time.monotonic()
        if req.assembled:
            if tap.legs:
                self.metrics.resume_gap.observe(now - tap.last_token_at)
                logger.info("non-streamed answer resumed on %s after %d tokens: a %.1f ms "
                            "gap, %.1f ms after the break was seen", watch.decode.url,
                            len(tap.tokens), 1000 * (now - tap.last_token_at),
                            1000 * (now - tap.broken_at))
            else:
                timeline.mark(req.transfer_id, "first_token", now)
        elif req.out is None:
            out = web.StreamResponse(status=200, headers={
                "Content-Type": d_resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache"})
            await out.prepare(req.request)
            req.out, req.first_byte = out, now
            timeline.mark(req.transfer_id, "first_token", req.first_byte)
        else:
            gap = now - tap.last_token_at
            self.metrics.resume_gap.observe(gap)
            logger.info("stream resumed on %s after %d tokens: a %.1f ms gap, %.1f ms after "
                        "the break was seen", watch.decode.url, len(tap.tokens), 1000 * gap,
                        1000 * (now - tap.broken_at))
        sink = req.out

        async def write(data: bytes) -> None:
            if sink is None:  # assembled: the events are kept, the client gets one body
                req.events.extend(whole_events(data))
            else:
                await sink.write(data)

        tap.begin()
        await write(tap.feed(head, now))
        # Tokens are flowing: the KV has landed, so the prefill leg no longer
        # matters; the decode instance going out of rotation still ends the stream.

        async def pump() -> None:
            # One race for the whole stream, not one per event: racing each token
            # cost a task and a wait per event on the proxy's critical path.
            async for piece in events:
                data = tap.feed(piece, time.monotonic())
                if not data:
                    continue
                try:
                    await write(data)
                except ConnectionError as exc:  # the client left: not the decode's fault
                    raise ClientGone from exc

        try:
            await watch.race(pump(), prefill=False)
        except ClientGone as gone:
            raise gone.__cause__ from None  # type: ignore[misc]
        except LegError:
            self.metrics.legs.labels("decode", "failed").inc()
            raise
        if not tap.done:  # the stream stopped without its end marker
            self.metrics.legs.labels("decode", "failed").inc()
            raise self.upstream.poisoned(watch.decode, 502, "ended its stream before [DONE]")
        self.metrics.legs.labels("decode", "ok").inc()
        timeline.mark(req.transfer_id, "last_token", tap.last_token_at)
        if sink is None:
            req.out = self._answer(req)
            return req.out
        await sink.write_eof()
        timeline.mark(req.transfer_id, "answer_sent")
        return sink
