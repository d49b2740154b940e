"""What ``pushkv proxy`` asks its instances besides legs, and what a failed call means.

* Health probes (:meth:`Upstream.probe`, run by :meth:`.pool.Pool.watch`); an
  instance coming back into rotation is checked again.
* Discovery (:meth:`Upstream.verify`): a one-token request carrying pushkv's
  discovery parameters; the answer tells whether the instance runs
  PushKVConnector in its role, its side channel (producers), its failure policy
  (consumers) and the model's vocabulary size. ``/v1/models`` gives the model's
  name and length.
* The errors of calls (:meth:`Upstream.failed`, :meth:`Upstream.leg_error`):
  an instance that cannot be reached leaves rotation; one that accepted a
  request and failed it stays in (its probes judge it, or :mod:`.failover`
  finds it gone), and the error says which instance failed and what it said.

Only aiohttp and the standard library (and pushkv's parameters and signing).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from typing import Any

import aiohttp

from ..params import ENDPOINT_KEY, POLICY_KEY, VOCAB_KEY, Discover, Endpoint, ParamsError
from ..signing import sign
from .input import COMPLETIONS, ModelInfo
from .legs import OUT_OF_ROTATION, TIMEOUT, UNREACHABLE, LegError, describe, unreachable
from .metrics import ProxyMetrics
from .pool import Instance, Pool
from .settings import ProxySettings
from .sse import read_json

logger = logging.getLogger("pushkv.proxy")

#: How long an idle connection to an instance is kept: below vLLM's own keep-alive
#: (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s by default).
_KEEPALIVE_S = 3.0
#: The longest a discovery request may take (an instance's check, at start and when
#: it comes back): one token of a one-token prompt.
_DISCOVERY_S = 30.0


class Upstream:
    """The proxy's HTTP client of its instances: one session, discovery, errors."""

    def __init__(self, pool: Pool, settings: ProxySettings, metrics: ProxyMetrics) -> None:
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.models: dict[str, ModelInfo] = {}
        self.vocab = 0  #: the served model's vocabulary size, once an instance told it
        self._session: aiohttp.ClientSession | None = None

    def open(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None,
                                        sock_connect=self.settings.connect_timeout_s)
        # Idle connections are dropped before vLLM closes them (its keep-alive: 5 s), so
        # a leg is never sent on a connection the instance is closing: that would look
        # like a request the engine dropped, which is not retried.
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(
                limit=0, force_close=False, keepalive_timeout=_KEEPALIVE_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the proxy is not started")
        return self._session

    def sign(self, params: dict[str, Any]) -> dict[str, Any]:
        return sign(params, self.settings.key) if self.settings.key else params


    async def probe(self, inst: Instance) -> bool | str:
        """A health probe; an instance coming back into rotation is also checked for
        pushkv's connector in its role (:meth:`check`)."""
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
        return await self.check(inst)

    async def check(self, inst: Instance) -> bool | str:
        """Whether ``inst`` runs pushkv's connector in its role, asked with a discovery
        request: True (and what it told is kept), why it must not serve, or False when
        it could not be asked (unreachable, an error answer)."""
        try:
            why = await self.verify(inst)
        except LegError as exc:
            logger.debug("%s instance %s: discovery failed: %s", inst.role, inst.url,
                         exc.message)
            return False
        return why or True

    async def verify(self, inst: Instance) -> str:
        """Ask ``inst`` who it is; '' when it runs pushkv's connector in its role (its
        side channel, failure policy and vocabulary are kept), else why it must not
        serve, with the fix. LegError when it cannot be asked."""
        params = await self.discover(inst)
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

    async def get_json(self, inst: Instance, path: str) -> tuple[int, Any]:
        try:
            async with self.session.get(
                    inst.url + path,
                    timeout=aiohttp.ClientTimeout(total=self.settings.connect_timeout_s * 2)
            ) as resp:
                return resp.status, await read_json(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.failed(inst, exc) from None

    async def post_json(self, inst: Instance, path: str, body: dict[str, Any],
                         headers: dict[str, str], timeout_s: float | None = None
                         ) -> tuple[int, Any]:
        total = timeout_s or self.settings.request_timeout_s
        try:
            async with self.session.post(inst.url + path, json=body, headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=total)) as resp:
                return resp.status, await read_json(resp)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self.failed(inst, exc) from None

    def failed(self, inst: Instance, exc: BaseException) -> LegError:
        """The error of a request whose connection to ``inst`` failed.

        An instance that cannot be reached (refused, no route, the connection or
        the answer timed out) leaves rotation, as a failed probe would take it out;
        one that accepted the request and then dropped it stays in: one request's
        fate says nothing of the instance's health, which the probes judge."""
        what = describe(exc)
        if unreachable(exc):
            self.pool.mark_down(inst, what)
            return LegError(inst.role, 502, f"{inst.role} instance {inst.url} could not be "
                            f"reached: {what}", cause=UNREACHABLE)
        if isinstance(exc, TimeoutError):
            self.pool.mark_down(inst, what)
            return LegError(inst.role, 502, f"{inst.role} instance {inst.url} did not answer "
                            f"in time: {what}", cause=TIMEOUT)
        return self.poisoned(inst, 502, f"dropped the request after accepting it ({what})")

    def leg_error(self, inst: Instance, status: int, answer: Any) -> LegError:
        """The error of a leg answered with ``status`` (not 200)."""
        if 400 <= status < 500:
            self.metrics.legs.labels(inst.role, "refused").inc()
            return LegError(inst.role, status, answer)
        # One request's error says nothing of the instance's health (the probes do):
        # it stays in rotation.
        self.metrics.legs.labels(inst.role, "failed").inc()
        said = LegError(inst.role, status, answer).message
        return self.poisoned(inst, 502 if inst.role == "prefill" else status,
                              f"answered HTTP {status}: {said:.300}")

    def poisoned(self, inst: Instance, status: int, what: str) -> LegError:
        """An engine failed on a request it had accepted (a 5xx, or dropped it): the
        client is told which instance and what it said, and the request is not sent
        to another instance, which it might make fail too (a poison request: a token
        id that crashes the model, an input that trips a bug)."""
        return LegError(inst.role, status, f"{inst.role} instance {inst.url} failed this "
                        f"request: {what}; it was not sent to another instance, as a request "
                        "that makes an engine fail may make the next one fail too",
                        instance=inst.url, dropped=True, what=what)

    async def discover(self, inst: Instance) -> dict[str, Any]:
        """The instance's answer to a discovery request (its connector's parameters)."""
        body = {"model": await self.model_name(inst), "prompt": [1], "max_tokens": 1,
                "kv_transfer_params": self.sign(Discover().to_params())}
        status, answer = await self.post_json(
            inst, COMPLETIONS, body, {},
            timeout_s=min(_DISCOVERY_S, self.settings.request_timeout_s))
        if status != 200:
            raise self.leg_error(inst, status, answer)
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        params = params if isinstance(params, dict) else {}
        vocab = params.get(VOCAB_KEY)
        if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
            self.learn_vocab(vocab, inst)
        return params

    def learn_vocab(self, vocab: int, inst: Instance) -> None:
        """The served model's vocabulary size, as an instance's connector told it."""
        if vocab == self.vocab:
            return
        if self.vocab:  # instances of two models: ids either one lacks are refused
            logger.warning("%s instance %s serves a vocabulary of %d tokens, others %d: "
                           "the smaller bounds token ids", inst.role, inst.url, vocab,
                           self.vocab)
            vocab = min(vocab, self.vocab)
        else:
            logger.info("token ids of prompts are checked against a vocabulary of %d tokens "
                        "(told by %s)", vocab, inst.url)
        self.vocab = vocab
        self.models = {k: replace(m, vocab_size=vocab) for k, m in self.models.items()}

    async def endpoint(self, inst: Instance) -> Endpoint:
        """A producer's side channel, learnt when it was checked (asked again if
        forgotten)."""
        async with inst.lock:
            if inst.endpoint is None:
                try:
                    why = await self.verify(inst)
                except LegError as exc:  # not the client's request that failed: retry it
                    raise LegError("prefill", 502, f"prefill instance {inst.url} could not be "
                                   f"asked for its side channel: {exc.message}",
                                   cause=exc.cause or UNREACHABLE) from None
                if why or inst.endpoint is None:
                    self.pool.refuse(inst, why)
                    raise LegError("prefill", 502, f"prefill instance {inst.url} is out of "
                                   f"rotation: {why}", cause=OUT_OF_ROTATION)
            return inst.endpoint

    async def policy(self, inst: Instance) -> str:
        """A decode instance's kv_load_failure_policy ("fail" if it cannot be learnt)."""
        if inst.policy is None:
            with contextlib.suppress(LegError):
                await self.verify(inst)
        return inst.policy or "fail"

    async def model_name(self, inst: Instance) -> str:
        if not self.models:
            await self.learn_models(inst)
        return next(iter(self.models))

    async def learn_models(self, inst: Instance) -> None:
        status, body = await self.get_json(inst, "/v1/models")
        try:
            models = {str(m["id"]): ModelInfo(str(m["id"]), int(m.get("max_model_len") or 0),
                                              self.vocab)
                      for m in body["data"]}
        except (KeyError, TypeError, ValueError):
            models = {}
        if not models:
            raise LegError(inst.role, 502, f"{inst.url}/v1/models answered {status}: "
                           f"{body!r:.300}", cause=UNREACHABLE)
        self.models = models
