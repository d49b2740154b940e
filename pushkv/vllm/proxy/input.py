"""What ``pushkv proxy`` accepts from a client, checked before anything reaches an engine.

A request the proxy cannot route safely is answered here with an
OpenAI-style error (``{"error": {"message", "type", "param", "code"}}``, the
shape vLLM's own server uses) and no engine sees it:

* a body that is not a JSON object, or larger than the configured limit (413);
* ``prompt`` (completions) or ``messages`` (chat) missing or malformed; a
  batch of prompts, ``n`` or ``best_of`` above 1 (one request is one transfer);
* a ``model`` no decode instance serves (404);
* ``max_tokens`` that is not a positive integer or exceeds the model's length,
  a token-id prompt that leaves no room for an output token or whose length
  plus ``max_tokens`` exceeds the model's length (400; vLLM would shorten the
  answer silently);
* a token id at or above the model's vocabulary size (400): vLLM checks token
  ids only when it has a tokenizer, and without one an id past the model's
  embedding crashes the engine;
* any ``kv_transfer_params`` at all: transfer parameters are the proxy's to
  set. A client cannot choose a transfer id, a producer address, or anything
  else the connectors act on.

Only the standard library is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

#: Status -> vLLM's error type name for it.
_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "RequestEntityTooLarge",
          429: "TooManyRequests", 502: "BadGateway", 503: "ServiceUnavailable",
          504: "GatewayTimeout"}

#: Largest token id accepted in a token-id prompt (vLLM's ids are int32).
_MAX_TOKEN_ID = 2**31 - 1


def error_body(message: str, status: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object, as vLLM's server writes it."""
    return {"error": {"message": message, "type": _TYPES.get(status, "Error"),
                      "param": param, "code": status}}


class ClientError(Exception):
    """The request is refused before any engine sees it."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.param)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """A model the decode instances serve, its context length and its vocabulary size
    (0: unknown)."""

    name: str
    max_model_len: int = 0
    vocab_size: int = 0


@dataclass(frozen=True, slots=True)
class Checked:
    """A request that passed the checks, with what routing needs to know."""

    body: dict[str, Any]
    model: str
    stream: bool
    prompt_tokens: int  #: exact for token-id prompts, estimated otherwise
    max_tokens: int  #: as asked, or the model's remaining length when not given


def _int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ClientError(400, f"'{key}' must be an integer, got {value!r:.80}", key)
    return value


def _prompt_tokens(path: str, body: Mapping[str, Any], vocab_size: int = 0) -> tuple[int, bool]:
    """(prompt length, exact?) after checking the prompt's shape (and its token ids
    against ``vocab_size``, when known)."""
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if prompt is None:
            raise ClientError(400, "'prompt' is required", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ClientError(400, "'prompt' must not be empty", "prompt")
            return len(prompt) // 4 + 1, False
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t <= _MAX_TOKEN_ID for t in prompt):
                raise ClientError(400, "token ids in 'prompt' must be in [0, 2^31)", "prompt")
            if vocab_size and (top := max(prompt)) >= vocab_size:
                raise ClientError(400, f"token id {top} in 'prompt' is not in the model's "
                                  f"vocabulary (ids 0 to {vocab_size - 1})", "prompt")
            return len(prompt), True
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            return _prompt_tokens(path, {"prompt": prompt[0]}, vocab_size)
        raise ClientError(400, "'prompt' must be one string or one non-empty list of token "
                          "ids (a batch of prompts is not routed: send one request each)",
                          "prompt")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ClientError(400, "'messages' is required and must be a non-empty list",
                          "messages")
    chars = 0
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ClientError(400, "each message must be an object with a 'role'", "messages")
        content = m.get("content")
        chars += len(content) if isinstance(content, str) else len(str(content))
    return chars // 4 + 1, False


def check_request(path: str, body: object, models: Mapping[str, ModelInfo],
                  max_tokens_limit: int = 0) -> Checked:
    """Check a client's request; :class:`ClientError` if it must not be routed.

    ``models``: what the decode instances serve (empty: not known yet, the
    model is not checked). ``max_tokens_limit``: a bound on ``max_tokens``
    besides the model's length (0: none).
    """
    if not isinstance(body, dict):
        raise ClientError(400, "the request body must be a JSON object")
    if "kv_transfer_params" in body:
        raise ClientError(400, "'kv_transfer_params' is set by the proxy; a request must not "
                          "carry it", "kv_transfer_params")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ClientError(400, "'model' must be a string", "model")
    if models:
        if model is None:
            model = next(iter(models))
        elif model not in models:
            raise ClientError(404, f"The model `{model:.200}` does not exist.", "model")
    info = models.get(model or "", ModelInfo(model or ""))
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise ClientError(400, "'stream' must be a boolean", "stream")
    for key in ("n", "best_of"):
        value = _int(body, key)
        if value is not None and value != 1:
            raise ClientError(400, f"'{key}' must be 1: each choice would need its own "
                              "transfer", key)
    tokens, exact = _prompt_tokens(path, body, info.vocab_size)
    keys = ("max_tokens", "max_completion_tokens") if path == CHAT else ("max_tokens",)
    asked = {k: v for k in keys if (v := _int(body, k)) is not None}
    for key, value in asked.items():
        if value < 1:
            raise ClientError(400, f"'{key}' must be at least 1, got {value}", key)
    max_tokens = min(asked.values()) if asked else 0
    length = info.max_model_len
    bound = min(b for b in (length, max_tokens_limit) if b) if (length or max_tokens_limit) \
        else 0
    if bound and max_tokens > bound:
        raise ClientError(400, f"'max_tokens' ({max_tokens}) is above this deployment's "
                          f"limit of {bound}", keys[0])
    if length and exact and tokens >= length:
        raise ClientError(400, f"the prompt ({tokens} tokens) leaves no room for an output "
                          f"token in the model's length of {length}", "prompt")
    if length and exact and max_tokens and tokens + max_tokens > length:
        # vLLM would cap max_tokens to what is left: an answer shorter than asked.
        raise ClientError(400, f"the prompt ({tokens} tokens) plus '{keys[0]}' ({max_tokens})"
                          f" is {tokens + max_tokens} tokens, above the model's length of "
                          f"{length}", keys[0])
    if not max_tokens:
        max_tokens = max(length - tokens, 1) if length else 16
    return Checked(body=body, model=str(model or ""), stream=bool(stream),
                   prompt_tokens=tokens, max_tokens=max_tokens)
