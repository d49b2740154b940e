"""The sim-vs-real library's simulated half (:mod:`pushkv.fit.sim_vs_real`) on a committed
sample of real results.

``data/sim_vs_real/real`` holds two ``vllm bench serve`` result files of one real run
(pushkv push and vLLM pull, 24 prompts, 2 QPS, 64 tokens in, 24 out) and what the
core probe and the servers' metrics said meanwhile. The simulator half must find
the points, simulate them with the committed profile, three ways, and compare."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from pushkv.fit.sim_vs_real.deployment import (
    SchedSamples,
    active_s,
    engine_spans,
    gc_line,
    gc_pauses,
    intake,
    intake_line,
    load_span,
    part_pids,
    parts,
    per_request,
    spans_line,
    threads_line,
)
from pushkv.fit.sim_vs_real.keys import gauge_keys, gauge_rate, gauge_speed, noise_table, speed_over
from pushkv.fit.sim_vs_real.report import BAND, compare, interval, precision
from pushkv.fit.sim_vs_real.runs import (
    PROFILE,
    SHARES,
    file_name,
    point_prompts,
    real_points,
    steal_record,
)
from pushkv.fit.sim_vs_real.simulate import run_sim
from pushkv.fit.sim_vs_real.tables import cpu_rows, cpu_table, iteration_rows, lone_gap

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data" / "sim_vs_real" / "real"


def test_a_points_iterations_beside_what_the_machine_did(tmp_path: Path) -> None:
    """The top rate's iterations, each with its real and simulated mean TTFT and what the
    run recorded meanwhile; a field a run did not record shows as '-', not as 0."""
    real, sim = tmp_path / "real", tmp_path / "sim"
    real.mkdir()
    sim.mkdir()
    push, pull = file_name("push", 2.0, 64, 24, 0), file_name("pull", 2.0, 64, 24, 0)
    for name, ttft in ((push, 40.0), (pull, 50.0)):
        data = json.loads((DATA / name).read_text())
        (real / name).write_text(json.dumps(data))
        (sim / name).write_text(json.dumps(data | {"mean_ttft_ms": ttft}))
    shares = {push: {
        "engine": {"decode_token_s": 0.0121},
        "threads": {"prefill": {"pinned": {"cores": 0.63}}, "decode": {"pinned": {"cores": 0.39}}},
        "gc": {"decode_api": {"max_ms": 78.9}, "router": {"max_ms": 1.0}},
        "speed": {"prefill": 100.0, "decode": 90.0},
        "gauges": [{"speed": {"prefill": 100.0, "decode": 100.0}}]}}
    text, rows = iteration_rows(real, sim, shares, input_len=64, rate=2.0)
    assert [r["mode"] for r in rows] == ["pull", "push"]
    pl, ps = rows
    assert ps["sim_ttft_ms"] == 40.0 and pl["sim_ttft_ms"] == 50.0
    assert ps["real_ttft_ms"] == round(json.loads((DATA / push).read_text())["mean_ttft_ms"], 1)
    assert (ps["decode_ms_a_token"], ps["prefill_pinned_cores"], ps["decode_pinned_cores"]) == (
        12.1, 0.63, 0.39)
    assert (ps["frontend_gc_max_ms"], ps["gc_part"]) == (78.9, "decode_api")
    assert ps["speed"] == {"prefill": 1.0, "decode": 0.9}
    assert pl["decode_ms_a_token"] is None and pl["gc_part"] is None and pl["speed"] is None
    assert "| push | 0 |" in text and "78.9 (decode_api)" in text and "| - / - |" in text
    assert iteration_rows(real, sim, shares, input_len=64, rate=8.0) == ("", [])


def test_a_point_sends_for_its_seconds_at_its_rate() -> None:
    assert point_prompts(2.0, 48) == 48
    assert point_prompts(2.0, 48, 8.0) == 48  # 16 in 8 s: the count stands
    assert point_prompts(24.0, 48, 8.0) == 192
    assert point_prompts(12.5, 48, 8.0) == 100
    assert point_prompts(7.0, 48, 7.1) == 50  # rounded up
    for bad in ((2.0, 0, None), (2.0, 48, 0.0), (0.0, 48, 8.0), (2.0, 48, float("nan"))):
        with pytest.raises(ValueError):
            point_prompts(*bad)


def test_points_of_a_run_may_send_different_counts(tmp_path: Path) -> None:
    """A run with ``--point-seconds`` sends more requests at its higher rates: each point
    is simulated with its own count, and only the output length must be the run's."""
    real = tmp_path / "real"
    real.mkdir()
    for f in DATA.glob("*_iter0.json"):
        shutil.copy(f, real / f.name)
    pull = file_name("pull", 2.0, 64, 24, 0)
    data = json.loads((real / pull).read_text())
    data["num_prompts"] = 30
    (real / pull).write_text(json.dumps(data))
    points, output_len, prompts = real_points(real)
    assert prompts[pull] == 30 and prompts[file_name("push", 2.0, 64, 24, 0)] == 24
    run_sim(PROFILE, tmp_path / "sim", points, output_len, prompts)
    got = json.loads((tmp_path / "sim" / pull).read_text())
    assert got["completed"] == 30
    push = json.loads((tmp_path / "sim" / file_name("push", 2.0, 64, 24, 0)).read_text())
    assert push["completed"] == 24
    data["output_len"] = 32  # the name says 24: a file of another length is refused
    (real / file_name("pull", 2.0, 64, 32, 0)).write_text(json.dumps(data))
    with pytest.raises(SystemExit, match="mixed output lengths"):
        real_points(real)


def test_the_simulator_half_runs_on_real_results(tmp_path: Path) -> None:
    points, output_len, num_prompts = real_points(DATA)
    assert sorted(p[0] for p in points) == ["pull", "push"]
    assert output_len == 24
    assert num_prompts == {file_name(m, q, i, 24, it): 24 for m, i, q, it in points}
    probe = json.loads((DATA / SHARES).read_text())
    runs = {"own": {}, "probe": {"shares": probe},
            "steps": {"shares": probe, "server_steps": True}}
    summaries = {}
    for name, kw in runs.items():
        out = tmp_path / name
        run_sim(PROFILE, out, points, output_len, num_prompts, **kw)
        assert len(list(out.glob("*_iter0.json"))) == 2
        table, summaries[name] = compare(DATA, out)
        assert "| push | 64 | 2 |" in table and "| pull | 64 | 2 |" in table
        s = summaries[name]
        assert s["points"] == 2
        for k in ("ttft_ratio_min", "ttft_ratio_max", "tpot_ratio_min", "tpot_ratio_max"):
            assert math.isfinite(s[k]) and s[k] > 0
    # The probe's wake-ups and the servers' slower steps only lengthen simulated TTFT.
    assert summaries["probe"]["ttft_ratio_min"] > summaries["own"]["ttft_ratio_min"]
    assert summaries["steps"]["ttft_ratio_max"] > summaries["own"]["ttft_ratio_max"]


#: how much later the synthetic gauges' client gets a request's first output than a
#: later one, beyond the router's marks (network.client_first_s)
FIRST_LATER_S = 0.0012


def _gauged_run(tmp_path: Path, *, slow: float = 1.0, iterations: int = 1,
                scales: tuple[float, ...] = (),
                rates: dict[int, float] | None = None) -> tuple[Path, dict]:
    """A copy of the sample's two points (``iterations`` of each, the same results),
    each with two gauges of 5 lone requests whose marks (router and servers) and client
    latencies are synthetic: the push pair's requests take ``slow`` times as long as the
    pull pair's pattern does, and a mode's k-th gauge ``scales[k]`` times as long.
    ``rates``: the rate each iteration's gauges record they ran at (by iteration; none
    recorded without, as gauges before they ran at their points' rates)."""
    import shutil

    real = tmp_path / "real"
    shutil.copytree(DATA, real)
    if iterations > 1:
        shares = json.loads((real / "cpu_probe.json").read_text())
        for fname in list(shares):
            for it in range(1, iterations):
                other = fname.replace("_iter0", f"_iter{it}")
                (real / other).write_text((real / fname).read_text())
                shares[other] = json.loads(json.dumps(shares[fname]))
        (real / "cpu_probe.json").write_text(json.dumps(shares))
    push = {"received": 0, "legs_sent": 0.2, "prefill_seen": 4, "decode_seen": 5,
            "registration_shipped": 5.5, "registration_handed": 6.5, "prefill_finished": 9,
            "write_posted": 10, "notify_received": 12, "ready": 13, "ready_scheduled": 13.5,
            "decode_scheduled": 14.5, "first_token": 20, "last_token": 66,
            "answer_sent": 66.5}
    pull = {"received": 0, "legs_sent": 0.2, "prefill_seen": 3, "prefill_finished": 8,
            "decode_seen": 17, "ready_scheduled": 21, "decode_scheduled": 22,
            "first_token": 28, "last_token": 74, "answer_sent": 74.5}
    shares = json.loads((real / "cpu_probe.json").read_text())
    t = 1000.0
    nth = {"push": 0, "pull": 0}
    for fname, got in sorted(shares.items(), key=lambda kv: _by_iteration(kv[0])):
        mode = fname.split("_")[0]
        pattern, base = (push, slow) if mode == "push" else (pull, 1.0)
        router, deployment = {"push": ("push", "pushkv"), "pull": ("pull", "nixl-pull")}[mode]
        gauges = []
        for side in ("before", "after"):
            scale = base * (scales[nth[mode] % len(scales)] if scales else 1.0)
            nth[mode] += 1
            marks, lat, ttft = {}, [], []
            t0 = t
            for i in range(5):
                rid = f"{fname}-{side}-{i}"
                marks[rid] = {e: t + ms * scale / 1e3 for e, ms in pattern.items()}
                lat.append((pattern["answer_sent"] - pattern["legs_sent"]) * scale / 1e3
                           + 0.0015)
                ttft.append((pattern["first_token"] - pattern["legs_sent"]) * scale / 1e3
                            + 0.0015 + FIRST_LATER_S)
                t += 1.0
            for d, keep in ((router, {"received", "legs_sent", "first_token", "last_token",
                                      "answer_sent"}), (deployment, None)):
                out = real / "timeline" / d
                out.mkdir(parents=True, exist_ok=True)
                with (out / f"timeline-{len(gauges)}{fname}.jsonl").open("w") as f:
                    for rid, ms in marks.items():
                        for ev, at in ms.items():
                            if keep is None or ev in keep:  # the router: its own
                                f.write(json.dumps({"id": rid, "ev": ev, "t": at,
                                                    "p": d}) + "\n")
            name = f"gauge/{Path(fname).stem}_{side}.json"
            (real / "gauge").mkdir(exist_ok=True)
            (real / name).write_text(json.dumps({
                "latencies": lat, "completed": len(lat),
                "mean_ttft_ms": sum(ttft) / len(ttft) * 1e3,
                "mean_e2el_ms": sum(lat) / len(lat) * 1e3}))
            gauges.append({"window": [t0, t], "file": name, "input_len": 64})
            if rates is not None:
                gauges[-1]["qps"] = rates[_by_iteration(fname)[0]]
            t += 10.0
        got["gauges"] = gauges
        got["cores_busy"] = {"prefill": 1.25, "decode": 1.9, "token_work_s": 0.0004,
                             "token_api_s": 0.00025, "token_item_s": 0.00015,
                             "token_api_item_s": 0.00008}
        got["host_cores"] = 2
    (real / "cpu_probe.json").write_text(json.dumps(shares))
    return real, shares


def _by_iteration(fname: str) -> tuple[int, str]:
    """Points in the order their iterations ran: by iteration, then name."""
    return int(fname.rsplit("_iter", 1)[1].split(".")[0]), fname


def test_a_points_keys_are_shrunk_by_how_far_the_runs_gauges_tell_points_apart(
        tmp_path: Path) -> None:
    """Three iterations of each mode, the middle one's two gauges 1.6 times as slow as
    the others' (gauge scales 1, 1, 1.6, 1.6, 1, 1): successive gauges differ by 0, 0.6,
    0, 0.6, 0 -- noise variance 0.072 -- around a variance of 0.08, so drift 0.008 and a
    point of two gauges keeps 0.008 / (0.008 + 0.036) = 2/11 of its own deviation from
    the mean (scale 1.2); a key that is affine in the scale keeps 2/11 of its."""
    real, shares = _gauged_run(tmp_path, iterations=3, scales=(1.0, 1.0, 1.6, 1.6, 1.0, 1.0))
    _, output_len, _ = real_points(real)
    noise: dict = {}
    shrunk, _ = gauge_keys(real, shares, PROFILE, output_len, noise_out=noise)
    raw, _ = gauge_keys(real, shares, PROFILE, output_len, shrink=False)
    assert set(noise) == {"push_in64", "pull_in64"}
    for mode, key in (("push", ("decode", "decode_step_overhead_s")),
                      ("pull", ("prefill", "return_s"))):
        got = noise[f"{mode}_in64"][".".join(key)]
        slow_, fast = (raw[f"{mode}_qps2_in64_out24_iter{it}.json"][key[0]][key[1]]
                       for it in (1, 0))
        per_scale = (slow_ - fast) / 0.6
        assert per_scale > 0
        assert got["noise_var"] == pytest.approx(0.072 * per_scale**2)
        assert got["drift_var"] == pytest.approx(0.008 * per_scale**2)
        mean = fast + 0.2 * per_scale
        for it, own in ((0, fast), (1, slow_), (2, fast)):
            point = shrunk[f"{mode}_qps2_in64_out24_iter{it}.json"][key[0]][key[1]]
            assert point == pytest.approx(mean + 2 / 11 * (own - mean))
    # with two gauges a mode, as every test above: nothing to estimate, nothing shrunk
    real1, shares1 = _gauged_run(tmp_path / "one")
    one, _ = gauge_keys(real1, shares1, PROFILE, output_len)
    as_measured, _ = gauge_keys(real1, shares1, PROFILE, output_len, shrink=False)
    assert one == as_measured
    table = noise_table(noise)
    assert "| push_in64 | decode.decode_step_overhead_s |" in table and "0.18 |" in table


def test_each_point_is_simulated_with_the_profile_its_gauges_measured(tmp_path: Path) -> None:
    """The gauge way: a point's steps and keys from the lone requests
    around it, the run's push-only keys and spread from the push gauges, the client's
    hop from the gauges' own latencies; the simulated points then run and compare."""
    real, shares = _gauged_run(tmp_path)
    points, output_len, num_prompts = real_points(real)
    per_point, run = gauge_keys(real, shares, PROFILE, output_len)
    push = per_point["push_qps2_in64_out24_iter0.json"]
    pull = per_point["pull_qps2_in64_out24_iter0.json"]
    assert push["decode"]["decode_step_overhead_s"] == pytest.approx(
        0.046 / 23 - bench_profile().decode.step_token_s)
    assert push["network"]["client_hop_s"] == pytest.approx(0.0015)
    assert pull["network"]["client_hop_s"] == pytest.approx(0.0015)
    for point in (push, pull):  # the client's first output, later than the others
        assert point["network"]["client_first_s"] == pytest.approx(FIRST_LATER_S)
    # the pull point keeps the push gauges' decode ingestion (its own timeline has none)
    assert pull["decode"]["ingest_s"] == pytest.approx(run["decode"]["ingest_s"])
    assert pull["prefill"]["ingest_s"] == pytest.approx(
        0.0028 - bench_profile().network.router_hop_s)
    assert len(run["host"]["spread"]) == 10  # 10 lone push requests
    assert run["host"]["model"] == push["host"]["model"] == "shared-cpu"
    assert push["host"]["decode"]["cores_busy"] == 1.9
    assert pull["host"]["prefill"]["cores_busy"] == 1.25
    assert push["host"]["cores"] == pull["host"]["cores"] == 2
    assert push["host"]["token_work_s"] == pull["host"]["token_work_s"] == 0.0004
    # the frontends' keys go to the host, none taken for an engine's side
    assert {k: push["host"][k] for k in ("token_api_s", "token_item_s", "token_api_item_s")
            } == {"token_api_s": 0.00025, "token_item_s": 0.00015, "token_api_item_s": 0.00008}
    assert not {"token_api_s", "token_item_s", "token_api_item_s"} & set(push["host"]["decode"])
    out = tmp_path / "sim-gauge"
    run_sim(PROFILE, out, points, output_len, num_prompts, gauges=per_point)
    _, summary = compare(real, out)
    assert summary["points"] == 2
    # a slower push pair in its gauges gives a slower simulated push point
    slow_real, slow_shares = _gauged_run(tmp_path / "slow", slow=2.0)
    slow_points, _ = gauge_keys(slow_real, slow_shares, PROFILE, output_len)
    slow_out = tmp_path / "sim-slow"
    run_sim(PROFILE, slow_out, points, output_len, num_prompts,
            gauges=slow_points)
    fast = json.loads((out / "push_qps2_in64_out24_iter0.json").read_text())
    slow = json.loads((slow_out / "push_qps2_in64_out24_iter0.json").read_text())
    assert slow["mean_ttft_ms"] > 1.5 * fast["mean_ttft_ms"]
    assert slow["mean_tpot_ms"] > 1.5 * fast["mean_tpot_ms"]


def test_the_api_servers_loops_only_where_asked(tmp_path: Path) -> None:
    """A run that measured the two jobs' keys simulates them only with ``api_loops``:
    without, exactly as the same run without those keys (the one frontend queue)."""
    real, shares = _gauged_run(tmp_path)
    points, output_len, num_prompts = real_points(real)
    per_point, _ = gauge_keys(real, shares, PROFILE, output_len)
    without = {f: {t: {k: v for k, v in kv.items()
                       if k not in ("token_api_s", "token_item_s", "token_api_item_s")}
                   if isinstance(kv, dict) else kv for t, kv in point.items()}
               for f, point in per_point.items()}
    got = {}
    for name, gauges, loops in (("asked", per_point, True), ("not", per_point, False),
                                ("none", without, False)):
        run_sim(PROFILE, tmp_path / name, points, output_len, num_prompts, gauges=gauges,
                frontend_cores=1, merge_tokens=output_len, api_loops=loops)
        got[name] = [json.loads(f.read_text())["ttfts"]
                     for f in sorted((tmp_path / name).glob("*_iter*.json"))]
    assert got["not"] == got["none"]
    assert got["asked"] != got["none"]


def test_engines_are_pinned_only_where_asked_and_the_host_has_a_core_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pinned_engines`` sets ``host.pinned`` on every point whose host has two cores or
    more; on one core it leaves the pool (nothing to pin to), and unasked it pins none
    (the lone requests a gauge's steps are fitted on run on no shared cores)."""
    import pushkv.sim.runner as runner

    real, shares = _gauged_run(tmp_path)
    points, output_len, num_prompts = real_points(real)
    per_point, _ = gauge_keys(real, shares, PROFILE, output_len)
    seen: list[tuple[int, bool]] = []  # the points' runs, not the lone fits' beside
    simulate = runner.run

    def spy(cfg, **kw):  # type: ignore[no-untyped-def]
        if cfg.workload.num_prompts == max(num_prompts.values()):
            seen.append((cfg.profile.host.cores, cfg.profile.host.pinned))
        return simulate(cfg, **kw)

    monkeypatch.setattr(runner, "run", spy)
    for cores, asked in ((2, True), (1, True), (2, False)):
        seen.clear()
        run_sim(PROFILE, tmp_path / f"sim-{cores}-{asked}", points, output_len, num_prompts,
                gauges=per_point, frontend_cores=1, host_cores=cores, pinned_engines=asked)
        assert seen == [(cores, asked and cores >= 2)] * len(points), (cores, asked)



def test_each_parts_cores_real_against_the_simulated_processes(tmp_path: Path) -> None:
    """The threads' cores per part beside the simulated processes' work over the run,
    iterations averaged; a point without threads or without the simulated split is left
    out, and the table says real / simulated."""
    real, sim = tmp_path / "real", tmp_path / "sim"
    real.mkdir()
    sim.mkdir()
    by = {"prefill engine": 0.2, "prefill beside": 0.1, "prefill-0": 0.1,
          "decode engine": 0.8, "decode-0": 0.3, "relay": 0.2}
    for it, busy in enumerate((1.0, 2.0)):
        name = file_name("push", 8.0, 64, 24, it)
        (real / name).write_text("{}")
        (sim / name).write_text(json.dumps({
            "duration": 2.0, "pushkv": {"host_busy_s_by_process": {
                k: v * busy for k, v in by.items()}}}))
    bare = file_name("pull", 8.0, 64, 24, 0)
    (real / bare).write_text("{}")
    (sim / bare).write_text(json.dumps({"duration": 2.0, "pushkv": {}}))
    shares = {file_name("push", 8.0, 64, 24, it): {"threads": {
        "prefill": {"pinned": {"cores": 0.2}, "floating": {"cores": 0.1}},
        "decode": {"pinned": {"cores": dec}, "floating": {"cores": 0.1}},
        "decode_api": {"floating": {"cores": 0.2}}}} for it, dec in ((0, 0.5), (1, 0.7))}
    shares[bare] = {"threads": {"decode": {"pinned": {"cores": 0.5}}}}
    rows = cpu_rows(real, sim, shares)
    assert len(rows) == 1
    r = rows[0]
    assert (r["mode"], r["qps"]) == ("push", 8.0)
    assert r["prefill_real"] == pytest.approx(0.3) and r["decode_real"] == pytest.approx(0.7)
    assert r["prefill_sim"] == pytest.approx(0.4 * 1.5 / 2)  # (0.4 + 0.8) / 2 s, averaged
    assert r["decode_sim"] == pytest.approx(0.8 * 1.5 / 2)
    assert r["decode_api_sim"] == pytest.approx(0.3 * 1.5 / 2)
    assert "router_real" not in r  # the run recorded no router threads
    text = cpu_table(rows)
    assert "| push | 8 | 0.30 / 0.30 | 0.70 / 0.60 | 0.20 / 0.23 | - | 1.20 / 1.12 |" in text
    assert cpu_table([]) == ""


def test_a_points_steps_are_fitted_on_the_host_it_is_simulated_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lone requests a gauge's steps are fitted with (:func:`lone_steps`) run on
    the point's host as it is simulated: engines pinned where the point's are, the one
    frontend queue where it has one. Fitted on another host, a lone request simulated
    on its own steps slower or faster than its gauge timed it."""
    import pushkv.sim.runner as runner
    from pushkv.fit.measure_connector import LONE_REQUESTS

    real, shares = _gauged_run(tmp_path)
    points, output_len, num_prompts = real_points(real)
    per_point, _ = gauge_keys(real, shares, PROFILE, output_len)
    assert all(p["host"]["token_api_s"] > 0 for p in per_point.values())
    fits: list[tuple[bool, float]] = []  # the fits' lone requests on the shared cores
    simulate = runner.run

    def spy(cfg, **kw):  # type: ignore[no-untyped-def]
        h = cfg.profile.host
        if cfg.workload.num_prompts == LONE_REQUESTS and h.cores:
            fits.append((h.pinned, h.token_api_s))
        return simulate(cfg, **kw)

    monkeypatch.setattr(runner, "run", spy)
    for placed in (True, False):
        fits.clear()
        run_sim(PROFILE, tmp_path / f"sim-{placed}", points, output_len, num_prompts,
                gauges=per_point, frontend_cores=1, host_cores=2, pinned_engines=placed,
                api_loops=placed)
        assert fits and {f[0] for f in fits} == {placed}
        assert {f[1] > 0 for f in fits} == {placed}


def test_a_points_steps_are_its_gauges_lone_wall_times_not_counted_twice(
        tmp_path: Path) -> None:
    """A gauge times a lone request's decode at 2 ms a token, the work it brings beside
    its steps (decode keeping 1.9 cores busy, its tokens' way out through one frontend
    core) in that time; the gauge way's point at 2 QPS steps at that again, where the
    steps as timed, on one pool of the shared cores, count that work twice
    (``wall_steps``). Pinned, the fit is :func:`lone_steps`' own (test_sim_lone_steps)."""
    real, shares = _gauged_run(tmp_path)
    points, output_len, num_prompts = real_points(real)
    per_point, _ = gauge_keys(real, shares, PROFILE, output_len)
    name = "push_qps2_in64_out24_iter0.json"
    fitted, walls = tmp_path / "fitted", tmp_path / "walls"
    one_pool = {"pinned_engines": False, "api_loops": False}  # the claim's host
    run_sim(PROFILE, fitted, points, output_len, num_prompts, gauges=per_point,
            frontend_cores=1, **one_pool)
    run_sim(PROFILE, walls, points, output_len, num_prompts, gauges=per_point,
            frontend_cores=1, wall_steps=True, **one_pool)
    per_token_ms = 46.0 / 23
    got = json.loads((fitted / name).read_text())["median_tpot_ms"]
    twice = json.loads((walls / name).read_text())["median_tpot_ms"]
    assert got == pytest.approx(per_token_ms, rel=0.05)
    assert twice > 1.05 * per_token_ms


def test_a_point_whose_cores_ran_slower_than_its_gauges_is_simulated_slower(
        tmp_path: Path) -> None:
    """The gauge way with ``speeds``: each side's ``cpu_speed`` is the probe's rate during
    the point over the mean of its gauges' (:func:`gauge_speed`); a point whose cores
    ran at half their gauges' speed is simulated slower, one at their speed as without."""
    assert gauge_speed({"speed": {"prefill": 100.0, "decode": 90.0},
                        "gauges": [{"speed": {"prefill": 200.0, "decode": 100.0}},
                                   {"speed": {"prefill": 200.0, "decode": 80.0}}]}
                       ) == {"prefill": 0.5, "decode": 1.0}
    # runs whose gauges were not probed, or a probe that saw nothing: no speed
    assert gauge_speed({"speed": {"prefill": 1.0, "decode": 1.0},
                        "gauges": [{}, {}]}) == {}
    assert gauge_speed({"speed": {"prefill": 0.0, "decode": 1.0}, "gauges": [
        {"speed": {"prefill": 1.0, "decode": 1.0}}]}) == {}
    real, shares = _gauged_run(tmp_path)
    points, output_len, num_prompts = real_points(real)
    per_point, _ = gauge_keys(real, shares, PROFILE, output_len)
    name = "push_qps2_in64_out24_iter0.json"

    def simulated(speed: float, out: Path) -> dict[str, float]:
        probed = {k: dict(v) for k, v in shares.items()}
        probed[name]["speed"] = {"prefill": 100.0 * speed, "decode": 100.0 * speed}
        probed[name]["gauges"] = [dict(g, speed={"prefill": 100.0, "decode": 100.0})
                                  for g in probed[name]["gauges"]]
        run_sim(PROFILE, out, points, output_len, num_prompts,
                gauges=per_point, shares=probed, speeds=True)
        return json.loads((out / name).read_text())

    plain = tmp_path / "plain"
    run_sim(PROFILE, plain, points, output_len, num_prompts, gauges=per_point)
    same = simulated(1.0, tmp_path / "same")
    half = simulated(0.5, tmp_path / "half")
    assert same["mean_ttft_ms"] == json.loads((plain / name).read_text())["mean_ttft_ms"]
    assert half["mean_ttft_ms"] > 1.3 * same["mean_ttft_ms"]
    assert half["mean_tpot_ms"] > 1.3 * same["mean_tpot_ms"]


def test_points_without_gauges_are_refused_in_a_line(tmp_path: Path) -> None:
    from pushkv.fit.cpu_profile import MeasurementError

    probe = json.loads((DATA / SHARES).read_text())
    with pytest.raises(MeasurementError, match="--gauge"):
        gauge_keys(DATA, probe, PROFILE, 24)


def bench_profile():  # type: ignore[no-untyped-def]
    from pushkv.sim.profile import load_profile

    return load_profile(PROFILE)


def test_cores_busy_is_the_mean_over_the_runs_starts_of_a_deployment(tmp_path: Path) -> None:
    """Each start of a deployment measures what its processes burn while an engine steps
    (24 lone requests, noisy); every point of the mode gets the mean over the starts."""
    real, shares = _gauged_run(tmp_path)
    for mode, prefill in (("push", 3.0), ("pull", 5.0)):
        first = f"{mode}_qps2_in64_out24_iter0.json"
        second = f"{mode}_qps2_in64_out24_iter1.json"
        (real / second).write_text((real / first).read_text())
        shares[second] = json.loads(json.dumps(shares[first]))
        shares[first]["cores_busy"] = {"prefill": prefill - 1, "decode": 1.2,
                                       "token_work_s": 0.001}
        shares[second]["cores_busy"] = {"prefill": prefill + 1, "decode": 1.4,
                                        "token_work_s": 0.002}
    _, output_len, _ = real_points(real)
    per_point, _ = gauge_keys(real, shares, PROFILE, output_len)
    for mode, prefill in (("push", 3.0), ("pull", 5.0)):
        for it in (0, 1):
            keys = per_point[f"{mode}_qps2_in64_out24_iter{it}.json"]
            assert keys["host"]["prefill"]["cores_busy"] == pytest.approx(prefill)
            assert keys["host"]["decode"]["cores_busy"] == pytest.approx(1.3)
            assert keys["host"]["token_work_s"] == pytest.approx(0.0015)


def test_an_engines_active_time_is_stepping_and_holding_a_lone_request() -> None:
    """cores_busy is taken over the time an engine's loop has the request in hand: a
    prefill until its KV has left (push: the write completed; pull: decode knows the read
    done), a decode from its first look at the request to the last token."""
    push = {"a": {"prefill_seen": 1.0, "prefill_finished": 1.008, "write_completed": 1.012,
                  "decode_seen": 0.999, "last_token": 1.2},
            "b": {"prefill_seen": 2.0, "prefill_finished": 2.01}}  # no end: not counted
    assert active_s(push, "prefill", "push") == pytest.approx(0.012)
    assert active_s(push, "decode", "push") == pytest.approx(0.201)
    pull = {"a": {"prefill_seen": 1.0, "prefill_finished": 1.008, "ready_scheduled": 1.04,
                  "decode_seen": 1.012, "last_token": 1.2}}
    assert active_s(pull, "prefill", "pull") == pytest.approx(0.04)
    assert active_s(pull, "decode", "pull") == pytest.approx(0.188)


def test_cores_busy_over_the_active_time_makes_the_profile_step_while_holding(
        tmp_path: Path) -> None:
    """A start measured over the active time (``holding``) sets steps_while_holding on
    both sides; one measured over the stepping time alone (older runs) does not."""
    real, shares = _gauged_run(tmp_path)
    _, output_len, _ = real_points(real)
    old, _ = gauge_keys(real, shares, PROFILE, output_len)
    for got in shares.values():
        got["cores_busy"]["holding"] = True
    new, _ = gauge_keys(real, shares, PROFILE, output_len)
    for fname in new:
        for side in ("prefill", "decode"):
            assert old[fname]["host"][side]["steps_while_holding"] is False
            assert new[fname]["host"][side]["steps_while_holding"] is True
            assert (new[fname]["host"][side]["cores_busy"]
                    == old[fname]["host"][side]["cores_busy"])


def test_per_request_run_queue_wait_is_each_parts_growth_in_ms_a_request() -> None:
    got = per_request({"prefill": 1.0, "decode": 2.0, "router": 0.5},
                      {"prefill": 1.024, "decode": 2.0, "decode_api": 9.0}, 24)
    assert got == {"prefill": 1.0, "decode": 0.0}
    assert per_request({"a": 0.0}, {"a": 0.01}, 0) == {"a": 10.0}


def test_a_deployments_parts_split_decodes_group_at_its_api_server() -> None:
    """One definition of the parts, for the CPU of cores_busy and the run-queue waits:
    decode's instance is its process group less its API server (the group's leader)."""
    from types import SimpleNamespace

    dep = SimpleNamespace(prefill=SimpleNamespace(proc=SimpleNamespace(pid=10)),
                          decode=SimpleNamespace(proc=SimpleNamespace(pid=20)))
    per_process = {10: 1.0, 20: 2.0, 30: 0.5}
    per_group = {10: 7.0, 20: 9.0}

    def groups(pgids: list[int]) -> float:
        return sum(per_group[g] for g in pgids)

    with_router = SimpleNamespace(router=SimpleNamespace(pid=30))
    assert parts(dep, with_router, per_process.__getitem__, groups) == {
        "prefill": 7.0, "decode": 7.0, "decode_api": 2.0, "router": 0.5}
    assert "router" not in parts(dep, SimpleNamespace(router=None),
                                 per_process.__getitem__, groups)


def test_sched_samples_tell_each_parts_threads_between_the_samples_around_a_span() -> None:
    """Over a point's load: the samples bracketing it, per part and placement, CPU
    seconds a second (cores busy), run-queue seconds a second (threads waiting) and the
    wait of each wake-up; the nearest samples where none brackets it."""
    from pushkv.hostprobe import Sched, ThreadSched

    s = SchedSamples(lambda: {})
    assert s.over(0.0, 1.0) == {}  # no samples yet
    zero = ThreadSched()
    mid = ThreadSched(Sched(0.5, 0.25, 10), Sched(0.1, 0.4, 4))
    end = ThreadSched(Sched(1.0, 0.5, 20), Sched(0.2, 0.8, 8))
    s.samples = [(0.0, {"prefill": zero, "router": zero}), (1.0, {"prefill": mid}),
                 (2.0, {"prefill": end, "router": zero})]
    got = s.over(0.5, 1.5)  # from the sample at 0 to the one at 2
    assert set(got) == {"prefill", "router"}
    assert got["prefill"]["pinned"] == {"cores": 0.5, "waiting": 0.25,
                                        "wait_per_wakeup_ms": 25.0}
    assert got["prefill"]["floating"] == {"cores": 0.1, "waiting": 0.4,
                                          "wait_per_wakeup_ms": 100.0}
    assert got["router"]["pinned"]["wait_per_wakeup_ms"] == 0.0  # never woke
    assert s.over(1.0, 1.0) == {}  # one sample on both sides: no interval
    assert s.over(-5.0, 9.0)["prefill"]["pinned"]["cores"] == 0.5  # the nearest ones
    line = threads_line(got)
    assert "prefill pinned 0.50/0.25/25.00 floating 0.10/0.40/100.00" in line
    assert "router ," in line + "," and "router pinned" not in line


def test_sched_samples_sample_in_the_background_until_closed() -> None:
    calls = iter(range(1_000_000))
    with SchedSamples(lambda: {"n": next(calls)}, period_s=0.001) as s:
        assert len(s.samples) >= 1  # the first taken before the work it brackets
        from pushkv.vllm.testing import poll
        poll(lambda: len(s.samples), lambda n: n >= 3, timeout_s=30, interval_s=0.01)
    n = len(s.samples)
    assert n >= 4  # the ones taken, and one more as it closed
    assert [x[1]["n"] for x in s.samples] == list(range(n))
    assert all(a[0] <= b[0] for a, b in zip(s.samples, s.samples[1:], strict=False))


def test_a_points_load_span_runs_from_its_first_mark_to_its_last(tmp_path: Path) -> None:
    assert load_span(tmp_path, "push", (0.0, 100.0)) is None  # no timelines
    for d in ("push", "pushkv"):
        (tmp_path / "timeline" / d).mkdir(parents=True)
    assert load_span(tmp_path, "push", (0.0, 100.0)) is None  # no marks
    from pushkv.timeline import Recorder

    router = Recorder(tmp_path / "timeline" / "push", "router")
    for tid, event, t in (("a", "received", 10.0), ("a", "legs_sent", 10.1),
                          ("a", "first_token", 10.5), ("b", "received", 11.0),
                          ("b", "legs_sent", 11.1), ("b", "last_token", 12.25),
                          ("c", "legs_sent", 500.0)):  # c: another point's
        router.mark(tid * 32, event, t)
    router.close()
    Recorder(tmp_path / "timeline" / "pushkv", "decode").close()
    assert load_span(tmp_path, "push", (0.0, 100.0)) == (10.0, 12.25)


def test_a_ratios_interval_and_verdict_against_the_closed_form() -> None:
    """Mean, Student's t interval and verdict of one point's iterations' ratios."""
    got = interval([0.9, 1.0, 1.1, 1.0])
    sd = math.sqrt(0.02 / 3)
    half = 3.182 * sd / 2  # t(0.975, 3 df) x sd / sqrt(4)
    assert got["mean"] == pytest.approx(1.0)
    assert (got["low"], got["high"]) == (pytest.approx(1 - half), pytest.approx(1 + half))
    assert got["verdict"] == "in"  # [0.87, 1.13] inside 0.75-1.33
    # (1.96 x cv / (1 - 1 / 1.33))^2 iterations for an interval as narrow as the band
    assert got["iterations_needed"] == max(2, math.ceil((1.96 * sd / (1 - 1 / 1.33)) ** 2))
    # iterations that agree on a miss: out; iterations that disagree: unsure
    assert interval([0.60, 0.62, 0.58, 0.61])["verdict"] == "out"
    assert interval([1.50, 1.52, 1.48])["verdict"] == "out"
    wide = interval([0.4, 1.2, 0.6, 1.0])
    assert wide["verdict"] == "unsure" and wide["iterations_needed"] > 4
    assert interval([0.7])["verdict"] == "unsure"  # one iteration: no interval
    with pytest.raises(ValueError):
        interval([])


def test_the_precision_table_pairs_each_points_iterations(tmp_path: Path) -> None:
    """Per point, the iterations both halves ran, as ratio intervals; verdicts counted
    over every statistic; an iteration only one half ran is left out."""
    real, sim = tmp_path / "real", tmp_path / "sim"
    real.mkdir()
    sim.mkdir()

    def write(d: Path, it: int, ttft: float, tpot: float) -> None:
        (d / file_name("push", 2.0, 64, 24, it)).write_text(json.dumps(
            {"mean_ttft_ms": ttft, "median_ttft_ms": ttft, "mean_tpot_ms": tpot,
             "median_tpot_ms": tpot, "completed": 24}))

    for it, (r, s) in enumerate([(40.0, 40.0), (50.0, 45.0), (60.0, 63.0)]):
        write(real, it, r, 5.0)
        write(sim, it, s, 3.0)  # TPOT 0.6 in every iteration: out
    write(real, 3, 500.0, 5.0)  # no simulated twin
    text, got = precision(real, sim)
    assert "| push | 64 | 2 | 3 |" in text
    point = got["points"]["push_in64_qps2"]
    assert point["mean_ttft_ms"]["mean"] == pytest.approx((1.0 + 0.9 + 1.05) / 3, abs=1e-3)
    assert point["mean_tpot_ms"]["verdict"] == "out"
    assert got["verdicts"] == {"in": 2, "out": 2, "unsure": 0}
    assert got["band"] == list(BAND)
    # a statistic whose real value is 0 in every iteration has no ratio: a dash, no verdict
    for it in range(3):
        path = real / file_name("push", 2.0, 64, 24, it)
        path.write_text(json.dumps(json.loads(path.read_text()) | {"median_tpot_ms": 0.0}))
    text, got = precision(real, sim)
    assert text.rstrip().endswith("| - |")
    assert "median_tpot_ms" not in got["points"]["push_in64_qps2"]
    assert got["verdicts"] == {"in": 2, "out": 1, "unsure": 0}


def test_the_hosts_share_of_each_core_is_recorded_per_core_rounded() -> None:
    """What ``cpu_probe.json`` keeps of :func:`pushkv.hostprobe.steal` for a point and a
    gauge: JSON keys, four places."""
    from pushkv.hostprobe import cpu_times, steal

    assert steal_record({0: {"of_wall": 0.123456, "of_work": 0.5}, 1: {
        "of_wall": 0.0, "of_work": 0.0}}) == {"0": {"of_wall": 0.1235, "of_work": 0.5},
                                              "1": {"of_wall": 0.0, "of_work": 0.0}}
    now = cpu_times()
    assert json.loads(json.dumps(steal_record(steal(now, now)))) == steal_record(
        steal(now, now))


def test_each_parts_gc_pauses_within_a_span_are_summed_clipped_and_counted(
        tmp_path: Path) -> None:
    """gc_pauses: the pauses of a part's processes, wherever they were recorded, within
    the point's span (clipped to it); other processes' and other times' left out."""
    router, servers = tmp_path / "push", tmp_path / "pushkv"
    for d in (router, servers):
        d.mkdir()

    def line(pid: int, t0: float, t1: float, kind: str = "gc2") -> str:
        return json.dumps({"pause": kind, "t0": t0, "t1": t1, "p": f"x{pid}", "pid": pid})

    (router / "timeline-7.jsonl").write_text(
        json.dumps({"id": "r", "ev": "received", "t": 10.5, "p": "router"}) + "\n"
        + line(7, 10.0, 10.010) + "\n" + line(7, 9.0, 9.5) + "\n")
    # a forked child (pid 12) writes its parent's (pid 11) file
    (servers / "timeline-11.jsonl").write_text(
        line(11, 10.995, 11.010) + "\n" + line(12, 10.200, 10.203, "gc0") + "\n"
        + line(99, 10.1, 10.2) + "\n")
    pids = {"prefill": [11], "decode": [12], "router": [7], "client": [8]}
    got = gc_pauses([router, servers, tmp_path / "absent"], (10.0, 11.0), pids)
    assert got == {"prefill": {"ms": 5.0, "n": 1, "max_ms": 5.0},
                   "decode": {"ms": 3.0, "n": 1, "max_ms": 3.0},
                   "router": {"ms": 10.0, "n": 1, "max_ms": 10.0},
                   "client": {"ms": 0.0, "n": 0, "max_ms": 0.0}}
    assert gc_line(got).endswith("router 10.0/1/10.0, client 0.0/0/0.0")


def test_a_points_engine_spans_are_each_parts_steps_and_model_runs(tmp_path: Path) -> None:
    """engine_spans: a part's step and forward spans that began within the point's span,
    counted, their mean and p90, and the share of the span they took; pauses, other
    processes' spans and spans begun outside left out."""
    servers = tmp_path / "pushkv"
    servers.mkdir()

    def span(pid: int, kind: str, t0: float, ms: float) -> str:
        return json.dumps({"span": kind, "t0": t0, "t1": t0 + ms / 1e3, "p": "x", "pid": pid})

    lines = [span(11, "step", 10.0 + i / 10, 10.0) for i in range(10)]  # prefill: 10 x 10 ms
    lines += [span(12, "forward", 10.1, 40.0), span(12, "forward", 10.5, 60.0),
              span(11, "step", 9.5, 300.0), span(99, "step", 10.2, 5.0),  # outside, others'
              json.dumps({"pause": "gc2", "t0": 10.3, "t1": 10.4, "p": "x", "pid": 11})]
    (servers / "timeline-11.jsonl").write_text("\n".join(lines) + "\n")
    got = engine_spans([servers, tmp_path / "absent"], (10.0, 11.0),
                       {"prefill": [11], "decode": [12]})
    assert got == {"prefill": {"step": {"n": 10, "mean_ms": 10.0, "p90_ms": 10.0, "busy": 0.1}},
                   "decode": {"forward": {"n": 2, "mean_ms": 50.0, "p90_ms": 58.0,
                                          "busy": 0.1}}}
    assert spans_line(got) == ("engine spans (n / mean / p90 ms / busy): prefill step "
                               "10/10.00/10.00/0.10, decode forward 2/50.00/58.00/0.10")


def test_a_legs_intake_is_the_mean_of_each_segment_over_the_points_requests(
        tmp_path: Path) -> None:
    """intake: per side, arrives -> sent -> queued -> taken -> sees, averaged over the
    requests whose legs left within the window; requests outside it left out."""
    router, servers = tmp_path / "push", tmp_path / "pushkv"
    for d in (router, servers):
        d.mkdir()
    marks, legs = [], []
    for rid, t, extra in (("a", 10.0, 0.0), ("b", 10.5, 0.002), ("late", 20.0, 1.0)):
        legs.append({"id": rid, "ev": "legs_sent", "t": t})
        for i, ev in enumerate(("prefill_arrived", "prefill_sent", "prefill_queued",
                                "prefill_taken", "prefill_seen")):
            marks.append({"id": rid, "ev": ev, "t": t + i * (0.001 + extra)})
    (router / "timeline-1.jsonl").write_text("".join(json.dumps(m) + "\n" for m in legs))
    (servers / "timeline-2.jsonl").write_text("".join(json.dumps(m) + "\n" for m in marks))
    got = intake([router, servers], (9.0, 11.0))
    assert got == pytest.approx({"prefill arrived -> sent": 2.0, "prefill sent -> queued": 2.0,
                                 "prefill queued -> taken": 2.0, "prefill taken -> seen": 2.0})
    assert intake_line(got).startswith("intake (ms, mean): prefill arrived -> sent 2.0, ")
    assert intake([tmp_path / "absent"], (9.0, 11.0)) == {}


def test_part_pids_are_the_parts_processes_by_the_one_definition() -> None:
    """part_pids takes the parts from parts(): decode's group less its API server."""
    import subprocess
    import sys
    from types import SimpleNamespace

    wait = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    api = subprocess.Popen(wait, stdin=subprocess.PIPE, process_group=0)
    engine = subprocess.Popen(wait, stdin=subprocess.PIPE, process_group=api.pid)
    prefill = subprocess.Popen(wait, stdin=subprocess.PIPE, process_group=0)
    try:
        dep = SimpleNamespace(prefill=SimpleNamespace(proc=prefill),
                              decode=SimpleNamespace(proc=api))
        got = part_pids(dep, SimpleNamespace(router=SimpleNamespace(pid=7)), 9)
        assert got == {"prefill": [prefill.pid], "decode": [engine.pid],
                       "decode_api": [api.pid], "router": [7], "client": [9]}
        assert "client" not in part_pids(dep, SimpleNamespace(router=None), None)
    finally:
        for p in (api, engine, prefill):
            p.kill()
            p.wait()
            p.stdin.close()  # type: ignore[union-attr]


def test_a_gauge_runs_at_its_points_rate_unless_told_otherwise() -> None:
    from types import SimpleNamespace

    assert gauge_rate(SimpleNamespace(gauge_qps=None), 2.0) == 2.0
    assert gauge_rate(SimpleNamespace(gauge_qps=None), 8) == 8.0
    assert gauge_rate(SimpleNamespace(gauge_qps=5.0), 2.0) == 5.0


def test_a_points_keys_are_shrunk_only_toward_gauges_at_its_own_rate(
        tmp_path: Path) -> None:
    """The run of the shrinking test above, but the slow middle iteration's gauges ran
    at another rate (8 requests a second, the others at 2): gauges at different rates
    measure different lone requests (a longer idle before each costs more), so each
    rate is its own group -- with no spread within either, every point keeps its own
    gauges' keys, where one group of all six would pull the slow point 9/11 of the way
    to the run's mean."""
    real, shares = _gauged_run(tmp_path, iterations=3, scales=(1.0, 1.0, 1.6, 1.6, 1.0, 1.0),
                               rates={0: 2.0, 1: 8.0, 2: 2.0})
    _, output_len, _ = real_points(real)
    noise: dict = {}
    shrunk, _ = gauge_keys(real, shares, PROFILE, output_len, noise_out=noise)
    raw, _ = gauge_keys(real, shares, PROFILE, output_len, shrink=False)
    assert set(noise) == {f"{m}_in64_qps{q}" for m in ("push", "pull") for q in (2, 8)}
    assert noise["push_in64_qps2"]["decode.decode_step_overhead_s"]["noise_var"] == 0
    for name, keys in raw.items():
        for side, table in keys.items():
            for key, value in table.items():
                assert shrunk[name][side][key] == pytest.approx(value), (name, side, key)
    slow_ = raw["pull_qps2_in64_out24_iter1.json"]["prefill"]["return_s"]
    assert slow_ > raw["pull_qps2_in64_out24_iter0.json"]["prefill"]["return_s"]
    assert noise["pull_in64_qps8"] == {}  # two gauges: too few to tell noise from drift
    assert "| pull_in64_qps2 | prefill.return_s |" in noise_table(noise)


def test_lone_requests_of_the_gauges_are_set_against_those_of_the_points(
        tmp_path: Path) -> None:
    """lone_gap: per mode, the lone requests of the gauges (by the rate they recorded)
    and of the points (by rate), each segment's mean; and the probe's wake-ups during
    the gauges and during the points by requests in flight (idle ones left out)."""
    real = tmp_path / "real"
    pattern = {"legs_sent": 0.0, "prefill_seen": 4, "prefill_finished": 9,
               "decode_arrived": 12, "decode_seen": 17, "ready_scheduled": 21,
               "decode_scheduled": 22, "first_token": 28, "last_token": 74,
               "answer_sent": 75}
    lines: list[str] = []

    def requests(t0: float, n: int, slow: float) -> list[float]:
        """``n`` lone requests from ``t0``, 1 s apart, decode's ingestion ``slow`` x."""
        for i in range(n):
            at = {e: ms + (slow - 1) * 5 * (e not in ("legs_sent", "prefill_seen",
                                                     "prefill_finished", "decode_arrived"))
                  for e, ms in pattern.items()}
            lines.extend(json.dumps({"id": f"{t0}-{i}", "ev": e, "t": t0 + i + ms / 1e3,
                                     "p": "pull"}) for e, ms in at.items())
        return [t0, t0 + n]

    gauge = {"window": requests(100.0, 4, 1.0), "file": "gauge/g_before.json",
             "qps": 2.0, "input_len": 64}
    point = requests(200.0, 6, 3.0)
    out = real / "timeline" / "pull"
    out.mkdir(parents=True)
    (real / "timeline" / "nixl-pull").mkdir()
    (out / "timeline-1.jsonl").write_text("\n".join(lines) + "\n")
    (real / "wakes" / "gauge").mkdir(parents=True)
    (real / "wakes" / "gauge" / "g_before.json").write_text(json.dumps(
        {"0": [[100.01, 0.001], [101.02, 0.003], [100.5, 0.9]]}))
    (real / "wakes" / "pull_qps2_in64_out24_iter0.json").write_text(json.dumps(
        {"0": [[200.01, 0.010], [200.5, 0.5]], "1": [[202.02, 0.020]]}))
    shares = {"pull_qps2_in64_out24_iter0.json": {"window": point, "gauges": [gauge]}}
    text, got = lone_gap(real, shares)
    reqs = got["pull"]["requests"]
    assert list(reqs) == ["gauges qps2", "qps2"]
    assert (reqs["gauges qps2"]["n"], reqs["qps2"]["n"]) == (4, 6)
    assert reqs["gauges qps2"]["mean_ms"]["decode arrives -> sees"] == pytest.approx(5.0)
    assert reqs["qps2"]["mean_ms"]["decode arrives -> sees"] == pytest.approx(15.0)
    assert reqs["qps2"]["mean_ms"]["legs out -> first token"] == pytest.approx(38.0)
    wakes = got["pull"]["wakes"]
    assert list(wakes) == ["gauges, 1 in flight", "points, 1 in flight"]
    assert wakes["gauges, 1 in flight"] == {"n": 2, "mean_ms": 2.0, "p99_ms": 3.0}
    assert wakes["points, 1 in flight"]["n"] == 2  # the ones at 100.5, 200.5 s found none
    assert wakes["points, 1 in flight"]["mean_ms"] == pytest.approx(15.0)
    assert "| decode arrives -> sees | 5.0 | 15.0 |" in text
    assert lone_gap(real, {}) == ("", {})


def _grid_run(tmp_path: Path) -> tuple[Path, dict]:
    """:func:`_gauged_run`'s two iterations (the second's gauges 1.6 times as slow),
    each point copied to 8 QPS at 64 tokens and to 2 QPS at 128 tokens (the same
    result and record: points to hold out)."""
    real, shares = _gauged_run(tmp_path, iterations=2, scales=(1.0, 1.0, 1.6, 1.6))
    for fname in list(shares):
        for other in (fname.replace("_qps2_", "_qps8_"), fname.replace("_in64_", "_in128_")):
            (real / other).write_text((real / fname).read_text())
            shares[other] = json.loads(json.dumps(shares[fname]))
    (real / "cpu_probe.json").write_text(json.dumps(shares))
    return real, shares


def test_cross_validation_keys_held_out_points_from_the_training_points_alone(
        tmp_path: Path) -> None:
    """Trained on 2 QPS at 64 tokens: a held-out point (a higher rate, a longer prompt)
    gets the mean of the training points' keys, the training points their own; every
    figure is judged in or out of sample, and the sweep at 64 tokens has its two rates."""
    from pushkv.fit.sim_vs_real.cross import cross_validate, split

    real, shares = _grid_run(tmp_path)
    points, output_len, _ = real_points(real)
    train, held = split(points, rates=(2.0,), inputs=(64,))
    assert {p[1:3] for p in train} == {(64, 2.0)}
    assert {p[1:3] for p in held} == {(64, 8.0), (128, 2.0)}
    trained, _ = gauge_keys(real, {f: v for f, v in shares.items() if "_qps2_in64_" in f},
                            PROFILE, output_len)
    got = cross_validate(tmp_path, PROFILE, rates=(2.0,), inputs=(64,), sweep_input=64,
                         say=lambda _: None)
    assert got["keyed_from"]["push_qps8_in64_out24_iter1.json"] == "push_in64_qps2"
    assert got["keyed_from"]["pull_qps2_in128_out24_iter0.json"] == "pull_in64_qps2"
    its = [trained[f"push_qps2_in64_out24_iter{i}.json"] for i in (0, 1)]
    step = [k["decode"]["decode_step_overhead_s"] for k in its]
    assert step[1] > step[0]  # the slower gauges' iteration
    held_keys = json.loads((tmp_path / "sim-cross" / "push_qps8_in64_out24_iter0.json")
                           .read_text())  # simulated: a result file, every request done
    assert held_keys["completed"] == 24
    ins, outs = got["in_sample"], got["out_of_sample"]
    assert ins["figures"] == 2 * 4 and outs["figures"] == 4 * 4  # points x statistics
    assert set(got["points"]["in_sample"]) == {"push_in64_qps2", "pull_in64_qps2"}
    assert 0 < outs["ratio_min"] <= outs["ratio_max"]
    assert outs["decided"] <= outs["figures"] and outs["in_band"] <= outs["decided"]
    assert got["knee"]["push"]["rates"] == [2.0, 8.0]
    top = got["top_rate"]  # the sweep's top rate, every iteration of it beside its sim
    assert (top["qps"], top["input_len"]) == (8.0, 64)
    assert sorted((r["mode"], r["iter"]) for r in top["iterations"]) == sorted(
        (p[0], p[3]) for p in points if p[1:3] == (64, 8.0))
    # a sweep length the run has no point of: no knee, no top rate, no error
    other = cross_validate(tmp_path, PROFILE, rates=(2.0,), inputs=(64,), sweep_input=999,
                           say=lambda _: None)
    assert other["knee"] == {} and other["top_rate"] == {
        "qps": None, "input_len": 999, "iterations": []}
    # the held-out keys are the training points' mean, not the held-out point's gauges
    from pushkv.fit.sim_vs_real.cross import predict

    predicted, _ = predict(trained, ["push_qps8_in64_out24_iter0.json"])
    assert predicted["push_qps8_in64_out24_iter0.json"]["decode"][
        "decode_step_overhead_s"] == pytest.approx(sum(step) / 2)
    with pytest.raises(ValueError, match="both in and out"):
        split(points, rates=(2.0, 8.0), inputs=(64, 128))


def test_a_held_out_points_keys_were_measured_at_its_training_groups_gauges_speed(
        ) -> None:
    """:func:`key_speeds`: a training point's keys were measured at its own gauges'
    probe rate, a held-out point's at the mean of its training group's; a point whose
    rate is unknown (unprobed gauges) is left out, and so is a group of such."""
    from pushkv.fit.sim_vs_real.cross import key_speeds

    def rec(*speeds: float) -> dict:
        return {"gauges": [{"speed": {"prefill": x, "decode": x / 2}} for x in speeds]}

    shares = {"push_qps2_in64_out24_iter0.json": rec(100.0, 300.0),
              "push_qps2_in64_out24_iter1.json": rec(400.0),
              "pull_qps2_in64_out24_iter0.json": {"gauges": [{}]}}
    train = set(shares)
    source = {"push_qps8_in64_out24_iter0.json": "push_in64_qps2",
              "pull_qps8_in64_out24_iter0.json": "pull_in64_qps2"}
    got = key_speeds(shares, train, source)
    assert got == {"push_qps2_in64_out24_iter0.json": {"prefill": 200.0, "decode": 100.0},
                   "push_qps2_in64_out24_iter1.json": {"prefill": 400.0, "decode": 200.0},
                   "push_qps8_in64_out24_iter0.json": {"prefill": 300.0, "decode": 150.0}}
    assert speed_over({"speed": {"prefill": 150.0, "decode": 300.0}},
                      got["push_qps8_in64_out24_iter0.json"]) == {"prefill": 0.5,
                                                                  "decode": 2.0}
    assert speed_over({"speed": {"prefill": 150.0}}, {"prefill": 1.0, "decode": 1.0}) == {}


def test_measured_speed_runs_a_held_out_point_on_the_cores_its_probe_saw(
        tmp_path: Path) -> None:
    """``cross_validate(measured_speed=True)``: a held-out point whose probe saw the
    cores at half the rate of its training group's gauges is simulated slower than
    without; one at their rate exactly as without; the speeds are reported."""
    from pushkv.fit.sim_vs_real.cross import cross_validate

    real, shares = _grid_run(tmp_path)
    for fname, got in shares.items():  # every gauge at 100, every point at its speed
        for g in got["gauges"]:
            g["speed"] = {"prefill": 100.0, "decode": 100.0}
        half = "_qps8_" in fname and fname.endswith("_iter0.json")
        got["speed"] = {"prefill": 50.0 if half else 100.0,
                        "decode": 50.0 if half else 100.0}
    (real / "cpu_probe.json").write_text(json.dumps(shares))
    name = "push_qps8_in64_out24_iter0.json"
    other = "push_qps8_in64_out24_iter1.json"

    def simulated(measured: bool) -> tuple[dict, dict, dict]:
        got = cross_validate(tmp_path, PROFILE, rates=(2.0,), inputs=(64,),
                             sweep_input=64, measured_speed=measured, say=lambda _: None)
        return (got, *(json.loads((tmp_path / "sim-cross" / n).read_text())
                       for n in (name, other)))

    plain, plain_slow, plain_same = simulated(False)
    speed, slow, same = simulated(True)
    assert plain["measured_speed"] is False and "cpu_speed" not in plain
    assert speed["measured_speed"] is True and speed["cpu_speed"] == [0.5, 1.0]
    assert slow["mean_ttft_ms"] > 1.3 * plain_slow["mean_ttft_ms"]
    assert slow["mean_tpot_ms"] > 1.3 * plain_slow["mean_tpot_ms"]
    assert same["mean_ttft_ms"] == plain_same["mean_ttft_ms"]


def test_measured_speed_without_cross_validation_is_refused_in_a_line(
        tmp_path: Path) -> None:
    """``--measured-speed`` has a reference only in a cross-validation: without
    ``--cross-validate`` the benchmark stops before it runs anything."""
    import subprocess
    import sys

    got = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sim_vs_real.py"),
                          "--out", str(tmp_path / "out"), "--sim-only", "--measured-speed"],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 2 and "--measured-speed needs --cross-validate" in got.stderr
    assert not (tmp_path / "out").exists()


def test_a_held_out_point_takes_the_nearest_training_length_then_rate() -> None:
    from pushkv.fit.sim_vs_real.cross import nearest_group

    groups = [("push", 64, 2.0), ("push", 64, 8.0), ("push", 192, 2.0),
              ("push", 192, 8.0), ("pull", 64, 2.0)]
    assert nearest_group("push", 320, 16.0, groups) == ("push", 192, 8.0)
    assert nearest_group("push", 128, 4.0, groups) == ("push", 192, 2.0)  # ties: longer
    assert nearest_group("push", 64, 5.0, groups) == ("push", 64, 8.0)  # ties: higher
    assert nearest_group("pull", 320, 16.0, groups) == ("pull", 64, 2.0)
    with pytest.raises(ValueError, match="mode"):
        nearest_group("push-layer", 64, 2.0, groups)


def test_the_knee_is_where_the_statistic_doubles_interpolated() -> None:
    from pushkv.fit.sim_vs_real.cross import knee

    # 30 ms at light load: 60 is reached between 8 (40) and 12 (80), halfway
    assert knee([2, 4, 8, 12], [30, 32, 40, 80]) == pytest.approx(10.0)
    assert knee([2, 4, 8], [30, 31, 33]) is None  # beyond the sweep
    assert knee([2, 4], [30, 60]) == 4
    with pytest.raises(ValueError, match="ascend"):
        knee([4, 2], [30, 60])


def _sweep(per_rate: dict[float, list[float]]) -> dict[float, dict[int, dict[str, float]]]:
    return {q: {i: {"mean_ttft_ms": v} for i, v in enumerate(vals)}
            for q, vals in per_rate.items()}


def test_a_knee_ratio_has_an_interval_over_the_iterations() -> None:
    """The iterations resampled together at every rate: a simulated sweep equal to
    the real one has every draw's ratio 1; one whose knee lies a third further out in
    every iteration is decided out, one past the sweep too; one real iteration in six
    with an episode at the top rates leaves the ratio unsure."""
    from pushkv.fit.sim_vs_real.cross import interval_text, knee_interval

    rates = [2.0, 8.0, 16.0, 24.0, 32.0]
    calm = {2.0: [30, 31, 29, 30, 30, 31], 8.0: [36, 35, 37, 36, 36, 35],
            16.0: [48, 50, 47, 49, 48, 50], 24.0: [90, 92, 88, 91, 90, 89],
            32.0: [150, 160, 140, 150, 155, 145]}
    same = knee_interval(_sweep(calm), _sweep(calm), rates)
    assert (same["low"], same["high"], same["verdict"]) == (1.0, 1.0, "in")
    assert same["undefined"] == 0 and same["draws"] == 2000
    assert interval_text(same) == " [1.00, 1.00] in"
    # simulated: the same light load, twice it reached past 24 QPS (real: about 18)
    later = {**calm, 24.0: [50, 49, 51, 50, 50, 49], 32.0: [90, 92, 88, 91, 90, 89]}
    out = knee_interval(_sweep(calm), _sweep(later), rates)
    assert out["verdict"] == "out" and 1.3 < out["low"] <= out["high"] < 1.6
    beyond = knee_interval(_sweep(calm), _sweep({**later, 32.0: [55] * 6}), rates)
    assert (beyond["low"], beyond["high"], beyond["verdict"]) == (None, None, "out")
    assert beyond["undefined"] == 0 and interval_text(beyond) == " [beyond, beyond] out"
    short = knee_interval(_sweep({**later, 32.0: [55] * 6}), _sweep(calm), rates)
    assert (short["low"], short["high"], short["verdict"]) == (0.0, 0.0, "out")
    # one real iteration in six with an episode at the top three rates
    episode = {**calm, 16.0: [48, 50, 47, 49, 48, 150], 24.0: [90, 92, 88, 91, 90, 400],
               32.0: [150, 160, 140, 150, 155, 600]}
    shaky = knee_interval(_sweep(episode), _sweep(calm), rates)
    assert shaky["verdict"] == "unsure" and shaky["low"] <= 1.0 < shaky["high"]
    assert knee_interval(_sweep(episode), _sweep(calm), rates) == shaky  # the seed's
    assert knee_interval(_sweep(episode), _sweep(calm), rates, seed=1) != shaky


def test_a_knee_interval_refuses_a_sweep_it_cannot_resample() -> None:
    from pushkv.fit.sim_vs_real.cross import interval_text, knee_interval

    with pytest.raises(ValueError, match="two or more rates"):
        knee_interval(_sweep({2.0: [30]}), _sweep({2.0: [30]}), [2.0])
    real = _sweep({2.0: [30, 30], 8.0: [40, 40]})
    sim = {q: {i + 5: v for i, v in its.items()} for q, its in real.items()}
    with pytest.raises(ValueError, match="no iteration"):
        knee_interval(real, sim, [2.0, 8.0])
    # an iteration one rate lacks (a failed point) is not drawn at all
    full = _sweep({2.0: [30, 31, 30], 8.0: [70, 50, 65]})
    failed = {q: dict(its) for q, its in full.items()}
    del failed[8.0][1]
    kept = {q: {i: v for i, v in its.items() if i != 1} for q, its in full.items()}
    assert knee_interval(failed, full, [2.0, 8.0]) == knee_interval(kept, full, [2.0, 8.0])
    # both knees beyond the sweep in every draw: no ratio, so no interval
    flat = knee_interval(real, real, [2.0, 8.0])
    assert (flat["low"], flat["high"], flat["verdict"]) == (None, None, "unsure")
    assert flat["undefined"] == 2000
    assert "beyond the sweep in 2000 of 2000" in interval_text(flat)
