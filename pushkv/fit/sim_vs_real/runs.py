"""A sim-vs-real run on disk: its points, its files, what its real half records.

A run's directory (``OUT``) holds the real half under ``OUT/real``: one ``vllm bench
serve`` result file per point, ``{mode}_qps{q}_in{i}_out{o}_iter{n}.json``
(:func:`file_name`, :data:`NAME`), the gauges' under ``OUT/real/gauge``
(:data:`GAUGES`), the core probe's wake-ups under ``OUT/real/wakes`` (:data:`WAKES`,
:func:`write_wakes`), every part's :mod:`pushkv.timeline` marks under
``OUT/real/timeline/<router>/``, ``<deployment>/`` and ``client/``
(:func:`timeline_dirs`), and per point, in ``OUT/real/cpu_probe.json``
(:data:`SHARES`, :func:`record_shares`), what was measured meanwhile: the probe's
share and wake-up delay per core, the servers' metrics, the point's window, steal
(:func:`steal_record`), the cores' speed (:func:`probe_speed`), the gauges around it.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

#: how the simulated half places the measured deployment's processes by default: each
#: engine's loop on its side's core (``host.pinned``; the deployment binds each vLLM CPU
#: worker's threads to a core of its own) and each API server a loop of its own where the
#: run measured ``host.token_api_s``, not one pool of cores and one frontend queue
PINNED_ENGINES = True
API_LOOPS = True
#: a step's orders reach the decode worker at that step's forward (vLLM on CPU schedules
#: and then executes each step; ``decode.orders_at_forward``), as the real servers do
ORDERS_AT_FORWARD = True
#: the measured CPU profile the simulated half starts from
PROFILE = Path(__file__).resolve().parents[2] / "sim" / "profiles" / "cpu-tiny.toml"
#: sim mode -> (real mode of pushkv.fit.e2e.modes, its deployment)
MODES = {"push": ("push", "pushkv"), "pull": ("pull", "nixl-pull")}
NAME = re.compile(r"^(?P<mode>[a-z-]+)_qps(?P<qps>[\d.]+)_in(?P<input>\d+)_out(?P<output>\d+)"
                  r"_iter(?P<iter>\d+)\.json$")
#: per result file: what a probe on each core met meanwhile (core 0: prefill, 1: decode)
SHARES = "cpu_probe.json"
#: the statistics of a result file the two halves are compared on
STATS = ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")
#: where the gauges' ``vllm bench serve`` result files go, under ``OUT/real``
GAUGES = "gauge"
#: where the client records its garbage-collector pauses, under ``OUT/real/timeline``
CLIENT = "client"
#: where each point's probe wake-ups go, one file a point (:func:`write_wakes`)
WAKES = "wakes"


def rate_name(q: float) -> str:
    return str(int(q)) if q == int(q) else str(q)


def file_name(mode: str, rate: float, input_len: int, output_len: int, it: int) -> str:
    return f"{mode}_qps{rate_name(rate)}_in{input_len}_out{output_len}_iter{it}.json"


def point_name(mode: str, input_len: int, rate: float) -> str:
    """A point's name across its iterations in tables and summaries
    (``push_in64_qps2``)."""
    return f"{mode}_in{input_len}_qps{rate_name(rate)}"


def timeline_dirs(real: Path, mode: str) -> list[Path]:
    """Where ``mode``'s router, servers and the client record (:mod:`pushkv.timeline`)."""
    name, deployment = MODES[mode]
    return [real / "timeline" / d for d in (name, deployment, CLIENT)]


def point_prompts(qps: float, num_prompts: int, point_seconds: float | None = None) -> int:
    """The requests a point at ``qps`` sends: ``num_prompts``, or with ``point_seconds``
    as many as ``qps`` sends in that long where that is more -- so that a point past the
    knee measures the load, not its first two seconds. ValueError for a count below 1,
    or seconds or a rate not above 0."""
    if num_prompts < 1:
        raise ValueError(f"a point sends at least one request, got {num_prompts}")
    if point_seconds is None:
        return num_prompts
    if not point_seconds > 0 or not qps > 0:
        raise ValueError(f"a point's rate and seconds must be > 0, got {qps}, {point_seconds}")
    return max(num_prompts, math.ceil(qps * point_seconds))


def real_points(real: Path) -> tuple[list[tuple[str, int, float, int]], int, dict[str, int]]:
    """The points of the result files in ``real``, their output length (one for the run)
    and each point's prompt count, by result file name (a run with ``--point-seconds``
    sends more requests at the higher rates)."""
    points, outs, prompts = [], set(), {}
    for path in sorted(real.iterdir()):
        m = NAME.match(path.name)
        if m is None or m["mode"] not in MODES:
            continue
        data = json.loads(path.read_text())
        points.append((m["mode"], int(m["input"]), float(m["qps"]), int(m["iter"])))
        outs.add(int(m["output"]))
        prompts[path.name] = (int(data["num_prompts"]) if "num_prompts" in data
                              else int(data["completed"]) + int(data.get("failed", 0)))
    if not points:
        raise SystemExit(f"no real result files in {real}")
    if len(outs) != 1:
        raise SystemExit(f"{real}: mixed output lengths {sorted(outs)}")
    return points, outs.pop(), prompts


def write_wakes(real: Path, stem: str, probe: Any) -> Path:
    """The core probe's wake-ups of point ``stem``, each as [when it was due
    (``time.monotonic()``, the timelines' clock), its delay (s)], by core, into
    ``real/wakes/<stem>.json``: what the profile's ``host.wake_beside_s`` is taken
    from, against the point's timeline (:func:`pushkv.fit.segments.wakes_by_flight`)."""
    out = real / WAKES / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(core): [[round(t, 6), round(w, 6)] for t, w in zip(
        probe.wake_times.get(core, ()), probe.wakes.get(core, ()), strict=True)]
        for core in sorted(probe.wakes)}))
    return out


def record_shares(real: Path, fname: str, shares: dict[str, Any]) -> None:
    """The cores' share and wake-up delay during one point, in ``real/cpu_probe.json``."""
    path = real / SHARES
    got = json.loads(path.read_text()) if path.exists() else {}
    got[fname] = shares
    path.write_text(json.dumps(got, indent=1, sort_keys=True))


def steal_record(got: dict[int, dict[str, float]]) -> dict[str, dict[str, float]]:
    """:func:`pushkv.hostprobe.steal` for ``cpu_probe.json``: per core (its number as a
    string), the host's share of the wall and of the work, rounded."""
    return {str(c): {k: round(v, 4) for k, v in share.items()} for c, share in got.items()}


def probe_speed(probe: Any) -> dict[str, float]:
    """The probe's rate of fixed work per CPU second on each side's core (core 0:
    prefill, 1: decode), rounded: the cores' speed over a point or a gauge."""
    return {side: round(probe.speed(core), 1) for side, core in (("prefill", 0), ("decode", 1))}
