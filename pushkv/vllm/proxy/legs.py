"""One leg of a request in ``pushkv proxy``: how it fails, and what may end it early.

* :class:`LegError` -- a leg failed: the HTTP answer to give the client, and
  what failover may do about it (:attr:`LegError.cause`: why another instance
  may serve it; :attr:`LegError.dropped`: an engine accepted it and then broke
  off, which fails over only when the instance is found gone, see
  :mod:`.failover`).
* :class:`Watch` -- races an upstream call against its attempt's other ends:
  the prefill leg failing, either instance going out of rotation, the decode
  instance being drained while the answer has not begun.
* :func:`prefill_body` -- the prefill leg's body made from the client's.

Only aiohttp and the standard library are used.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp
from aiohttp import web

from .input import CHAT
from .input import error_body as _error_body
from .pool import Instance, Pool

T = TypeVar("T")

#: Why a leg may be served by another instance (:attr:`LegError.cause`, the ``cause``
#: label of ``pushkv_proxy_failover_causes_total``).
UNREACHABLE = "unreachable"  #: the connection was refused or could not be made in time
TIMEOUT = "timeout"  #: the instance did not answer in time
OUT_OF_ROTATION = "out_of_rotation"  #: its probes failed while the leg waited
DRAINED = "drained"  #: it was drained while the answer had not begun
GONE = "gone"  #: it broke the leg off (reset, 5xx, stream cut) and its /health then failed


class LegError(Exception):
    """One leg failed; carries the HTTP answer to give the client.

    ``body``: an OpenAI-style error object to return as it is, or a message.
    ``cause``: set when the request never reached an engine that accepted it (the
    instance could not be reached, left rotation or was drained while the leg
    waited), so another instance may serve it (:data:`UNREACHABLE` ...).
    ``dropped``: an engine accepted the leg and then failed it (a 5xx, a dropped
    connection, a stream cut short). Such a request is not sent to another instance
    (it may be a poison request that would make the next engine fail too) unless
    the instance is then found gone (:mod:`.failover`).
    """

    def __init__(self, leg: str, status: int, body: Any, *, cause: str = "",
                 dropped: bool = False, instance: str = "", what: str = "") -> None:
        super().__init__(f"{leg} leg failed with HTTP {status}")
        self.leg = leg
        self.status = status
        self.body = body
        self.cause = cause
        self.dropped = dropped
        self.instance = instance  #: the instance's URL, when one is to blame
        self.what = what  #: what the instance did, in a few words (a dropped leg)

    @property
    def retryable(self) -> bool:
        """No engine accepted the leg: another instance may serve it."""
        return bool(self.cause)

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


#: Turns an exception of a connection to an instance into the leg's error.
Failed = Callable[[Instance, BaseException], LegError]


class Watch:
    """What can end an attempt early: its prefill leg failing, either of its
    instances going out of rotation (probes failed: it died or hangs), or its
    decode instance being drained before the answer began."""

    def __init__(self, pool: Pool, failed: Failed, decode: Instance,
                 p_task: asyncio.Task[None] | None = None,
                 prefill: Instance | None = None) -> None:
        self.pool = pool
        self.failed = failed
        self.decode, self.d_down, self.d_drain = decode, decode.down, decode.draining
        self.p_task, self.prefill = p_task, prefill
        self.p_down = prefill.down if prefill is not None else None

    async def race(self, aw: Awaitable[T], *, prefill: bool = True) -> T:
        """``aw``'s result, unless the attempt ends first (a :class:`LegError`).
        ``prefill=False``: the answer began (tokens flow), so neither the prefill leg
        nor a drain ends it; only the decode instance going out of rotation does."""
        task = asyncio.ensure_future(aw)
        watchers = [asyncio.ensure_future(self.d_down.wait())]
        if prefill:
            watchers.append(asyncio.ensure_future(self.d_drain.wait()))
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
                    raise_if_failed(p_task)
                if done != {p_task}:
                    break
                waits.discard(p_task)  # the prefill leg answered: keep waiting
            if not task.done():
                if self.d_down.is_set() or self.prefill is None or \
                        self.p_down is None or not self.p_down.is_set():
                    inst = self.decode
                else:
                    inst = self.prefill
                if inst is self.decode and not self.d_down.is_set():
                    raise LegError("decode", 503, f"decode instance {inst.url} was drained "
                                   "before the answer began", cause=DRAINED)
                raise LegError(inst.role, 502, f"{inst.role} instance {inst.url} went out "
                               "of rotation", cause=OUT_OF_ROTATION)
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
            task.add_done_callback(retrieve)


class ClientGone(Exception):
    """Writing to the client failed (raised from the ConnectionError)."""


def retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def raise_if_failed(task: asyncio.Future[Any]) -> None:
    if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
        raise exc


def prefill_body(body: dict[str, Any], path: str, params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: the same prompt, one token, no stream."""
    out = dict(body, max_tokens=1, stream=False, n=1, kv_transfer_params=params)
    if path == CHAT:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "return_token_ids"):
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
