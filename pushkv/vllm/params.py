"""The ``kv_transfer_params`` the push proxy and ``PushKVConnector`` exchange.

A request reaches vLLM with a JSON object in ``kv_transfer_params``; vLLM hands
it to the connector untouched, and whatever the connector returns from
``request_finished`` comes back to the HTTP client in the response. pushkv
uses four shapes:

* **prefill leg** (proxy -> producer)::

      {"do_remote_decode": true, "transfer_id": "<id>", "incarnation": <int>}

* **decode leg** (proxy -> consumer)::

      {"do_remote_prefill": true, "transfer_id": "<id>", "incarnation": <int>,
       "producer": {"engine_id": "...", "host": "...", "port": 5600,
                    "ranks": ["tcp://host:port", ...]}}

* **discovery** (proxy -> any instance, once): ``{"pushkv_discover": true}``;
  the answer's ``kv_transfer_params`` carry ``{"pushkv_endpoint": {...},
  "pushkv_policy": ..., "pushkv_vocab_size": n}`` (:class:`Endpoint`, the failure
  policy, the model's vocabulary size), which is how the proxy learns a
  producer's side channel, checks each instance's role and checks token ids.

* **prefill answer** (producer -> proxy): ``{"transfer_id": ..., "pushkv_endpoint": {...},
  "num_tokens": n}``, for logs.

vLLM's NIXL PD flow, as ``vllm-router --vllm-pd-disaggregation --kv-connector
nixl`` (and other sequential routers) drive it, is spoken too:

* **NIXL prefill leg** (router -> producer): ``{"do_remote_decode": true, ...}``
  without a ``transfer_id`` (:class:`NixlPrefillLeg`). Every other field in it
  (``remote_engine_id``, ``remote_block_ids``... all null there) is ignored.
* **NIXL prefill answer** (producer -> router), passed by the router verbatim
  into the decode leg: vLLM's fields (``do_remote_prefill: true``,
  ``remote_engine_id``, ``remote_block_ids``, ``remote_request_id``,
  ``remote_host``, ``remote_port``, ``tp_size``, ``pp_size``,
  ``remote_num_tokens``, ``transfer_mode: "pull"`` for a pull) plus pushkv's
  (``transfer_id`` and ``incarnation``, both minted by the producer,
  ``pushkv_endpoint``, ``pushkv_direction``, a pull's ``pushkv_lease_ms`` and,
  when its source was sealed, ``pushkv_seals``). A push is not announced in
  ``transfer_mode``: vllm-router rewrites the decode leg of a ``"push"`` answer
  into vLLM's push-connector fields and drops pushkv's.
* **NIXL decode leg** (router -> consumer): that answer. pushkv reads
  ``transfer_id``, ``incarnation``, ``pushkv_endpoint`` (where to connect),
  ``pushkv_direction`` (else ``transfer_mode``; ``"pull"``: read
  ``remote_block_ids``; ``"push"``: register), ``remote_block_ids``,
  ``remote_engine_id`` (checked against the endpoint), ``pushkv_lease_ms`` and
  ``pushkv_seals`` (every read is checked against its rank's seal). It ignores
  ``remote_host``/``remote_port`` (the endpoint lists every rank's address),
  ``tp_size``/``pp_size`` (the handshake tells), ``remote_request_id``,
  ``remote_num_tokens``, ``remote_blocks_expiry_time`` and ``dcp_size``. A
  decode leg without ``transfer_id`` is another connector's (vLLM's
  NixlConnector) and is left alone.

The transfer id and its incarnation are drawn by the proxy (random) and are
the key both sides match on; with a shared key every object also carries the
proxy's signature (:mod:`.signing`). This module needs the standard library
only, so the proxy stays light.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..protocol.errors import ConfigError
from ..protocol.messages import MAX_TARGET

#: Longest transfer or engine id accepted (the protocol's wire limit).
MAX_ID_LEN = 256

#: A side-channel address as the runtime advertises it.
_ADDRESS = re.compile(r"tcp://[A-Za-z0-9.\-:\[\]]{1,253}:[0-9]{1,5}")

#: Most source block ids a decode leg may name (a 16 M-token prompt in 256-token blocks).
MAX_BLOCKS = 65536

DISCOVER_KEY = "pushkv_discover"
#: In a NIXL-style answer: "pull" or "push", how this transfer's KV moves.
DIRECTION_KEY = "pushkv_direction"
ENDPOINT_KEY = "pushkv_endpoint"
#: Rule 12: a decode leg's turn at its held source (set by a router that re-targets).
TARGET_KEY = "pushkv_target"
#: In a consumer's discovery answer: its ``kv_load_failure_policy``.
POLICY_KEY = "pushkv_policy"
#: In a discovery answer: the served model's vocabulary size (token ids are below it).
VOCAB_KEY = "pushkv_vocab_size"
#: In a pull's NIXL-style answer: each producer rank's seal of the published source
#: (rule 11), ``{"<rank>": "<base64>"}``; absent: published unsealed.
SEALS_KEY = "pushkv_seals"
#: Longest seal accepted, in bytes (one 8-byte digest per KV head plus a header).
MAX_SEAL_BYTES = 16384


class ParamsError(ConfigError):
    """A request's ``kv_transfer_params`` are not valid pushkv parameters."""


def _id(obj: Mapping[str, Any], key: str, where: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not 1 <= len(value) <= MAX_ID_LEN:
        raise ParamsError(
            f"{where}: {key!r} must be a string of 1 to {MAX_ID_LEN} characters, got {value!r}"
        )
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    """Where an instance's pushkv side channel listens, and what it is."""

    engine_id: str
    host: str
    port: int
    role: str = "producer"  #: "producer" or "consumer"
    tp_size: int = 1
    pp_size: int = 1
    block_size: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    #: Side-channel address of every rank (by global rank), as each rank bound it.
    #: Empty: rank ``r`` listens on ``port + r`` (fixed ports).
    ranks: tuple[str, ...] = ()

    def addresses(self) -> dict[int, str]:
        """Side-channel address of every rank."""
        if self.ranks:
            return dict(enumerate(self.ranks))
        return {r: f"tcp://{self.host}:{self.port + r}" for r in range(self.world_size)}

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine_id": self.engine_id,
            "host": self.host,
            "port": self.port,
            "role": self.role,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "block_size": self.block_size,
        }
        if self.ranks:
            out["ranks"] = list(self.ranks)
        return out

    @classmethod
    def from_json(cls, obj: object, where: str = "endpoint") -> Endpoint:
        if not isinstance(obj, Mapping):
            raise ParamsError(f"{where} must be an object, got {type(obj).__name__}")
        port = obj.get("port")
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise ParamsError(f"{where}: 'port' must be an integer in [1, 65535], got {port!r}")
        host = _id(obj, "host", where)
        role = obj.get("role", "producer")
        if role not in ("producer", "consumer"):
            raise ParamsError(f"{where}: 'role' must be 'producer' or 'consumer', got {role!r}")
        sizes = {name: obj.get(name, default)
                 for name, default in (("tp_size", 1), ("pp_size", 1), ("block_size", 0))}
        for name, value in sizes.items():
            low = 0 if name == "block_size" else 1
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= 4096:
                raise ParamsError(f"{where}: {name!r} must be an integer in [{low}, 4096]")
        world = sizes["tp_size"] * sizes["pp_size"]
        ranks = obj.get("ranks", [])
        if not isinstance(ranks, list) or (ranks and len(ranks) != world):
            raise ParamsError(f"{where}: 'ranks' must list one address per rank ({world})")
        for address in ranks:
            if not (isinstance(address, str) and _ADDRESS.fullmatch(address)):
                raise ParamsError(f"{where}: 'ranks' holds {address!r:.80}, not an address "
                                  "like tcp://host:port")
        if not ranks and port + world - 1 > 65535:
            raise ParamsError(f"{where}: ports of every rank must stay below 65536")
        return cls(engine_id=_id(obj, "engine_id", where), host=host, port=port, role=role,
                   ranks=tuple(ranks), **sizes)


def with_ranks(endpoint: Endpoint, ranks: Mapping[int, str]) -> Endpoint:
    """``endpoint`` advertising each rank's bound side-channel address."""
    ordered = tuple(ranks[r] for r in range(len(ranks)))
    port = int(ordered[0].rsplit(":", 1)[1])
    return replace(endpoint, ranks=ordered, port=port)


def _with_incarnation(params: dict[str, Any], incarnation: int) -> dict[str, Any]:
    if incarnation:
        params["incarnation"] = incarnation
    return params


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillLeg:
    """A producer request: compute the prompt, hold its KV for ``transfer_id``."""

    transfer_id: str
    #: Which use of the id this is (drawn by the proxy, the same on both legs; 0: none).
    incarnation: int = 0

    def to_params(self) -> dict[str, Any]:
        return _with_incarnation({"do_remote_decode": True, "transfer_id": self.transfer_id},
                                 self.incarnation)


@dataclass(frozen=True, slots=True, kw_only=True)
class NixlPrefillLeg:
    """A producer request in vLLM's NIXL PD flow (a sequential router): compute the
    prompt, hold its KV, answer with what the decode leg needs. The producer names
    the transfer (and draws its incarnation)."""


#: How a transfer's bytes move, as ``transfer_mode`` spells it.
DIRECTIONS = ("push", "pull")


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodeLeg:
    """A consumer request: receive the prompt's KV of ``transfer_id`` from ``producer``."""

    transfer_id: str
    producer: Endpoint
    incarnation: int = 0
    #: "push": register and be written; "pull": read ``src_block_ids`` (the
    #: producer already published them: a sequential router's decode leg).
    direction: str = "push"
    src_block_ids: tuple[int, ...] = ()
    #: Pull: how long the producer holds the source from when it answered (its
    #: lease), None if the answer did not say.
    lease_s: float | None = None
    #: Rule 12: this decode engine's turn at the source (``pushkv_target``): 0 for
    #: the engine chosen first; a router re-targeting the held source counts up.
    target: int = 0
    #: Pull: every producer rank's seal of the source (rule 11), None: unsealed.
    seals: dict[int, bytes] | None = None

    def to_params(self) -> dict[str, Any]:
        out = _with_incarnation({
            "do_remote_prefill": True,
            "transfer_id": self.transfer_id,
            "producer": self.producer.to_json(),
        }, self.incarnation)
        if self.target:
            out[TARGET_KEY] = self.target
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Discover:
    """Ask an instance for its :class:`Endpoint`."""

    def to_params(self) -> dict[str, Any]:
        return {DISCOVER_KEY: True}


Leg = PrefillLeg | NixlPrefillLeg | DecodeLeg | Discover


#: The keys of a NIXL-style answer a producer signs (with a shared key): every one
#: a consumer reads. Routers and vLLM may add others; they are dropped unread.
NIXL_SIGNED = ("do_remote_prefill", "transfer_id", "incarnation", "pushkv_direction",
               "transfer_mode", "remote_block_ids", "remote_engine_id", ENDPOINT_KEY,
               "pushkv_lease_ms", SEALS_KEY)

#: How long a producer's answer may take to reach the decode instance through the
#: router, at most (pushkv's bound, not a measured one): a pulled source is known
#: held until the decode request's arrival plus the lease the answer carries,
#: less this. A read that could complete later fails closed (LEASE_EXPIRED).
RELAY_BOUND_S = 2.0


def nixl_answer(*, endpoint: Endpoint, transfer_id: str, incarnation: int, request_id: str,
                block_ids: list[int], num_tokens: int, direction: str,
                lease_s: float | None = None) -> dict[str, Any]:
    """A producer's answer to a :class:`NixlPrefillLeg`: vLLM NixlConnector's fields
    (what a router passes on to the decode leg) plus pushkv's own."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": endpoint.engine_id,
        "remote_block_ids": list(block_ids),
        "remote_request_id": request_id,
        "remote_host": endpoint.host,
        "remote_port": endpoint.port,
        "tp_size": endpoint.tp_size,
        "pp_size": endpoint.pp_size,
        "remote_num_tokens": num_tokens,
        # vllm-router rewrites the decode leg of a "push" answer into vLLM's push
        # connector's fields, dropping pushkv's: a push is announced in pushkv's key only.
        **({"transfer_mode": "pull"} if direction == "pull" else {}),
        DIRECTION_KEY: direction,
        "transfer_id": transfer_id,
        "incarnation": incarnation,
        "num_tokens": num_tokens,
        ENDPOINT_KEY: endpoint.to_json(),
        # Pull: the source's lease, so the decode side reads only while it is held.
        **({"pushkv_lease_ms": int(lease_s * 1000)} if lease_s is not None else {}),
    }


def seals_json(seals: Mapping[int, bytes]) -> dict[str, str]:
    """Each producer rank's seal as a NIXL-style answer carries it (:data:`SEALS_KEY`)."""
    return {str(r): base64.b64encode(seal).decode("ascii") for r, seal in sorted(seals.items())}


def _seals(value: object, producer: Endpoint, where: str) -> dict[int, bytes] | None:
    """:data:`SEALS_KEY` of a pull's answer: one seal per rank of ``producer``, or None
    if the answer has none. Only its form is checked here; the reading rank's
    runtime checks each seal it uses (a torn or foreign one refuses the pull)."""
    if value is None:
        return None
    ranks = producer.world_size
    if not isinstance(value, Mapping) or len(value) != ranks:
        raise ParamsError(f"{where}: {SEALS_KEY!r} must map each of the producer's {ranks} "
                          f"ranks to its seal, got {value!r:.80}")
    out: dict[int, bytes] = {}
    for key, text in value.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < ranks):
            raise ParamsError(f"{where}: {SEALS_KEY!r} names rank {key!r:.20}, not one of "
                              f"0..{ranks - 1}")
        if not isinstance(text, str) or len(text) > (MAX_SEAL_BYTES + 2) // 3 * 4:
            raise ParamsError(f"{where}: {SEALS_KEY!r} of rank {key} must be base64 of at "
                              f"most {MAX_SEAL_BYTES} bytes")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise ParamsError(f"{where}: {SEALS_KEY!r} of rank {key} is not base64") from None
        if not raw:
            raise ParamsError(f"{where}: {SEALS_KEY!r} of rank {key} is empty")
        out[int(key)] = raw
    return out


def _block_ids(value: object, where: str) -> tuple[int, ...]:
    """``remote_block_ids``: a list of block ids, or vLLM's one list per KV group
    (pushkv serves one group)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], list):
        value = value[0]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_BLOCKS:
        raise ParamsError(f"{where}: 'remote_block_ids' must be a list of 1 to {MAX_BLOCKS} "
                          "block ids")
    for b in value:
        if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < 2**31:
            raise ParamsError(f"{where}: 'remote_block_ids' holds {b!r:.40}, not a block id")
    return tuple(value)


def _target(params: Mapping[str, Any], where: str) -> int:
    """The decode leg's turn at its source (rule 12), 0 when not given."""
    target = params.get(TARGET_KEY, 0)
    if not (isinstance(target, int) and not isinstance(target, bool)
            and 0 <= target <= MAX_TARGET):
        raise ParamsError(f"{where}: {TARGET_KEY!r} must be an integer in [0, {MAX_TARGET}], got "
                          f"{target!r:.40}")
    return target


def _nixl_decode(params: Mapping[str, Any], transfer_id: str, incarnation: int) -> DecodeLeg:
    """A decode leg carrying a pushkv producer's NIXL-style answer."""
    where = "decode leg"
    producer = Endpoint.from_json(params[ENDPOINT_KEY], f"{where}: {ENDPOINT_KEY!r}")
    engine = params.get("remote_engine_id")
    if engine is not None and engine != producer.engine_id:
        raise ParamsError(f"{where}: 'remote_engine_id' {engine!r:.80} is not the endpoint's "
                          f"engine {producer.engine_id!r}")
    mode = params.get(DIRECTION_KEY, params.get("transfer_mode", "push"))
    if mode not in DIRECTIONS:
        raise ParamsError(f"{where}: {DIRECTION_KEY!r} must be 'push' or 'pull', got "
                          f"{mode!r:.40}")
    if incarnation == 0:
        raise ParamsError(f"{where}: 'incarnation' is missing (the producer draws one)")
    src = _block_ids(params.get("remote_block_ids"), where) if mode == "pull" else ()
    lease = params.get("pushkv_lease_ms")
    if lease is not None and (not isinstance(lease, int) or isinstance(lease, bool)
                              or not 0 <= lease < 2**40):
        raise ParamsError(f"{where}: 'pushkv_lease_ms' must be a whole number of "
                          f"milliseconds >= 0, got {lease!r:.40}")
    seals = _seals(params.get(SEALS_KEY), producer, where) if mode == "pull" else None
    return DecodeLeg(transfer_id=transfer_id, producer=producer, incarnation=incarnation,
                     direction=mode, src_block_ids=src,
                     lease_s=None if lease is None else lease / 1000,
                     target=_target(params, where), seals=seals)


def parse_params(params: object) -> Leg | None:
    """The pushkv leg in a request's ``kv_transfer_params``, or None if it has none.

    Raises :class:`ParamsError` for parameters that claim to be pushkv's but are
    malformed (a transfer id that is not a string, a bad producer address...).
    """
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params must be an object, got {type(params).__name__}")
    if params.get(DISCOVER_KEY) is True:
        return Discover()
    decode = params.get("do_remote_prefill") is True
    prefill = params.get("do_remote_decode") is True
    if not (decode or prefill):
        return None
    if decode and prefill:
        raise ParamsError("a request cannot be both the prefill and the decode leg")
    if "transfer_id" not in params:
        # vLLM's NIXL flow: the prefill leg is ours to answer; a decode leg without
        # our transfer id carries another connector's answer (vLLM's NixlConnector).
        return NixlPrefillLeg() if prefill else None
    transfer_id = _id(params, "transfer_id", "kv_transfer_params")
    incarnation = params.get("incarnation", 0)
    if not (isinstance(incarnation, int) and not isinstance(incarnation, bool)
            and 0 <= incarnation < 2**63):
        raise ParamsError(f"kv_transfer_params: 'incarnation' must be an integer in "
                          f"[0, 2^63), got {incarnation!r:.40}")
    if prefill:
        return PrefillLeg(transfer_id=transfer_id, incarnation=incarnation)
    if "producer" not in params:
        if ENDPOINT_KEY in params:  # a pushkv producer's NIXL-style answer
            return _nixl_decode(params, transfer_id, incarnation)
        raise ParamsError("decode leg: 'producer' (the prefill endpoint) is missing")
    producer = Endpoint.from_json(params["producer"], "decode leg: 'producer'")
    return DecodeLeg(transfer_id=transfer_id, producer=producer, incarnation=incarnation,
                     target=_target(params, "decode leg"))
