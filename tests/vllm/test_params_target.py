"""Rule 12 in ``kv_transfer_params``: a decode leg's turn at its held source."""

from __future__ import annotations

import pytest

from pushkv.vllm.params import TARGET_KEY, DecodeLeg, Endpoint, ParamsError, parse_params

PRODUCER = Endpoint(engine_id="P", host="127.0.0.1", port=5555)


def test_the_turn_round_trips_and_defaults_to_the_first_engine():
    first = DecodeLeg(transfer_id="t", producer=PRODUCER, incarnation=7)
    assert TARGET_KEY not in first.to_params()
    assert parse_params(first.to_params()).target == 0
    later = DecodeLeg(transfer_id="t", producer=PRODUCER, incarnation=7, target=2)
    assert later.to_params()[TARGET_KEY] == 2
    assert parse_params(later.to_params()) == later


@pytest.mark.parametrize("bad", [-1, 1 << 17, True, "1", 1.5])
def test_a_bad_turn_is_refused_with_its_key(bad):
    params = dict(DecodeLeg(transfer_id="t", producer=PRODUCER, incarnation=7).to_params())
    params[TARGET_KEY] = bad
    with pytest.raises(ParamsError, match=TARGET_KEY):
        parse_params(params)
