"""pushkv plan's backends: Ray gives the process pool's plan; a killed worker's
configurations are rerun (process pool and Ray); Ray missing is refused in one line."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("simpy")

from pushkv.sim import WorkloadConfig, load_profile
from pushkv.sim.planner import SLO, BackendError, Plan, PlanSpec, run_plan
from pushkv.sim.planner.backends import RAY_TASK_NAME, check_backend
from pushkv.sim.planner.cli import main
from pushkv.sim.planner.report import to_json

TINY = Path(__file__).parents[2] / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"
DEADLINE_S = 120.0

# six configurations (1P1D, 1P2D, 2P1D x pull, push), a fraction of a second each
SMALL = PlanSpec(profile=load_profile(TINY), gpus=3, modes=("push", "pull"),
                 workload=WorkloadConfig(input_len=512, output_len=8, num_prompts=12),
                 slo=SLO(ttft_s=0.03, tpot_s=0.01), rate_tol=0.5, rate_range=8)
# 1P1D in each mode, each long enough (about a second) to be seen running and killed
SLOW = PlanSpec(profile=load_profile(TINY), gpus=2, modes=("push", "pull"),
                workload=WorkloadConfig(input_len=512, output_len=8, num_prompts=200),
                slo=SLO(ttft_s=0.03, tpot_s=0.01), rate_tol=0.5, rate_range=8)


def _doc(plan: Plan) -> dict[str, Any]:
    """The plan's JSON without what depends on where and how fast it ran."""
    doc = to_json(plan)
    for key in ("wall_s", "jobs", "backend", "reruns"):
        doc.pop(key)
    return json.loads(json.dumps(doc))


@pytest.fixture(scope="module")
def pool_plans() -> dict[str, Plan]:
    return {"small": run_plan(SMALL, jobs=2, progress=None)}


@pytest.fixture(scope="module")
def ray_local() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def _run_in_thread(spec: PlanSpec, **kw: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            box["plan"] = run_plan(spec, progress=None, **kw)
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, box


def _kill_first(find: Callable[[], list[int]], thread: threading.Thread) -> int:
    """Poll ``find`` until it names a process, SIGKILL it, return its pid."""
    done = threading.Event()
    while not done.wait(0.05):
        assert thread.is_alive(), "the plan finished before a worker could be killed"
        pids = find()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            return pids[0]
    raise AssertionError("unreachable")


def _ray_task_pids() -> list[int]:
    """Ray workers running a plan's task: their process title is ``ray::<task>``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(f"ray::{RAY_TASK_NAME}".encode()):
            out.append(int(entry))
    return out


def test_ray_gives_the_process_pools_json(ray_local: Any, pool_plans: dict[str, Plan],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    plan = run_plan(SMALL, backend="ray", progress=None)
    assert plan.backend == "ray" and plan.jobs == 2 and plan.reruns == 0
    assert ray_local.is_initialized()  # an instance started before is left running
    assert _doc(plan) == _doc(pool_plans["small"])
    assert plan.best is not None  # the case has an answer to agree on
    # the command line, the same plan as flags
    assert main(["plan", "--profile", str(TINY), "--gpus", "3", "--modes", "push", "pull",
                 "--input-len", "512", "--output-len", "8", "--num-prompts", "12",
                 "--ttft-slo", "0.03", "--tpot-slo", "0.01", "--rate-tol", "0.5",
                 "--rate-range", "8", "--backend", "ray", "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["backend"] == "ray" and doc["reruns"] == 0
    for key in ("wall_s", "jobs", "backend", "reruns"):
        doc.pop(key)
    assert doc == _doc(pool_plans["small"])


@pytest.mark.skipif(sys.platform != "linux", reason="reads worker titles from /proc")
def test_a_killed_ray_worker_has_its_configuration_rerun(ray_local: Any) -> None:
    thread, box = _run_in_thread(SLOW, backend="ray")
    victim = _kill_first(_ray_task_pids, thread)
    thread.join(DEADLINE_S)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    plan: Plan = box["plan"]
    assert plan.reruns >= 1, f"worker {victim} killed, nothing rerun"
    assert len(plan.outcomes) == 2
    # the rerun configuration's result is the one an undisturbed search finds
    assert _doc(plan) == _doc(run_plan(SLOW, jobs=1, progress=None))


def test_a_killed_worker_process_has_its_configurations_rerun(
        pool_plans: dict[str, Plan]) -> None:
    thread, box = _run_in_thread(SMALL, jobs=2)

    def workers() -> list[int]:
        return [p.pid for p in multiprocessing.active_children() if p.pid is not None]

    _kill_first(workers, thread)
    thread.join(DEADLINE_S)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    plan: Plan = box["plan"]
    assert plan.reruns >= 1
    assert _doc(plan) == _doc(pool_plans["small"])


def test_ray_missing_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    with pytest.raises(BackendError, match=r"pip install 'pushkv\[ray\]'"):
        check_backend("ray")
    with pytest.raises(BackendError, match="needs Ray"):
        run_plan(SMALL, backend="ray", progress=None)
    with pytest.raises(SystemExit) as info:
        main(["plan", "--profile", str(TINY), "--gpus", "3", "--backend", "ray"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'pushkv[ray]'" in err[0], err


@pytest.mark.parametrize(("argv", "words"), [
    (["--ray-address", "auto"], "only for --backend ray"),
    (["--backend", "dask"], "invalid choice"),
])
def test_bad_backend_flags_exit_2_with_one_line(argv: list[str], words: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "--profile", str(TINY), "--gpus", "3", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
