"""Reading upstream answers in ``pushkv proxy``: JSON bodies and server-sent events."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from .input import error_body


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


async def sse_head_then_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream stream's first whole SSE event, then the rest as it arrives.

    Only the first event is looked at (an error before the first token); the
    rest is relayed in the pieces it came in, so a relay writes once per piece,
    not once per event, when the upstream sends several events at a time."""
    buf = b""
    content = resp.content
    async for chunk in content.iter_any():
        buf += chunk
        if (cut := buf.find(b"\n\n")) >= 0:
            yield buf[: cut + 2]
            buf = buf[cut + 2:]
            break
    else:
        if buf:
            yield buf
        return
    if buf:
        yield buf
    async for chunk in content.iter_any():
        yield chunk


def carries_tokens(piece: bytes) -> bool:
    """Whether a relayed piece of a stream holds more than its ``[DONE]`` marker."""
    return bool(piece.replace(b"data: [DONE]", b"").strip())


def sse_error(event: bytes) -> dict[str, Any] | None:
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


async def write_sse_error(out: web.StreamResponse, message: str, code: int) -> None:
    with contextlib.suppress(ConnectionError, RuntimeError):
        await out.write(b"data: " + json.dumps(error_body(message, code)).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
