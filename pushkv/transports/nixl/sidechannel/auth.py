"""Authenticated side-channel frames: HMAC-SHA256 with replay protection.

With a shared key configured, every side-channel frame ``[kind, body]`` gets a
third part, its **tag**::

    version (1 B) | stream (16 B) | counter (8 B, big-endian) | timestamp (8 B, float)
    | HMAC-SHA256 (32 B)

The MAC covers a domain label, the **destination's identity**
(``engine_id/rank``, so a frame sent to one rank cannot be replayed to another),
the kind, the header fields and the body with its length (so a truncated or
extended frame fails). One sender connection (one ``PUSH`` socket) is one
*stream*: a random id, and a counter that grows by one per frame.

A receiver accepts a frame only if, in this order:

1. the tag has the right shape and the MAC verifies (``auth_failed`` if not);
2. its timestamp lies within ``window_s`` of the receiver's clock
   (``auth_stale``): a frame captured earlier cannot be replayed later;
3. its counter is greater than the last one accepted in its stream
   (``auth_replayed``): a frame cannot be replayed within the window either.

A stream idle for more than twice the window is forgotten: any frame of it
that could still be replayed is then outside the window. Only frames that
passed the MAC touch the stream table, so a party without the key cannot
grow it.

Not protected: confidentiality (frames travel in clear), NIXL notifications and
the NIXL data plane (see ``docs/nixl.md``), and -- within ``window_s`` of a
receiver's restart under the same identity -- one replay of each frame sent to
its previous incarnation.

The key itself is never logged and never stored in a printable object.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from pushkv.protocol.errors import ConfigError

VERSION: Final = 1
_HEADER = struct.Struct(">B16sQd")
_MAC_LEN: Final = 32
TAG_LEN: Final = _HEADER.size + _MAC_LEN
_DOMAIN: Final = b"pushkv side channel\x00"
MIN_KEY_BYTES: Final = 16

#: Reasons a frame is dropped, as stats keys.
FAILED, STALE, REPLAYED = "auth_failed", "auth_stale", "auth_replayed"
#: What each reason means, for the log line of its first drop.
REASONS: Final = {
    FAILED: "its tag is missing or malformed, or its MAC does not verify for this rank "
            "(another key, or a frame meant for another rank)",
    STALE: "its timestamp is outside the replay window (clock skew, or a replay)",
    REPLAYED: "its counter is not above the last one accepted in its stream (a replay)",
}


def load_key(key_file: str = "", key_env: str = "") -> bytes | None:
    """The shared key: the contents of ``key_file`` (whitespace stripped) if set,
    else the environment variable named ``key_env`` if set and non-empty, else None.

    ConfigError (naming the setting, never the key) if the file cannot be read
    or the key is shorter than 16 bytes.
    """
    if key_file:
        try:
            with open(key_file, "rb") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the side-channel key file (setting key_file): "
                              f"{exc.strerror or exc}") from None
        source = "key_file"
    elif key_env and os.environ.get(key_env, "").strip():
        key, source = os.environ[key_env].strip().encode(), f"environment variable {key_env}"
    else:
        return None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"the side-channel key from {source} is shorter than "
                          f"{MIN_KEY_BYTES} bytes")
    return key


def _mac(key: bytes, dest: bytes, kind: bytes, header: bytes, body: bytes) -> bytes:
    m = hmac.new(key, _DOMAIN, hashlib.sha256)
    m.update(len(dest).to_bytes(2, "big"))
    m.update(dest)
    m.update(len(kind).to_bytes(1, "big"))
    m.update(kind)
    m.update(header)
    m.update(len(body).to_bytes(8, "big"))
    m.update(body)
    return m.digest()


class Signer:
    """Tags the frames of one sender connection (one stream) to one destination."""

    __slots__ = ("_counter", "_dest", "_key", "dest", "stream")

    def __init__(self, key: bytes, dest: str) -> None:
        self._key = key
        self.dest = dest
        self._dest = dest.encode()
        self.stream = os.urandom(16)
        self._counter = 0

    def sign(self, kind: bytes, body: bytes, *, timestamp: float | None = None) -> bytes:
        """The tag part for ``[kind, body]`` (the next counter of this stream)."""
        self._counter += 1
        header = _HEADER.pack(VERSION, self.stream, self._counter,
                              time.time() if timestamp is None else timestamp)
        return header + _mac(self._key, self._dest, kind, header, body)


@dataclass(slots=True)
class _Stream:
    counter: int
    seen: float  #: receiver's monotonic clock at the last accepted frame


@dataclass(slots=True)
class Verifier:
    """Checks frames addressed to one rank (``me``); counts what it drops."""

    key: bytes = field(repr=False)
    me: str
    window_s: float
    max_streams: int = 65536
    dropped: Counter[str] = field(default_factory=Counter)
    last_drop: str = ""  #: the reason of the latest drop ("" before any)
    _streams: dict[bytes, _Stream] = field(default_factory=dict)
    _next_prune: float = 0.0

    def check(self, kind: bytes, body: bytes, tag: bytes) -> bool:
        """True if the frame is authentic and fresh; else count why and return False."""
        if len(tag) != TAG_LEN:
            return self.drop(FAILED)
        header, mac = tag[:_HEADER.size], tag[_HEADER.size:]
        version, stream, counter, stamp = _HEADER.unpack(header)
        want = _mac(self.key, self.me.encode(), kind, header, body)
        if version != VERSION or not hmac.compare_digest(mac, want):
            return self.drop(FAILED)
        if not abs(time.time() - stamp) <= self.window_s:  # also rejects NaN
            return self.drop(STALE)
        now = time.monotonic()
        self._prune(now)
        s = self._streams.get(stream)
        if s is None:
            if len(self._streams) >= self.max_streams:
                return self.drop(FAILED)
            self._streams[stream] = _Stream(counter, now)
            return True
        if counter <= s.counter:
            return self.drop(REPLAYED)
        s.counter, s.seen = counter, now
        return True

    def drop(self, reason: str) -> bool:
        """Count one dropped frame; always False (what :meth:`check` returns for it)."""
        self.dropped[reason] += 1
        self.last_drop = reason
        return False

    def _prune(self, now: float) -> None:
        if now < self._next_prune:
            return
        self._next_prune = now + self.window_s
        idle = 2 * self.window_s
        for sid in [sid for sid, s in self._streams.items() if now - s.seen > idle]:
            del self._streams[sid]


@dataclass(frozen=True, slots=True)
class SideKey:
    """A loaded key and its replay window (what a side channel needs to sign and verify)."""

    key: bytes = field(repr=False)
    window_s: float = 60.0

    def signer(self, dest: str) -> Signer:
        return Signer(self.key, dest)

    def verifier(self, me: str) -> Verifier:
        return Verifier(self.key, me, self.window_s)


def identity(engine_id: str, rank: int) -> str:
    """The destination identity a frame's MAC is bound to."""
    return f"{engine_id}/{rank}"
