"""Resumable streams: a streamed completion whose decode instance dies goes on elsewhere.

A :class:`Tap` sits between a streamed answer's decode leg and the client. It
writes whole server-sent events only (a piece cut inside an event waits for its
end), so the client holds exactly the events written, and it remembers what they
carried: the prompt's token ids (vLLM sends them with the first event when
``return_token_ids`` is set) and every generated token id.

When the decode leg breaks after the client received k tokens, the request goes
on as a **continuation** (:func:`continuation`): the same body with the prompt
plus the k tokens as a token-id prompt, ``max_tokens`` (and ``min_tokens``)
reduced by k, the same sampling settings. It is routed like a new request (a
prefill leg, whose prefix cache holds the prompt's full blocks, and a decode leg
on another instance); the tap rewrites its events so the client sees one answer:
the first leg's ``id`` and ``created``, no second ``prompt_token_ids``, and
``usage`` counted against the client's prompt (prompt tokens minus k, completion
tokens plus k).

A non-streamed completion is resumed by the same rule: the proxy asks its decode
leg for a stream and assembles the client's one body from the tap's events
(:mod:`.assemble`).

Token ids, never text, carry the state: the decode leg always asks for
``return_token_ids``; when the client did not, the tap drops ``token_ids`` and
``prompt_token_ids`` from what it writes (which costs a parse per event; a
client that asks for them gets the first leg's events unparsed). Greedy decoding
continues exactly. What a continuation does not carry over: a seeded sampler's
state (vLLM seeds a request's generator at its start and draws once per token,
so the continuation's draws start again from the seed), a stop string that
straddles the break (vLLM matches stop strings in the output text of one
request), ``logprobs``' text offsets (they restart at the continuation's
text), and ``echo`` (the prompt was echoed by the first leg). Chat completions
are not resumed (their prompt is rendered from messages by the engine); their
streams end with an error event as before.

Only the standard library is used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .input import COMPLETIONS

_DONE = b"data: [DONE]"


class NotResumable(Exception):
    """The stream cannot go on elsewhere (says why)."""


@dataclass
class Tap:
    """What the client received of one streamed answer, across its legs."""

    client_ids: bool  #: the client asked for token ids (``return_token_ids``)
    keep: bool = True  #: remember what was written (False: the stream is not resumable)
    prompt_ids: list[int] | None = None
    tokens: list[int] = field(default_factory=list)  #: generated ids the client holds
    finished: bool = False  #: an event carried a finish_reason
    done: bool = False  #: the ``[DONE]`` marker was written
    legs: int = 0  #: decode legs relayed so far (the first is 1)
    resumed_at: int = 0  #: tokens the client held when the current leg began
    last_token_at: float = 0.0  #: time.monotonic() of the last event carrying tokens
    broken_at: float = 0.0  #: time.monotonic() when the proxy last saw the stream break
    _raw: list[bytes] = field(default_factory=list)  #: first-leg events not parsed yet
    _tail: bytes = b""
    _head: dict[str, Any] = field(default_factory=dict)  #: the first event's id, created

    def begin(self) -> None:
        """A decode leg's answer begins (the first, or a continuation's)."""
        self.settle()
        self.legs += 1
        self.resumed_at = len(self.tokens)
        self._tail = b""

    @property
    def rewrites(self) -> bool:
        """Whether events are parsed and rewritten (else passed on as they came)."""
        return self.legs > 1 or not self.client_ids

    def feed(self, piece: bytes, now: float) -> bytes:
        """The bytes to write for ``piece`` of the upstream stream: every event it
        completes, rewritten when needed; a trailing part event waits."""
        buf = self._tail + piece
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self._tail = buf
            return b""
        whole, self._tail = buf[: cut + 2], buf[cut + 2:]
        if not self.rewrites:
            if self.keep:
                self._raw.append(whole)
            if whole.replace(_DONE, b"").strip():
                self.last_token_at = now
            if whole.rstrip().endswith(_DONE):
                self.done = True
            return whole
        out = [self._event(e, now) for e in whole.split(b"\n\n") if e.strip()]
        return b"".join(out)

    def settle(self) -> None:
        """Parse the events passed on unparsed, so :attr:`tokens` is complete."""
        raw, self._raw = self._raw, []
        for chunk in raw:
            for event in chunk.split(b"\n\n"):
                if event.strip():
                    self._learn(_data(event))

    def _event(self, event: bytes, now: float) -> bytes:
        data = _data(event)
        if data is None:
            if event.strip() == _DONE:
                self.done = True
            return event + b"\n\n"
        self._learn(data)
        if isinstance(data, dict) and isinstance(data.get("choices"), list):
            self.last_token_at = now
            self._rewrite(data)
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def _learn(self, data: Any) -> None:
        if not isinstance(data, dict):
            return
        if not self._head:
            self._head = {k: data[k] for k in ("id", "created") if k in data}
        for choice in data.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            ids = choice.get("prompt_token_ids")
            if self.prompt_ids is None and isinstance(ids, list):
                self.prompt_ids = [int(t) for t in ids]
            self.tokens += [int(t) for t in choice.get("token_ids") or ()]
            if choice.get("finish_reason") is not None:
                self.finished = True

    def _rewrite(self, data: dict[str, Any]) -> None:
        k = self.resumed_at
        if self.legs > 1:
            data.update(self._head)
        for choice in data["choices"]:
            if not isinstance(choice, dict):
                continue
            if self.legs > 1 or not self.client_ids:
                choice.pop("prompt_token_ids", None)
            if not self.client_ids:
                choice.pop("token_ids", None)
        usage = data.get("usage")
        if k and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            usage["prompt_tokens"] -= k
            usage["completion_tokens"] = int(usage.get("completion_tokens") or 0) + k


def _data(event: bytes) -> Any:
    """The JSON of an SSE event's ``data:`` line, or None (``[DONE]``, not JSON)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            try:
                return json.loads(line[5:].strip())
            except ValueError:
                return None
    return None


def decode_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The decode leg's body for a client's streamed completion: token ids asked for,
    so a break can be resumed (:class:`Tap` drops them if the client did not ask)."""
    if path == COMPLETIONS and body.get("stream"):
        return dict(body, return_token_ids=True)
    return body


def continuation(body: dict[str, Any], path: str, tap: Tap) -> dict[str, Any]:
    """The request that continues ``body``'s answer after the tokens ``tap`` saw.
    :class:`NotResumable` when it cannot."""
    if path != COMPLETIONS:
        raise NotResumable("chat completions are not resumed")
    tap.settle()
    if tap.prompt_ids is None:
        raise NotResumable("the stream carried no prompt token ids")
    k = len(tap.tokens)
    out = dict(body, prompt=tap.prompt_ids + tap.tokens, return_token_ids=True)
    if isinstance(body.get("max_tokens"), int):
        out["max_tokens"] = body["max_tokens"] - k
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - k)
    for key in ("echo", "prompt_logprobs"):
        out.pop(key, None)
    return out


def complete(tap: Tap, body: dict[str, Any]) -> bool:
    """Whether the client already holds the whole answer (nothing to resume): a
    finish reason came, or every asked-for token did."""
    tap.settle()
    asked = body.get("max_tokens")
    return tap.finished or (isinstance(asked, int) and len(tap.tokens) >= asked)
