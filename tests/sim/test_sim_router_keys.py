"""The router's side of a request: the client's way to and from the router
(network.client_hop_s) and its first output's extra way (network.client_first_s), the
prefill answer's way out (prefill.return_s, a frontend job with the queue on), a pull's
read posted by the worker (order_handoff_s); each measured from a real run's marks."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("simpy")

from sim_helpers import config, on_host

from pushkv.fit.cpu_profile import MeasurementError
from pushkv.fit.measure_connector import client_first, client_hop, pull_keys
from pushkv.fit.sim_vs_real.keys import real_keys
from pushkv.sim.host.shared_cpu import on_shared_cores
from pushkv.sim.profile import DEFAULT, ProfileError, load_profile, profile_from_dict
from pushkv.sim.runner import run

ROOT = Path(__file__).resolve().parents[2]
TINY_PATH = ROOT / "pushkv" / "sim" / "profiles" / "cpu-tiny.toml"
TINY = load_profile(TINY_PATH)
#: connector keys of the size this machine's pairs measured (ms-scale hand-offs)
KEYS = {"prefill": {"ingest_s": 0.002}, "decode": {
    "ingest_s": 0.0027, "return_s": 0.0018, "order_handoff_s": 0.0009,
    "event_handoff_s": 0.0012, "admit_lag_s": 0.0015}}


def _with(extra: dict[str, dict[str, float]] | None = None, **host: int):  # type: ignore[no-untyped-def]
    tables = {side: dict(fields) for side, fields in KEYS.items()}
    for side, fields in (extra or {}).items():
        tables.setdefault(side, {}).update(fields)
    prof = dataclasses.replace(TINY, **{
        side: dataclasses.replace(getattr(TINY, side), **fields)
        for side, fields in tables.items()})
    if host:  # the frontends as a queue: a shared CPU
        return on_host(prof, **host)
    return prof.validate()


def _alone(profile, mode: str):  # type: ignore[no-untyped-def]
    """One request: nothing to interact with, so every delay adds to it exactly."""
    cfg = config(mode, qps=1.0, input_len=128, output_len=8, num_prompts=1)
    return run(dataclasses.replace(cfg, profile=profile)).result


# ------------------------------------------------------------------ client_hop_s


@pytest.mark.parametrize("key", ["client_hop_s", "client_first_s"])
def test_the_clients_keys_are_off_by_default_and_validated(key: str) -> None:
    assert getattr(DEFAULT.network, key) == 0.0 and getattr(TINY.network, key) == 0.0
    for bad, words in ((-0.001, "must be >= 0"), (math.nan, "must be a finite"),
                       (math.inf, "must be a finite")):
        with pytest.raises(ProfileError, match=f"network.{key} {words}"):
            profile_from_dict({"network": {key: bad}})


@pytest.mark.parametrize("cores", [0, 1])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_client_hop_adds_exactly_itself_to_ttft_alone_not_to_tpot(mode: str,
                                                                  cores: int) -> None:
    x = 0.0016
    base = _alone(_with(frontend_cores=cores), mode)
    hop = _alone(_with({"network": {"client_hop_s": x}}, frontend_cores=cores), mode)
    assert hop["ttfts"][0] - base["ttfts"][0] == pytest.approx(x, abs=1e-9)
    assert hop["itls"] == base["itls"]


@pytest.mark.parametrize("key", ["client_hop_s", "client_first_s"])
def test_the_clients_keys_scale_with_the_cores_share(key: str) -> None:
    prof = on_host(_with({"network": {key: 0.002}}), prefill={"cpu_share": 0.5},
                   decode={"cpu_share": 0.5})
    assert getattr(on_shared_cores(prof).network, key) == pytest.approx(0.004)


# ----------------------------------------------------------------- client_first_s


@pytest.mark.parametrize("cores", [0, 1])
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_client_first_delays_the_first_token_alone_not_the_answer(mode: str,
                                                                 cores: int) -> None:
    """A lone request: its TTFT grows by exactly the key, its end-to-end latency not at
    all (the later tokens' way is client_hop_s's), so its first gap shrinks by it."""
    base = _alone(_with(frontend_cores=cores), mode)
    x = base["itls"][0][0] / 2  # shorter than the first gap
    first = _alone(_with({"network": {"client_first_s": x}}, frontend_cores=cores), mode)
    assert first["ttfts"][0] - base["ttfts"][0] == pytest.approx(x, abs=1e-9)
    assert first["latencies"] == base["latencies"]
    gaps, was = first["itls"][0], base["itls"][0]
    assert gaps[0] == pytest.approx(was[0] - x, abs=1e-9)
    assert gaps[1:] == was[1:]


def test_no_later_token_reaches_the_client_before_the_first() -> None:
    """A first output later than the next tokens' whole gaps: they wait for it (the
    client reads its stream in order), the answer's end unchanged."""
    base = _alone(_with(frontend_cores=1), "push")
    x = 3 * max(base["itls"][0])
    first = _alone(_with({"network": {"client_first_s": x}}, frontend_cores=1), "push")
    assert first["ttfts"][0] == pytest.approx(base["ttfts"][0] + x, abs=1e-9)
    assert all(gap >= 0 for gap in first["itls"][0])
    assert first["itls"][0][0] == 0.0  # the second token waited for the first
    assert first["latencies"][0] == pytest.approx(
        max(base["latencies"][0], first["ttfts"][0]), abs=1e-9)


def test_client_first_is_the_routers_stream_less_the_clients() -> None:
    """The router's 'first token -> answer sent' is 10 ms a request (_router); a client
    that saw 8.5 ms from its first token to its last got the first 1.5 ms later."""
    reqs = _router(4)
    result = {"completed": 4, "mean_ttft_ms": 12.0, "mean_e2el_ms": 20.5}
    assert client_first([(reqs, result)]) == pytest.approx(0.0015)
    other = {"completed": 4, "mean_ttft_ms": 12.0, "mean_e2el_ms": 21.5}  # 0.5 ms
    assert client_first([(reqs, result), (reqs, other)]) == pytest.approx(0.001)
    # a client that saw the stream longer than the router did: nothing later, 0
    assert client_first([(reqs, {**result, "mean_e2el_ms": 23.0})]) == 0.0


def test_client_first_refuses_what_it_cannot_pair_or_read() -> None:
    reqs = _router(3)
    with pytest.raises(MeasurementError, match="cannot pair"):
        client_first([(reqs, {"completed": 2, "mean_ttft_ms": 1.0, "mean_e2el_ms": 2.0})])
    with pytest.raises(MeasurementError, match="finite"):
        client_first([(reqs, {"completed": 3, "mean_ttft_ms": math.nan,
                              "mean_e2el_ms": 2.0})])
    with pytest.raises(MeasurementError, match="finite"):
        client_first([(reqs, {"completed": 3, "mean_e2el_ms": 2.0})])
    with pytest.raises(MeasurementError, match="no point"):
        client_first([])


# -------------------------------------------------------------- prefill.return_s


def test_the_prefill_answer_as_a_frontend_job_costs_nothing_alone() -> None:
    """A lone pull: nothing else on the frontends, the job is the delay it was."""
    x = 0.002
    off = _alone(_with({"prefill": {"return_s": x}}, frontend_cores=0), "pull")
    on = _alone(_with({"prefill": {"return_s": x}}, frontend_cores=1), "pull")
    assert on["ttfts"][0] == pytest.approx(off["ttfts"][0], abs=2e-7)


def test_a_push_prefill_answer_is_off_the_critical_path() -> None:
    """Push: the answer leaves the frontends long before decode's first token needs them."""
    base = _alone(_with(frontend_cores=1), "push")
    slow = _alone(_with({"prefill": {"return_s": 0.002}}, frontend_cores=1), "push")
    assert slow["ttfts"] == base["ttfts"]


def test_the_prefill_answer_adds_exactly_itself_to_a_lone_pull() -> None:
    x = 0.002
    base = _alone(_with(frontend_cores=1), "pull")
    slow = _alone(_with({"prefill": {"return_s": x}}, frontend_cores=1), "pull")
    assert slow["ttfts"][0] - base["ttfts"][0] == pytest.approx(x, abs=1e-9)


def test_under_load_the_prefill_answers_queue_on_the_frontends() -> None:
    cfg = config("pull", qps=math.inf, input_len=128, output_len=16, num_prompts=20)
    slow = {"prefill": {"return_s": 0.002}}
    delay = run(dataclasses.replace(cfg, profile=_with(slow, frontend_cores=0))).result
    queue = run(dataclasses.replace(cfg, profile=_with(slow, frontend_cores=1))).result
    assert queue["completed"] == delay["completed"] == 20
    assert queue["mean_ttft_ms"] > delay["mean_ttft_ms"]


# ------------------------------------------------------- a pull's read hand-off


def test_a_pulls_read_waits_exactly_the_order_handoff_alone() -> None:
    """vLLM's NixlConnector reads in the worker: the order's way there is on a pull's
    critical path (push: the registration overlaps the prefill)."""
    a = _alone(_with({"decode": {"order_handoff_s": 0.001}}), "pull")
    b = _alone(_with({"decode": {"order_handoff_s": 0.004}}), "pull")
    assert b["ttfts"][0] - a["ttfts"][0] == pytest.approx(0.003, abs=1e-9)
    assert a["itls"] == b["itls"]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_orders_at_the_forward_leave_a_lone_request_as_it_was(mode: str) -> None:
    """A lone request is admitted while decode computes nothing: its order is handed
    ``order_handoff_s`` later either way, so the key measured there stands."""
    keyed = _with()
    at = _with({"decode": {"orders_at_forward": True}})
    assert json.dumps(_alone(at, mode)) == json.dumps(_alone(keyed, mode))


def test_an_order_shipped_during_a_step_reaches_the_transport_at_its_forward() -> None:
    """``decode.orders_at_forward``: an order shipped while decode computes a step reaches
    the transport when that step's interpreter part (``step_python_s``) has run, on a
    host of its own exactly that long after; without it, ``order_handoff_s`` after. Every
    order shipped alone still takes ``order_handoff_s``."""
    from pushkv.sim.marks import Timeline

    py, handoff = TINY.decode.step_python_s, 0.004  # the two far apart
    got = {}
    for at in (False, True):
        prof = _with({"decode": {"orders_at_forward": at, "order_handoff_s": handoff}})
        cfg = config("push", qps=200.0, input_len=128, output_len=64, num_prompts=6)
        marks = Timeline()
        res = run(dataclasses.replace(cfg, profile=prof), timeline=marks).result
        assert res["completed"] == 6
        shipped, handed = ("registration_shipped", "registration_handed")
        gaps = [m[handed] - m[shipped] for m in marks.requests.values()
                if shipped in m and handed in m]
        got[at] = gaps
    assert got[False] == pytest.approx([handoff] * 6)
    assert {round(g, 9) for g in got[True]} <= {round(handoff, 9), round(py, 9)}
    assert any(g == pytest.approx(py) for g in got[True])  # some shipped mid-step


def test_a_step_cut_by_layers_takes_no_forward_callback() -> None:
    """A layer-wise step reports each layer; one that also asks for its forward's start
    is refused, not silently ignored."""
    from pushkv.sim.feed import Layers

    cfg = config("push", qps=1.0, input_len=128, output_len=8, num_prompts=1)
    transport = run(dataclasses.replace(cfg, profile=TINY), keep_objects=True).transport
    assert transport is not None
    layers = Layers(0.001, 0.001, 2, lambda _: None)
    with pytest.raises(ValueError, match="not both"):
        next(transport.run_step("prefill-0", 0.0, 0.003, layers, at_forward=lambda: None))


def test_pull_without_the_handoff_posts_inline_as_before() -> None:
    """order_handoff_s 0: the read is posted inline in the scheduler's step, the result
    of a profile without the key (the default GPU profile's pull)."""
    cfg = config("pull", qps=8.0, input_len=2048, output_len=16, num_prompts=20)
    zero = dataclasses.replace(DEFAULT, decode=dataclasses.replace(DEFAULT.decode,
                                                                   order_handoff_s=0.0))
    assert json.dumps(run(cfg).result) == json.dumps(
        run(dataclasses.replace(cfg, profile=zero.validate())).result)


def test_deterministic_with_every_key() -> None:
    prof = _with({"network": {"client_hop_s": 0.0016}, "prefill": {"return_s": 0.002}},
                 frontend_cores=1)
    for mode in ("push", "pull"):
        cfg = config(mode, qps=20.0, input_len=128, output_len=16, num_prompts=40,
                     profile=prof)
        a, b = run(cfg).result, run(cfg).result
        assert a["ttfts"] == b["ttfts"] and a["itls"] == b["itls"]


# ----------------------------------------------------------------- measuring them


def _router(n: int, gap: float = 1.0, span: float = 0.02) -> dict[str, dict[str, float]]:
    """n requests ``gap`` s apart, each ``span`` s from legs out to answer sent."""
    return {f"r{i}": {"received": i * gap - 0.0003, "legs_sent": i * gap,
                      "first_token": i * gap + 0.01, "answer_sent": i * gap + span}
            for i in range(n)}


def test_client_hop_is_the_clients_latency_beyond_the_routers_marks() -> None:
    reqs = _router(5)
    lat = [0.02 + 0.0015 + 0.0001 * i for i in range(5)]  # in order of sending
    assert client_hop([(reqs, lat, 1.0)]) == pytest.approx(0.0015 + 0.0002)
    assert client_hop([(reqs, lat, 0.5)]) == pytest.approx((0.0015 + 0.0002) / 2)
    # paired by the router's order of receiving, whatever the dict's order
    backwards = dict(reversed(list(reqs.items())))
    assert client_hop([(backwards, lat, 1.0)]) == client_hop([(reqs, lat, 1.0)])


def test_client_hop_counts_only_requests_alone_and_refuses_what_it_cannot_pair() -> None:
    reqs = _router(4)
    reqs["r1"]["answer_sent"] = 2.5  # r1 still streaming when r2 arrives: neither alone
    lat = [0.0213, 1.0, 1.0, 0.0213]
    assert client_hop([(reqs, lat, 1.0)]) == pytest.approx(0.0013)
    with pytest.raises(MeasurementError, match="cannot pair"):
        client_hop([(reqs, lat[:3], 1.0)])
    with pytest.raises(MeasurementError, match="client_hop_s"):
        client_hop([(_router(2, gap=0.001), [0.02, 0.02], 1.0)])  # none alone
    with pytest.raises(MeasurementError, match="share"):
        client_hop([(reqs, lat, 0.0)])


def test_pull_keys_take_the_hops_and_decode_ingest_off_the_answers_way() -> None:
    prof = _with()
    reqs = {f"r{i}": {"prefill_finished": i + 0.0, "decode_seen": i + 0.009}
            for i in range(3)}
    less = 2 * prof.network.router_hop_s + prof.decode.ingest_s
    got = pull_keys(reqs, prof)
    assert got == {"prefill": {"return_s": pytest.approx(0.009 - less)}}
    assert pull_keys(reqs, prof, share=0.5)["prefill"]["return_s"] == pytest.approx(
        (0.009 - less) / 2)
    quick = {k: {**r, "decode_seen": r["prefill_finished"] + 0.001} for k, r in reqs.items()}
    assert pull_keys(quick, prof)["prefill"]["return_s"] == 0.0
    with pytest.raises(MeasurementError, match="prefill finished -> decode sees"):
        pull_keys({"r": {"prefill_finished": 1.0}}, prof)


def test_the_benchmark_measures_both_from_its_real_half(tmp_path: Path) -> None:
    """``--real-keys``: the client's latencies against the router's marks, the pull
    servers' marks, each point in its window."""
    real = tmp_path / "real"
    shares: dict[str, object] = {}
    for mode, (router_dir, servers) in {"push": ("push", "pushkv"),
                                       "pull": ("pull", "nixl-pull")}.items():
        fname = f"{mode}_qps2_in64_out4_iter0.json"
        t0 = 100.0 if mode == "push" else 200.0
        reqs = _router(3)
        for d, evs in ((router_dir, ("received", "legs_sent", "first_token", "answer_sent")),
                       (servers, ("prefill_finished", "decode_seen"))):
            (real / "timeline" / d).mkdir(parents=True)
            with (real / "timeline" / d / "timeline-1.jsonl").open("w") as f:
                for rid, marks in reqs.items():
                    if d == servers:
                        marks = {"prefill_finished": marks["legs_sent"] + 0.005,
                                 "decode_seen": marks["legs_sent"] + 0.016}
                    for ev in evs:
                        f.write(json.dumps({"id": f"{mode}{rid}", "ev": ev,
                                            "t": t0 + marks[ev], "p": "x"}) + "\n")
        (real / fname).write_text(json.dumps({"latencies": [0.0217] * 3}))
        shares[fname] = {"prefill": {"cpu_share": 1.0}, "decode": {"cpu_share": 1.0},
                         "window": [t0, t0 + 10]}
    keys = real_keys(real, shares, TINY_PATH)
    assert keys["network"]["client_hop_s"] == pytest.approx(0.0017)
    less = 2 * TINY.network.router_hop_s + TINY.decode.ingest_s
    assert keys["prefill"]["return_s"] == pytest.approx(max(0.0, 0.011 - less))


def test_measure_adds_the_router_keys_to_a_base_profile(tmp_path: Path) -> None:
    from pushkv.fit.measure import main as measure_main

    router, pull = tmp_path / "router", tmp_path / "pull"
    for d in (router, pull):
        d.mkdir()
    with (router / "timeline-1.jsonl").open("w") as f:
        for rid, marks in _router(3).items():
            for ev, t in marks.items():
                f.write(json.dumps({"id": rid, "ev": ev, "t": t, "p": "router"}) + "\n")
    with (pull / "timeline-2.jsonl").open("w") as f:
        for i in range(3):
            for ev, t in (("legs_sent", i), ("prefill_finished", i + 0.005),
                          ("decode_seen", i + 0.016)):
                f.write(json.dumps({"id": f"p{i}", "ev": ev, "t": t, "p": "x"}) + "\n")
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"latencies": [0.0217] * 3}))
    out = tmp_path / "p.toml"
    assert measure_main(["--out", str(out), "--base", str(TINY_PATH), "--pull-timeline",
                         str(pull), "--client-hop", str(router), str(result)]) == 0
    prof = load_profile(out)
    assert prof.network.client_hop_s == pytest.approx(0.0017)
    less = 2 * TINY.network.router_hop_s + TINY.decode.ingest_s
    assert prof.prefill.return_s == pytest.approx(max(0.0, 0.011 - less))
    assert "network.client_hop_s 1.700 ms" in out.read_text()
    result.write_text(json.dumps({"ttfts": []}))  # not a result with latencies
    assert measure_main(["--out", str(out), "--base", str(TINY_PATH), "--client-hop",
                         str(router), str(result)]) == 2
    result.write_text(json.dumps({"latencies": [0.0217] * 3}))  # a window of no request
    assert measure_main(["--out", str(out), "--base", str(TINY_PATH), "--client-hop",
                         str(router), str(result), "--client-window", "50", "60"]) == 2
