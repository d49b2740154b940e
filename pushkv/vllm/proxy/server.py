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
  request dropped after the instance accepted it) never takes an instance out.
  Instances are chosen by least outstanding work.
* **Roles.** At start and whenever an instance comes back into rotation, a
  discovery request checks that it runs PushKVConnector in its role (producer
  behind ``--prefill``, consumer behind ``--decode``); one that does not is
  kept out with one log line naming the fix, and ``/health`` says why.
* **Failover.** A leg that no engine accepted (its instance could not be
  reached, or went out of rotation while the leg waited) before any output
  reached the client is sent again, once, as a **new transfer** on other
  instances (the other leg is cancelled and follows). A request an engine
  failed on (a 5xx, or accepted then dropped) is never sent to another: it
  may be a poison request that would make the next engine fail too; the
  client is told which instance failed and what it said. When no producer is left, the
  decode instance's ``kv_load_failure_policy`` decides: ``recompute`` serves
  the request on the decode instance alone; ``fail`` answers 503/502.
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
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from pushkv import timeline
from pushkv.protocol import new_incarnation
from pushkv.transports.nixl.config import NixlConfig

from ..params import (
    ENDPOINT_KEY,
    POLICY_KEY,
    VOCAB_KEY,
    DecodeLeg,
    Discover,
    Endpoint,
    ParamsError,
    PrefillLeg,
)
from ..signing import sign
from .input import CHAT, COMPLETIONS, Checked, ClientError, ModelInfo, check_request
from .input import error_body as _error_body
from .metrics import CONTENT_TYPE, ProxyMetrics
from .pool import HealthSettings, Instance, Pool
from .sse import carries_tokens, read_json, sse_error, sse_head_then_chunks, write_sse_error

logger = logging.getLogger("pushkv.proxy")
T = TypeVar("T")

#: Environment variable holding the shared key when no file is given (the runtime's).
KEY_ENV: str = NixlConfig.key_env
#: Draws incarnations; seeded from the OS, never from time.
_RNG = random.Random(os.urandom(16))
#: How long an idle connection to an instance is kept: below vLLM's own keep-alive
#: (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default).
_KEEPALIVE_S = 3.0
#: The longest a discovery request may take (an instance's check, at start and when
#: it comes back): one token of a one-token prompt.
_DISCOVERY_S = 30.0
#: Request headers passed on to both legs.
_FORWARDED = ("Authorization", "X-Request-Priority")


@dataclass(frozen=True, kw_only=True)
class ProxySettings:
    """Settings of ``pushkv proxy`` (each one a command-line flag)."""

    request_timeout_s: float = 600.0  #: the longest a client waits for its answer or an error
    connect_timeout_s: float = 5.0  #: opening a connection to an instance
    retries: int = 1  #: times a request is sent again after a leg failed before any output
    max_body_bytes: int = 8 << 20  #: larger request bodies get 413
    max_tokens_limit: int = 0  #: bound on max_tokens besides the model's length (0: none)
    health: HealthSettings = field(default_factory=HealthSettings)
    key: bytes | None = field(default=None, repr=False)  #: shared key signing the params

    def __post_init__(self) -> None:
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("timeouts must be positive")
        if self.retries < 0 or self.max_body_bytes < 1 or self.max_tokens_limit < 0:
            raise ValueError("retries, max_body_bytes and max_tokens_limit must be >= 0")


class LegError(Exception):
    """One leg failed; carries the HTTP answer to give the client.

    ``body``: an OpenAI-style error object to return as it is, or a message.
    ``retryable``: the request never reached an engine that accepted it (the
    instance could not be reached, or left rotation while the leg waited), so
    another instance may serve it. A request an engine refused (4xx) or failed
    on (5xx, or accepted and dropped) is not: see :meth:`PushProxy._poisoned`.
    """

    def __init__(self, leg: str, status: int, body: Any, *, retryable: bool = False,
                 instance: str = "") -> None:
        super().__init__(f"{leg} leg failed with HTTP {status}")
        self.leg = leg
        self.status = status
        self.body = body
        self.retryable = retryable
        self.instance = instance  #: the instance's URL, when one is to blame

    @property
    def message(self) -> str:
        """What went wrong, in one line."""
        body = self.body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            body = body["error"].get("message", body)
        return " ".join(str(body).split())

    def response(self) -> web.Response:
        body = self.body
        if not isinstance(body, dict) or "error" not in body:
            body = _error_body(self.message, self.status)
        headers = {"X-PushKV-Leg": self.leg}
        if self.instance:
            headers["X-PushKV-Instance"] = self.instance
        return web.json_response(body, status=self.status, headers=headers)


@dataclass(eq=False)
class _Request:
    """One client request while it is routed."""

    request: web.Request
    path: str
    checked: Checked
    started: float
    out: web.StreamResponse | None = None  #: set once the answer began
    first_byte: float | None = None
    transfer_id: str = ""  #: the current attempt's (timeline marks)


#: Turns an exception of a connection to an instance into the leg's error.
_Failed = Callable[[Instance, BaseException], "LegError"]


class _Watch:
    """What can end an attempt early: its prefill leg failing, or either of its
    instances going out of rotation (probes failed: it died or hangs)."""

    def __init__(self, pool: Pool, failed: _Failed, decode: Instance,
                 p_task: asyncio.Task[None] | None = None,
                 prefill: Instance | None = None) -> None:
        self.pool = pool
        self.failed = failed
        self.decode, self.d_down = decode, decode.down
        self.p_task, self.prefill = p_task, prefill
        self.p_down = prefill.down if prefill is not None else None

    async def race(self, aw: Awaitable[T], *, prefill: bool = True) -> T:
        task = asyncio.ensure_future(aw)
        watchers = [asyncio.ensure_future(self.d_down.wait())]
        p_task = self.p_task if prefill else None
        if p_task is not None and self.p_down is not None:
            watchers.append(asyncio.ensure_future(self.p_down.wait()))
        try:
            waits: set[asyncio.Future[Any]] = {task, *watchers}
            if p_task is not None:
                waits.add(p_task)
            while True:
                done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if p_task is not None:
                    _raise_if_failed(p_task)
                if done != {p_task}:
                    break
                waits.discard(p_task)  # the prefill leg answered: keep waiting
            if not task.done():
                inst = self.decode if self.d_down.is_set() or self.prefill is None \
                    else self.prefill
                raise LegError(inst.role, 502, f"{inst.role} instance {inst.url} went out "
                               "of rotation", retryable=True)
            try:
                return await task
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise self.failed(self.decode, exc) from None
        finally:
            for w in watchers:
                w.cancel()
            if not task.done():
                task.cancel()
            # It may end (or have ended, when this race was cancelled) with an error of
            # its own, a write to a client that left: take it, nobody else will.
            task.add_done_callback(_retrieve)


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
        self.models: dict[str, ModelInfo] = {}
        self._vocab = 0  #: the served model's vocabulary size, once an instance told it
        self._session: aiohttp.ClientSession | None = None
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
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None,
                                        sock_connect=self.settings.connect_timeout_s)
        # Idle connections are dropped before vLLM closes them (its keep-alive: 5 s), so
        # a leg is never sent on a connection the instance is closing: that would look
        # like a request the engine dropped, which is not retried.
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(
                limit=0, force_close=False, keepalive_timeout=_KEEPALIVE_S))
        # Each instance must run pushkv's connector in its role before it serves;
        # one that cannot be asked now is out of rotation until a probe can.
        async def check(inst: Instance) -> None:
            try:
                why = await self._verify(inst)
            except LegError as exc:
                if inst.up:  # reachable (else it is out already), but it did not answer
                    self.pool.mark_down(inst, f"a discovery request failed: {exc.message:.300}")
                return
            if why:
                self.pool.refuse(inst, why)

        await asyncio.gather(*(check(i) for i in self.pool.all))
        self._watcher = asyncio.create_task(self.pool.watch(self._probe))

    async def _stop(self, app: web.Application) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy is not started")
        return self._session

    def _sign(self, params: dict[str, Any]) -> dict[str, Any]:
        return sign(params, self.settings.key) if self.settings.key else params

    # ---------------------------------------------------- upstream I/O

    async def _probe(self, inst: Instance) -> bool | str:
        """A health probe; an instance coming back into rotation is also checked for
        pushkv's connector in its role (:meth:`_check`)."""
        h = self.settings.health
        try:
            async with self.session.get(
                    inst.url + "/health", timeout=aiohttp.ClientTimeout(total=h.timeout_s)) as r:
                if r.status != 200:
                    return False
            if h.generate_timeout_s and self.models:
                body = {"model": next(iter(self.models)), "prompt": [1], "max_tokens": 1}
                async with self.session.post(
                        inst.url + COMPLETIONS, json=body,
                        timeout=aiohttp.ClientTimeout(total=h.generate_timeout_s)) as r:
                    if r.status != 200:
                        return False
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False
        if inst.up and inst.verified:
            return True
        return await self._check(inst)

    async def _check(self, inst: Instance) -> bool | str:
        """Whether ``inst`` runs pushkv's connector in its role, asked with a discovery
        request: True (and what it told is kept), why it must not serve, or False when
        it could not be asked (unreachable, an error answer)."""
        try:
            why = await self._verify(inst)
        except LegError as exc:
            logger.debug("%s instance %s: discovery failed: %s", inst.role, inst.url,
                         exc.message)
            return False
        return why or True

    async def _verify(self, inst: Instance) -> str:
        """Ask ``inst`` who it is; '' when it runs pushkv's connector in its role (its
        side channel, failure policy and vocabulary are kept), else why it must not
        serve, with the fix. LegError when it cannot be asked."""
        params = await self._discover(inst)
        want = "kv_producer" if inst.role == "prefill" else "kv_consumer"
        fix = ("start it with --kv-transfer-config '{\"kv_connector\":\"PushKVConnector\","
               f"\"kv_connector_module_path\":\"pushkv.vllm.connector\",\"kv_role\":\"{want}\""
               ", ...}'")
        if ENDPOINT_KEY not in params:
            return (f"it does not run PushKVConnector (its answer to a discovery request "
                    f"carried no pushkv parameters): {fix}; if it does, its connector and the "
                    "proxy hold different shared keys (--key-file, key_file)")
        try:
            endpoint = Endpoint.from_json(params[ENDPOINT_KEY], "discovery answer")
        except ParamsError as exc:
            return (f"its connector's discovery answer is not understood ({exc}): run the "
                    "same pushkv version on the instances and the proxy")
        has = f"kv_{endpoint.role}"
        if has != want:
            other = "decode" if inst.role == "prefill" else "prefill"
            return (f"it runs PushKVConnector as {has}, but is given as --{inst.role}: give "
                    f"it as --{other}, or start it with \"kv_role\":\"{want}\"")
        if inst.role == "prefill":
            if inst.endpoint != endpoint:
                logger.info("producer %s: engine %s, side channel %s", inst.url,
                            endpoint.engine_id, endpoint.addresses())
            inst.endpoint = endpoint
        else:
            inst.policy = "recompute" if params.get(POLICY_KEY) == "recompute" else "fail"
        inst.verified = True
        return ""

    async def _get_json(self, inst: Instance, path: str) -> tuple[int, Any]:
        try:
            async with self.session.get(
                    inst.url + path,
                    timeout=aiohttp.ClientTimeout(total=self.settings.connect_timeout_s * 2)
            ) as resp:
                return resp.status, await read_json(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed(inst, exc) from None

    async def _post_json(self, inst: Instance, path: str, body: dict[str, Any],
                         headers: dict[str, str], timeout_s: float | None = None
                         ) -> tuple[int, Any]:
        total = timeout_s or self.settings.request_timeout_s
        try:
            async with self.session.post(inst.url + path, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=total)) as resp:
                return resp.status, await read_json(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed(inst, exc) from None

    def _failed(self, inst: Instance, exc: BaseException) -> LegError:
        """The error of a request whose connection to ``inst`` failed.

        An instance that cannot be reached (refused, no route, the connection or
        the answer timed out) leaves rotation, as a failed probe would take it out;
        one that accepted the request and then dropped it stays in: one request's
        fate says nothing of the instance's health, which the probes judge."""
        what = describe(exc)
        if unreachable(exc):
            self.pool.mark_down(inst, what)
            return LegError(inst.role, 502, f"{inst.role} instance {inst.url} could not be "
                            f"reached: {what}", retryable=True)
        if isinstance(exc, TimeoutError):
            self.pool.mark_down(inst, what)
            return LegError(inst.role, 502, f"{inst.role} instance {inst.url} did not answer "
                            f"in time: {what}", retryable=True)
        return self._poisoned(inst, 502, f"dropped the request after accepting it ({what})")

    def _leg_error(self, inst: Instance, status: int, answer: Any) -> LegError:
        """The error of a leg answered with ``status`` (not 200)."""
        if 400 <= status < 500:
            self.metrics.legs.labels(inst.role, "refused").inc()
            return LegError(inst.role, status, answer)
        # One request's error says nothing of the instance's health (the probes do):
        # it stays in rotation.
        self.metrics.legs.labels(inst.role, "failed").inc()
        said = LegError(inst.role, status, answer).message
        return self._poisoned(inst, 502 if inst.role == "prefill" else status,
                              f"answered HTTP {status}: {said:.300}")

    def _poisoned(self, inst: Instance, status: int, what: str) -> LegError:
        """An engine failed on a request it had accepted (a 5xx, or dropped it): the
        client is told which instance and what it said, and the request is not sent
        to another instance, which it might make fail too (a poison request: a token
        id that crashes the model, an input that trips a bug)."""
        return LegError(inst.role, status, f"{inst.role} instance {inst.url} failed this "
                        f"request: {what}; it was not sent to another instance, as a request "
                        "that makes an engine fail may make the next one fail too",
                        instance=inst.url)

    async def _discover(self, inst: Instance) -> dict[str, Any]:
        """The instance's answer to a discovery request (its connector's parameters)."""
        body = {"model": await self._model_name(inst), "prompt": [1], "max_tokens": 1,
                "kv_transfer_params": self._sign(Discover().to_params())}
        status, answer = await self._post_json(
            inst, COMPLETIONS, body, {},
            timeout_s=min(_DISCOVERY_S, self.settings.request_timeout_s))
        if status != 200:
            raise self._leg_error(inst, status, answer)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        params = params if isinstance(params, dict) else {}
        vocab = params.get(VOCAB_KEY)
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
            self._learn_vocab(vocab, inst)
        return params

    def _learn_vocab(self, vocab: int, inst: Instance) -> None:
        """The served model's vocabulary size, as an instance's connector told it."""
        if vocab == self._vocab:
            return
        if self._vocab:  # instances of two models: ids either one lacks are refused
            logger.warning("%s instance %s serves a vocabulary of %d tokens, others %d: "
                           "the smaller bounds token ids", inst.role, inst.url, vocab,
                           self._vocab)
            vocab = min(vocab, self._vocab)
        else:
            logger.info("token ids of prompts are checked against a vocabulary of %d tokens "
                        "(told by %s)", vocab, inst.url)
        self._vocab = vocab
        self.models = {k: replace(m, vocab_size=vocab) for k, m in self.models.items()}

    async def _endpoint(self, inst: Instance) -> Endpoint:
        """A producer's side channel, learnt when it was checked (asked again if
        forgotten)."""
        async with inst.lock:
            if inst.endpoint is None:
                try:
                    why = await self._verify(inst)
                except LegError as exc:  # not the client's request that failed: retry it
                    raise LegError("prefill", 502, f"prefill instance {inst.url} could not be "
                                   f"asked for its side channel: {exc.message}",
                                   retryable=True) from None
                if why or inst.endpoint is None:
                    self.pool.refuse(inst, why)
                    raise LegError("prefill", 502, f"prefill instance {inst.url} is out of "
                                   f"rotation: {why}", retryable=True)
            return inst.endpoint

    async def _policy(self, inst: Instance) -> str:
        """A decode instance's kv_load_failure_policy ("fail" if it cannot be learnt)."""
        if inst.policy is None:
            with contextlib.suppress(LegError):
                await self._verify(inst)
        return inst.policy or "fail"

    async def _model_name(self, inst: Instance) -> str:
        if not self.models:
            await self._learn_models(inst)
        return next(iter(self.models))

    async def _learn_models(self, inst: Instance) -> None:
        status, body = await self._get_json(inst, "/v1/models")
        try:
            models = {str(m["id"]): ModelInfo(str(m["id"]), int(m.get("max_model_len") or 0),
                                              self._vocab)
                      for m in body["data"]}
        except (KeyError, TypeError, ValueError):
            models = {}
        if not models:
            raise LegError(inst.role, 502, f"{inst.url}/v1/models answered {status}: "
                           f"{body!r:.300}", retryable=True)
        self.models = models

    # ------------------------------------------------------- handlers

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def list_models(self, request: web.Request) -> web.Response:
        inst = self.pool.pick("decode") or self.decode[0]
        try:
            status, body = await self._get_json(inst, "/v1/models")
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
        for role in ("decode", "prefill"):
            if not any(i.up for i in self.pool.of(role)):
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
        if not self.models:
            for inst in [i for i in self.decode if i.up] or self.decode:
                with contextlib.suppress(LegError):
                    await self._learn_models(inst)
                    break
        return check_request(path, body, self.models, self.settings.max_tokens_limit)

    async def _serve(self, request: web.Request, path: str) -> web.StreamResponse:
        started = time.monotonic()
        try:
            checked = await self._read(request, path)
        except ClientError as exc:
            self.metrics.requests.labels("client_error").inc()
            return web.json_response(exc.body(), status=exc.status)
        req = _Request(request, path, checked, started)
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
        """Attempts on chosen instances; retries a failure that left no output."""
        avoid: dict[str, list[Instance]] = {"prefill": [], "decode": []}
        retries = 0
        last: LegError | None = None
        while True:
            decode = self.pool.pick("decode", avoid["decode"])
            if decode is None:
                raise last or LegError("decode", 503, _error_body(
                    "no decode instance is in rotation", 503))
            prefill = self.pool.pick("prefill", avoid["prefill"])
            if prefill is None:
                return await self._decode_alone(req, decode, "no prefill instance is in "
                                                "rotation", last)
            try:
                return await self._attempt(req, prefill, decode)
            except LegError as exc:
                if not exc.retryable or req.out is not None:
                    raise
                last = exc
                failed = prefill if exc.leg == "prefill" else decode
                avoid[exc.leg].append(failed)
                if retries >= self.settings.retries:
                    if exc.leg == "prefill":
                        return await self._decode_alone(req, decode, str(exc), exc)
                    raise
                retries += 1
                self.metrics.retries.inc()
                if self.pool.pick(exc.leg, avoid[exc.leg]) not in (None, failed):
                    self.metrics.failovers.labels(exc.leg).inc()
                logger.info("retrying a request as a new transfer after: %s", exc)

    async def _decode_alone(self, req: _Request, decode: Instance, why: str,
                            exc: LegError | None = None) -> web.StreamResponse:
        """No producer could serve: the decode instance's failure policy decides."""
        if await self._policy(decode) != "recompute":
            if exc is not None:
                raise exc
            raise LegError("prefill", 503, _error_body(why, 503))
        self.metrics.recomputed.inc()
        logger.info("serving a request on decode instance %s alone: %s", decode.url, why)
        with self._busy(decode, req.checked.prompt_tokens + req.checked.max_tokens):
            return await self._relay(req, decode, dict(req.checked.body),
                                     self._headers(req, None),
                                     _Watch(self.pool, self._failed, decode))

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

    async def _attempt(self, req: _Request, prefill: Instance,
                       decode: Instance) -> web.StreamResponse:
        chk = req.checked
        endpoint = await self._endpoint(prefill)
        transfer_id = uuid.uuid4().hex
        incarnation = new_incarnation(_RNG)
        headers = self._headers(req, transfer_id)
        p_body = _prefill_body(chk.body, req.path, self._sign(
            PrefillLeg(transfer_id=transfer_id, incarnation=incarnation).to_params()))
        d_body = dict(chk.body, kv_transfer_params=self._sign(DecodeLeg(
            transfer_id=transfer_id, producer=endpoint, incarnation=incarnation).to_params()))
        req.transfer_id = transfer_id
        timeline.mark(transfer_id, "received", req.started)
        with self._busy(prefill, chk.prompt_tokens), \
                self._busy(decode, chk.prompt_tokens + chk.max_tokens):
            timeline.mark(transfer_id, "legs_sent")
            p_task = asyncio.create_task(self._prefill_leg(prefill, req.path, p_body, headers))
            try:
                return await self._relay(
                    req, decode, d_body, headers,
                    _Watch(self.pool, self._failed, decode, p_task, prefill))
            finally:
                if not p_task.done():
                    p_task.cancel()
                    self.metrics.legs.labels("prefill", "cancelled").inc()
                with contextlib.suppress(BaseException):
                    await p_task

    async def _prefill_leg(self, inst: Instance, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> None:
        status, answer = await self._post_json(inst, path, body, headers)
        if status != 200:
            raise self._leg_error(inst, status, answer)
        self.metrics.legs.labels("prefill", "ok").inc()
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if isinstance(params, dict) and ENDPOINT_KEY in params:
            with contextlib.suppress(ParamsError):
                inst.endpoint = Endpoint.from_json(params[ENDPOINT_KEY])

    async def _relay(self, req: _Request, decode: Instance, body: dict[str, Any],
                     headers: dict[str, str], watch: _Watch) -> web.StreamResponse:
        """Send the decode leg and relay its answer, unless the attempt fails first."""
        d_resp = await watch.race(self._open_decode(decode, req.path, body, headers))
        try:
            if req.checked.stream:
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

    async def _open_decode(self, inst: Instance, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> aiohttp.ClientResponse:
        try:
            resp = await self.session.post(
                inst.url + path, json=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout_s))
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.legs.labels("decode", "failed").inc()
            raise self._failed(inst, exc) from None
        if resp.status != 200:
            answer = await read_json(resp)
            resp.close()
            raise self._leg_error(inst, resp.status, answer)
        return resp

    async def _relay_stream(self, req: _Request, d_resp: aiohttp.ClientResponse,
                            watch: _Watch) -> web.StreamResponse:
        events = sse_head_then_chunks(d_resp)
        head = await watch.race(anext(events, b""))
        error = sse_error(head)
        if error is not None:  # the decode leg failed before its first token
            code = error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            raise self._leg_error(watch.decode, status, {"error": error})
        out = web.StreamResponse(status=200, headers={
            "Content-Type": d_resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache"})
        await out.prepare(req.request)
        req.out, req.first_byte = out, time.monotonic()
        timeline.mark(req.transfer_id, "first_token", req.first_byte)
        await out.write(head)
        # Tokens are flowing: the KV has landed, so the prefill leg no longer
        # matters; the decode instance going out of rotation still ends the stream.
        last = req.first_byte

        async def pump() -> None:
            # One race for the whole stream, not one per event: racing each token
            # cost a task and a wait per event on the proxy's critical path.
            nonlocal last
            async for piece in events:
                if carries_tokens(piece):
                    last = time.monotonic()
                try:
                    await out.write(piece)
                except ConnectionError as exc:  # the client left: not the decode's fault
                    raise _ClientGone from exc

        try:
            await watch.race(pump(), prefill=False)
        except _ClientGone as gone:
            raise gone.__cause__ from None  # type: ignore[misc]
        except LegError as exc:
            self.metrics.legs.labels("decode", "failed").inc()
            await write_sse_error(out, f"decode stream broke: {exc.message:.500}", 502)
            return out
        self.metrics.legs.labels("decode", "ok").inc()
        timeline.mark(req.transfer_id, "last_token", last)
        await out.write_eof()
        timeline.mark(req.transfer_id, "answer_sent")
        return out


class _ClientGone(Exception):
    """Writing to the client failed (raised from the ConnectionError)."""


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _raise_if_failed(task: asyncio.Future[Any]) -> None:
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        raise exc


def _prefill_body(body: dict[str, Any], path: str, params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: the same prompt, one token, no stream."""
    out = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=params)
    if path == CHAT:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    return out


def unreachable(exc: BaseException) -> bool:
    """Whether a connection error happened before an instance could accept the request:
    no connection was made (refused, no route, unknown name) or making it timed out."""
    return isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError)


def describe(exc: BaseException) -> str:
    """An exception as one short line: its class and message, never a nested repr."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return f"{name}: {text:.200}" if text else name
