"""Progressive push in the cluster simulator: one request, load, a shared fabric, closed loop."""

from __future__ import annotations

import dataclasses

import pytest
from sim_helpers import config

from pushkv.sim import SimConfig, TransferMode, WorkloadConfig, run
from pushkv.sim.marks import Timeline
from pushkv.sim.progressive import named_profile, whatif
from pushkv.sim.scenario import RouterPolicy
from pushkv.sim.workload import WorkloadError

TCP = named_profile("tcp100")  # the wire is slow beside prefill: ranges queue for it
FRESH = dataclasses.replace(TCP, prefill=dataclasses.replace(TCP.prefill,
                                                             prefix_hit_fraction=0.0))


def _run(mode: str, *, n: int, prompts: int, profile=FRESH, conc: int | None = None,
         **kw):
    tl = Timeline()
    cfg = SimConfig(mode=TransferMode(mode), profile=profile, workload=WorkloadConfig(
        request_rate=float("inf"), input_len=n, output_len=2, num_prompts=prompts,
        max_concurrency=conc), **kw)
    out = run(cfg, keep_objects=True, timeline=tl)
    assert out.result["failed"] == 0 and out.leaked_blocks == 0
    return out, tl


def test_one_request_at_a_time_is_the_single_request_model():
    """Requests one after another (closed loop, one in flight) on idle engines: each has
    the one-request model's TTFT, in every push mode (16k: two prefill steps)."""
    for mode, single in (("push", "push"), ("push-chunk", "chunk"), ("push-layer", "layer")):
        out, _ = _run(mode, n=16384, prompts=3, conc=1)
        want = whatif(TCP, 16384, single).ttft_s
        assert out.result["ttfts"] == pytest.approx([want] * 3, abs=2e-7)
    # and progressive push is worth something here, so the comparison can fail
    assert whatif(TCP, 16384, "layer").ttft_s < 0.8 * whatif(TCP, 16384, "push").ttft_s


@pytest.mark.parametrize("mode", ["push-chunk", "push-layer"])
def test_at_load_every_range_is_written_once_and_ready_follows_every_part(mode):
    """Twelve 16k prompts at once: prefill steps hold several prompts, one writer thread
    posts every request's ranges. Each request moves exactly the bytes of its one
    whole-request write, and its READY comes after the last of its writes."""
    whole, _ = _run("push", n=16384, prompts=12)
    prog, tl = _run(mode, n=16384, prompts=12)
    t = prog.transport
    assert t is not None and whole.transport is not None
    extra = prog.result["pushkv"]
    assert extra["granularity"] == mode.split("-")[1]
    assert extra["writes"] >= 2 * 12  # ranges went out before prefill ended
    ctl = TCP.network.control_latency_s
    for tid, marks in tl.requests.items():
        done = t.writes_done[tid]
        (one,) = whole.transport.writes_done[tid]
        assert sum(b for _, b in done) == one[1]  # every cell once, none twice
        assert len(done) >= 2
        assert marks["ready"] >= max(w for w, _ in done) + ctl
        assert marks["ready"] >= marks["prefill_finished"]


def test_two_requests_ranges_share_the_fabric_fairly():
    """Two prefill instances push-layer one 16k prompt each into one decode node: their
    ranges share its ingress link half and half, so their last writes end together, each
    later than alone; first come first served (fifo) would finish one first."""
    def wire_after_prefill(profile, prompts):
        out, tl = _run("push-layer", n=16384, prompts=prompts, profile=profile,
                       num_prefill=2, router_policy=RouterPolicy.ROUND_ROBIN)
        assert out.transport is not None
        assert len({r.prefill for r in out.requests}) == prompts
        return [max(w for w, _ in out.transport.writes_done[tid]) - m["prefill_finished"]
                for tid, m in tl.requests.items()]

    (alone,) = wire_after_prefill(FRESH, 1)
    a, b = wire_after_prefill(FRESH, 2)
    assert a == pytest.approx(b, rel=1e-9)
    assert a > 1.5 * alone  # the backlog at prefill end drains at half the rate
    fifo = dataclasses.replace(FRESH, network=dataclasses.replace(FRESH.network,
                                                                  sharing="fifo"))
    a, b = wire_after_prefill(fifo, 2)
    assert abs(a - b) > 0.1 * alone


@pytest.mark.parametrize("mode", ["pull", "push-layer"])
def test_closed_loop_keeps_exactly_n_in_flight(mode):
    """--max-concurrency 4 with 14 requests due at once: never more than 4 in flight, and
    each send (at t=0, then as one ends) leaves exactly 4 in flight while any wait."""
    n = 4

    def load(conc: int | None) -> SimConfig:
        return dataclasses.replace(config(mode), workload=WorkloadConfig(
            request_rate=float("inf"), input_len=2048, output_len=8, num_prompts=14,
            max_concurrency=conc))

    out = run(load(n))
    res = out.result
    assert res["max_concurrency"] == n and res["completed"] == 14
    spans = [(s, s + lat) for s, lat in zip(res["start_times"], res["latencies"], strict=True)]
    eps = 1e-6  # the file's times are rounded to 0.1 us

    def in_flight(t: float) -> int:
        return sum(1 for s, e in spans if s <= t + eps and e > t + eps)

    sends = sorted({s for s, _ in spans})
    assert sends[0] == 0.0 and len(sends) > 1
    # a slot never idles while a request waits for one: N in flight, fewer only once
    # every request left (the last sends, two ending together, leave one slot empty)
    not_ended = [sum(1 for _, e in spans if e > t + eps) for t in sends]
    assert [in_flight(t) for t in sends] == [min(n, k) for k in not_ended]
    assert sum(1 for t in sends if in_flight(t) == n) >= len(sends) - 1
    assert max(in_flight(t) for _, t in spans) <= n
    # open loop: all 14 at once
    open_ = run(load(None))
    assert set(open_.result["start_times"]) == {0.0}


def test_bad_concurrency_is_refused():
    for bad in (0, -1, 2.5):
        with pytest.raises(WorkloadError):
            WorkloadConfig(max_concurrency=bad)


def test_plot_draws_progressive_and_closed_loop_results(tmp_path):
    """Result files of the new modes, open and closed loop, are read and drawn."""
    from pushkv.sim.plot import load_points, plot

    def tiny(mode: str, conc: int | None) -> SimConfig:
        return dataclasses.replace(config(mode), workload=WorkloadConfig(
            request_rate=8.0, input_len=1024, output_len=2, num_prompts=4,
            max_concurrency=conc))

    names = [run(tiny(m, c)).write(tmp_path).name
             for m, c in (("push-chunk", None), ("push-layer", 2))]
    assert names == ["push-chunk_qps8_in1024_out2_iter0.json",
                     "push-layer_qps8_c2_in1024_out2_iter0.json"]
    assert {p.mode for p in load_points(tmp_path, "ttft")} == {"push-chunk", "push-layer c2"}
    assert plot(tmp_path, "ttft", tmp_path / "t.png", modes=["push-layer"]).stat().st_size > 0


def test_a_prefill_death_mid_stream_ends_every_request_once_without_leaks():
    """Two prefill instances push layer-wise and one dies while streaming: its prompts'
    transfers fail (recomputed on decode) or are re-sent; every request ends exactly once
    (the recorder refuses a second end), no block stays held, no message is refused."""
    from pushkv.protocol import FailurePolicy
    from pushkv.sim.scenario import FaultConfig, ProtocolSettings

    cfg = SimConfig(mode=TransferMode.PUSH_LAYER, num_prefill=2, num_decode=2,
                    faults=FaultConfig(kill_prefill_at=0.5),
                    protocol=ProtocolSettings(policy=FailurePolicy.RECOMPUTE),
                    workload=WorkloadConfig(request_rate=8, input_len=16384, output_len=4,
                                            num_prompts=16))
    out = run(cfg)
    extra = out.result["pushkv"]
    assert out.result["completed"] == 16 and out.leaked_blocks == 0 and out.rejected == 0
    assert extra["recomputed"] + extra["rerouted"] > 0  # the death touched some requests
    assert extra["ranges_reported"] > extra["writes"] > 16
