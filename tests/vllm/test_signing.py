"""With a shared key, kv_transfer_params that a proxy holding the key did not sign are
refused by the connector (vLLM's real scheduler, workers played by the test)."""

from __future__ import annotations

import pytest

from pushkv.vllm.params import ParamsError, PrefillLeg
from pushkv.vllm.signing import ReplayGuard, sign, verify

from .conftest import VLLM_MISSING

KEY = b"0123456789abcdef0123456789abcdef"


def test_signature_round_trip_and_what_it_refuses():
    params = PrefillLeg(transfer_id="t1").to_params()
    signed = sign(params, KEY, now=1000.0)
    assert verify(signed, KEY, now=1010.0) == params
    forged = dict(signed, transfer_id="t2")
    truncated = {k: v for k, v in signed.items() if k != "do_remote_decode"}
    for bad, match in ((params, "not signed"), (forged, "bad signature"),
                       (truncated, "bad signature"), (sign(params, b"x" * 32), "bad signature"),
                       (dict(signed, pushkv_sig={"t": "x"}), "malformed")):
        with pytest.raises(ParamsError, match=match):
            verify(bad, KEY, now=1010.0)
    with pytest.raises(ParamsError, match="old"):
        verify(signed, KEY, now=1000.0 + 901)


def test_replay_guard_allows_the_same_request_and_refuses_another():
    guard = ReplayGuard(max_age_s=10)
    guard.check("PrefillLeg", "t1", "req-a", now=0)
    guard.check("PrefillLeg", "t1", "req-a", now=1)  # vLLM asks again for one request
    guard.check("DecodeLeg", "t1", "req-b", now=1)  # the other leg is another kind
    with pytest.raises(ParamsError, match="replay"):
        guard.check("PrefillLeg", "t1", "req-c", now=2)
    guard.check("PrefillLeg", "t1", "req-c", now=100)  # long forgotten: the signature's age
    # refuses it before the guard is asked


if not VLLM_MISSING:
    from vllm.v1.request import RequestStatus

    from pushkv.vllm.params import ENDPOINT_KEY, DecodeLeg, Endpoint

    from .harness import Engine, vllm_config


def _engine(tiny_model, role: str, tmp_path, policy: str = "fail") -> Engine:
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    return Engine(vllm_config(tiny_model, role, engine_id=f"{role}-0", policy=policy,
                              extra={"key_file": str(key_file), "side_channel_port": 6200}))


@pytest.mark.vllm
def test_consumer_refuses_unsigned_forged_and_replayed_decode_legs(tiny_model, tmp_path):
    e = _engine(tiny_model, "kv_consumer", tmp_path)
    producer = Endpoint(engine_id="prefill-0", host="127.0.0.1", port=5600)
    good = sign(DecodeLeg(transfer_id="t-ok", producer=producer).to_params(), KEY)
    unsigned = DecodeLeg(transfer_id="t-un", producer=producer).to_params()
    forged = dict(good, producer=dict(producer.to_json(), host="10.6.6.6"))
    ok = e.request(40, params=good, max_tokens=2)
    bad = [e.request(40, params=p, max_tokens=2, first=20 + i)
           for i, p in enumerate((unsigned, forged, good))]  # the last one replays t-ok
    e.step()
    (order,) = e.orders("recv")
    assert order.req_id == ok.request_id and order.producer == producer
    assert sorted(e.orders("recv_fail")) == sorted(r.request_id for r in bad)
    assert e.connector.scheduler_side.refused == 3
    e.step(kv=None)
    assert all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in [ok, *bad])


@pytest.mark.vllm
def test_producer_holds_nothing_for_unsigned_legs_and_discovery_needs_the_key(
        tiny_model, tmp_path):
    e = _engine(tiny_model, "kv_producer", tmp_path)
    unsigned = e.request(40, params=PrefillLeg(transfer_id="t-un").to_params(), max_tokens=1)
    signed = e.request(40, params=sign(PrefillLeg(transfer_id="t-ok").to_params(), KEY),
                       max_tokens=1, first=30)
    spy = e.request(8, params={"pushkv_discover": True}, max_tokens=1, first=50)
    found = e.request(8, params=sign({"pushkv_discover": True}, KEY), max_tokens=1, first=60)
    e.run_until(lambda: len(e.outputs.finish) == 4)
    e.step()
    (send,) = e.finished_prefills()
    assert send.transfer_id == "t-ok"
    assert e.outputs.params[unsigned.request_id] is None
    assert e.outputs.params[spy.request_id] is None
    assert ENDPOINT_KEY in e.outputs.params[found.request_id]
    assert e.outputs.params[signed.request_id]["transfer_id"] == "t-ok"
