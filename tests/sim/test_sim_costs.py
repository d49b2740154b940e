"""The closed forms behind the model, checked against the public figures they encode."""

from __future__ import annotations

import dataclasses
import math

import pytest

pytest.importorskip("simpy")

from pushkv.sim import costs
from pushkv.sim.profile import DEFAULT


def test_kv_and_weight_sizes_match_the_model_card() -> None:
    m = DEFAULT.model
    assert m.kv_bytes_per_token() == 262_144  # 256 KiB per token
    assert m.kv_bytes_per_token(tp=8) == 32 * 1024  # one KV head per rank
    assert 16384 * m.kv_bytes_per_token() == 4 << 30  # a 16k prompt is 4 GiB
    assert m.weight_bytes_per_gpu(8) == pytest.approx(8.2e9, rel=0.01)


def test_full_16k_prefill_is_about_1_3_pflop() -> None:
    flops = costs.prefill_flops(DEFAULT, 16384)
    attention = flops - 2 * DEFAULT.model.non_embedding_params * 16384
    assert attention == pytest.approx(0.28e15, rel=0.02)
    assert flops == pytest.approx(1.3e15, rel=0.02)


def test_chunks_add_up_to_the_whole_prompt() -> None:
    whole = costs.prefill_flops(DEFAULT, 8192)
    parts = costs.prefill_flops(DEFAULT, 4096) + costs.prefill_flops(DEFAULT, 4096, 4096)
    assert parts == pytest.approx(whole, rel=1e-12)


def test_full_prefills_at_8_qps_exceed_the_node() -> None:
    """The consistency check: without prefix hits, 8 QPS x 16k needs more than one node."""
    d = DEFAULT.prefill
    t = costs.compute_s(DEFAULT, d, costs.prefill_flops(DEFAULT, 16384))
    assert 8 * t > 1.0


def test_light_load_decode_step_is_the_published_tpot() -> None:
    t = costs.step_s(DEFAULT, DEFAULT.decode, decode_contexts=1100, num_decodes=1)
    assert 5.6e-3 <= t <= 5.8e-3


def test_decode_step_grows_with_kv_read() -> None:
    eng = DEFAULT.decode
    short = costs.step_s(DEFAULT, eng, decode_contexts=8 * 1024, num_decodes=8)
    long = costs.step_s(DEFAULT, eng, decode_contexts=8 * 16384, num_decodes=8)
    extra = 8 * (16384 - 1024) * DEFAULT.model.kv_bytes_per_token(8)
    bw = DEFAULT.gpu.hbm_bandwidth * eng.kv_read_efficiency
    assert long - short == pytest.approx(extra / bw, rel=1e-9)


def test_empty_step_costs_nothing() -> None:
    assert costs.step_s(DEFAULT, DEFAULT.decode) == 0.0


def test_posting_cost_is_inside_the_measured_range() -> None:
    """18,880 descriptors took 46 ms on EFA (2.4 us each); the fitted per-descriptor cost
    lies inside the measured 2.4-3.9 us, so the same list costs 46-74 ms here."""
    n = DEFAULT.network
    assert 2.4e-6 <= n.post_per_descriptor_s <= 3.9e-6
    assert 46e-3 <= costs.post_s(n, 18_880) <= 74e-3
    assert costs.post_s(n, 118) == pytest.approx(460e-6, rel=0.3)  # the contiguous case
    assert costs.post_s(n, 0) == n.post_fixed_s


def test_posting_and_wire_overlap() -> None:
    """A transfer ends when the wire has moved everything and the last descriptor is
    posted, whichever is later; the wire never waits for a finished post."""
    n = DEFAULT.network
    nbytes, desc = 512 << 20, 13_000
    wire = costs.transfer_s(n, nbytes, desc, read=True)
    assert costs.pipelined_s(n, nbytes, desc, read=True) == wire
    assert costs.pipelined_s(n, nbytes, desc, read=True, posting_left_s=0.5 * wire) == wire
    slow_post = 2 * wire
    assert costs.pipelined_s(n, nbytes, desc, read=True, posting_left_s=slow_post) == (
        slow_post + n.wire_latency_s)


def test_transfer_is_descriptor_bound_for_small_and_byte_bound_for_large() -> None:
    n = dataclasses.replace(DEFAULT.network, wire_model="two-limits")
    per_gpu_rate = n.descriptor_rate / n.gpus_per_node
    small = costs.transfer_s(n, 1000 * 4096, 1000, read=False) - n.wire_latency_s
    assert small == pytest.approx(1000 / per_gpu_rate)
    big = costs.transfer_s(n, 128 * (8 << 20), 128, read=False) - n.wire_latency_s
    assert big == pytest.approx(128 * (8 << 20) * n.gpus_per_node / n.write_bandwidth)
    read = costs.transfer_s(n, 128 * (8 << 20), 128, read=True) - n.wire_latency_s
    assert read > big


@pytest.mark.parametrize(("size", "gbps"), [(64 << 10, 97), (128 << 10, 191), (256 << 10, 325),
                                            (512 << 10, 358),
                                            (1 << 20, 353), (2 << 20, 367)])
def test_wire_model_follows_the_mooncake_table(size: int, gbps: float) -> None:
    """Node WRITE bandwidth by descriptor size: the measured points exactly (default
    model), within 13% with the older two-limit model."""
    count = 1000
    for model, rel in (("measured-points", 1e-9), ("two-limits", 0.13)):
        n = dataclasses.replace(DEFAULT.network, wire_model=model)
        t = costs.transfer_s(n, count * size, count, read=False) - n.wire_latency_s
        node_bw = count * size * n.gpus_per_node / t
        assert node_bw == pytest.approx(gbps * 1e9, rel=rel), model
        assert math.isfinite(node_bw)


def test_measured_points_interpolate_and_extrapolate() -> None:
    n = DEFAULT.network
    # Below the smallest point: that point's descriptor rate (97 GB/s / 64 KiB).
    rate = 97e9 / (64 << 10)
    assert costs.node_throughput(n, 16 << 10, read=False) == pytest.approx(rate * (16 << 10))
    # Half-way in log size between 128 KiB and 256 KiB: half-way in throughput.
    mid = costs.node_throughput(n, 2 ** 17.5, read=False)
    assert mid == pytest.approx((191e9 + 325e9) / 2)
    assert costs.node_throughput(n, 64 << 20, read=False) == 367e9  # above: the last
    # READ: rate-bound like WRITE for small descriptors, capped at the READ peak.
    assert costs.node_throughput(n, 64 << 10, read=True) == pytest.approx(97e9)
    assert costs.node_throughput(n, 1 << 20, read=True) == n.read_bandwidth
