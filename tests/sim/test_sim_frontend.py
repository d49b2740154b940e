"""The frontends as one queue (host.frontend_cores) and vLLM's arrival process."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("simpy")

import simpy
from sim_helpers import config, with_profile

from pushkv.sim import run
from pushkv.sim.host.frontend import Frontend
from pushkv.sim.profile import ProfileError
from pushkv.sim.workload import WorkloadConfig, WorkloadError

DATA = Path(__file__).parent / "data" / "vllm_bench_arrivals.json"


def _md1_wait(rate: float, service: float, n: int, cores: int = 1, seed: int = 0) -> float:
    """Mean wait in a Frontend fed Poisson jobs of a fixed service time."""
    env = simpy.Environment()
    fe = Frontend(env, cores, token_s=0.0)
    gaps = np.random.default_rng(seed).exponential(1 / rate, n)
    for t in np.cumsum(gaps):
        env.timeout(float(t)).callbacks.append(lambda _: fe.serve(service, lambda: None))
    env.run()
    assert fe.jobs == n and fe.pending == 0
    return fe.waited_s / n


@pytest.mark.parametrize("rho", [0.3, 0.6])
def test_one_core_is_an_md1_queue(rho: float) -> None:
    """Poisson arrivals, fixed service s, one server: mean wait rho s / (2 (1 - rho))."""
    s = 0.002
    got = _md1_wait(rho / s, s, 40_000)
    assert got == pytest.approx(rho * s / (2 * (1 - rho)), rel=0.06)


def test_more_cores_than_work_never_wait() -> None:
    assert _md1_wait(100.0, 0.001, 2_000, cores=64) == 0.0


def test_frontend_needs_a_core() -> None:
    with pytest.raises(ValueError, match="at least one core"):
        Frontend(simpy.Environment(), 0, token_s=0.001)


def _keys(return_s: float, cores: int) -> object:
    return with_profile(prefill={"ingest_s": 0.002}, decode={"ingest_s": 0.003,
                                                             "return_s": return_s},
                        host={"model": "shared-cpu", "frontend_cores": cores})


def test_alone_the_queue_adds_nothing_to_ttft() -> None:
    """One request alone: nothing to wait behind, so the first token comes exactly when
    the delays gave it."""
    cfg = config("push", qps=1.0, input_len=512, output_len=8, num_prompts=1)
    off = run(dataclasses.replace(cfg, profile=_keys(0.0001, 0))).result
    on = run(dataclasses.replace(cfg, profile=_keys(0.0001, 1))).result
    assert on["ttfts"][0] == pytest.approx(off["ttfts"][0], abs=2e-7)


def test_a_slow_frontend_sets_the_token_pace() -> None:
    """Tokens emitted faster than the frontend passes them on leave at its pace: every
    gap is exactly one token's service time (return_s far above a decode step)."""
    ret = 0.05
    cfg = config("push", qps=1.0, input_len=512, output_len=8, num_prompts=1,
                 profile=_keys(ret, 1))
    res = run(cfg).result
    assert res["itls"][0] == pytest.approx([ret] * 7, abs=2e-7)


def test_load_makes_legs_wait_behind_streaming_tokens() -> None:
    cfg = config("push", qps=20.0, input_len=512, output_len=32, num_prompts=60)
    off = run(dataclasses.replace(cfg, profile=_keys(0.002, 0))).result
    on = run(dataclasses.replace(cfg, profile=_keys(0.002, 1))).result
    assert on["completed"] == off["completed"] == 60
    assert on["mean_ttft_ms"] > off["mean_ttft_ms"]
    assert on["mean_tpot_ms"] > off["mean_tpot_ms"]


def test_deterministic() -> None:
    cfg = config("pull", qps=20.0, input_len=512, output_len=16, num_prompts=40,
                 profile=_keys(0.002, 1))
    a, b = run(cfg).result, run(cfg).result
    assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]


@pytest.mark.parametrize("bad", [-1, 1.5])
def test_frontend_cores_must_be_a_count(bad: object) -> None:
    with pytest.raises(ProfileError, match="frontend_cores"):
        with_profile(host={"model": "shared-cpu", "frontend_cores": bad})


def test_vllm_arrivals_are_the_real_runs_send_times() -> None:
    """The 'vllm' generator gives the send times the pushkv proxy recorded for
    vllm bench serve's requests (seed 0 and 1) on this machine, to the jitter of the
    client's sending and the proxy's receiving."""
    points = json.loads(DATA.read_text())["points"]
    for name, rate, seed in (("push_qps2_in64_out24_iter0.json", 2.0, 0),
                             ("push_qps8_in64_out24_iter1.json", 8.0, 1)):
        cfg = config("push", qps=rate, input_len=64, output_len=24, num_prompts=24,
                     iteration=seed)
        cfg = dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload,
                                                                    arrivals="vllm"))
        sent = run(cfg).result["start_times"]
        offsets = [t - sent[0] for t in sent]
        diffs = sorted(abs(a - b) for a, b in zip(offsets, points[name], strict=True))
        assert diffs[len(diffs) // 2] < 0.002  # the proxy's receive jitter, typically
        assert diffs[-1] < 0.02  # a request the loaded client sent late


def test_default_arrivals_are_the_simulators_own() -> None:
    base = config("push", qps=2.0, num_prompts=24)
    vllm = dataclasses.replace(base, workload=dataclasses.replace(base.workload,
                                                                  arrivals="vllm"))
    assert run(base).result["start_times"] != run(vllm).result["start_times"]


def test_unknown_arrivals_refused() -> None:
    with pytest.raises(WorkloadError, match="arrivals"):
        WorkloadConfig(arrivals="uniform")


def test_measure_writes_the_frontends_cores() -> None:
    """The measure step records the machine's cores; the frontends get those no engine of
    the pair is pinned to, and one at least."""
    from test_sim_measure import GOOD

    from pushkv.fit.cpu_profile import profile_data
    from pushkv.sim.host.frontend import frontend_cores

    assert [frontend_cores(n) for n in (1, 2, 3, 16)] == [1, 1, 1, 14]
    assert "host" not in profile_data(GOOD)  # not recorded: off, dedicated
    got = profile_data(dataclasses.replace(GOOD, cpu_count=2))
    assert got["host"]["frontend_cores"] == 1 and got["host"]["model"] == "shared-cpu"


def test_the_cli_takes_vllms_send_times(tmp_path: Path) -> None:
    from pushkv.sim.cli import main

    outs = []
    for arrivals in ("vllm", "pushkv"):
        out = tmp_path / arrivals
        assert main(["sim", "--mode", "push", "--qps", "2", "--input-len", "64",
                     "--output-len", "4", "--num-prompts", "24", "--arrivals", arrivals,
                     "--result-dir", str(out)]) == 0
        (path,) = out.glob("*.json")
        outs.append(json.loads(path.read_text())["start_times"])
    points = json.loads(DATA.read_text())["points"]["push_qps2_in64_out24_iter0.json"]
    assert [t - outs[0][0] for t in outs[0]] == pytest.approx(points, abs=0.02)
    assert outs[0] != outs[1]


def test_the_probes_wake_up_tail() -> None:
    """What the probe keeps of its wake-ups besides the median: p90, p99, the largest and
    the share of stalls over 10 ms."""
    from pushkv.fit.cores import CoreProbe

    probe = CoreProbe(cores=())
    probe.wakes[0] = [0.0001] * 95 + [0.02] * 4 + [0.3]
    assert probe.wake_tail(0) == {"p90_s": 0.0001, "p99_s": 0.3, "max_s": 0.3,
                                  "over_10ms": 0.05}
    assert probe.wake_tail(1) == {"p90_s": 0.0, "p99_s": 0.0, "max_s": 0.0, "over_10ms": 0.0}
    assert probe.wake_s(0) == 0.0001


def test_the_probes_wake_ups_at_quantiles() -> None:
    """Every core's wake-ups pooled, at evenly spaced quantiles: the midpoints of equal
    slices, so the tail a mean depends on is kept (not only the median)."""
    from pushkv.fit.cores import quantiles

    assert quantiles([float(i) for i in range(1000)], 10) == [50.0 + 100 * i
                                                              for i in range(10)]
    assert quantiles([], 10) == [] and quantiles([3.0], 4) == [3.0] * 4
    with pytest.raises(ValueError, match="at least one point"):
        quantiles([1.0], 0)
    # two cores' wake-ups pooled, as wake_beside pools them: the one 50 ms is kept
    got = quantiles([0.001] * 9 + [0.050] + [0.0001] * 10, 20)
    assert got == [0.0001] * 10 + [0.001] * 9 + [0.050]


def test_steal_between_two_readings_of_proc_stat() -> None:
    """The host's share of each CPU from two ``/proc/stat`` texts, against the closed form:
    of the wall, steal / all ticks; of the work, steal / (steal + busy)."""
    from pushkv.hostprobe import cpu_times, steal

    before = cpu_times("cpu  9 9 9 9 9 9 9 9 0 0\n"
                       "cpu0 100 0 50 1000 10 0 5 20 0 0\n"
                       "cpu1 200 0 60 900 0 0 0 0 0 0\nintr 1 2 3\n")
    after = cpu_times("cpu  9 9 9 9 9 9 9 9 0 0\n"
                      "cpu0 160 0 70 1100 10 0 5 70 0 0\n"
                      "cpu1 200 0 60 1000 0 0 0 0 0 0\n")
    assert sorted(before) == [0, 1]  # the aggregate line is not a CPU
    got = steal(before, after)
    # cpu0: user 60 + system 20 busy, idle 100, steal 50: 230 ticks in all
    assert got[0]["of_wall"] == 50 / 230
    assert got[0]["of_work"] == 50 / 130
    assert got[1] == {"of_wall": 0.0, "of_work": 0.0}  # idle throughout
    assert steal(before, {}) == {}
    # an old kernel's shorter line: the missing fields count 0
    assert cpu_times("cpu0 1 2 3 4\n")[0]["steal"] == 0


def test_autogroup_reads_the_kernels_setting(tmp_path) -> None:
    """``sched_autogroup_enabled``: 1 on, 0 off, absent None; and this machine's is one
    of the three."""
    from pushkv.hostprobe import autogroup

    f = tmp_path / "sched_autogroup_enabled"
    f.write_text("1\n")
    assert autogroup(f) is True
    f.write_text("0\n")
    assert autogroup(f) is False
    assert autogroup(tmp_path / "absent") is None
    assert autogroup() in (True, False, None)


def test_steal_on_this_machine() -> None:
    """The real ``/proc/stat``: every CPU present, shares within [0, 1]."""
    import os

    from pushkv.hostprobe import cpu_times, steal

    a = cpu_times()
    if not a:
        pytest.skip("no /proc/stat here")
    assert len(a) == os.cpu_count()
    for share in steal(a, cpu_times()).values():
        assert 0.0 <= share["of_wall"] <= 1.0 and 0.0 <= share["of_work"] <= 1.0
