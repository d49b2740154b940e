"""Reading upstream answers in ``pushkv proxy``: JSON bodies and server-sent events."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from aiohttp import web

from .proxy_input import error_body


async def read_json(resp: aiohttp.ClientResponse) -> Any:
    raw = await resp.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The upstream stream cut into whole SSE events (each ending in a blank line)."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while (cut := buf.find(b"\n\n")) >= 0:
            yield buf[: cut + 2]
            buf = buf[cut + 2:]
    if buf:
        yield buf


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
