"""Hardware, model, engine and network profiles, with a source for every number.

A :class:`Profile` says how long things take: prefill compute, a decode step,
posting descriptors, moving bytes. The built-in :data:`DEFAULT` is Qwen3-32B
in bf16, TP8 on one 8x H200 node per side, over EFA (p5en). Its sections and
every field's source are in :mod:`pushkv.sim.sections` (re-exported here);
this module holds the whole profile: its validation and its file format.

A user profile is a TOML file whose tables override fields of the default,
e.g.::

    name = "llama-70b-h100"
    [model]
    num_layers = 80
    [prefill]
    compute_efficiency = 0.5
    [network]
    post_per_descriptor_s = 3e-6

The ``[host]`` section (:mod:`pushkv.sim.host.profile`) names the host model and
holds its keys: ``dedicated`` hardware by default, or a ``shared-cpu`` machine whose
cores the engines and frontends share.

Unknown tables or keys, wrong types and out-of-range values raise
:class:`ProfileError` with the offending key named; a key that moved to ``[host]``
is refused with its new place.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..protocol.errors import ConfigError
from .host.profile import HostError, HostProfile, moved_message, validate_host
from .sections import (
    ALLOCATORS,
    CONNECTOR_KEYS,
    INLINE_POSTS,
    PREEMPTIONS,
    SHARINGS,
    SKEWS,
    UNUSED,
    WIRE_MODELS,
    ControlProfile,
    EngineProfile,
    GPUProfile,
    ModelProfile,
    NetworkProfile,
)

__all__ = [
    "CONNECTOR_KEYS", "DEFAULT", "ControlProfile", "EngineProfile", "GPUProfile",
    "ModelProfile", "NetworkProfile", "Profile", "ProfileError", "derived_keys", "describe",
    "load_profile", "markdown", "profile_from_dict",
]


class ProfileError(ConfigError):
    """A profile file or value is invalid."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Everything that sets a duration in the model."""

    name: str = field(default="qwen3-32b-h200-tp8-efa",
                      metadata={"help": "profile name", "source": "built-in"})
    model: ModelProfile = field(default_factory=ModelProfile, metadata={"help": "the model"})
    gpu: GPUProfile = field(default_factory=GPUProfile, metadata={"help": "one accelerator"})
    prefill: EngineProfile = field(
        default_factory=lambda: EngineProfile(prefix_hit_fraction=0.9),
        metadata={"help": "the prefill instance(s)"},
    )
    decode: EngineProfile = field(
        default_factory=EngineProfile, metadata={"help": "the decode instance(s)"}
    )
    network: NetworkProfile = field(
        default_factory=NetworkProfile, metadata={"help": "fabric and posting costs"}
    )
    control: ControlProfile = field(
        default_factory=ControlProfile, metadata={"help": "control-plane costs"}
    )
    host: HostProfile = field(
        default_factory=HostProfile,
        metadata={"help": "the host the processes run on, and its model (pushkv.sim.host)"},
    )

    def validate(self) -> Profile:
        """Raise :class:`ProfileError` on a value no engine could have; return self."""
        for name, value, _help, _source in describe(self):
            for v in value if isinstance(value, tuple) else (value,):
                if isinstance(v, float) and not math.isfinite(v):
                    raise ProfileError(f"{name} must be a finite number, got {v}")
        base = EngineProfile()
        for side, fields in UNUSED.items():
            e = getattr(self, side)
            for name, why in fields.items():
                if getattr(e, name) != getattr(base, name):
                    raise ProfileError(f"{side}.{name} is not used ({why}); remove it")
        m = self.model
        for name in ("num_layers", "hidden_size", "num_q_heads", "num_kv_heads", "head_dim",
                     "dtype_bytes"):
            _positive(f"model.{name}", getattr(m, name))
        _positive("model.total_params", m.total_params)
        _positive("model.non_embedding_params", m.non_embedding_params)
        for name in ("peak_flops", "hbm_bandwidth", "memory_bytes"):
            _positive(f"gpu.{name}", getattr(self.gpu, name))
        for side in ("prefill", "decode"):
            e: EngineProfile = getattr(self, side)
            for name in ("tp", "max_num_seqs", "max_num_batched_tokens", "block_size"):
                _positive(f"{side}.{name}", getattr(e, name))
            for name in ("step_python_s", "step_token_s", "allreduce_s", *CONNECTOR_KEYS):
                if getattr(e, name) < 0:
                    raise ProfileError(f"{side}.{name} must be >= 0")
            for name in ("gpu_memory_utilization", "compute_efficiency", "kv_read_efficiency"):
                v = getattr(e, name)
                if not 0 < v <= 1:
                    raise ProfileError(f"{side}.{name} must be in (0, 1], got {v}")
            for name in ("prefix_hit_fraction", "fragmentation"):
                v = getattr(e, name)
                if not 0 <= v <= 1:
                    raise ProfileError(f"{side}.{name} must be in [0, 1], got {v}")
            if e.block_size & (e.block_size - 1) or e.block_size > 1024:
                raise ProfileError(f"{side}.block_size must be a power of two up to 1024 "
                                   f"(vLLM's attention kernels), got {e.block_size}")
            if e.preemption not in PREEMPTIONS:
                raise ProfileError(f"{side}.preemption must be one of {', '.join(PREEMPTIONS)}, "
                                   f"got {e.preemption!r}")
            if e.allocator not in ALLOCATORS:
                raise ProfileError(f"{side}.allocator must be one of {', '.join(ALLOCATORS)}, "
                                   f"got {e.allocator!r}")
            if e.inline_post not in INLINE_POSTS:
                raise ProfileError(f"{side}.inline_post must be one of {', '.join(INLINE_POSTS)}, "
                                   f"got {e.inline_post!r}")
            for name in ("prefill_step_overhead_s", "decode_step_overhead_s",
                         "activation_reserve_bytes"):
                if getattr(e, name) < 0:
                    raise ProfileError(f"{side}.{name} must be >= 0")
            if e.num_blocks(m, self.gpu) * e.block_size < 1024:
                raise ProfileError(f"{side}: the model leaves no room for a KV cache")
            if m.num_kv_heads >= e.tp and m.num_kv_heads % e.tp:
                raise ProfileError(f"{side}.tp {e.tp} does not divide {m.num_kv_heads} KV heads")
            if m.num_kv_heads < e.tp and e.tp % m.num_kv_heads:
                raise ProfileError(f"{side}.tp {e.tp} is not a multiple of the KV heads")
        n = self.network
        for name in ("descriptor_rate", "write_bandwidth", "read_bandwidth"):
            _positive(f"network.{name}", getattr(n, name))
        _positive("network.gpus_per_node", n.gpus_per_node)
        if n.wire_model not in WIRE_MODELS:
            raise ProfileError(f"network.wire_model must be one of {', '.join(WIRE_MODELS)}, "
                               f"got {n.wire_model!r}")
        if n.rank_skew_dist not in SKEWS:
            raise ProfileError(f"network.rank_skew_dist must be one of {', '.join(SKEWS)}, "
                               f"got {n.rank_skew_dist!r}")
        if not 0 <= n.post_gil_fraction <= 1:
            raise ProfileError(f"network.post_gil_fraction must be in [0, 1], "
                               f"got {n.post_gil_fraction}")
        if n.rank_skew < 0:
            raise ProfileError("network.rank_skew must be >= 0")
        if n.sharing not in SHARINGS:
            raise ProfileError(f"network.sharing must be one of {', '.join(SHARINGS)}, "
                               f"got {n.sharing!r}")
        sizes, bws = n.point_sizes_bytes, n.point_write_bandwidth
        if not sizes or len(sizes) != len(bws):
            raise ProfileError("network.point_sizes_bytes and point_write_bandwidth must be "
                               "non-empty and of equal length")
        for name, vals in (("point_sizes_bytes", sizes), ("point_write_bandwidth", bws)):
            for v in vals:
                _positive(f"network.{name}", v)
        if any(b <= a for a, b in itertools.pairwise(sizes)):
            raise ProfileError("network.point_sizes_bytes must be strictly ascending")
        c = self.control
        for name in ("message_send_s", "message_recv_s", "handshake_s"):
            if getattr(c, name) < 0:
                raise ProfileError(f"control.{name} must be >= 0")
        for name in ("wire_latency_s", "control_latency_s", "router_hop_s", "client_hop_s",
                     "client_first_s", "post_fixed_s", "post_per_descriptor_s",
                     "notify_wait_s"):
            if getattr(n, name) < 0:
                raise ProfileError(f"network.{name} must be >= 0")
        try:
            validate_host(self.host)
        except HostError as exc:
            raise ProfileError(str(exc)) from None
        return self


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and value > 0 and math.isfinite(value)):
        raise ProfileError(f"{name} must be a positive number, got {value!r}")


DEFAULT = Profile()

_SECTIONS = {
    "model": ModelProfile,
    "gpu": GPUProfile,
    "prefill": EngineProfile,
    "decode": EngineProfile,
    "network": NetworkProfile,
    "control": ControlProfile,
    "host": HostProfile,
}


def _coerce(where: str, f: dataclasses.Field[Any], value: Any, current: Any) -> Any:
    """Check a TOML value against the type of the field it replaces."""
    if isinstance(current, bool):
        if not isinstance(value, bool):
            raise ProfileError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(value, bool):
        raise ProfileError(f"{where}: booleans are not accepted here")
    if isinstance(current, int) and not isinstance(current, bool):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int):
            raise ProfileError(f"{where} must be an integer, got {value!r}")
        return value
    if isinstance(current, float):
        if not isinstance(value, int | float):
            raise ProfileError(f"{where} must be a number, got {value!r}")
        if not math.isfinite(value):
            raise ProfileError(f"{where} must be a finite number, got {value}")
        return float(value)
    if isinstance(current, tuple):
        if not isinstance(value, list) or not all(
                isinstance(v, int | float) and not isinstance(v, bool) for v in value):
            raise ProfileError(f"{where} must be a list of numbers, got {value!r}")
        if not all(math.isfinite(v) for v in value):
            raise ProfileError(f"{where} must hold finite numbers, got {value!r}")
        return tuple(float(v) for v in value)
    if isinstance(current, str):
        if not isinstance(value, str):
            raise ProfileError(f"{where} must be a string, got {value!r}")
        return value
    raise ProfileError(f"{where} cannot be set from a profile file")  # pragma: no cover


def _override(obj: Any, table: dict[str, Any], where: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    changes = {}
    for key, value in table.items():
        f = fields.get(key)
        moved = moved_message(where, key)
        if moved is not None:
            raise ProfileError(moved)
        why = UNUSED.get(where, {}).get(key)
        if why is not None:
            raise ProfileError(f"{where}.{key} is not used ({why}); remove it")
        if f is None:
            known = ", ".join(sorted(fields))
            raise ProfileError(f"unknown key {where}.{key} (known: {known})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):  # a sub-table: [host.prefill]
            if not isinstance(value, dict):
                raise ProfileError(f"[{where}.{key}] must be a table")
            changes[key] = _override(current, value, f"{where}.{key}")
        else:
            changes[key] = _coerce(f"{where}.{key}", f, value, current)
    return dataclasses.replace(obj, **changes)


#: what a derived step overhead depends on (besides its side's tp and allreduce_s)
OVERHEAD_INPUTS = ("model.num_layers",)


def derived_keys(data: dict[str, Any]) -> list[str]:
    """The step-overhead keys a profile document ``data`` leaves to be derived: those an
    engine side reads (not :data:`UNUSED`) and the document does not set, on a side
    whose inputs it changes (``model.num_layers``, the side's ``tp`` or
    ``allreduce_s``). See :meth:`EngineProfile.derived_step_overheads`."""
    model: dict[str, Any] = data["model"] if isinstance(data.get("model"), dict) else {}
    out = []
    for side in ("prefill", "decode"):
        table: dict[str, Any] = data[side] if isinstance(data.get(side), dict) else {}
        if not ("num_layers" in model or "tp" in table or "allreduce_s" in table):
            continue
        for key in ("prefill_step_overhead_s", "decode_step_overhead_s"):
            if key not in table and key not in UNUSED.get(side, {}):
                out.append(f"{side}.{key}")
    return out


def _derive(profile: Profile, keys: list[str]) -> Profile:
    changes: dict[str, Any] = {}
    for side in ("prefill", "decode"):
        e: EngineProfile = getattr(profile, side)
        values = e.derived_step_overheads(profile.model)
        mine: dict[str, Any] = {k.partition(".")[2]: values[k.partition(".")[2]] for k in keys
                if k.startswith(side + ".")}
        if mine:
            changes[side] = dataclasses.replace(e, **mine)
    return dataclasses.replace(profile, **changes)


def profile_from_dict(data: dict[str, Any], base: Profile = DEFAULT) -> Profile:
    """Apply a parsed TOML document to ``base`` (the built-in default); step overheads
    it leaves unset while changing what they depend on are derived
    (:func:`derived_keys`)."""
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key == "name":
            if not isinstance(value, str) or not value:
                raise ProfileError("name must be a non-empty string")
            changes["name"] = value
        elif key in _SECTIONS:
            if not isinstance(value, dict):
                raise ProfileError(f"[{key}] must be a table")
            changes[key] = _override(getattr(base, key), value, key)
        else:
            raise ProfileError(
                f"unknown table or key {key!r} (known: name, {', '.join(_SECTIONS)})"
            )
    profile = dataclasses.replace(base, **changes)
    return _derive(profile, derived_keys(data)).validate()


def load_profile(path: str | Path) -> Profile:
    """Read a TOML profile; :class:`ProfileError` if missing, malformed or invalid."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except FileNotFoundError as exc:
        raise ProfileError(f"profile file not found: {p}") from exc
    except OSError as exc:
        raise ProfileError(f"cannot read profile file {p}: {exc.strerror}") from exc
    try:
        data = tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"malformed TOML in {p}: {exc}") from exc
    return profile_from_dict(data)


def describe(profile: Profile) -> list[tuple[str, Any, str, str]]:
    """Every leaf field as (dotted name, value, help, source), for docs and --help."""
    rows: list[tuple[str, Any, str, str]] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                rows.append((prefix + f.name, value, f.metadata.get("help", ""),
                             f.metadata.get("source", "")))

    walk(profile, "")
    return rows


def markdown(profile: Profile = DEFAULT) -> str:
    """The profile as a table: parameter, value, meaning, source."""
    lines = ["| parameter | value | meaning | source |", "|---|---|---|---|"]
    for name, value, help_text, source in describe(profile):
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| `{name}` | {shown} | {help_text} | {source} |")
    return "\n".join(lines)

