"""A grid of runs (modes x input lengths x rates x iterations), in parallel processes.

Each point is one :func:`~pushkv.sim.runner.run` and one result file named as the
post's benchmark script names them, so :mod:`pushkv.sim.plot` reads simulated
and real sweeps alike. Workers are started with ``spawn`` (safe everywhere,
no inherited state); the parent writes every file, in a fixed order.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .scenario import ConfigError, Dispatch, SimConfig, TransferMode
from .workload import WorkloadConfig

#: Mode labels a sweep accepts: a transfer mode, or ``push-seq`` (push, sequential router);
#: ``push-chunk`` and ``push-layer`` are progressive push (concurrent router).
MODE_LABELS = ("pull", "push", "pull-async", "push-seq", "auto", "auto-seq", "push-chunk",
               "push-layer")


def parse_mode(label: str) -> tuple[TransferMode, Dispatch]:
    """``push-seq`` -> (PUSH, SEQUENTIAL); ``pull`` -> (PULL, SEQUENTIAL); ..."""
    if label in ("push-seq", "auto-seq"):
        return TransferMode(label[:-4]), Dispatch.SEQUENTIAL
    try:
        mode = TransferMode(label)
    except ValueError as exc:
        raise ConfigError(
            f"unknown mode {label!r} (choose from {', '.join(MODE_LABELS)})"
        ) from exc
    return mode, Dispatch.SEQUENTIAL if mode.is_pull else Dispatch.CONCURRENT


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """The grid; defaults are the post's sweep."""

    modes: tuple[str, ...] = field(default=("pull", "push"), metadata={"help": "mode labels"})
    input_lens: tuple[int, ...] = field(
        default=(1024, 2048, 4096, 8192, 16384), metadata={"help": "prompt lengths"}
    )
    rates: tuple[float, ...] = field(default=(1, 2, 4, 8), metadata={"help": "request rates"})
    output_len: int = field(default=128, metadata={"help": "generated tokens per request"})
    num_prompts: int = field(default=100, metadata={"help": "requests per point"})
    iterations: int = field(default=5, metadata={
        "help": "iterations of each point, each with its own random streams (seeds): "
        "figures are means over them"})
    seed: int = field(default=0, metadata={"help": "workload seed (each iteration its own stream)"})
    burstiness: float = field(default=1.0, metadata={"help": "gamma shape of the gaps"})
    arrivals: str = field(default="pushkv", metadata={
        "help": "gap generator (WorkloadConfig.arrivals)"})
    max_concurrency: int | None = field(default=None, metadata={
        "help": "closed loop: requests in flight at most (WorkloadConfig.max_concurrency)"})

    def __post_init__(self) -> None:
        for label in self.modes:
            parse_mode(label)
        if not self.modes or not self.input_lens or not self.rates:
            raise ConfigError("a sweep needs at least one mode, input length and rate")
        if self.iterations < 1:
            raise ConfigError(f"iterations must be >= 1, got {self.iterations}")


def configs(spec: SweepSpec, base: SimConfig | None = None) -> list[SimConfig]:
    """Every point of the grid, built on ``base`` (profile, protocol, faults, topology)."""
    base = base or SimConfig()
    out = []
    for label in spec.modes:
        mode, dispatch = parse_mode(label)
        for n in range(spec.iterations):
            for input_len in spec.input_lens:
                for rate in spec.rates:
                    workload = WorkloadConfig(
                        request_rate=float(rate), burstiness=spec.burstiness,
                        input_len=input_len, output_len=spec.output_len,
                        num_prompts=spec.num_prompts, seed=spec.seed,
                        arrivals=spec.arrivals, max_concurrency=spec.max_concurrency,
                    )
                    out.append(dataclasses.replace(
                        base, mode=mode, dispatch=dispatch, workload=workload, iteration=n,
                    ))
    return out


@dataclass(frozen=True, slots=True)
class PointResult:
    """What a worker sends back: the file name, the JSON text, and its wall time."""

    file_name: str
    text: str
    wall_s: float
    requests: int


def run_point(cfg: SimConfig) -> PointResult:
    """Run one point (a top-level function, so ``spawn`` workers can import it)."""
    from .runner import run

    r = run(cfg)
    return PointResult(cfg.file_name(), json.dumps(r.result), r.wall_s, cfg.workload.num_prompts)


def _cost(cfg: SimConfig) -> float:
    """Rough relative wall cost, to start the slowest points first."""
    w = cfg.workload
    return w.num_prompts * (w.output_len + w.input_len / 512)


def default_jobs() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def run_sweep(
    cfgs: Sequence[SimConfig],
    out_dir: str | Path,
    *,
    jobs: int | None = None,
    progress: bool = True,
    on_result: Callable[[PointResult], None] | None = None,
) -> tuple[list[Path], float]:
    """Run every config, write one JSON per point into ``out_dir``; return (paths, wall s)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = [c.file_name() for c in cfgs]
    if len(set(names)) != len(names):
        raise ConfigError("two points of the sweep would write the same file")
    order = sorted(cfgs, key=_cost, reverse=True)
    jobs = min(jobs or default_jobs(), len(order))
    t0 = time.perf_counter()
    results: Iterable[PointResult]
    bar: Any = None
    if progress:
        from tqdm import tqdm  # type: ignore[import-untyped]

        bar = tqdm(total=len(order), unit="point", desc="sweep", dynamic_ncols=True)
    paths: list[Path] = []
    if jobs <= 1:
        results = map(run_point, order)
        paths = _collect(results, out, bar, on_result)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(jobs) as pool:
            paths = _collect(pool.imap_unordered(run_point, order), out, bar, on_result)
    if bar is not None:
        bar.close()
    return sorted(paths), time.perf_counter() - t0


def _collect(
    results: Iterable[PointResult], out: Path, bar: Any,
    on_result: Callable[[PointResult], None] | None,
) -> list[Path]:
    paths = []
    for res in results:
        path = out / res.file_name
        path.write_text(res.text)
        paths.append(path)
        if on_result is not None:
            on_result(res)
        if bar is not None:
            bar.update(1)
    return paths
