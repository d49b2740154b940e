"""Helpers shared by the simulator tests (pytest puts this folder on ``sys.path``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("simpy")

from pushkv.sim import SimConfig, TransferMode, WorkloadConfig
from pushkv.sim.profile import DEFAULT, Profile, load_profile


def config(mode: str = "push", *, qps: float = 2.0, input_len: int = 2048,
           output_len: int = 16, num_prompts: int = 20, seed: int = 0,
           **kw: Any) -> SimConfig:
    """A small, fast run."""
    return SimConfig(
        mode=TransferMode(mode),
        workload=WorkloadConfig(request_rate=qps, input_len=input_len, output_len=output_len,
                                num_prompts=num_prompts, seed=seed),
        **kw,
    )


def with_profile(**sections: dict[str, Any]) -> Profile:
    """The default profile with some fields of some sections replaced."""
    changes = {name: dataclasses.replace(getattr(DEFAULT, name), **fields)
               for name, fields in sections.items()}
    return dataclasses.replace(DEFAULT, **changes).validate()


def on_host(profile: Profile, *, prefill: dict[str, Any] | None = None,
            decode: dict[str, Any] | None = None, **host: Any) -> Profile:
    """``profile`` on the shared-CPU host model with some ``[host]`` keys replaced
    (``prefill``, ``decode``: those of ``[host.prefill]``, ``[host.decode]``)."""
    h = profile.host
    new = dataclasses.replace(
        h, model="shared-cpu", **host,
        prefill=dataclasses.replace(h.prefill, **(prefill or {})),
        decode=dataclasses.replace(h.decode, **(decode or {})))
    return dataclasses.replace(profile, host=new).validate()


#: the cpu-tiny profile (the tiny model on vLLM CPU, as measured)
TINY = load_profile(Path(__file__).resolve().parents[2] / "pushkv" / "sim" / "profiles"
                    / "cpu-tiny.toml")


def tiny_on_host(**host: Any) -> Profile:
    """cpu-tiny with frontend work to do (the API servers' keys as measured on the 2-core
    machine), on a shared CPU with ``host`` keys."""
    return on_host(dataclasses.replace(
        TINY, prefill=dataclasses.replace(TINY.prefill, ingest_s=0.002, return_s=0.002),
        decode=dataclasses.replace(TINY.decode, ingest_s=0.003, return_s=0.0005),
    ), **host)


def tiny_result(mode: str, qps: float, n: int, **host: Any) -> dict[str, Any]:
    """The result file of ``n`` requests at ``qps``, 128 tokens in, 16 out, on
    :func:`tiny_on_host` with ``host`` keys."""
    from pushkv.sim.runner import run

    cfg = dataclasses.replace(config(mode, qps=qps, input_len=128, output_len=16,
                                     num_prompts=n), profile=tiny_on_host(**host))
    return run(cfg).result


def write_timeline(directory: Path, requests: dict[str, dict[str, float]]) -> Path:
    """``requests`` (per id, each mark's time) as one process's pushkv.timeline file in
    ``directory``, which is made; returns ``directory``."""
    import json

    directory.mkdir(parents=True)
    with (directory / "timeline-1.jsonl").open("w") as f:
        for tid, marks in requests.items():
            for ev, t in marks.items():
                f.write(json.dumps({"id": tid, "ev": ev, "t": t, "p": "x"}) + "\n")
    return directory
