"""TP / PP / head mapping: exactly one writer per destination slice."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pushkv.protocol import ConfigError, EngineSpec, expected_writers, targets_of, writers_of
from pushkv.protocol.mapping import assignment


def spec(name, tp, heads, pp=1, layers=8, mla=False):
    return EngineSpec(engine_id=name, tp_size=tp, pp_size=pp, num_layers=layers,
                      num_kv_heads=heads, mla=mla)


def valid_tp(heads):
    return st.sampled_from([t for t in (1, 2, 4, 8, 16) if (t <= heads and heads % t == 0)
                            or (t > heads and t % heads == 0)])


@st.composite
def engine_pairs(draw):
    mla = draw(st.booleans())
    heads = 1 if mla else draw(st.sampled_from([1, 2, 4, 8]))
    layers = draw(st.integers(3, 12))
    src = spec("P", draw(valid_tp(heads)), heads, draw(st.integers(1, 3)), layers, mla)
    dst = spec("D", draw(valid_tp(heads)), heads, draw(st.integers(1, 2)), layers, mla)
    return src, dst


def slices_by_reference(src, dst, dst_rank):
    """(global layer, global head) -> producer global rank, from first principles."""
    j, stage = dst.split(dst_rank)
    out = {}
    for layer in dst.layers_of(stage):
        src_stage = [s for s in range(src.pp_size) if layer in src.layers_of(s)]
        assert len(src_stage) == 1
        for h in dst.heads_of(j):
            holders = [r for r in range(src.tp_size) if h in src.heads_of(r)]
            out[layer, h] = src.rank_of(holders[j % len(holders)], src_stage[0])
    return out


@given(engine_pairs())
def test_every_slice_has_exactly_one_writer(pair):
    src, dst = pair
    for d in range(dst.world_size):
        ref = slices_by_reference(src, dst, d)
        got = {}
        src_heads_of = {r: src.heads_of(src.split(r)[0]) for r in range(src.world_size)}
        dst_first = dst.heads_of(dst.split(d)[0]).start
        for a in writers_of(src, dst, d):
            for layer in a.layers:
                for hs, hd, n in a.heads:
                    for i in range(n):
                        g = dst_first + hd + i
                        assert src_heads_of[a.src_rank].start + hs + i == g  # same head
                        assert (layer, g) not in got, "two writers for one slice"
                        got[layer, g] = a.src_rank
        assert got == ref
        assert expected_writers(src, dst, d) == frozenset(ref.values())


@given(engine_pairs())
def test_targets_mirror_writers(pair):
    src, dst = pair
    forward = {(a.src_rank, a.dst_rank) for d in range(dst.world_size)
               for a in writers_of(src, dst, d)}
    backward = {(a.src_rank, a.dst_rank) for s in range(src.world_size)
                for a in targets_of(src, dst, s)}
    assert forward == backward


@pytest.mark.parametrize(("p", "d"), [(8, 8), (8, 4), (8, 2), (8, 1), (4, 1), (2, 1)])
def test_producer_tp_at_least_consumer_tp(p, d):
    src, dst = spec("P", p, 8), spec("D", d, 8)
    for r in range(p):
        assert [a.dst_rank for a in targets_of(src, dst, r)] == [r // (p // d)]
    for j in range(d):
        assert len(expected_writers(src, dst, j)) == p // d


@pytest.mark.parametrize(("p", "d"), [(1, 2), (1, 8), (2, 8), (4, 8)])
def test_producer_tp_below_consumer_tp(p, d):
    src, dst = spec("P", p, 8), spec("D", d, 8)
    for r in range(p):
        assert len(targets_of(src, dst, r)) == d // p
    for j in range(d):
        assert len(expected_writers(src, dst, j)) == 1


def test_replicated_heads_spread_over_replicas():
    # 2 KV heads, TP 8 both sides: each head on 4 ranks; D rank j reads P rank j.
    src, dst = spec("P", 8, 2), spec("D", 8, 2)
    for j in range(8):
        assert expected_writers(src, dst, j) == {j}


def test_mla_one_writer_per_destination():
    src, dst = spec("P", 8, 1, mla=True), spec("D", 4, 1, mla=True)
    seen = [expected_writers(src, dst, j) for j in range(4)]
    assert all(len(s) == 1 for s in seen)
    assert len(set().union(*seen)) == 4  # spread, not all from rank 0


def test_pipeline_stages_multiply_writers():
    src, dst = spec("P", 2, 8, pp=2), spec("D", 2, 8)
    for j in range(2):
        writers = writers_of(src, dst, j)
        assert len(writers) == 2  # one per stage
        assert sorted(a.layers.start for a in writers) == [0, 4]


def test_assignment_of_unrelated_ranks_is_an_error():
    src, dst = spec("P", 2, 8), spec("D", 2, 8)
    with pytest.raises(ConfigError, match="does not write"):
        assignment(src, dst, 1, 0)


@pytest.mark.parametrize(
    ("src", "dst", "match"),
    [
        (spec("P", 3, 8), spec("D", 1, 8), "do not divide"),
        (spec("P", 6, 4), spec("D", 1, 4), "not a multiple"),
        (spec("P", 1, 8), spec("D", 1, 4), "num_kv_heads"),
        (spec("P", 1, 8, layers=4), spec("D", 1, 8), "num_layers"),
        (spec("P", 1, 2, mla=True), spec("D", 1, 2), "MLA"),
        (spec("P", 1, 8, pp=9), spec("D", 1, 8), "PP"),
    ],
)
def test_incompatible_engines_are_rejected(src, dst, match):
    with pytest.raises(ConfigError, match=match):
        expected_writers(src, dst, 0)


def test_rank_outside_world():
    with pytest.raises(ConfigError, match="outside world"):
        expected_writers(spec("P", 2, 8), spec("D", 2, 8), 2)


def test_default_stage_split_matches_vllm():
    # vLLM gives the remainder to the stages before the last: 10 layers over 4 -> 2,3,3,2
    s = spec("P", 1, 8, pp=4, layers=10)
    assert s.stage_sizes() == (2, 3, 3, 2)
    assert [s.layers_of(i) for i in range(4)] == [range(0, 2), range(2, 5), range(5, 8),
                                                    range(8, 10)]


def test_explicit_uneven_stages():
    s = EngineSpec(engine_id="P", pp_size=2, num_layers=8, num_kv_heads=8, pp_layers=(3, 5))
    assert s.layers_of(1) == range(3, 8)
    dst = spec("D", 1, 8, layers=8)
    assert sorted(a.layers.start for a in writers_of(s, dst, 0)) == [0, 3]
    with pytest.raises(ConfigError, match="summing to 8"):
        EngineSpec(engine_id="P", pp_size=2, num_layers=8, num_kv_heads=8,
                   pp_layers=(3, 4)).validate()
