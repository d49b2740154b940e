"""Progressive push in the simulator: the same protocol inputs, TTFT by mode."""

import dataclasses

import pytest

from pushkv.sim import costs
from pushkv.sim.profile import DEFAULT
from pushkv.sim.progressive import (
    MODES,
    PROFILES,
    hidden_share,
    named_profile,
    table,
    whatif,
)


def test_whole_request_push_matches_the_closed_form():
    """One range = one write of the whole request: prefill, then post + wire."""
    n = 4096
    out = whatif(DEFAULT, n, "push")
    eng = DEFAULT.prefill
    prefill = costs.step_s(DEFAULT, eng, prefill_chunks=((n, 0),))
    assert out.prefill_s == pytest.approx(prefill)
    assert out.writes == 1
    net = DEFAULT.network
    wire = costs.pipelined_s(net, n * DEFAULT.model.kv_bytes_per_token(eng.tp),
                             out.descriptors, read=False,
                             posting_left_s=costs.post_s(net, out.descriptors))
    # READY: register is long in, the write starts at prefill end, one control hop and
    # the receiving thread's time
    ready = prefill + wire + net.control_latency_s + DEFAULT.control.message_recv_s
    assert out.ready_s == pytest.approx(ready)
    # TTFT: a hop to the engines, READY, one decode step, a hop back
    decode = costs.step_s(DEFAULT, DEFAULT.decode, decode_contexts=n, num_decodes=1)
    assert out.ttft_s == pytest.approx(2 * net.router_hop_s + ready + decode, abs=1e-6)


def test_modes_order_and_the_floor():
    for name in PROFILES:
        prof = named_profile(name)
        out = {m: whatif(prof, 16384, m) for m in MODES}
        assert out["free"].ttft_s <= out["layer"].ttft_s <= out["push"].ttft_s
        assert out["free"].ttft_s <= out["chunk"].ttft_s <= out["push"].ttft_s
        # the same bytes move whichever way they are cut
        assert out["layer"].writes > out["chunk"].writes > out["push"].writes == 1


def test_one_chunk_prompts_gain_nothing_from_chunkwise_push():
    out = {m: whatif(DEFAULT, 2048, m) for m in ("push", "chunk")}
    assert out["chunk"].ttft_s == pytest.approx(out["push"].ttft_s)
    assert hidden_share(out["push"], out["chunk"]) == pytest.approx(0.0)


def test_costly_posting_eats_the_gain_of_many_tiny_writes():
    """Layer-wise push pays the fixed posting cost per layer: when it exceeds a
    layer's compute, READY trails prefill by the backlog."""
    slow = dataclasses.replace(DEFAULT, network=dataclasses.replace(
        DEFAULT.network, post_fixed_s=5e-3))
    push, layer = whatif(slow, 1024, "push"), whatif(slow, 1024, "layer")
    assert layer.ttft_s > push.ttft_s


def test_table_reports_every_length():
    rows = table(named_profile("tcp100"), (1024, 16384))
    assert [r["input_len"] for r in rows] == [1024, 16384]
    assert rows[1]["hidden_layer"] > rows[1]["hidden_chunk"] > 0


def test_unknown_mode_and_profile_are_refused():
    with pytest.raises(ValueError):
        whatif(DEFAULT, 10, "sideways")
    with pytest.raises(ValueError):
        named_profile("nope")
