"""Signed ``kv_transfer_params``: only a proxy holding the shared key can start a transfer.

With a key configured, the proxy adds ``"pushkv_sig": {"t": <unix time>,
"mac": <hex>}`` to every ``kv_transfer_params`` it sends, where ``mac`` is
HMAC-SHA256 (standard library) over a version tag, ``t`` and the parameters in
canonical JSON (sorted keys, no spaces). A connector holding the same key
accepts parameters only when the MAC matches, ``t`` is within ``max_age_s``
of its clock, and -- for a transfer leg -- the transfer id was not already
used by a leg of the same kind within that time (a replay). Anything else is
refused: no transfer is made from it.

This protects *which transfers happen*: a client that reaches a vLLM instance
directly cannot make a producer push to an address of its choice, register
against a producer, or take over another request's transfer id. It does not
authenticate plain completions (use vLLM's ``--api-key``), nor encrypt
anything. Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from .params import ParamsError

SIG_KEY = "pushkv_sig"
_TAG = b"pushkv-params-v1\n"
#: Default: how old (or how far ahead) a signature's time may be.
MAX_AGE_S = 900.0


def _mac(key: bytes, t: float, params: Mapping[str, Any]) -> str:
    body = json.dumps(params, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    msg = _TAG + repr(float(t)).encode() + b"\n" + body.encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def sign(params: Mapping[str, Any], key: bytes, now: float | None = None,
         fields: tuple[str, ...] | None = None) -> dict[str, Any]:
    """``params`` with a signature added; with ``fields``, the signature covers those
    keys only (others may be added on the way -- vLLM adds some to a prefill's
    answer -- and are dropped by :func:`verify`)."""
    t = round(time.time() if now is None else now, 3)
    clean = {k: v for k, v in params.items() if k != SIG_KEY}
    if fields is None:
        return {**clean, SIG_KEY: {"t": t, "mac": _mac(key, t, clean)}}
    covered = {k: clean[k] for k in fields if k in clean}
    return {**clean, SIG_KEY: {"t": t, "mac": _mac(key, t, covered), "f": sorted(covered)}}


def verify(params: Mapping[str, Any], key: bytes, now: float | None = None,
           max_age_s: float = MAX_AGE_S) -> dict[str, Any]:
    """The parameters without their signature; :class:`ParamsError` unless signed
    with ``key`` within ``max_age_s`` of ``now``."""
    sig = params.get(SIG_KEY)
    if not isinstance(sig, Mapping):
        raise ParamsError("kv_transfer_params are not signed (a shared key is configured)")
    t, mac = sig.get("t"), sig.get("mac")
    if not isinstance(t, int | float) or isinstance(t, bool) or not isinstance(mac, str):
        raise ParamsError("kv_transfer_params: malformed signature")
    clean = {k: v for k, v in params.items() if k != SIG_KEY}
    covered = sig.get("f")
    if covered is not None:  # only these keys are signed: the others are dropped
        if not (isinstance(covered, list) and all(isinstance(k, str) for k in covered)):
            raise ParamsError("kv_transfer_params: malformed signature")
        clean = {k: clean[k] for k in covered if k in clean}
    if not hmac.compare_digest(_mac(key, float(t), clean), mac):
        raise ParamsError("kv_transfer_params: bad signature")
    now = time.time() if now is None else now
    if abs(now - float(t)) > max_age_s:
        raise ParamsError(f"kv_transfer_params: signature is {now - float(t):.0f} s old "
                          f"(accepted: {max_age_s:.0f} s)")
    return clean


class ReplayGuard:
    """Transfer ids seen within ``max_age_s``, with the request that used them; the
    same id in another request is a replay."""

    def __init__(self, max_age_s: float = MAX_AGE_S, max_entries: int = 200_000) -> None:
        self.max_age_s = max_age_s
        self.max_entries = max_entries
        self._seen: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()

    def check(self, kind: str, transfer_id: str, request_id: str,
              now: float | None = None) -> None:
        now = time.time() if now is None else now
        seen = self._seen
        while seen and (next(iter(seen.values()))[1] < now - 2 * self.max_age_s
                        or len(seen) >= self.max_entries):
            seen.popitem(last=False)
        first = seen.get((kind, transfer_id))
        if first is not None and first[0] != request_id:
            raise ParamsError(f"kv_transfer_params: transfer {transfer_id!r} was already "
                              f"used by another {kind} leg (replay)")
        seen[(kind, transfer_id)] = (request_id, now)
