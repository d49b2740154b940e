"""bench_e2e's harness (:mod:`pushkv.fit.e2e`): paired overheads per round and the ratio's
interval over rounds, the phases, the turns and their freezer, the kept client."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from pushkv.fit.e2e import bench_client, deployment, overheads, phases, rounds
from pushkv.fit.e2e.client import Result


def records(extra_ms: dict[str, list[float]], plain: list[float],
            load: str = "conc") -> list[dict[str, Any]]:
    """Rounds of 3 requests; each mode's latency is plain's plus its overhead that round."""
    out = []
    for it, base in enumerate(plain):
        for mode, extra in [("plain", [0.0] * len(plain)), *extra_ms.items()]:
            for k in range(3):
                lat = base + extra[it] + k  # the same spread inside every round
                out.append({"mode": mode, "load": load, "phase": "p", "iter": it, "slot": -1,
                            "latency_ms": lat, "ttft_ms": 1.0, "tpot_ms": 1.0,
                            "same_as_plain": True})
    return out


def test_a_steady_ratio_has_a_tight_interval_whatever_the_machine_drift():
    plain = [100.0, 250.0, 120.0, 400.0, 90.0]  # the machine's speed swings by round
    recs = records({"push-client": [10.0] * 5, "vllm-push-client": [20.0] * 5}, plain)
    assert overheads.bootstrap_ratio(recs, "push-client", "vllm-push-client", "plain",
                               "conc") == (0.5, 0.5)
    v = overheads.verdict(recs, ["plain", "push-client", "vllm-push-client"])
    assert v["overhead_ratio_vs_vllm_push_conc"] == 0.5
    assert v["overhead_ratio_vs_vllm_push_conc_ci95"] == [0.5, 0.5]
    assert v["overhead_ratio_vs_vllm_push_seq_ci95"] is None  # no sequential rounds


def test_noisy_rounds_give_an_interval_around_the_ratio():
    ours = [5.0, 30.0, 12.0, 0.0, 20.0, 8.0]
    theirs = [25.0, 10.0, 30.0, 18.0, 40.0, 22.0]
    recs = records({"push-client": ours, "vllm-push-client": theirs}, [100.0] * 6)
    lo, hi = overheads.bootstrap_ratio(recs, "push-client", "vllm-push-client", "plain", "conc")
    point = overheads.verdict(recs, ["plain", "push-client", "vllm-push-client"])[
        "overhead_ratio_vs_vllm_push_conc"]
    assert lo < point < hi
    assert lo >= min(ours) / max(theirs) and hi <= max(ours) / min(theirs)


def test_too_few_rounds_or_no_positive_baseline_give_no_interval():
    two = records({"push-client": [1.0, 2.0], "vllm-push-client": [2.0, 3.0]}, [50.0, 60.0])
    assert overheads.bootstrap_ratio(two, "push-client", "vllm-push-client", "plain",
                                     "conc") is None
    negative = records({"push-client": [1.0] * 4, "vllm-push-client": [-5.0] * 4}, [50.0] * 4)
    assert overheads.bootstrap_ratio(negative, "push-client", "vllm-push-client", "plain",
                               "conc") is None


def test_behind_the_router_pushkv_over_pull_has_a_latency_ratio_and_an_interval():
    """Each round's two medians are drawn together: a machine swinging by round leaves
    a steady ratio's interval tight; a round served by one mode only is not counted."""
    plain = [100.0, 250.0, 120.0, 400.0, 90.0]
    recs = records({"router-pushkv": [10.0] * 5, "router-pull": [20.0] * 5}, plain, "seq")
    recs += [dict(r, iter=9) for r in recs if r["mode"] == "router-pushkv"]
    point, ci, n = overheads.latency_ratio(recs, "router-pushkv", "router-pull", "seq")
    assert n == 5 and point < 1 and ci is not None and ci[0] <= point <= ci[1] < 1
    v = overheads.verdict(recs, ["plain", "router-pushkv", "router-pull"])
    assert v["router_rounds"] == 5 and v["router_pushkv_vs_pull_seq"] == round(point, 3)
    assert v["router_pushkv_vs_pull_seq_ci95"] == [round(x, 3) for x in ci]
    assert v["router_pushkv_vs_pull_seq_overhead_ratio"] == 0.5
    assert v["router_pushkv_vs_pull_seq_overhead_ratio_ci95"] == [0.5, 0.5]
    assert "router_pushkv_vs_pull_conc" not in v  # no concurrent rounds
    assert "proxy_pushkv_vs_router_pull_seq" not in v  # pushkv's proxy did not run
    few = records({"router-pushkv": [1.0, 2.0], "router-pull": [2.0, 3.0]}, [50.0, 60.0])
    assert overheads.latency_ratio(few, "router-pushkv", "router-pull", "conc")[1] is None


def test_modes_of_different_phases_are_drawn_apart():
    recs = records({"push-client": [10.0, 12.0, 8.0, 11.0]}, [100.0] * 4)
    for r in records({"vllm-push-client": [20.0, 24.0, 16.0, 22.0]}, [300.0] * 4):
        recs.append(dict(r, phase="q"))  # another phase, its own plain rounds
    lo, hi = overheads.bootstrap_ratio(recs, "push-client", "vllm-push-client", "plain", "conc")
    assert 8.0 / 24.0 <= lo <= 0.5 <= hi <= 12.0 / 16.0


def test_cycles_alternate_the_phase_order():
    plan = [["plain", "pushkv"], ["plain", "nixl-push"]]
    assert phases.cycle_phases(plan, 1) == [(0, plan[0]), (0, plan[1])]
    assert phases.cycle_phases(plan, 3) == [(0, plan[0]), (0, plan[1]), (1, plan[1]),
                                            (1, plan[0]), (2, plan[0]), (2, plan[1])]
    with pytest.raises(SystemExit, match="--cycles"):
        phases.cycle_phases(plan, 0)


def test_rounds_of_several_runs_pool_without_mixing_their_phases(tmp_path):
    import json
    a, b = tmp_path / "a", tmp_path / "b"
    for d, plain in ((a, [100.0] * 4), (b, [300.0] * 4)):
        d.mkdir()
        recs = records({"push-client": [10.0] * 4, "vllm-push-client": [20.0] * 4}, plain)
        (d / "latency.json").write_text(json.dumps(recs))
    v = overheads.pooled_verdict([a, b])
    assert v["rounds"] == 8 and v["overhead_ratio_vs_vllm_push_conc"] == 0.5
    assert v["overhead_ratio_vs_vllm_push_conc_ci95"] == [0.5, 0.5]
    with pytest.raises(SystemExit, match="does not exist"):
        overheads.pooled_verdict([tmp_path / "missing"])


def test_the_proxy_hop_has_an_interval_over_rounds():
    recs = records({"push": [4.0, 6.0, 5.0, 30.0, 5.0]}, [100.0] * 5, load="seq")
    recs = [dict(r, mode="push-client") if r["mode"] == "plain" else r for r in recs]
    lo, hi = overheads.bootstrap_overhead(recs, "push", "push-client", "seq")
    assert 4.0 <= lo <= 5.0 <= hi <= 30.0
    v = overheads.verdict(recs, ["push-client", "push"])
    assert v["proxy_hop_ms"] == 5.0 and v["proxy_hop_ms_ci95"] == [lo, hi]
    assert overheads.bootstrap_overhead(recs[:12], "push", "push-client", "seq") is None


def test_the_routers_cpu_per_request_is_a_mean_over_every_request_it_served():
    recs = records({"push": [10.0] * 4, "push-asyncio": [12.0] * 4}, [100.0] * 4)
    for i, r in enumerate(recs):  # ticks of 10 ms: each request 0 or 10
        r["router_cpu_ms"] = {"push": 10.0 * (i % 4 == 0), "push-asyncio": 10.0 * (i % 2),
                              "plain": float("nan")}[r["mode"]]
    v = overheads.verdict(recs, ["plain", "push", "push-asyncio"])
    assert v["router_cpu_ms_per_request"] == {"push": 2.5, "push-asyncio": 5.0}


def test_in_turns_each_connector_pairs_with_the_plain_requests_of_its_own_turn():
    """--phases turns: plain serves each deployment's turn of a round; a mode's overhead
    is taken against plain's requests of the same turn, and the two connectors' rounds
    are drawn together (one phase)."""
    recs = []
    for it, (fast, slow) in enumerate([(100.0, 200.0), (150.0, 90.0), (80.0, 300.0)]):
        for turn, base, mode, extra in (("pushkv", fast, "push-client", 10.0),
                                        ("nixl-push", slow, "vllm-push-client", 20.0)):
            for m, lat in (("plain", base), (mode, base + extra)):
                for k in range(3):
                    recs.append({"mode": m, "load": "conc", "phase": "turns", "iter": it,
                                 "slot": -1, "turn": turn, "latency_ms": lat + k,
                                 "ttft_ms": 1.0, "tpot_ms": 1.0, "same_as_plain": True})
    over = overheads.paired_overheads(recs, "push-client", "plain", "conc")
    assert over == {("turns", 0): [10.0], ("turns", 1): [10.0], ("turns", 2): [10.0]}
    v = overheads.verdict(recs, ["plain", "push-client", "vllm-push-client"])
    assert v["overhead_ratio_vs_vllm_push_conc"] == 0.5
    assert v["overhead_ratio_vs_vllm_push_conc_ci95"] == [0.5, 0.5]
    # without the turn, plain's two turns would be one pool and the overheads wrong
    mixed = [{k: v for k, v in r.items() if k != "turn"} for r in recs]
    assert overheads.paired_overheads(mixed, "push-client", "plain", "conc") != over


def test_turns_put_every_deployment_up_in_one_phase():
    assert phases.plan_phases("turns", ["plain", "pushkv", "nixl-push"]) == [
        ["plain", "pushkv", "nixl-push"]]


class _Freezer:
    """A Freezer's interface over a log of what was stopped and continued."""

    def __init__(self, kind: str, log: list[tuple[str, str]]) -> None:
        self.kind, self.log = kind, log

    def freeze(self) -> None:
        self.log.append(("freeze", self.kind))

    def thaw(self) -> None:
        self.log.append(("thaw", self.kind))


def _stage(log: list[tuple[str, str]]) -> Any:
    modes = {"plain": ["plain"], "pushkv": ["push-client", "push"],
             "nixl-push": ["vllm-push-client"]}

    async def settle(name: str) -> None:
        log.append(("settle", name))

    return rounds.Stage({k: _Freezer(k, log) for k in modes}, modes, settle)


def _running(log: list[tuple[str, str]]) -> set[str]:
    """The deployments not stopped after ``log`` (all start stopped)."""
    up: set[str] = set()
    for what, kind in log:
        if what == "thaw":
            up.add(kind)
        elif what == "freeze":
            up.discard(kind)
    return up


def test_a_stage_runs_one_deployment_and_settles_each_mode_after_its_thaw():
    import asyncio

    log: list[tuple[str, str]] = []
    stage = _stage(log)
    stage.freeze_all()
    log.clear()
    for kind in ["plain", "pushkv", "pushkv", "plain", "nixl-push"]:
        asyncio.run(stage.enter(kind))
        assert _running(log) == {kind} and stage.running == kind
    assert stage.thaws == 4  # entering the running deployment again is a no-op
    assert log == [("thaw", "plain"), ("settle", "plain"),
                   ("freeze", "plain"), ("thaw", "pushkv"),
                   ("settle", "push-client"), ("settle", "push"),
                   ("freeze", "pushkv"), ("thaw", "plain"), ("settle", "plain"),
                   ("freeze", "plain"), ("thaw", "nixl-push"),
                   ("settle", "vllm-push-client")]
    stage.thaw_all()
    assert _running(log) == {"plain", "pushkv", "nixl-push"} and stage.running is None


def test_a_stage_orders_modes_by_deployment_one_thaw_per_deployment():
    stage = _stage([])
    names = ["plain", "push-client", "push"]
    assert stage.order(names, 0) == ["plain", "push-client", "push"]
    assert stage.order(names, 1) == ["push", "push-client", "plain"]
    assert stage.order(names, 2) == ["plain", "push-client", "push"]
    # prompt after prompt, the deployment changes once per prompt
    flat = [n for i in range(6) for n in stage.order(names, i)]
    kinds = ["plain" if n == "plain" else "pushkv" for n in flat]
    assert sum(a != b for a, b in itertools.pairwise(kinds)) == 6


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("load", ["seq", "conc"])
def test_in_turns_every_request_runs_with_only_its_own_deployment_up(
        monkeypatch, interleave, load):
    """serve_round with a stage: plain's requests run with every pair stopped, each
    pair's with plain stopped; outputs are still checked against plain's."""
    import asyncio
    from types import SimpleNamespace

    log: list[tuple[str, str]] = []
    stage = _stage(log)
    stage.freeze_all()
    seen: list[tuple[str, frozenset[str]]] = []

    async def fake_run_mode(client, ep, batch, max_tokens, concurrent):
        seen.append((ep.mode.name, frozenset(_running(log))))
        return [Result(0.1, 0.01, 0.001, tokens=list(p[:2])) for p in batch]

    monkeypatch.setattr(rounds, "run_mode", fake_run_mode)
    kind = {"plain": "plain", "push-client": "pushkv", "push": "pushkv"}
    eps = {n: SimpleNamespace(mode=SimpleNamespace(name=n), dep=SimpleNamespace(kind=k))
           for n, k in kind.items()}
    args = SimpleNamespace(interleave=interleave, output_len=4)
    batch = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    failures: list[str] = []
    recs = asyncio.run(rounds.serve_round(None, eps, stage.order(list(eps), 1), args, load,
                                       batch, 1, "turns", failures, turn="pushkv",
                                       stage=stage))
    assert not failures and len(recs) == 3 * len(batch)
    assert all(r["same_as_plain"] and r["turn"] == "pushkv" for r in recs)
    assert {name for name, _ in seen} == set(kind)
    for name, up in seen:
        assert up == {kind[name]}, (name, up)


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    from pathlib import Path
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _wait_for(procs: list[Any], stopped: bool, timeout_s: float = 60.0) -> None:
    """Block until every child in ``procs`` reported being stopped (or continued): the
    kernel's SIGCHLD wakes the wait, waitid tells whose state changed (SIGCHLD must be
    blocked, so that it stays pending until waited for). Another thread of the process
    that does not block it may take the signal instead, so the wait also rechecks every
    50 ms until the deadline."""
    import os
    import signal
    import time

    flag = (os.WSTOPPED if stopped else os.WCONTINUED) | os.WNOHANG | os.WNOWAIT
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while os.waitid(os.P_PID, p.pid, flag) is None:
            left = deadline - time.monotonic()
            assert left > 0, f"states {[_state(q.pid) for q in procs]}"
            signal.sigtimedwait({signal.SIGCHLD}, min(left, 0.05))
        os.waitid(os.P_PID, p.pid, flag & ~os.WNOWAIT)  # consume this report
        assert (_state(p.pid) == "T") == stopped


def test_a_frozen_deployment_is_stopped_and_thaws_whole(tmp_path):
    """Freezer stops every process group of a deployment and its routers, and thaws
    them again, on real processes (each in a session of its own, as servers start)."""
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    def spawn() -> subprocess.Popen[bytes]:  # blocks on its stdin until killed
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                stdin=subprocess.PIPE, start_new_session=True)

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    procs = [spawn() for _ in range(3)]
    try:
        dep = SimpleNamespace(servers=[SimpleNamespace(proc=p) for p in procs[:2]])
        ep = SimpleNamespace(router=procs[2])
        freezer = deployment.Freezer(dep, [ep])
        freezer.freeze()
        _wait_for(procs, stopped=True)
        with freezer:
            _wait_for(procs, stopped=False)
            assert not freezer.frozen
        _wait_for(procs, stopped=True)
        freezer.thaw()
        _wait_for(procs, stopped=False)
        procs[0].kill()
        procs[0].wait()
        freezer.freeze()  # a process that died is skipped, the others still stop
        _wait_for(procs[1:], stopped=True)
        freezer.thaw()
        _wait_for(procs[1:], stopped=False)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdin.close()  # type: ignore[union-attr]
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _Completions:
    """A streaming ``/v1/completions`` endpoint in a thread of this process: one SSE chunk
    a token, then the usage, then ``[DONE]`` -- the shape ``vllm bench serve`` reads. It
    stands in for the servers only; the client under test is vLLM's own."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.loop = asyncio.new_event_loop()
        self.requests = 0
        self.url = ""
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(60)

    def _run(self, started: Any) -> None:
        import asyncio
        import json

        from aiohttp import web

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.requests += 1
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for _ in range(int(body["max_tokens"])):
                await resp.write(b'data: {"choices": [{"text": " w"}]}\n\n')
            usage = {"choices": [], "usage": {"completion_tokens": body["max_tokens"],
                                              "prompt_tokens": 8}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return resp

        async def start() -> None:
            app = web.Application()
            app.router.add_post("/v1/completions", completions)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            self.url = f"http://127.0.0.1:{port}"
            started.set()

        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(start())
            self.loop.run_forever()
        finally:
            self.loop.close()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


def test_one_kept_client_runs_many_benchmarks_and_outlives_a_failed_one(tmp_path):
    """BenchClient runs vLLM's ``vllm bench serve`` again and again in one process
    (its import paid once); a run with bad flags fails alone, a client that died is
    replaced, and each run's output goes to its own log."""
    from pushkv.vllm.testing import write_tiny_llama, write_word_tokenizer

    model = tmp_path / "model"
    write_tiny_llama(model)
    write_word_tokenizer(model)
    server = _Completions()
    try:
        with bench_client.BenchClient() as client:
            def bench(name: str, n: int, log: str) -> bool:
                return bench_client.bench_serve(server.url, str(model), tmp_path, name, qps="inf",
                                       input_len=8, output_len=3, num_prompts=n, seed=1,
                                       log=tmp_path / log, client=client,
                                       extra=("--ready-check-timeout-sec", "0"))

            assert bench("a.json", 4, "a.log")
            pid = client.proc.pid
            assert bench("b.json", 5, "b.log")
            assert client.proc.pid == pid  # the same process ran both
            assert not client.run(["--no-such-flag"], tmp_path / "bad.log")
            assert "--no-such-flag" in (tmp_path / "bad.log").read_text()
            assert bench("c.json", 2, "a.log")  # it outlived the failed run
            assert client.proc.pid == pid
            client.proc.kill()
            client.proc.wait()
            assert bench("d.json", 3, "d.log")  # a fresh one
            assert client.proc.pid != pid
            assert client.runs == 5
        assert client.proc is None
        import json

        for name, n in (("a", 4), ("b", 5), ("c", 2), ("d", 3)):
            result = json.loads((tmp_path / f"{name}.json").read_text())
            assert (result["completed"], result["failed"]) == (n, 0)
        assert server.requests == 14
        assert (tmp_path / "a.log").read_text().count("$ vllm bench serve") == 2
    finally:
        server.close()


# ------------------------------------------------- the hops of a pull behind a router


def _pull(t0: float, dur: float) -> dict[str, float]:
    """A pulled request's shared marks, from its prefill's arrival to its decode step."""
    names = ("prefill_arrived", "prefill_seen", "prefill_finished", "decode_arrived",
             "decode_seen", "ready_scheduled", "decode_scheduled")
    return {n: t0 + dur * i / (len(names) - 1) for i, n in enumerate(names)}


def test_a_pull_is_in_a_batch_when_it_overlaps_two_others():
    from pushkv.fit.e2e.pull_timeline import in_batch

    reqs = {"a": _pull(0.0, 1.0), "b": _pull(0.5, 1.0), "c": _pull(0.9, 1.0),
            "alone": _pull(10.0, 1.0), "pair1": _pull(20.0, 1.0), "pair2": _pull(20.5, 1.0),
            "unfinished": {"prefill_arrived": 0.2}}
    assert set(in_batch(reqs)) == {"a", "b", "c"}
    # touching ends do not overlap; one other is enough when asked for one
    assert set(in_batch({"x": _pull(0.0, 1.0), "y": _pull(1.0, 1.0)}, overlap=1)) == set()
    assert set(in_batch(reqs, overlap=1)) == {"a", "b", "c", "pair1", "pair2"}


def test_the_pull_report_gives_every_pull_and_the_batched_ones_apart(tmp_path, capsys):
    import json

    from pushkv.fit.e2e import pull_timeline

    lines = []
    for tid, marks in {"s": _pull(0.0, 0.01), "b1": _pull(1.0, 0.08), "b2": _pull(1.01, 0.1),
                       "b3": _pull(1.02, 0.12)}.items():
        lines += [json.dumps({"id": tid, "ev": ev, "t": t, "p": "x"}) for ev, t in marks.items()]
    (tmp_path / "timeline" / "nixl-pull").mkdir(parents=True)
    (tmp_path / "timeline" / "nixl-pull" / "timeline-1.jsonl").write_text("\n".join(lines))
    text, got = pull_timeline.pull_report(tmp_path, ["nixl-pull"])
    span = "prefill arrives -> decode step"
    assert got["all"]["nixl-pull"][span]["n"] == 4
    assert got["in_batch"]["nixl-pull"][span]["n"] == 3
    assert got["in_batch"]["nixl-pull"][span]["median"] == pytest.approx(100.0)
    assert "served in a batch" in text
    assert pull_timeline.main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(got))
    with pytest.raises(SystemExit):  # no timeline of the named deployments: a clear error
        pull_timeline.main([str(tmp_path), "--deployments", "pushkv"])


def test_the_router_hop_starts_where_the_answer_leaves():
    """pushkv's answer leaves at ``answered`` (after its worker saved the KV at
    ``prefill_finished``); vLLM's connector marks only ``prefill_finished`` there."""
    from pushkv.fit.e2e.pull_timeline import hop_segments

    hop = "answer out -> decode arrives (router hop)"
    vllm = _pull(0.0, 0.06)
    assert hop_segments(vllm)[hop] == pytest.approx(
        (vllm["decode_arrived"] - vllm["prefill_finished"]) * 1e3)
    pushkv = {**vllm, "answered": vllm["prefill_finished"] + 0.004}
    assert hop_segments(pushkv)[hop] == pytest.approx(
        (vllm["decode_arrived"] - pushkv["answered"]) * 1e3)
