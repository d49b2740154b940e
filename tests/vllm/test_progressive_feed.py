"""Progressive push's feed: which prompt KV ranges the producer's scheduler half
reports for vLLM's real v1 Scheduler, step by step (``push_granularity``).

The workers are played by the test (no model): each step's metadata is read
and checked against the Scheduler's own view of the request -- what it
scheduled, what it had computed, which blocks it allocated.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from vllm.v1.outputs import KVConnectorOutput

from pushkv.vllm.config import ConnectorConfigError
from pushkv.vllm.params import PrefillLeg

from .harness import Engine, fresh_free, vllm_config

pytestmark = pytest.mark.vllm

BS = 32


def producer(model, granularity: str = "chunk", budget: int = 50, num_blocks: int = 64,
             prefix_caching: bool = True) -> Engine:
    """A producer Scheduler whose chunked prefill computes ``budget`` tokens a step."""
    cfg = vllm_config(model, "kv_producer", engine_id="prefill-0", num_blocks=num_blocks,
                      extra={"push_granularity": granularity})
    cfg.scheduler_config.max_num_batched_tokens = budget
    cfg.cache_config.enable_prefix_caching = prefix_caching
    return Engine(cfg)


def leg(tid: str) -> dict[str, object]:
    return PrefillLeg(transfer_id=tid, incarnation=5).to_params()


def finish_push(e: Engine, *req_ids: str) -> None:
    """The workers report the pushes done; the engine must then hold nothing."""
    e.step(kv=KVConnectorOutput(finished_sending=set(req_ids)))
    assert e.held() == set()
    assert e.free_blocks == fresh_free(e)
    assert e.connector.scheduler_side.sends_held() == {}
    feed = e.connector.scheduler_side.feed
    assert feed is None or feed.streaming() == {}


@pytest.mark.parametrize("granularity", ["chunk", "layer"])
def test_each_step_reports_the_whole_blocks_it_completed(tiny_model, granularity):
    e = producer(tiny_model, granularity, budget=50)
    req = e.request(200, params=leg("t-1"), max_tokens=1)
    seen = []
    while req.request_id not in e.outputs.finish:
        out = e.step()
        seen.append([(r.start, r.end, r.block_ids) for r in e.metas[-1].send_ranges])
        assert out.num_scheduled_tokens == {req.request_id: 50}
    blocks = tuple(e.blocks_of(req.request_id))
    # 50 tokens a step: [0, 50) completes block 0, [50, 100) blocks 1-2, [100, 150)
    # block 3, and the last step the rest, its partial last block included.
    assert seen == [[(0, 32, blocks[:1])], [(32, 96, blocks[:3])], [(96, 128, blocks[:4])],
                    [(128, 200, blocks)]]
    assert {(r.transfer_id, r.incarnation, r.req_id) for r in e.orders("send_ranges")} == {
        ("t-1", 5, req.request_id)}
    # The step of the last range also finishes the prefill (a leg of one token ends
    # with it), closing the stream as it saves the KV.
    (send,) = e.metas[-1].send_at_save
    assert (send.transfer_id, send.num_tokens, send.block_ids) == ("t-1", 200, blocks)
    e.step()
    assert e.orders("send") == []
    finish_push(e, req.request_id)


def test_request_granularity_reports_no_range(tiny_model):
    e = producer(tiny_model, "request", budget=50)
    req = e.request(200, params=leg("t-r"), max_tokens=1)
    e.run_until(lambda: req.request_id in e.outputs.finish)
    e.step()
    assert e.orders("send_ranges") == [] and len(e.finished_prefills()) == 1
    assert not e.connector.scheduler_side.feed.ranges
    finish_push(e, req.request_id)


def test_a_prompt_of_one_step_is_one_range_then_the_push(tiny_model):
    e = producer(tiny_model, "layer", budget=512)
    req = e.request(70, params=leg("t-one"), max_tokens=1)
    e.step()
    (r,) = e.orders("send_ranges")
    assert (r.start, r.end, list(r.block_ids)) == (0, 70, e.blocks_of(req.request_id))
    assert len(e.metas[-1].send_at_save) == 1  # and the push, as the same step ends
    e.run_until(lambda: req.request_id in e.outputs.finish)
    assert len(e.orders("send_ranges")) == 1 and len(e.finished_prefills()) == 1
    finish_push(e, req.request_id)


def test_a_local_prefix_hit_is_reported_with_the_first_range(tiny_model):
    e = producer(tiny_model, "chunk", budget=512)
    warm = e.request(64, max_tokens=1, first=10)  # caches two blocks
    e.run_until(lambda: warm.request_id in e.outputs.finish)
    req = e.request(100, params=leg("t-hit"), max_tokens=1, first=10)
    out = e.step()
    assert out.num_scheduled_tokens == {req.request_id: 100 - 64}  # computed: the rest
    (r,) = e.orders("send_ranges")
    assert (r.start, r.end, list(r.block_ids)) == (0, 100, e.blocks_of(req.request_id))
    e.run_until(lambda: bool(e.finished_prefills()))
    finish_push(e, req.request_id)


def test_legs_whose_decode_side_waits_for_the_answer_are_not_streamed(tiny_model):
    e = producer(tiny_model, "layer", budget=50)
    nixl = e.request(120, params={"do_remote_decode": True}, max_tokens=1)
    plain = e.request(120, max_tokens=1, first=400)
    e.run_until(lambda: {nixl.request_id, plain.request_id} <= set(e.outputs.finish))
    assert e.orders("send_ranges") == []
    # a router's leg is published whole as the step computing its prompt saves it
    (send,) = e.orders("send_at_save")
    assert send.direction == "pull" and send.req_id == nixl.request_id
    e.step()
    assert e.orders("send") == []
    finish_push(e, nixl.request_id)


def test_abort_mid_prefill_ends_the_stream_and_frees_at_once(tiny_model):
    e = producer(tiny_model, "chunk", budget=50)
    req = e.request(200, params=leg("t-cut"), max_tokens=1)
    e.run(2)
    assert [r.end for r in e.orders("send_ranges")] == [32, 96]
    e.abort(req.request_id)
    e.run(3)
    (abort,) = e.orders("send_abort")
    assert (abort.transfer_id, abort.incarnation) == ("t-cut", 5)
    assert e.orders("send") == [] and len(e.orders("send_ranges")) == 2
    assert e.held() == set() and e.free_blocks == fresh_free(e)
    assert e.connector.scheduler_side.feed.streaming() == {}


def test_preempted_mid_stream_the_transfer_is_aborted_and_never_pushed(tiny_model):
    # 6 usable blocks: a decoding request grows into the blocks the prefill holds.
    e = producer(tiny_model, "layer", budget=40, num_blocks=7)
    big = e.request(62, max_tokens=120)
    e.run(2)
    req = e.request(100, params=leg("t-pre"), max_tokens=1, first=300)
    preempted = []
    for _ in range(300):
        out = e.step()
        if req.request_id in out.preempted_req_ids:
            preempted.append([r.end for r in e.orders("send_ranges")])
        if {big.request_id, req.request_id} <= set(e.outputs.finish):
            break
    assert preempted == [[32, 64]], "the stream should be preempted once, after 2 ranges"
    (abort,) = e.orders("send_abort")
    assert abort.transfer_id == "t-pre"
    # The recomputed prefill reports nothing more and is not pushed.
    assert [r.end for r in e.orders("send_ranges")] == [32, 64]
    assert e.orders("send") == []
    assert e.outputs.finish[req.request_id] == "length"
    assert e.held() == set() and e.free_blocks == fresh_free(e)
    assert e.connector.scheduler_side.feed.streaming() == {}


@given(lengths=st.lists(st.integers(1, 250), min_size=1, max_size=4),
       budget=st.integers(8, 200), shared=st.booleans())
def test_ranges_partition_each_prompt_in_order_over_the_blocks_allocated(
        tiny_model, lengths, budget, shared):
    e = producer(tiny_model, "chunk", budget=budget, num_blocks=64)
    reqs = [e.request(n, params=leg(f"t-{i}"), max_tokens=1,
                      first=10 if shared else 100 * i) for i, n in enumerate(lengths)]
    reported = {r.request_id: 0 for r in reqs}
    for _ in range(400):
        if all(r.request_id in e.outputs.finish for r in reqs):
            break
        e.step()
        for rng in e.metas[-1].send_ranges:
            req = e.sched.requests[rng.req_id]
            # contiguous, in order, on block boundaries but for the prompt's end
            assert rng.start == reported[rng.req_id] < rng.end <= req.num_prompt_tokens
            assert rng.end % BS == 0 or rng.end == req.num_prompt_tokens
            assert req.num_computed_tokens >= rng.end  # computed by this step
            blocks = e.blocks_of(rng.req_id)
            assert list(rng.block_ids) == blocks[:-(-rng.end // BS)]
            reported[rng.req_id] = rng.end
    else:
        raise AssertionError("requests did not finish")
    assert reported == {r.request_id: r.num_prompt_tokens for r in reqs}
    e.step()
    assert sorted(s.req_id for s in e.finished_prefills()) == sorted(reported)
    finish_push(e, *reported)


def test_an_unknown_granularity_is_refused_by_name(tiny_model):
    with pytest.raises(ConnectorConfigError, match="push_granularity must be one of"):
        producer(tiny_model, "token")


def test_aborted_after_its_whole_prompt_was_reported_it_is_still_pushed(tiny_model):
    # Its KV is complete and may have landed: the decode side can answer before the
    # prefill leg, which pushkv's proxy then cancels.
    e = producer(tiny_model, "layer", budget=50)
    req = e.request(120, params=leg("t-late"), max_tokens=3)
    e.run_until(lambda: bool(e.orders("send_ranges"))
                and e.orders("send_ranges")[-1].end == 120)
    e.abort(req.request_id)
    e.step()
    assert e.orders("send_abort") == []
    (send,) = e.orders("send")
    assert (send.transfer_id, send.num_tokens) == ("t-late", 120)
    assert req.request_id in e.held()  # held for the push
    finish_push(e, req.request_id)
