"""The CPU tuning of vLLM servers (``pushkv/vllm/cpu_tuning``) really caps vLLM's busy loop.

Without the cap, two vLLM CPU servers of different TP sizes on two cores spun on
their shared-memory queues for as long as a handshake waited, and a producer
rank's side channel answered the consumer's card only after the consumer's
handshake timeout (see ``test_hetero_tp.py``). Servers get the cap through
``ServerSpec(spin_s=...)``; this checks, in a child process with a server's
environment, that vLLM's own ``SpinCondition`` then spins 2 ms, not 1 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from pushkv.vllm.testing import CPU_TUNING, SPANS_ENV, SPIN_ENV, SPIN_S, ServerSpec

pytestmark = pytest.mark.vllm

#: What a vLLM process sees: a reader's busy-loop period and the sleeping reader's recheck.
PROBE = """
import json, sys, zmq
from vllm.distributed.device_communicators import shm_broadcast as m
ctx = zmq.Context()
cond = m.SpinCondition(is_reader=True, context=ctx, notify_address=sys.argv[1])
print(json.dumps({"busy_loop_s": cond.busy_loop_s,
                  "recheck_ms": m.SHM_READER_RECHECK_INTERVAL_MS}))
ctx.destroy(linger=0)
"""


def probe(spec: ServerSpec, tmp_path: Path) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, f"ipc://{tmp_path}/notify"],
                         env=spec.environ(), capture_output=True, text=True, timeout=300,
                         check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_spin_s_puts_the_tuning_first_on_a_servers_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    env = ServerSpec(model="m", port=1, spin_s=SPIN_S, env={"X": "1"}).environ()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(CPU_TUNING)
    assert (CPU_TUNING / "sitecustomize.py").is_file()
    assert env[SPIN_ENV] == SPIN_S and env["X"] == "1"
    plain = ServerSpec(model="m", port=1).environ()
    assert str(CPU_TUNING) not in plain["PYTHONPATH"].split(os.pathsep)
    assert SPIN_ENV not in plain


def test_a_tuned_server_spins_milliseconds_where_vllm_spins_a_second(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    tuned = probe(ServerSpec(model="m", port=1, spin_s=SPIN_S), tmp_path)
    assert tuned == {"busy_loop_s": float(SPIN_S), "recheck_ms": 5}
    plain = probe(ServerSpec(model="m", port=1), tmp_path)  # vLLM's own values
    assert plain["busy_loop_s"] == 1 and plain["recheck_ms"] > 5


@pytest.mark.parametrize(("value", "interval", "warned"), [
    ("0.001", 0.001, False), ("", 0.005, False), ("-1", 0.005, True), ("fast", 0.005, True),
    ("inf", 0.005, True)])
def test_a_tuned_servers_switch_interval_comes_from_its_environment(
        value: str, interval: float, warned: bool) -> None:
    env = ServerSpec(model="m", port=1, spin_s=SPIN_S,
                     env={"PUSHKV_BENCH_SWITCH_S": value}).environ()
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.getswitchinterval())"],
                         env=env, capture_output=True, text=True, timeout=120, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) == pytest.approx(interval)
    assert ("PUSHKV_BENCH_SWITCH_S" in out.stderr) is warned


#: Where each of vLLM's functions the timeline instruments comes from in a process:
#: the intake's three, then the spans' three.
INSTRUMENTED = """
import json
from vllm.v1.engine import core, core_client
from vllm.v1.worker import gpu_worker
fns = (core_client.AsyncMPClient.add_request_async, core.EngineCoreProc.preprocess_add_request,
       core.EngineCoreProc._handle_client_request, core.EngineCore.step,
       core.EngineCore.step_with_batch_queue, gpu_worker.Worker.execute_model)
print(json.dumps([f.__module__.split(".")[0] for f in fns]))
"""


@pytest.mark.parametrize(("timeline_dir", "spans", "origins"), [
    (True, "1", ["sitecustomize"] * 6),
    (True, "", ["sitecustomize"] * 3 + ["vllm"] * 3),
    (False, "1", ["vllm"] * 6)])
def test_a_tuned_server_with_a_timeline_instruments_its_legs_intake_and_steps(
        timeline_dir: bool, spans: str, origins: list[str], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``PUSHKV_BENCH_TIMELINE_DIR`` the installed vLLM's intake functions are
    wrapped, its step and model run too with ``PUSHKV_BENCH_SPANS`` (an API that moved
    would print 'cannot patch' and run unwrapped); without a timeline all are vLLM's."""
    monkeypatch.delenv("PUSHKV_BENCH_TIMELINE_DIR", raising=False)
    monkeypatch.delenv(SPANS_ENV, raising=False)
    env = {SPANS_ENV: spans} | ({"PUSHKV_BENCH_TIMELINE_DIR": str(tmp_path)}
                                if timeline_dir else {})
    out = subprocess.run([sys.executable, "-c", INSTRUMENTED],
                         env=ServerSpec(model="m", port=1, spin_s=SPIN_S, env=env).environ(),
                         capture_output=True, text=True, timeout=300, check=True)
    assert "cannot patch" not in out.stderr, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == origins
