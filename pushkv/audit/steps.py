"""Reading a run's protocol steps out of its timeline files.

Every process of a run that records a timeline (:mod:`pushkv.timeline`, the
connector's ``timeline_dir``) writes ``timeline-<pid>.jsonl`` into one directory.
The lines with an ``"a"`` object are protocol steps (:data:`pushkv.timeline.STEPS`);
the others (request marks, garbage-collector pauses) are not read here.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The fields each step must carry, with their types.
_NEEDED: dict[str, tuple[str, ...]] = {
    "registration_sent": ("inc", "att", "src", "dst"),
    "write_posted": ("inc", "att", "src", "dst", "part", "parts"),
    "write_completed": ("inc", "att", "src", "dst", "ok"),
    "answer_sent": ("inc", "att", "src", "dst", "posted", "failed"),
    "source_released": ("inc", "src"),
    "notify_received": ("inc", "att", "src", "dst", "part", "parts"),
    "digest_checked": ("inc", "att", "src", "dst", "ok"),
    "dest_released": ("inc", "att", "dst"),
    "read_posted": ("inc", "att", "src", "dst"),
    "read_completed": ("inc", "att", "src", "dst", "ok"),
    "outcome": ("inc", "att", "dst", "kind"),
}
_TYPES: dict[str, type | tuple[type, ...]] = {
    "inc": int, "att": int, "part": int, "parts": int, "chunk": int, "chunks": int,
    "posted": int, "failed": int, "src": str, "dst": str, "kind": str, "reason": str,
    "ok": bool, "sealed": bool, "grace": (int, float, type(None)),
}
_KINDS = ("ready", "failed", "cancelled")


class AuditInputError(Exception):
    """The timelines cannot be audited: what is wrong, and where."""


@dataclass(frozen=True, slots=True)
class Step:
    """One protocol step a process recorded."""

    t: float
    event: str
    transfer_id: str
    process: str
    order: int  #: position in the whole run: time, then each file's own order
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)

    def __getitem__(self, name: str) -> Any:
        return self.fields[name]

    @property
    def use(self) -> tuple[str, int]:
        return self.transfer_id, int(self.fields["inc"])

    def describe(self, t0: float) -> str:
        """``event@+seconds(process)``, times from the run's first step."""
        return f"{self.event}@+{self.t - t0:.6f}s({self.process})"


@dataclass
class Run:
    """Every protocol step of a run, by use (transfer id, incarnation)."""

    uses: dict[tuple[str, int], list[Step]]
    steps: int
    processes: list[str]
    files: int
    t0: float


def _check(d: dict[str, Any]) -> str:
    """Why a step line is unusable ("" when it is fine)."""
    ev = d.get("ev")
    a = d["a"]
    if not isinstance(a, dict):
        return "its step fields are not an object"
    if ev not in _NEEDED:
        return f"unknown step {ev!r} (known: {', '.join(_NEEDED)})"
    if not isinstance(d.get("id"), str):
        return "no transfer id"
    t = d.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t):
        return f"time {t!r} is not a finite number"
    for name in _NEEDED[ev]:
        if name not in a:
            return f"{ev} without its field {name!r}"
    for name, value in a.items():
        want = _TYPES.get(name)
        if want is None:
            continue
        if isinstance(value, bool) and want is int:
            return f"field {name!r} is {value!r}, not an integer"
        if not isinstance(value, want):
            return f"field {name!r} is {value!r}"
    if ev == "outcome" and a["kind"] not in _KINDS:
        return f"outcome kind {a['kind']!r} (known: {', '.join(_KINDS)})"
    return ""


def read(directory: str | os.PathLike[str]) -> Run:
    """Every protocol step under ``directory``. Raises :class:`AuditInputError` when
    there is no such directory, no timeline file, a line that is not JSON (other than
    a file's torn last line: a killed process), a step with missing or wrong fields,
    or no step at all (recorded before the steps existed, or not by the transports)."""
    root = Path(directory)
    if not root.is_dir():
        raise AuditInputError(f"{root}: no such directory (expected a timeline_dir holding "
                              "timeline-<pid>.jsonl files)")
    paths = sorted(root.glob("timeline-*.jsonl"))
    if not paths:
        raise AuditInputError(f"{root}: no timeline-*.jsonl file (was the run recorded with "
                              "timeline_dir set?)")
    raw: list[tuple[float, int, str, str, str, dict[str, Any]]] = []
    processes: set[str] = set()
    for path in paths:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise AuditInputError(f"{path}: unreadable ({exc})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except ValueError:
                if n == len(lines):
                    continue  # the torn last line of a killed process
                raise AuditInputError(f"{path}:{n}: not a JSON line: {line[:80]!r}") from None
            if not isinstance(d, dict):
                raise AuditInputError(f"{path}:{n}: not a JSON object: {line[:80]!r}")
            if "a" not in d:
                continue  # a request mark or a pause
            why = _check(d)
            if why:
                raise AuditInputError(f"{path}:{n}: {why}")
            process = str(d.get("p", path.stem))
            processes.add(process)
            raw.append((float(d["t"]), len(raw), d["ev"], d["id"], process, d["a"]))
    if not raw:
        raise AuditInputError(f"{root}: {len(paths)} timeline file(s) but no protocol step in "
                              "them (steps are recorded by the transports while timeline_dir "
                              "is set)")
    raw.sort(key=lambda r: (r[0], r[1]))  # each file's lines keep their order at equal times
    uses: dict[tuple[str, int], list[Step]] = defaultdict(list)
    for order, (t, _, ev, tid, process, a) in enumerate(raw):
        uses[tid, int(a["inc"])].append(Step(t, ev, tid, process, order, a))
    return Run(dict(uses), len(raw), sorted(processes), len(paths), raw[0][0])


__all__ = ["AuditInputError", "Run", "Step", "read"]
