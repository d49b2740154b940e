"""vLLM's real v1 Scheduler driving PushKVConnector's scheduler half, on both roles.

The workers are played by the test: it reads each step's metadata and answers
with the finished/failed sets a worker would report. Every test ends by
checking that no block leaked and the connector forgot the request.
"""

from __future__ import annotations

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from pushkv.vllm.config import ConnectorConfigError
from pushkv.vllm.params import ENDPOINT_KEY, VOCAB_KEY, DecodeLeg, Endpoint, PrefillLeg

from .harness import Engine, fresh_free, vllm_config

pytestmark = pytest.mark.vllm

PRODUCER = Endpoint(engine_id="prefill-0", host="127.0.0.1", port=5600)
BS = 32


def decode_params(tid: str) -> dict[str, object]:
    return DecodeLeg(transfer_id=tid, producer=PRODUCER).to_params()


def recv_done(*req_ids: str, failed: tuple[str, ...] = ()) -> KVConnectorOutput:
    return KVConnectorOutput(finished_recving=set(req_ids) | set(failed),
                             failed_recving=set(failed))


@pytest.fixture
def consumer(tiny_model):
    def make(**kw):
        return Engine(vllm_config(tiny_model, "kv_consumer", engine_id="decode-0", **kw))
    return make


@pytest.fixture
def producer(tiny_model):
    def make(**kw):
        return Engine(vllm_config(tiny_model, "kv_producer", engine_id="prefill-0", **kw))
    return make


def assert_idle(engine: Engine) -> None:
    side = engine.connector.scheduler_side
    assert engine.held() == set()
    assert engine.free_blocks == fresh_free(engine)
    assert side.transfers_in_flight() == {}
    assert side.lent_blocks() == {}
    assert side.sends_held() == {}


# ------------------------------------------------------------------ consumer


def test_decode_request_waits_for_its_kv_then_decodes(consumer):
    e = consumer()
    req = e.request(70, params=decode_params("t-1"), max_tokens=3)
    e.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (order,) = e.orders("recv")
    blocks = e.blocks_of(req.request_id)
    assert order.transfer_id == "t-1" and order.producer == PRODUCER
    assert list(order.block_ids) == blocks and len(blocks) == 3  # ceil(70 / 32)
    assert (order.num_tokens, order.first_token) == (70, 0)
    e.run(3)  # nothing lands: it keeps waiting, registered once
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(e.orders("recv")) == 1
    e.step(kv=recv_done(req.request_id))
    out = e.step()
    assert out.num_scheduled_tokens == {req.request_id: 1}  # only the last prompt token
    e.run_until(lambda: req.request_id in e.outputs.finish)
    assert e.outputs.finish[req.request_id] == "length"
    assert len(e.outputs.tokens[req.request_id]) == 3
    assert_idle(e)


def test_the_first_decode_step_of_a_pushed_transfer_tells_its_producer_once(consumer):
    """Rule 12: the step that admits the request whose KV landed carries its transfer
    in ``consumed`` (the workers send Consumed), once; no step before it does."""
    e = consumer()
    req = e.request(70, params=decode_params("t-c"), max_tokens=3)
    e.step()
    e.step(kv=recv_done(req.request_id))  # READY: vLLM learns it at this step's end
    assert e.orders("consumed") == []
    out = e.step()
    assert out.num_scheduled_tokens == {req.request_id: 1}  # its first decode step
    assert e.metas[-1].consumed == ["t-c"] and not e.metas[-1].is_empty()
    e.run_until(lambda: req.request_id in e.outputs.finish)
    assert e.orders("consumed") == ["t-c"]
    assert_idle(e)


def test_a_pushed_transfer_ended_before_its_first_step_is_reported_consumed(consumer):
    """READY, then aborted before vLLM admitted it: its producer need keep nothing."""
    e = consumer()
    req = e.request(70, params=decode_params("t-e"), max_tokens=3)
    e.step()
    e.step(kv=recv_done(req.request_id))
    e.abort(req.request_id)
    e.step()
    assert e.orders("consumed") == ["t-e"]
    assert_idle(e)


def test_registration_skips_the_local_prefix_hit(consumer):
    e = consumer()
    a = e.request(80, params=decode_params("t-a"), max_tokens=1)
    e.step()
    e.step(kv=recv_done(a.request_id))
    e.run_until(lambda: a.request_id in e.outputs.finish)
    # Same first 64 tokens: two cached blocks are hit locally, only the rest is pushed.
    b = e.request(90, params=decode_params("t-b"), max_tokens=1)
    e.step()
    order = e.orders("recv")[-1]
    assert order.transfer_id == "t-b"
    assert (order.num_tokens, order.first_token) == (90, 64)
    assert list(order.block_ids) == e.blocks_of(b.request_id)
    e.step(kv=recv_done(b.request_id))
    e.run_until(lambda: b.request_id in e.outputs.finish)
    assert_idle(e)


def test_transfers_sharing_a_cached_prefix_are_serialised(consumer):
    e = consumer()
    warm = e.request(64, max_tokens=1)  # caches two prefix blocks locally
    e.run_until(lambda: warm.request_id in e.outputs.finish)
    a = e.request(80, params=decode_params("t-a"), max_tokens=1)
    b = e.request(96, params=decode_params("t-b"), max_tokens=1)
    e.step()
    assert {o.transfer_id for o in e.orders("recv")} == {"t-a"}
    shared = set(e.blocks_of(a.request_id)) & set(e.blocks_of(b.request_id))
    assert len(shared) == 2
    assert e.connector.scheduler_side.transfers_in_flight() == {
        a.request_id: "waiting", b.request_id: "deferred"}
    e.step(kv=recv_done(a.request_id))  # a's blocks are no longer lent...
    e.step()  # ...so the next step ships b
    assert [o.transfer_id for o in e.orders("recv")] == ["t-a", "t-b"]
    assert e.orders("recv")[-1].first_token == 64
    e.step(kv=recv_done(b.request_id))
    e.run_until(lambda: {a.request_id, b.request_id} <= set(e.outputs.finish))
    assert_idle(e)


def test_abort_while_waiting_cancels_and_holds_blocks_until_fenced(consumer):
    e = consumer()
    req = e.request(50, params=decode_params("t-x"))
    e.step()
    before = e.free_blocks
    e.abort(req.request_id)
    e.step()
    (abort,) = e.orders("recv_abort")
    assert (abort.req_id, abort.transfer_id) == (req.request_id, "t-x")
    e.run(2)
    assert e.free_blocks == before and req.request_id in e.held()  # not reusable yet
    e.step(kv=recv_done(req.request_id))  # the worker saw the fence
    assert_idle(e)


def test_abort_of_a_deferred_registration_needs_no_fence(consumer):
    e = consumer()
    warm = e.request(64, max_tokens=1)
    e.run_until(lambda: warm.request_id in e.outputs.finish)
    a = e.request(80, params=decode_params("t-a"))
    b = e.request(80, params=decode_params("t-b"), first=10)
    e.step()
    e.abort(b.request_id)
    e.step()
    assert e.orders("recv_drop") == [b.request_id]
    assert e.orders("recv_abort") == []
    e.step(kv=recv_done(b.request_id, a.request_id))
    e.run_until(lambda: a.request_id in e.outputs.finish)
    assert [o.transfer_id for o in e.orders("recv")] == ["t-a"]
    assert_idle(e)


def test_abort_before_admission_touches_nothing(consumer):
    e = consumer(num_blocks=5)
    big = e.request(120, max_tokens=8)  # all 4 usable blocks
    e.step()
    waiting = e.request(60, params=decode_params("t-q"))
    e.step()
    assert waiting.status == RequestStatus.WAITING
    e.abort(waiting.request_id)
    e.run_until(lambda: big.request_id in e.outputs.finish)
    assert e.orders("recv") == [] and e.orders("recv_abort") == []
    assert_idle(e)


def test_failed_transfer_under_policy_fail_errors_the_request(consumer):
    e = consumer(policy="fail")
    req = e.request(40, params=decode_params("t-f"))
    e.step()
    e.step(kv=recv_done(failed=(req.request_id,)))
    assert e.outputs.finish[req.request_id] == "error"
    assert_idle(e)


def test_failed_transfer_under_policy_recompute_prefills_locally(consumer):
    e = consumer(policy="recompute")
    req = e.request(40, params=decode_params("t-r"), max_tokens=2)
    e.step()
    e.step(kv=recv_done(failed=(req.request_id,)))
    out = e.step()
    assert out.num_scheduled_tokens == {req.request_id: 40}  # the whole prompt, locally
    e.run_until(lambda: req.request_id in e.outputs.finish)
    assert e.outputs.finish[req.request_id] == "length"
    assert len(e.orders("recv")) == 1  # never registered again
    assert e.orders("consumed") == []  # nothing landed: no source to free
    assert_idle(e)


def test_malformed_decode_params_fail_through_the_policy(consumer):
    e = consumer(policy="fail")
    bad = {"do_remote_prefill": True, "transfer_id": "t-bad", "producer": {"port": "x"}}
    req = e.request(40, params=bad)
    e.step()
    assert e.orders("recv") == [] and e.orders("recv_fail") == [req.request_id]
    e.step(kv=recv_done(failed=(req.request_id,)))
    assert e.outputs.finish[req.request_id] == "error"
    assert_idle(e)


def test_preempted_after_its_kv_arrived_the_request_resumes_locally(consumer):
    e = consumer(num_blocks=6)
    other = e.request(64, max_tokens=40)
    req = e.request(64, params=decode_params("t-p"), max_tokens=40, first=500)
    e.step(kv=None)
    e.step(kv=recv_done(req.request_id))
    preempted = set()
    for _ in range(80):
        out = e.step()
        preempted |= out.preempted_req_ids
        if {other.request_id, req.request_id} <= set(e.outputs.finish):
            break
    assert preempted, "the tiny block pool should have forced a preemption"
    assert req.num_preemptions + other.num_preemptions >= 1
    assert len(e.orders("recv")) == 1  # re-admission never registers again
    assert e.orders("consumed") == ["t-p"]  # at its first admission only
    assert e.outputs.finish[req.request_id] == "length"
    assert_idle(e)


def test_memory_pressure_preempts_running_requests_never_a_waiting_transfer(consumer):
    e = consumer(num_blocks=6)  # 5 usable blocks
    running = e.request(64, max_tokens=90)  # grows from 2 to 5 blocks
    e.step()
    waiting = e.request(60, params=decode_params("t-w"), max_tokens=2, first=400)
    e.step()
    assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    held = e.blocks_of(waiting.request_id)
    for _ in range(60):  # the running request needs blocks the waiting one holds
        e.step()
        assert waiting.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert e.blocks_of(waiting.request_id) == held
        if running.num_preemptions:
            break
    assert running.num_preemptions >= 1  # vLLM preempted the running request instead
    e.step(kv=recv_done(waiting.request_id))
    e.run_until(lambda: {running.request_id, waiting.request_id} <= set(e.outputs.finish))
    assert [o.transfer_id for o in e.orders("recv")] == ["t-w"]  # one attempt, never reissued
    assert_idle(e)


def test_requests_without_pushkv_params_are_left_alone(consumer):
    e = consumer()
    plain = e.request(40, max_tokens=2)
    nixl = e.request(40, params={"do_remote_prefill": True, "remote_engine_id": "x"},
                     max_tokens=2, first=300)
    e.run_until(lambda: {plain.request_id, nixl.request_id} <= set(e.outputs.finish))
    assert e.orders("recv") == []
    assert_idle(e)


# ------------------------------------------------------------------ producer


def prefill_params(tid: str) -> dict[str, object]:
    return PrefillLeg(transfer_id=tid).to_params()


def test_prefill_holds_its_blocks_until_the_push_completed(producer):
    """A one-token prefill leg is finished by the step that computes its prompt, as
    that step saves its KV: not one engine step later, when vLLM reports it ended."""
    e = producer()
    req = e.request(70, params=prefill_params("t-1"), max_tokens=1)
    e.run_until(lambda: req.request_id in e.outputs.finish)
    params = e.outputs.params[req.request_id]
    assert params is not None and params["transfer_id"] == "t-1"
    assert params[ENDPOINT_KEY]["engine_id"] == "prefill-0"
    blocks = e.blocks_of(req.request_id)
    (send,) = e.metas[-1].send_at_save  # the step that computed the prompt
    assert (send.transfer_id, send.num_tokens, list(send.block_ids)) == ("t-1", 70, blocks)
    e.step()
    assert e.orders("send") == []  # vLLM's end of the request adds no second push
    e.run(3)
    assert req.request_id in e.held()  # delay_free: kept while the push runs
    e.step(kv=KVConnectorOutput(finished_sending={req.request_id}))
    assert_idle(e)


def test_prefill_aborted_midway_fails_the_transfer_and_frees_at_once(producer):
    e = producer()
    req = e.request(200, params=prefill_params("t-2"), max_tokens=1)
    e.abort(req.request_id)
    e.step()
    (abort,) = e.orders("send_abort")
    assert (abort.req_id, abort.transfer_id) == (req.request_id, "t-2")
    assert e.orders("send") == []
    assert_idle(e)


def test_prefill_that_stopped_early_still_pushes(producer):
    e = producer()
    req = e.request(40, params=prefill_params("t-3"), max_tokens=3)
    e.run_until(lambda: req.request_id in e.outputs.finish)
    e.step()
    (send,) = e.orders("send")
    assert send.num_tokens == 40 and len(send.block_ids) >= 2
    e.step(kv=KVConnectorOutput(finished_sending={req.request_id}))
    assert_idle(e)


def test_discovery_request_returns_the_endpoint(producer):
    e = producer(extra={"side_channel_port": 6123})
    req = e.request(8, params={"pushkv_discover": True}, max_tokens=1)
    e.run_until(lambda: req.request_id in e.outputs.finish)
    endpoint = Endpoint.from_json(e.outputs.params[req.request_id][ENDPOINT_KEY])
    assert (endpoint.engine_id, endpoint.port, endpoint.role) == ("prefill-0", 6123, "producer")
    assert endpoint.block_size == BS
    assert e.outputs.params[req.request_id][VOCAB_KEY] == 1000  # the tiny model's
    assert_idle(e)


# --------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"lease": 3}, "unknown kv_connector_extra_config key"),
        ({"backend": "TCP"}, "backend must be one of"),
        ({"lease_s": 2, "heartbeat_s": 5}, "heartbeat_s"),
        ({"side_channel_port": 70000}, "side_channel_port"),
        ({"window_s": "soon"}, "window_s must be a number"),
    ],
)
def test_bad_extra_config_is_refused_by_name(tiny_model, extra, match):
    with pytest.raises(ConnectorConfigError, match=match):
        Engine(vllm_config(tiny_model, "kv_consumer", extra=extra))


def test_timeline_marks_the_decode_schedulers_hops_in_order(consumer, tmp_path):
    from pushkv import timeline

    timeline.configure(tmp_path, "decode-scheduler")
    try:
        e = consumer()
        req = e.request(70, params=decode_params("t-tl"), max_tokens=2)
        e.step()
        e.run(2)  # still waiting: seen once, registered once
        e.step(kv=recv_done(req.request_id))
        e.run_until(lambda: req.request_id in e.outputs.finish)
    finally:
        timeline.configure(None)
    marks = timeline.by_request(timeline.read(tmp_path))["t-tl"]
    chain = ["decode_arrived", "decode_seen", "registration_shipped", "ready_scheduled",
             "decode_scheduled"]
    assert list(marks) == chain  # each once, in this order
    assert [marks[k] for k in chain] == sorted(marks.values())
