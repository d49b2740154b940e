"""vLLM's NIXL PD parameters, as a sequential router sends them, through the real
v1 Scheduler with PushKVConnector: the producer answers what the decode leg
needs and chooses the direction by the dispatch; the consumer follows it;
untrusted values are refused."""

from __future__ import annotations

import base64

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from vllm.v1.outputs import KVConnectorOutput

from pushkv.vllm.metadata import PublishedSeals
from pushkv.vllm.params import (
    ENDPOINT_KEY,
    MAX_BLOCKS,
    MAX_SEAL_BYTES,
    RELAY_BOUND_S,
    SEALS_KEY,
    DecodeLeg,
    NixlPrefillLeg,
    ParamsError,
    PrefillLeg,
    parse_params,
)
from pushkv.vllm.scheduler_side import leg_direction

from .harness import Engine, fresh_free, vllm_config

pytestmark = pytest.mark.vllm

#: What vllm-router 0.1.17 sends as the prefill leg in PD mode (--kv-connector nixl).
ROUTER_PREFILL = {"do_remote_decode": True, "do_remote_prefill": False,
                  "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                  "remote_port": None}


def engine(model, role: str, **extra) -> Engine:
    eid = "prefill-0" if role == "kv_producer" else "decode-0"
    extra.setdefault("side_channel_port", 5600)  # no worker here binds one
    return Engine(vllm_config(model, role, engine_id=eid, extra=extra))


def prefill_answer(model, **extra) -> tuple[Engine, dict]:
    p = engine(model, "kv_producer", **extra)
    req = p.request(70, params=dict(ROUTER_PREFILL), max_tokens=1)
    p.run_until(lambda: req.request_id in p.outputs.finish)
    answer = p.outputs.params[req.request_id]
    assert answer is not None
    return p, answer


def test_the_router_prefill_leg_is_answered_with_a_pull(tiny_model):
    p, answer = prefill_answer(tiny_model)
    rid = next(iter(p.outputs.finish))
    blocks = p.blocks_of(rid)
    # Published as the step that computed the prompt saved its KV, so before the
    # answer exists (a decode side reading at once finds the source known), not one
    # step later
    (send,) = p.orders("send_at_save")
    assert p.metas[-1].send_at_save == [send]
    p.step()
    assert p.orders("send") == []
    assert send.direction == "pull" and list(send.block_ids) == blocks
    # vLLM NixlConnector's fields, which the router passes to the decode leg
    assert answer["do_remote_prefill"] is True and answer["do_remote_decode"] is False
    assert answer["remote_engine_id"] == "prefill-0"
    assert answer["remote_block_ids"] == blocks
    assert answer["transfer_mode"] == "pull" and answer["pushkv_direction"] == "pull"
    assert answer["tp_size"] == 1
    # pushkv's: a transfer id and incarnation the producer minted
    assert answer["transfer_id"] == send.transfer_id and answer["transfer_id"].startswith("nixl:")
    assert answer["incarnation"] == send.incarnation != 0
    assert answer[ENDPOINT_KEY]["engine_id"] == "prefill-0"
    # the source's lease, so that the decode side reads only while it is held
    assert answer["pushkv_lease_ms"] == 30_000
    p.step(kv=KVConnectorOutput(finished_sending={rid}))
    p.run(2)
    assert p.held() == set() and p.free_blocks == fresh_free(p)


def test_direction_push_overrides_the_choice_behind_a_sequential_router(tiny_model):
    p, answer = prefill_answer(tiny_model, direction="push")
    p.step()
    (send,) = p.orders("send")
    assert send.direction == "push" and answer["pushkv_direction"] == "push"
    # vllm-router would rewrite the decode leg of a transfer_mode "push" answer into
    # vLLM's push fields (dropping pushkv's): a push is not announced there.
    assert "transfer_mode" not in answer


def test_a_concurrent_leg_always_pushes():
    assert leg_direction(PrefillLeg(transfer_id="t"), "auto") == "push"
    assert leg_direction(PrefillLeg(transfer_id="t"), "pull") == "push"
    assert leg_direction(NixlPrefillLeg(), "auto") == "pull"
    assert leg_direction(NixlPrefillLeg(), "pull") == "pull"
    assert leg_direction(NixlPrefillLeg(), "push") == "push"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_decode_leg_follows_the_answer(tiny_model, mode):
    _, answer = prefill_answer(tiny_model, direction=mode)
    d = engine(tiny_model, "kv_consumer")
    req = d.request(70, params=answer, max_tokens=2)
    d.step()
    (order,) = d.orders("recv")
    assert order.req_id == req.request_id and order.direction == mode
    assert order.transfer_id == answer["transfer_id"]
    assert order.incarnation == answer["incarnation"]
    assert order.producer.engine_id == "prefill-0"
    want = tuple(answer["remote_block_ids"]) if mode == "pull" else ()
    assert order.src_block_ids == want
    if mode == "pull":  # held until the request's arrival + lease - the relay bound
        assert order.lease_until == pytest.approx(
            req.arrival_time + answer["pushkv_lease_ms"] / 1000 - RELAY_BOUND_S)
    else:
        assert order.lease_until is None and "pushkv_lease_ms" not in answer
    d.step(kv=KVConnectorOutput(finished_recving={req.request_id}))
    d.run_until(lambda: req.request_id in d.outputs.finish)
    assert d.held() == set() and d.free_blocks == fresh_free(d)


def test_a_vllm_nixl_answer_is_left_to_its_connector():
    vllm_answer = {"do_remote_prefill": True, "do_remote_decode": False,
                   "remote_block_ids": [1, 2], "remote_engine_id": "e",
                   "remote_host": "h", "remote_port": 5600, "tp_size": 1}
    assert parse_params(vllm_answer) is None
    assert isinstance(parse_params(ROUTER_PREFILL), NixlPrefillLeg)


def _answer(**changes):
    base = {"do_remote_prefill": True, "transfer_id": "nixl:p:r", "incarnation": 5,
            "transfer_mode": "pull", "remote_block_ids": [3, 4], "remote_engine_id": "p",
            ENDPOINT_KEY: {"engine_id": "p", "host": "127.0.0.1", "port": 5600}}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not ...}


def test_a_good_answer_parses():
    leg = parse_params(_answer())
    assert isinstance(leg, DecodeLeg)
    assert (leg.direction, leg.src_block_ids, leg.incarnation) == ("pull", (3, 4), 5)
    assert parse_params(_answer(remote_block_ids=[[3, 4]])).src_block_ids == (3, 4)
    assert leg.lease_s is None and parse_params(_answer(pushkv_lease_ms=1500)).lease_s == 1.5


@pytest.mark.parametrize("changes", [
    {"remote_block_ids": ["3"]},
    {"remote_block_ids": [-1]},
    {"remote_block_ids": [True]},
    {"remote_block_ids": [2**31]},
    {"remote_block_ids": []},
    {"remote_block_ids": list(range(MAX_BLOCKS + 1))},
    {"remote_block_ids": [[1], [2]]},
    {"remote_block_ids": ...},
    {"remote_engine_id": "someone-else"},
    {"transfer_mode": "teleport"},
    {"pushkv_direction": "sideways"},
    {"incarnation": ...},
    {"incarnation": -1},
    {"transfer_id": "x" * 300},
    {"pushkv_lease_ms": -1},
    {"pushkv_lease_ms": 1.5},
    {"pushkv_lease_ms": "30000"},
    {"pushkv_lease_ms": True},
    {ENDPOINT_KEY: {"engine_id": "p", "host": "127.0.0.1", "port": 0}},
    {ENDPOINT_KEY: {"engine_id": "p", "host": "h", "port": 1, "ranks": ["file:///etc"]}},
])
def test_untrusted_answers_are_refused(changes):
    with pytest.raises(ParamsError):
        parse_params(_answer(**changes))


def test_a_refused_decode_leg_fails_through_the_policy(tiny_model):
    d = engine(tiny_model, "kv_consumer")
    req = d.request(40, params=_answer(remote_block_ids=[-7]))
    d.step()
    assert d.orders("recv") == [] and d.orders("recv_fail") == [req.request_id]


def test_with_a_key_the_producer_signs_its_answer_and_tampering_is_refused(
        tiny_model, monkeypatch):
    monkeypatch.setenv("PUSHKV_SIDE_CHANNEL_KEY", "k" * 32)
    _, answer = prefill_answer(tiny_model)  # the router's leg is unsigned: still served
    assert "pushkv_sig" in answer
    d = engine(tiny_model, "kv_consumer")
    ok = d.request(70, params=dict(answer), max_tokens=2)
    bad = d.request(70, params={**answer, "remote_block_ids": [0, 1, 2]}, max_tokens=2,
                    first=500)
    d.step()
    assert [o.req_id for o in d.orders("recv")] == [ok.request_id]
    assert d.orders("recv_fail") == [bad.request_id]


# ------------------------------------------------------------- rule 11: seals


SEAL = b"PR\x01 a seal of the published source"


def sealing(seal: bytes = SEAL):
    """The workers of a producer: each source published for a pull as the step saves
    its KV is sealed in that step's output (what WorkerSide.published_seals gives)."""
    def workers(out):
        pulls = [s for s in out.kv_connector_metadata.send_at_save if s.direction == "pull"]
        if not pulls:
            return None
        return KVConnectorOutput(kv_connector_worker_meta=PublishedSeals(
            seals={s.transfer_id: {0: seal} for s in pulls}))
    return workers


def sealed_answer(model, seal: bytes = SEAL, **extra) -> tuple[Engine, dict]:
    p = engine(model, "kv_producer", **extra)
    req = p.request(70, params=dict(ROUTER_PREFILL), max_tokens=1)
    p.run_until(lambda: req.request_id in p.outputs.finish, workers=sealing(seal))
    return p, p.outputs.params[req.request_id]


@pytest.mark.parametrize("granularity", ["request", "chunk", "layer"])
def test_a_pull_answer_carries_the_seal_of_the_step_that_published_it(tiny_model,
                                                                      granularity):
    """vLLM's real scheduler finishes the request before it hands over the step's
    worker output: the answer is sealed in place, before it leaves the engine.
    Whatever the push_granularity, the source is published whole, as the step that
    computes the prompt saves it (no progressive range of it goes out)."""
    p, answer = sealed_answer(tiny_model, push_granularity=granularity)
    assert p.orders("send_ranges") == [] and p.orders("send") == []
    (send,) = p.orders("send_at_save")
    assert send.direction == "pull" and send.transfer_id == answer["transfer_id"]
    assert answer[SEALS_KEY] == {"0": base64.b64encode(SEAL).decode()}
    assert p.connector.scheduler_side.unsealed == 0
    d = engine(tiny_model, "kv_consumer")
    d.request(70, params=answer, max_tokens=2)
    d.step()
    (order,) = d.orders("recv")
    assert order.direction == "pull" and order.seals == {0: SEAL}


def test_an_unsealed_pull_answer_leaves_unsealed_and_is_never_touched_again(tiny_model):
    _, answer = sealed_answer(tiny_model, seal=b"")  # integrity off, or not sampled
    assert SEALS_KEY not in answer
    p, answer = prefill_answer(tiny_model)  # no worker output at all: counted
    side = p.connector.scheduler_side
    assert SEALS_KEY not in answer and side.unsealed == 1
    # a seal that comes a step later (the answer is gone) changes nothing
    before = dict(answer)
    p.step(kv=KVConnectorOutput(kv_connector_worker_meta=PublishedSeals(
        seals={answer["transfer_id"]: {0: SEAL}})))
    assert answer == before
    d = engine(tiny_model, "kv_consumer")
    d.request(70, params=answer, max_tokens=2)
    d.step()
    assert d.orders("recv")[0].seals is None


def test_with_a_key_the_seals_are_signed(tiny_model, monkeypatch):
    monkeypatch.setenv("PUSHKV_SIDE_CHANNEL_KEY", "k" * 32)
    _, answer = sealed_answer(tiny_model)
    assert SEALS_KEY in answer and SEALS_KEY in answer["pushkv_sig"]["f"]
    d = engine(tiny_model, "kv_consumer")
    ok = d.request(70, params=dict(answer), max_tokens=2)
    forged = base64.b64encode(b"PR\x01 another seal").decode()
    bad = d.request(70, params={**answer, SEALS_KEY: {"0": forged}}, max_tokens=2, first=500)
    d.step()
    assert [o.req_id for o in d.orders("recv")] == [ok.request_id]
    assert d.orders("recv_fail") == [bad.request_id]


def test_the_ranks_seals_are_merged():
    a = PublishedSeals(seals={"t": {0: b"a"}, "u": {0: b""}})
    b = PublishedSeals(seals={"t": {1: b"b"}})
    assert a.aggregate(b).seals == {"t": {0: b"a", 1: b"b"}, "u": {0: b""}}
    assert a.seals == {"t": {0: b"a"}, "u": {0: b""}}  # the parts are left as they were


def test_a_good_seal_parses():
    seal = base64.b64encode(SEAL).decode()
    assert parse_params(_answer(**{SEALS_KEY: {"0": seal}})).seals == {0: SEAL}
    assert parse_params(_answer()).seals is None
    # a push answer's seals are not read (a push is checked by its writes' digests)
    assert parse_params(_answer(transfer_mode="push", **{SEALS_KEY: {"0": seal}})).seals is None


@pytest.mark.parametrize("seals", [
    ["AAAA"],                                  # not a mapping
    {},                                        # no rank's
    {"0": "AAAA", "1": "AAAA"},                # a rank the producer does not have
    {"1": "AAAA"},                             # rank 0's missing
    {"x": "AAAA"},
    {"-0": "AAAA"},
    {"0": 7},
    {"0": "not base64!"},
    {"0": ""},                                 # empty
    {"0": "A" * (MAX_SEAL_BYTES * 2)},         # too long
])
def test_untrusted_seals_are_refused(seals):
    with pytest.raises(ParamsError, match=SEALS_KEY):
        parse_params(_answer(**{SEALS_KEY: seals}))


def test_with_integrity_off_a_pull_answer_waits_for_no_seal(tiny_model):
    """Nothing seals the source: the answer leaves as it is, counted nowhere."""
    p, answer = prefill_answer(tiny_model, integrity="off")
    assert SEALS_KEY not in answer and p.connector.scheduler_side.unsealed == 0


@pytest.fixture
def recorded(tmp_path):
    """This process's timeline marks, recorded under tmp_path for the test."""
    from pushkv import timeline

    timeline.configure(None)
    timeline.configure(tmp_path, "test")
    try:
        yield lambda: [(m.transfer_id, m.event) for m in timeline.read(tmp_path)]
    finally:
        timeline.configure(None)


def test_a_pull_answer_is_marked_answered_once_as_it_leaves(tiny_model, recorded):
    """The timeline's ``answered`` (pushkv.fit.e2e.pull_timeline): once per pull answer
    on each of its ways out -- sealed, with integrity off (no seal awaited), and left
    unsealed at the step's end -- and never for a push answer."""
    ways = {"sealed": lambda: sealed_answer(tiny_model),
            "integrity off": lambda: prefill_answer(tiny_model, integrity="off"),
            "unsealed at the step's end": lambda: prefill_answer(tiny_model),
            "push": lambda: prefill_answer(tiny_model, direction="push")}
    for way, answer_of in ways.items():
        seen = len(recorded())
        _, answer = answer_of()
        mine = [e for t, e in recorded()[seen:] if t == answer["transfer_id"]]
        assert mine.count("answered") == (way != "push"), (way, mine)
