"""Non-streamed completions answered from a streamed decode leg, so they can be resumed.

A non-streamed answer whose decode instance dies while it generates could only be
sent again from the start (its source at the producer is released by then). So
the proxy asks the decode instance for a **streamed** answer
(:func:`streamed`: ``stream``, ``stream_options.include_usage``; the resume tap
adds ``return_token_ids``), keeps its events as they come, and answers the client
once, at the end, with the one JSON body vLLM would have given (:func:`assemble`).
When the decode leg breaks after k >= 1 tokens, the answer is resumed on another
decode instance by the same rule as a streamed one (:mod:`.resume`); the client
sees nothing of it but a later answer.

What is assembled: ``id``, ``object``, ``created``, ``model``,
``system_fingerprint`` of the stream; one choice (index 0) with the text of
every event joined, ``finish_reason`` and ``stop_reason`` of the event that
finished it, ``token_ids`` and ``prompt_token_ids`` when the client asked for
them (``return_token_ids``), ``logprobs`` and ``prompt_logprobs`` null; the
usage event's ``usage`` (``prompt_tokens``, ``completion_tokens``,
``total_tokens``, and ``prompt_tokens_details`` where the server gives it).

What is passed through unchanged, non-streamed (:func:`why_not`): chat
completions (not resumed), ``echo``, ``logprobs``, ``prompt_logprobs`` (their
streamed form is split per event, with text offsets that a continuation
restarts), a client's own ``stream_options``, and every request when resumes
are off (``resumes`` 0). ``n`` and ``best_of`` above 1 are refused by the
proxy's input checks before this.

Only the standard library is used.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .input import COMPLETIONS

_DONE = b"[DONE]"


class AssemblyError(ValueError):
    """The decode leg's stream cannot be made into one answer (says why).
    ``error``: the engine's error object when the stream carried one."""

    def __init__(self, message: str, error: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.error = error


def why_not(body: Mapping[str, Any], path: str) -> str:
    """Why a non-streamed request is passed through non-streamed, or '' when its
    answer is assembled from a streamed decode leg."""
    if path != COMPLETIONS:
        return "chat completions are not resumed"
    for key in ("echo", "logprobs", "prompt_logprobs", "stream_options"):
        if body.get(key) is not None and body.get(key) is not False:
            return f"'{key}' is set"
    return ""


def streamed(body: Mapping[str, Any]) -> dict[str, Any]:
    """The decode leg's body for an assembled answer: the same request, streamed, with
    the usage in a last event."""
    return dict(body, stream=True, stream_options={"include_usage": True})


def events(data: bytes) -> list[bytes]:
    """The whole server-sent events in ``data`` (as the resume tap writes them)."""
    return [e for e in data.split(b"\n\n") if e.strip()]


def _payload(event: bytes) -> Any:
    lines = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
    if len(lines) != 1:
        raise AssemblyError(f"an event has {len(lines)} data lines, not 1: {event!r:.200}")
    if lines[0] == _DONE:
        return _DONE
    try:
        return json.loads(lines[0])
    except (ValueError, UnicodeDecodeError):
        raise AssemblyError(f"an event's data is not JSON: {event!r:.200}") from None


def assemble(stream: Iterable[bytes], usage: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The non-streamed completion body of a streamed one's events (each one whole
    ``data:`` event, the last ``[DONE]``). ``usage``: used when the stream carried
    none (it broke after its last token, before its usage event).
    :class:`AssemblyError` for a stream that is not one complete answer."""
    head: dict[str, Any] = {}
    text: list[str] = []
    token_ids: list[int] | None = None
    prompt_ids: list[int] | None = None
    finish: tuple[Any, Any] | None = None
    done = False
    for event in stream:
        if done:
            raise AssemblyError("an event came after [DONE]")
        data = _payload(event)
        if data is _DONE:
            done = True
            continue
        if not isinstance(data, dict):
            raise AssemblyError(f"an event is not a JSON object: {data!r:.200}")
        if isinstance(data.get("error"), dict):
            raise AssemblyError(f"the stream carried an error: {data['error']!r:.300}",
                                dict(data["error"]))
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise AssemblyError(f"an event has no choices list: {data!r:.200}")
        for key in ("id", "created", "model"):
            if key in data:
                head.setdefault(key, data[key])
        if data.get("system_fingerprint") is not None:
            head["system_fingerprint"] = data["system_fingerprint"]
        if isinstance(data.get("usage"), dict):
            if finish is None:
                raise AssemblyError("the usage event came before a finish reason")
            usage = data["usage"]
        for choice in choices:
            if not isinstance(choice, dict) or choice.get("index") != 0:
                raise AssemblyError(f"a choice is not the one asked for: {choice!r:.200}")
            if finish is not None:
                raise AssemblyError("a choice came after the finish reason")
            piece = choice.get("text")
            if not isinstance(piece, str):
                raise AssemblyError(f"a choice's text is not a string: {piece!r:.80}")
            text.append(piece)
            if choice.get("prompt_token_ids") is not None:
                if prompt_ids is not None:
                    raise AssemblyError("prompt_token_ids came twice")
                prompt_ids = _ids(choice["prompt_token_ids"])
            if choice.get("token_ids") is not None:
                token_ids = (token_ids or []) + _ids(choice["token_ids"])
            if choice.get("finish_reason") is not None:
                finish = (choice["finish_reason"], choice.get("stop_reason"))
    if not done:
        raise AssemblyError("the stream ended before [DONE]")
    if finish is None:
        raise AssemblyError("the stream ended without a finish reason")
    if not isinstance(usage, Mapping):
        raise AssemblyError("the stream carried no usage")
    if not {"id", "created", "model"} <= head.keys():
        raise AssemblyError("the stream named no id, created or model")
    return {
        "id": head["id"], "object": "text_completion", "created": head["created"],
        "model": head["model"],
        "choices": [{"index": 0, "text": "".join(text), "logprobs": None,
                     "finish_reason": finish[0], "stop_reason": finish[1],
                     "token_ids": token_ids, "prompt_logprobs": None,
                     "prompt_token_ids": prompt_ids, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": head.get("system_fingerprint"),
        "usage": {"prompt_tokens_details": None, "completion_tokens_details": None, **usage},
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
    }


def _ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise AssemblyError(f"token ids are not a list of integers: {value!r:.80}")
    return list(value)
