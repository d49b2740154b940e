"""Each switchable mechanism's limiting case against its closed form."""

from __future__ import annotations

import pytest

pytest.importorskip("simpy")

from sim_helpers import config, with_profile

from pushkv.sim import costs, run
from pushkv.sim.profile import DEFAULT

H8 = sum(1 / k for k in range(1, 9))  # the slowest of 8 exponentials: H_8 x the mean


def _alone(mode: str, **sections: dict) -> tuple[float, float]:
    """TTFT of one request alone, and the duration of its transfer as one rank sees it
    (from the start of posting to the end of the wire)."""
    r = run(config(mode, qps=1.0, input_len=4096, output_len=4, num_prompts=1,
                   profile=with_profile(**sections) if sections else DEFAULT),
            keep_objects=True)
    assert r.transport is not None
    (n,) = r.transport.descriptors
    net = DEFAULT.network
    kv = 4096 * DEFAULT.model.kv_bytes_per_token(DEFAULT.decode.tp)
    moved = costs.pipelined_s(net, kv, n, read=mode != "push",
                              posting_left_s=costs.post_s(net, n))
    return r.result["ttfts"][0], moved


@pytest.mark.parametrize("mode", ["pull", "pull-async", "push"])
def test_ready_waits_for_the_slowest_rank(mode: str) -> None:
    """With a fixed skew the slowest rank takes (1 + 2s) times as long: TTFT grows by
    exactly 2s times the transfer."""
    base, moved = _alone(mode)
    skewed, _ = _alone(mode, network={"rank_skew": 0.1, "rank_skew_dist": "fixed"})
    assert skewed - base == pytest.approx(0.2 * moved, abs=2e-7)  # ttfts: 7 decimals


def test_exponential_skew_makes_the_slowest_of_eight_h8_times_late() -> None:
    r = run(config("push", qps=8.0, input_len=1024, output_len=4, num_prompts=400,
                   profile=with_profile(network={"rank_skew": 0.05})), keep_objects=True)
    assert r.transport is not None
    skews = r.transport.skews
    assert len(skews) == 400
    assert sum(skews) / len(skews) == pytest.approx(0.05 * H8, rel=0.08)


def _gil_case(fraction: float, post: float, step_at: float, python_s: float,
              dt: float) -> float:
    """A posting thread starts a ``post``-second post at 0; the engine loop of the same
    process starts a ``dt`` step at ``step_at``; return when the step ends."""
    import random

    import simpy

    from pushkv.sim.host.dedicated import Dedicated
    from pushkv.sim.network import Network
    from pushkv.sim.scenario import FaultConfig, ProtocolSettings
    from pushkv.sim.transport import SimTransport

    prof = with_profile(network={"post_gil_fraction": fraction})
    env = simpy.Environment()
    t = SimTransport(env, prof, Network(env, prof.network), ProtocolSettings(),
                     FaultConfig(), random.Random(0), Dedicated(env, prof))
    t._add_node("p")
    ended: list[float] = []

    def loop():  # type: ignore[no-untyped-def]
        yield env.timeout(step_at)
        yield from t.run_step("p", python_s, dt)
        ended.append(env.now)

    env.process(t._post_holding_gil("p", post))
    env.process(loop())
    env.run()
    return ended[0]


@pytest.mark.parametrize(("fraction", "expected"), [
    (1.0, 0.040 + 0.010),   # the loop waits for the whole post, then runs its step
    (0.5, 0.020 + 0.010),   # the lock is held for half the post
    (0.25, 0.010 + 0.010),
    (0.1, 0.005 + 0.010),   # released (at 4 ms) before the loop asked: no wait
    (0.0, 0.005 + 0.010),
])
def test_a_posting_thread_holding_the_lock_delays_the_loop(fraction: float,
                                                           expected: float) -> None:
    assert _gil_case(fraction, post=0.040, step_at=0.005, python_s=0.002,
                     dt=0.010) == pytest.approx(expected)


def test_moving_posting_off_the_loop_has_its_price_in_pull_async_not_in_push() -> None:
    """A decode reader thread holds decode's lock while it posts: decode steps wait. Push
    posts on prefill, whose steps have room, and decode never waits."""
    def go(mode: str, fraction: float) -> dict:
        prof = with_profile(network={"post_gil_fraction": fraction})
        return run(config(mode, qps=8.0, input_len=16384, output_len=64, num_prompts=40,
                          profile=prof)).result

    held, free = go("pull-async", 1.0), go("pull-async", 0.0)
    assert held["pushkv"]["gil_wait_ms_by_engine"].get("decode-0", 0) > 100
    assert free["pushkv"]["gil_wait_ms_by_engine"].get("decode-0", 0) < 1  # messages only
    assert held["mean_tpot_ms"] > free["mean_tpot_ms"] * 1.05
    push = go("push", 1.0)
    assert "decode-0" not in push["pushkv"]["gil_wait_ms_by_engine"]


def _seq_push_alone(**control: float) -> float:
    from pushkv.sim import Dispatch

    r = run(config("push", qps=1.0, input_len=4096, output_len=4, num_prompts=1,
                   dispatch=Dispatch.SEQUENTIAL, profile=with_profile(control=control)))
    return float(r.result["ttfts"][0])


def test_messages_cost_their_sender_and_receiver() -> None:
    """Push behind a sequential router: the registration (sent, then received) and the
    write notification (received) are on the critical path: a + 2b."""
    free = _seq_push_alone(message_send_s=0.0, message_recv_s=0.0)
    priced = _seq_push_alone(message_send_s=0.001, message_recv_s=0.002)
    assert priced - free == pytest.approx(0.001 + 2 * 0.002, abs=2e-7)


@pytest.mark.parametrize("mode", ["pull", "pull-async", "push"])
def test_the_first_contact_waits_for_the_handshake_once(mode: str) -> None:
    """Alone, a transfer whose registration or read leaves after prefill (push behind a
    sequential router; pull always) waits exactly the handshake, through the core's
    Connect (push) or before planning the read (pull)."""
    from pushkv.sim import Dispatch

    def go(before: bool, n: int) -> tuple[list[float], dict]:
        r = run(config(mode, qps=2.0, input_len=2048, output_len=4, num_prompts=n,
                       dispatch=Dispatch.SEQUENTIAL,
                       profile=with_profile(control={"handshake_before_run": before,
                                                     "handshake_s": 1.5})),
                keep_objects=True)
        assert r.transport is not None
        assert r.result["completed"] == n
        return r.result["ttfts"], dict(r.transport.stats)

    (met,), _ = go(True, 1)
    (cold,), _ = go(False, 1)
    assert cold - met == pytest.approx(1.5, abs=1e-6)  # alone: exactly the handshake
    ttfts, stats = go(False, 6)
    assert stats["handshakes"] == 1  # one per pair, however many transfers wait for it
    assert max(ttfts) < 1.5 + 0.1


def test_vllm_free_order_reuses_uncached_blocks_first_and_reversed() -> None:
    import numpy as np

    from pushkv.sim.blocks import BlockPool

    rng = np.random.default_rng(0)
    uncached = BlockPool(10, 0.0, rng, "vllm-uncached")
    a = uncached.allocate(4)
    uncached.free(a)
    assert uncached.allocate(4) == [3, 2, 1, 0]  # reversed, at the head
    cached = BlockPool(10, 0.0, rng, "vllm-cached")
    cached.free(cached.allocate(4))
    assert cached.allocate(6) == [4, 5, 6, 7, 8, 9]  # LRU: to the tail
    assert cached.allocate(4) == [3, 2, 1, 0]
    static = BlockPool(10, 0.0, rng, "tail")
    static.free(static.allocate(4))
    assert static.allocate(10) == [4, 5, 6, 7, 8, 9, 0, 1, 2, 3]


@pytest.mark.parametrize(("allocator", "second"), [("static", 128), ("history", 128 * 64)])
def test_descriptor_counts_follow_the_pools_history(allocator: str, second: int) -> None:
    """Fresh pools, two 1k-token requests one after the other. With vLLM's free order the
    second lands in the first's decode blocks, reversed: no two blocks adjacent in the
    same direction on both sides, one descriptor per block, layer and plane."""
    prof = with_profile(prefill={"allocator": allocator, "fragmentation": 0.0},
                        decode={"allocator": allocator, "fragmentation": 0.0})
    r = run(config("push", qps=0.5, input_len=1024, output_len=8, num_prompts=2,
                   profile=prof), keep_objects=True)
    assert r.transport is not None
    first, then = r.requests
    assert first.token_times[-1] < then.arrival  # strictly one after the other
    assert r.transport.descriptors == [128, second]


def _decode_pool_of(blocks: int) -> float:
    """A decode activation reserve that leaves ``blocks`` KV blocks."""
    m, g, d = DEFAULT.model, DEFAULT.gpu, DEFAULT.decode
    per_block = m.kv_bytes_per_token(d.tp) * d.block_size
    return g.memory_bytes * d.gpu_memory_utilization - m.weight_bytes_per_gpu(d.tp) - (
        blocks + 0.5) * per_block


def test_memory_pressure_preempts_the_newest_and_it_recomputes() -> None:
    """Two 1k requests (64 blocks of prompt, 4 more for 64 tokens) in a 130-block decode
    pool: both start, then the second is preempted for the first's growth; when the
    first ends, the second computes its prompt and tokens again in one step."""
    prof = with_profile(decode={"activation_reserve_bytes": _decode_pool_of(130)})
    r = run(config("push", qps=float("inf"), input_len=1024, output_len=64, num_prompts=2,
                   profile=prof), keep_objects=True)
    assert r.decodes[0].pool.num_blocks == 130
    first, second = r.requests
    assert r.result["completed"] == 2 and r.leaked_blocks == 0
    assert (first.preempted, second.preempted) == (0, 1)
    assert second.recomputed and len(second.token_times) == 64
    ctx = second.recompute_len
    assert 1024 < ctx < 1024 + 64
    gap = second.token_times[ctx - 1024] - first.token_times[-1]
    assert gap == pytest.approx(
        costs.step_s(DEFAULT, DEFAULT.decode, prefill_chunks=((ctx, 0),)), abs=1e-9)


def test_without_preemption_the_second_waits_for_room() -> None:
    prof = with_profile(decode={"activation_reserve_bytes": _decode_pool_of(130),
                                "preemption": "off"})
    r = run(config("push", qps=float("inf"), input_len=1024, output_len=64, num_prompts=2,
                   profile=prof), keep_objects=True)
    first, second = r.requests
    assert (first.preempted, second.preempted) == (0, 0) and not second.recomputed
    assert second.token_times[0] > first.token_times[-1]
    assert r.result["completed"] == 2 and r.leaked_blocks == 0


def test_reissue_preempts_a_transfer_in_flight_and_registers_a_new_attempt() -> None:
    """Prefill computes one prompt per second, so the second registration waits for its
    KV while the first request runs and needs blocks: the core fences the second's
    attempt, its blocks come back, and when there is room it registers again (a new
    attempt); it completes and nobody recomputes."""
    prof = with_profile(decode={"activation_reserve_bytes": _decode_pool_of(130),
                                "preemption": "reissue"},
                        prefill={"max_num_seqs": 1, "prefill_step_overhead_s": 1.0})
    r = run(config("push", qps=float("inf"), input_len=1024, output_len=64, num_prompts=2,
                   profile=prof), keep_objects=True)
    assert r.transport is not None
    first, second = r.requests
    assert r.result["completed"] == 2 and r.leaked_blocks == 0
    assert first.preempted == 0 and second.preempted >= 1 and not second.recomputed
    stats = r.transport.stats
    assert stats["preempted_transfers"] == stats["reissued"] == second.preempted
    assert stats["sent_Register"] == 2 + second.preempted  # one per attempt
    assert len(r.transport.descriptors) == 2  # the KV was written once, into the last
