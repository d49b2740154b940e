"""Where each value of the profile in effect came from, and what a profile leaves out.

``pushkv sim`` builds its profile from three layers: the built-in default
(:data:`pushkv.sim.profile.DEFAULT`), a TOML file (``--profile``) and a few flags
(``--prefix-hit``, ``--fragmentation``, ``--post-per-descriptor-us``).
:func:`resolve` applies them and remembers, for every leaf key, which layer set it;
:func:`to_toml` prints the result as a profile that loads back to the very same
:class:`~pushkv.sim.profile.Profile` (so a run under it is the same byte for byte).

A profile can still say things the model does not use. Keys no configuration uses
are refused when the file is read (:data:`pushkv.sim.sections.UNUSED`, the host keys
of the ``dedicated`` model). A key that only *another* setting of the profile uses
(:data:`OTHER_SETTING`: the two wire models' own keys, ``rank_skew_dist`` without a
skew) is kept and named in a warning with the setting that would use it: a profile
may carry both wire models' data to compare them by switching ``wire_model`` alone.
A profile that changes the model or the accelerator but inherits the built-in
Qwen3-32B TP8 node's parallelism, node size, step overheads and batch limits gets a
warning naming them (:data:`HARDWARE_BOUND`); step overheads the file leaves to be
derived from the model's layers and the side's TP
(:func:`~pushkv.sim.profile.derived_keys`) are not inherited, and their origin says so.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .profile import (
    DEFAULT,
    Profile,
    ProfileError,
    derived_keys,
    describe,
    profile_from_dict,
)
from .sections import UNUSED

BUILTIN = "built-in default"

#: key -> (the setting that must hold for the key to be used, a test of it, why not now)
OTHER_SETTING: dict[str, tuple[str, Any]] = {
    "network.descriptor_rate": (
        'network.wire_model = "two-limits"', lambda p: p.network.wire_model == "two-limits"),
    "network.write_bandwidth": (
        'network.wire_model = "two-limits"', lambda p: p.network.wire_model == "two-limits"),
    "network.point_sizes_bytes": (
        'network.wire_model = "measured-points"',
        lambda p: p.network.wire_model == "measured-points"),
    "network.point_write_bandwidth": (
        'network.wire_model = "measured-points"',
        lambda p: p.network.wire_model == "measured-points"),
    "network.rank_skew_dist": ("network.rank_skew > 0", lambda p: p.network.rank_skew > 0),
}

#: keys of the built-in profile sized for Qwen3-32B at TP8 on an 8x H200 node: a
#: profile of another model or accelerator that leaves them inherited is warned
HARDWARE_BOUND = (
    "prefill.tp", "decode.tp", "network.gpus_per_node",
    "prefill.prefill_step_overhead_s", "decode.decode_step_overhead_s",
    "prefill.max_num_seqs", "decode.max_num_seqs",
)


@dataclass(frozen=True)
class Resolved:
    """The profile in effect, every leaf key's origin, and the warnings it earned."""

    profile: Profile
    origins: dict[str, str]  #: dotted key -> BUILTIN, "file PATH" or "flag --NAME"
    warnings: tuple[str, ...] = field(default=())

    def origin(self, key: str) -> str:
        return self.origins.get(key, BUILTIN)


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> list[str]:
    out: list[str] = []
    for k, v in data.items():
        if isinstance(v, dict):
            out.extend(_leaf_keys(v, f"{prefix}{k}."))
        else:
            out.append(prefix + k)
    return out


def _read(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_bytes()
    except FileNotFoundError as exc:
        raise ProfileError(f"profile file not found: {p}") from exc
    except OSError as exc:
        raise ProfileError(f"cannot read profile file {p}: {exc.strerror}") from exc
    try:
        return tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"malformed TOML in {p}: {exc}") from exc


def _set(profile: Profile, dotted: str, value: Any) -> Profile:
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(profile, **{head: value})
    return dataclasses.replace(profile, **{head: _set(getattr(profile, head), rest, value)})


def warnings_for(profile: Profile, set_keys: list[str], where: str) -> list[str]:
    """The warning lines a profile that sets ``set_keys`` earns (see the module doc)."""
    out = []
    for key in set_keys:
        rule = OTHER_SETTING.get(key)
        if rule is not None and not rule[1](profile):
            out.append(f"{key} (set in {where}) is ignored here; only {rule[0]} uses it")
    changes_hw = any(k.startswith(("model.", "gpu.")) for k in set_keys)
    inherited = [k for k in HARDWARE_BOUND if k not in set_keys]
    if changes_hw and inherited:
        values = dict((n, v) for n, v, _h, _s in describe(profile))
        shown = ", ".join(f"{k} = {values[k]:g}" if isinstance(values[k], float)
                          else f"{k} = {values[k]}" for k in inherited)
        out.append(f"{where} changes the model or accelerator but inherits from the "
                   f"built-in {DEFAULT.name} profile: {shown} (sized for Qwen3-32B, TP8 on "
                   "an 8x H200 node: set them for your model and hardware)")
    return out


def resolve(path: str | Path | None = None,
            flags: dict[str, tuple[Any, str]] | None = None) -> Resolved:
    """The built-in default, then the file at ``path``, then ``flags`` (dotted key ->
    (value, flag name)); :class:`ProfileError` on any value the profile refuses."""
    origins: dict[str, str] = {}
    warnings: list[str] = []
    profile = DEFAULT
    if path is not None:
        data = _read(path)
        profile = profile_from_dict(data)
        where = f"file {path}"
        keys = _leaf_keys(data)
        for k in keys:
            origins[k] = where
        derived = derived_keys(data)
        for k in derived:
            side = k.partition(".")[0]
            origins[k] = (f"derived from model.num_layers, {side}.tp and {side}.allreduce_s "
                          f"({where})")
        warnings.extend(warnings_for(profile, keys + derived, where))
    for key, (value, flag) in (flags or {}).items():
        profile = _set(profile, key, value)
        origins[key] = f"flag {flag}"
    return Resolved(profile.validate(), origins, tuple(warnings))


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ProfileError(f"cannot write {v!r} as TOML")  # pragma: no cover


def _unused(key: str) -> bool:
    section, _, name = key.partition(".")
    return name in UNUSED.get(section, {})


def to_toml(resolved: Resolved) -> str:
    """Every effective value as a TOML profile, each with its origin as a comment.

    Keys no configuration reads are left out (a profile may not set them); keys only
    another setting reads are written as comments, so the file loads without
    warnings and gives the same profile."""
    p = resolved.profile
    inherited_hw = {k for k in HARDWARE_BOUND if resolved.origin(k) == BUILTIN}
    changes_hw = any(resolved.origin(k) != BUILTIN for k, *_ in describe(p)
                     if k.startswith(("model.", "gpu.")))
    lines = ["# the profile in effect: every value, and where it came from",
             f"name = {_toml_value(p.name)}  # {resolved.origin('name')}"]

    def table(obj: Any, prefix: str) -> None:
        subs = []
        lines.append("")
        lines.append(f"[{prefix}]")
        for f in dataclasses.fields(obj):
            key = f"{prefix}.{f.name}"
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                subs.append((value, key))
                continue
            if _unused(key):
                continue
            note = resolved.origin(key)
            if changes_hw and key in inherited_hw:
                note += " (inherited from the Qwen3-32B TP8 profile: check it)"
            text = f"{f.name} = {_toml_value(value)}"
            rule = OTHER_SETTING.get(key)
            if rule is not None and not rule[1](p):
                lines.append(f"# {text}  # {note}; ignored: only {rule[0]} uses it")
            else:
                lines.append(f"{text}  # {note}")
        for value, key in subs:
            table(value, key)

    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if dataclasses.is_dataclass(value):
            table(value, f.name)
    return "\n".join(lines) + "\n"


__all__ = ["BUILTIN", "HARDWARE_BOUND", "OTHER_SETTING", "Resolved", "resolve", "to_toml",
           "warnings_for"]
