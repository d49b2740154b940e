"""The simulated half, one way: every point of a real run, simulated at its send times.

:func:`run_sim` simulates ``(mode, input, rate, iteration)`` points with a profile --
as measured, on the cores the probe met, with the servers' step times, or with each
point's gauges' keys -- and writes the result files and, if asked, each point's
timeline marks beside the real half's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ...sim.host import SHARED_CPU
from ...sim.host.profile import MAX_SPEED
from ...sim.profile import Profile, load_profile, profile_from_dict
from ..measure_connector import lone_steps
from .keys import gauges_speed, speed_over
from .runs import API_LOOPS, ORDERS_AT_FORWARD, PINNED_ENGINES, file_name


def run_sim(profile_path: Path, sim: Path, points: Sequence[tuple[str, int, float, int]],
            output_len: int, num_prompts: int | Mapping[str, int], *, seed: int = 0,
            shares: dict[str, dict[str, Any]] | None = None,
            server_steps: bool = False, timelines: Path | None = None,
            arrivals: str = "vllm", frontend_cores: int | None = None,
            host_cores: int | None = None,
            keys: dict[str, dict[str, float]] | None = None,
            gauges: dict[str, dict[str, dict[str, float]]] | None = None,
            speeds: bool = False,
            speed_refs: Mapping[str, dict[str, float]] | None = None,
            wall_steps: bool = False, merge_tokens: int | None = None,
            api_loops: bool = API_LOOPS, pinned_engines: bool = PINNED_ENGINES) -> None:
    """The simulator at ``(mode, input, rate, iteration)`` points, into ``sim``, each
    sending ``num_prompts`` requests (or its own count, by result file name); with
    ``shares`` (by result file name), each point's engines get the share of a core and
    the wake-up delay the probe met on their cores (``cpu_share``, ``wake_s``), else a
    core each. With ``server_steps`` the engines' step overheads are instead what the
    real P/D servers' metrics gave at that point (wall times under the load, share 1),
    per-token costs as profiled. With ``timelines``, each point's timeline marks go into
    ``timelines/<point>/`` (:mod:`pushkv.sim.marks`). ``arrivals``: the send times'
    generator (``"vllm"``: the very ones ``vllm bench serve --seed seed+iteration`` used
    in the real half); ``frontend_cores`` replaces the profile's
    ``host.frontend_cores`` (the frontends as a queue; 0 off), ``host_cores``
    ``host.cores`` (engines and frontends on shared cores; 0 off); either, not 0, makes
    the host the shared-CPU model (:mod:`pushkv.sim.host`); ``keys`` (per table,
    key: value) replace the profile's (:func:`~.keys.real_keys`); ``gauges`` (by result file name,
    per table, key: value) replace them again for that point alone (:func:`~.keys.gauge_keys`),
    on a core each; with ``speeds`` too, each side's ``cpu_speed`` the point's against
    its gauges' (:func:`~.keys.gauge_speed`, from ``shares``), or against
    ``speed_refs[file name]`` where given (per side, the probe rate the point's keys
    were measured at: :func:`~.keys.speed_over`). A point's gauged step times are
    its lone requests' wall times, the work they brought beside their steps in them, so
    on shared cores its steps are first made to give those wall times to a lone request
    simulated there, on the host as this run places it -- pinned, one queue or loops,
    merging (:func:`pushkv.fit.measure_connector.lone_steps`; ``wall_steps``: the
    gauged steps as they are, that work counted twice). ``merge_tokens`` replaces the
    profile's ``host.merge_tokens`` on every point run on the shared-CPU host (up to so
    many of a request's tokens waiting together on the frontend queue leave as one
    chunk; 0: none). Without ``api_loops`` a point's measured ``host.token_api_s`` is
    set to 0: the frontend queue serves everything (:mod:`pushkv.sim.host.frontend`).
    ``pinned_engines``: on every point whose host has two cores or more
    (``host.cores``), each engine's loop on a core of its own and the rest floating
    (``host.pinned``, :class:`pushkv.sim.host.cores.PinnedCores`)."""
    from ...sim.marks import Timeline
    from ...sim.runner import run
    from ...sim.scenario import SimConfig, TransferMode
    from ...sim.workload import WorkloadConfig

    def placed(profile: Profile) -> Profile:
        """``profile``'s host as this run simulates it: the one frontend queue unless
        ``api_loops``, the engines pinned with ``pinned_engines``, ``merge_tokens``; and
        decode's orders taken at its steps' forward (:data:`.runs.ORDERS_AT_FORWARD`)."""
        if profile.decode.orders_at_forward != ORDERS_AT_FORWARD:
            profile = dataclasses.replace(profile, decode=dataclasses.replace(
                profile.decode, orders_at_forward=ORDERS_AT_FORWARD)).validate()
        h = profile.host
        changes: dict[str, Any] = {}
        if not api_loops and h.token_api_s:  # the one frontend queue
            changes["token_api_s"] = 0.0
        if pinned_engines and h.model == SHARED_CPU and h.cores >= 2:
            changes["pinned"] = True
        if merge_tokens is not None and h.model == SHARED_CPU:
            changes["merge_tokens"] = merge_tokens
        return dataclasses.replace(profile, host=dataclasses.replace(
            h, **changes)).validate() if changes else profile

    base = load_profile(profile_path)
    for name, cores in (("frontend_cores", frontend_cores), ("cores", host_cores)):
        if cores is not None:
            model = SHARED_CPU if cores else base.host.model
            host: dict[str, Any] = {"model": model, name: cores}
            base = dataclasses.replace(base, host=dataclasses.replace(
                base.host, **host)).validate()
    for table, values in (keys or {}).items():
        base = dataclasses.replace(base, **{table: dataclasses.replace(
            getattr(base, table), **values)}).validate()
    sim.mkdir(parents=True, exist_ok=True)
    for old in sim.glob("*_iter*.json"):
        old.unlink()
    for mode, input_len, rate, it in points:
        profile = base
        fname = file_name(mode, rate, input_len, output_len, it)
        prompts = num_prompts if isinstance(num_prompts, int) else num_prompts[fname]
        got = (shares or {}).get(fname)
        if gauges is not None:
            if fname not in gauges:
                raise RuntimeError(f"{fname}: no gauge to simulate it with")
            point = {t: dict(v) for t, v in gauges[fname].items()}
            if host_cores is not None:  # the command line's cores, over the real run's
                point.get("host", {}).pop("cores", None)
            profile = placed(profile_from_dict(point, base=base))  # fitted as simulated
            if not wall_steps:  # the gauges' lone wall times, the request's own work out
                profile = lone_steps(profile, mode=mode, input_len=input_len,
                                     output_len=output_len)
            if speeds:
                keyed_at = (gauges_speed(got or {}) if speed_refs is None
                            else speed_refs.get(fname, {}))
                sides = {side: {"cpu_speed": min(MAX_SPEED, speed)}
                         for side, speed in speed_over(got or {}, keyed_at).items()}
                profile = profile_from_dict({"host": {"model": SHARED_CPU, **sides}},
                                            base=profile)
        elif got:
            pre, dec = dict(got["prefill"]), dict(got["decode"])  # cpu_share, wake_s
            pre_steps: dict[str, Any] = {}
            dec_steps: dict[str, Any] = {}
            speed, ref = got.get("speed", {}), base.host.probe_speed
            if ref > 0 and speed.get("prefill", 0) > 0 and speed.get("decode", 0) > 0:
                # the cores' speed now against when the profile was measured
                pre["cpu_speed"] = speed["prefill"] / ref
                dec["cpu_speed"] = speed["decode"] / ref
            eng = got.get("engine", {})
            if server_steps and eng.get("prefill_step_s") and eng.get("decode_token_s"):
                tok_p, tok_d = base.prefill.step_token_s, base.decode.step_token_s
                pre |= {"cpu_share": 1.0, "cpu_speed": 1.0}
                dec |= {"cpu_share": 1.0, "cpu_speed": 1.0}
                pre_steps = {"prefill_step_overhead_s": max(
                    0.0, eng["prefill_step_s"] - tok_p * input_len)}
                dec_steps = {"decode_step_overhead_s": max(0.0, eng["decode_token_s"] - tok_d)}
            h = base.host  # the probe's share of a core and wake-ups: a shared CPU
            profile = dataclasses.replace(
                base, prefill=dataclasses.replace(base.prefill, **pre_steps),
                decode=dataclasses.replace(base.decode, **dec_steps),
                host=dataclasses.replace(h, model=SHARED_CPU,
                                         prefill=dataclasses.replace(h.prefill, **pre),
                                         decode=dataclasses.replace(h.decode, **dec)),
            ).validate()
        profile = placed(profile)
        cfg = SimConfig(mode=TransferMode(mode), profile=profile, iteration=it,
                        workload=WorkloadConfig(request_rate=rate, input_len=input_len,
                                                output_len=output_len,
                                                num_prompts=prompts, seed=seed,
                                                arrivals=arrivals))
        tl = Timeline() if timelines is not None else None
        res = run(cfg, timeline=tl)
        if tl is not None and timelines is not None:
            tl.write(timelines / Path(cfg.file_name()).stem)
        if res.result["completed"] != prompts or res.leaked_blocks:
            raise RuntimeError(f"simulated {cfg.file_name()}: {res.result['completed']} of "
                               f"{prompts} completed, {res.leaked_blocks} blocks leaked")
        res.write(sim)
