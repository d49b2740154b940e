"""vLLM KV cache tensors described in the protocol's terms, and moved by its plans.

Each layout is built the way vLLM allocates it (real torch tensors, views into
one buffer where vLLM uses one), described by :func:`describe_kv_caches`, and
then a protocol plan is executed byte for byte between two such caches -- with
different TP sizes and, where the layout allows it, different block sizes --
and the result is checked against the tensors' own indexing.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is needed to build KV tensors")

from pushkv.protocol import ConfigError, EngineSpec, PlanError  # noqa: E402
from pushkv.protocol.mapping import assignment, expected_writers  # noqa: E402
from pushkv.protocol.planner import plan_transfer  # noqa: E402
from pushkv.transports.inmemory import copy_plan  # noqa: E402
from pushkv.vllm.layout import KVRegions, describe_kv_caches, layer_index  # noqa: E402

D = 64  # head_dim
NB = 16  # blocks
LAYERS = 2


def names(n: int = LAYERS) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def spec(engine_id: str, tp: int = 1, heads: int = 2, mla: bool = False) -> EngineSpec:
    return EngineSpec(engine_id=engine_id, tp_size=tp, num_layers=LAYERS, num_kv_heads=heads,
                      mla=mla)


def cpu_cache(heads: int, bs: int, seed: int | None) -> dict[str, torch.Tensor]:
    """vLLM's CPU cache: all layers in one buffer, [NB, heads, bs, 2 * D] each."""
    per_layer = NB * heads * bs * 2 * D
    buf = torch.zeros(LAYERS * per_layer, dtype=torch.float32)
    if seed is not None:
        buf.normal_(generator=torch.Generator().manual_seed(seed))
    return {n: buf[i * per_layer:(i + 1) * per_layer].view(NB, heads, bs, 2 * D)
            for i, n in enumerate(names())}


def flash_cache(heads: int, bs: int, seed: int | None, hnd: bool = False
                ) -> dict[str, torch.Tensor]:
    """GPU flash-attention style: [2, NB, bs, heads, D] per layer, HND by strides."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    out = {}
    for n in names():
        if hnd:
            t = torch.zeros(2, NB, heads, bs, D).permute(0, 1, 3, 2, 4)
        else:
            t = torch.zeros(2, NB, bs, heads, D)
        if gen is not None:
            t.normal_(generator=gen)
        out[n] = t
    return out


def regions(caches: dict[str, torch.Tensor], r: KVRegions) -> list[np.ndarray]:
    """A writable byte view of every region (the memory NIXL would register)."""
    size = r.layout.region_bytes
    return [np.frombuffer((ctypes.c_uint8 * size).from_address(b), dtype=np.uint8)
            for b in r.bases]


def push(src: tuple[dict, KVRegions], dst: tuple[dict, KVRegions], src_blocks, dst_blocks,
         tokens: int, first: int = 0) -> None:
    """Execute, between two caches, the plan of every producer rank writing into one
    consumer rank (what the NIXL writer does, with numpy copies)."""
    (s_cache, s_reg), (d_cache, d_reg) = src, dst
    a = assignment(s_reg.info.engine, d_reg.info.engine, s_reg.info.rank, d_reg.info.rank)
    plan = plan_transfer(s_reg.layout, d_reg.layout, a, src_blocks, dst_blocks,
                         s_reg.units(tokens), s_reg.first_unit(first))
    copy_plan(plan, regions(s_cache, s_reg), regions(d_cache, d_reg))


def test_layer_index_reads_vllm_layer_names():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("language_model.model.layers.3.attn") == 3
    with pytest.raises(ConfigError):
        layer_index("lm_head")


def test_cpu_cache_is_whole_pages_one_buffer():
    caches = cpu_cache(heads=2, bs=32, seed=None)
    r = describe_kv_caches(caches, engine=spec("p"), rank=0, block_size=32, head_dim=D)
    lo = r.layout
    assert (lo.block_size, lo.head_dim, lo.planes, lo.num_heads) == (1, 32 * 2 * D, 1, 2)
    assert lo.block_bytes == 2 * 32 * 2 * D * 4 and lo.stride == lo.block_bytes
    assert r.token_unit == 32 and r.units(33) == 2 and r.units(32) == 1
    first = caches[names()[0]]
    assert r.bases == (first.data_ptr(), first.data_ptr() + first.numel() * 4)
    assert r.buffers == ((first.data_ptr(), LAYERS * first.numel() * 4),)
    with pytest.raises(ConfigError, match="does not start a block"):
        r.first_unit(16)


def test_flash_layouts_are_split_planes():
    nhd = describe_kv_caches(flash_cache(2, 16, None), engine=spec("p"), rank=0,
                             block_size=16, head_dim=D)
    hnd = describe_kv_caches(flash_cache(2, 16, None, hnd=True), engine=spec("p"), rank=0,
                             block_size=16, head_dim=D)
    assert (nhd.layout.order, hnd.layout.order) == ("NHD", "HND")
    for r in (nhd, hnd):
        assert (r.layout.planes, r.layout.block_size, r.token_unit) == (2, 16, 1)
        assert r.bases[1] - r.bases[0] == NB * r.layout.block_bytes  # V plane after K


def test_flashinfer_layout_interleaves_k_and_v_per_block():
    caches = {n: torch.zeros(NB, 2, 16, 2, D) for n in names()}
    r = describe_kv_caches(caches, engine=spec("p"), rank=0, block_size=16, head_dim=D)
    assert r.layout.block_stride == 2 * r.layout.block_bytes
    assert r.bases[1] - r.bases[0] == r.layout.block_bytes


def test_mla_latent_cache():
    caches = {n: torch.zeros(NB, 16, 576, dtype=torch.bfloat16) for n in names()}
    r = describe_kv_caches(caches, engine=spec("p", tp=2, heads=1, mla=True), rank=1,
                           block_size=16, head_dim=576)
    assert (r.layout.planes, r.layout.num_heads, r.layout.head_dim) == (1, 1, 576)


@pytest.mark.parametrize(
    ("caches", "match"),
    [
        ({n: torch.zeros(NB, 3, 32, 2 * D) for n in names()}, "expected"),
        ({n: torch.zeros(NB, 32, 2, 2 * D).transpose(1, 2) for n in names()}, "page"),
        ({n: torch.zeros(NB, 32 * 2 * D * 2) for n in names()}, "unknown"),
        ({"model.layers.0.attn": torch.zeros(NB, 2, 32, 2 * D)}, "not stage"),
    ],
)
def test_layouts_it_cannot_describe_exactly_are_refused(caches, match):
    with pytest.raises(ConfigError, match=match):
        describe_kv_caches(caches, engine=spec("p"), rank=0, block_size=32, head_dim=D)


def pages(cache: dict[str, torch.Tensor], block: int, head: int) -> torch.Tensor:
    return torch.stack([t[block, head] for t in cache.values()])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_cpu_pages_reshard_across_tp_sizes(p_tp, d_tp):
    heads = 2
    p_engine, d_engine = spec("p", tp=p_tp, heads=heads), spec("d", tp=d_tp, heads=heads)
    p_ranks = [(c := cpu_cache(heads // p_tp, 32, seed=10 + r),
                describe_kv_caches(c, engine=p_engine, rank=r, block_size=32, head_dim=D))
               for r in range(p_tp)]
    d_ranks = [(c := cpu_cache(heads // d_tp, 32, seed=None),
                describe_kv_caches(c, engine=d_engine, rank=r, block_size=32, head_dim=D))
               for r in range(d_tp)]
    src_blocks, dst_blocks, tokens = [3, 4, 9], [7, 2, 12], 70  # last block partial
    for d_rank, dst in enumerate(d_ranks):
        writers = expected_writers(p_engine, d_engine, d_rank)
        assert len(writers) == max(1, p_tp // d_tp)
        for p_rank in writers:
            push(p_ranks[p_rank], dst, src_blocks, dst_blocks, tokens)
    for h in range(heads):  # global head h: compare its page on both sides
        p_cache = p_ranks[h // (heads // p_tp)][0]
        d_cache = d_ranks[h // (heads // d_tp)][0]
        for sb, db in zip(src_blocks, dst_blocks, strict=True):
            assert torch.equal(pages(d_cache, db, h % (heads // d_tp)),
                               pages(p_cache, sb, h % (heads // p_tp)))
    untouched = set(range(NB)) - set(dst_blocks)
    for cache, _ in d_ranks:
        assert all(not t[sorted(untouched)].any() for t in cache.values())


def test_cpu_pages_of_different_block_sizes_are_refused_not_corrupted():
    p = describe_kv_caches(cpu_cache(2, 32, 1), engine=spec("p"), rank=0, block_size=32,
                           head_dim=D)
    d = describe_kv_caches(cpu_cache(2, 64, None), engine=spec("d"), rank=0, block_size=64,
                           head_dim=D)
    a = assignment(p.info.engine, d.info.engine, 0, 0)
    with pytest.raises(PlanError, match="element shape differs"):
        plan_transfer(p.layout, d.layout, a, [1, 2], [3], p.units(64))


def test_split_planes_remap_tokens_across_block_sizes():
    p_cache, d_cache = flash_cache(2, 16, seed=3), flash_cache(2, 32, seed=None, hnd=True)
    p = describe_kv_caches(p_cache, engine=spec("p"), rank=0, block_size=16, head_dim=D)
    d = describe_kv_caches(d_cache, engine=spec("d"), rank=0, block_size=32, head_dim=D)
    src_blocks, dst_blocks, tokens = [5, 1, 8, 2, 11], [6, 3, 9], 70
    push((p_cache, p), (d_cache, d), src_blocks, dst_blocks, tokens, first=32)
    for t in range(tokens):
        sb, so = src_blocks[t // 16], t % 16
        db, do = dst_blocks[t // 32], t % 32
        for layer in names():
            want = p_cache[layer][:, sb, so] if t >= 32 else torch.zeros(2, 2, D)
            assert torch.equal(d_cache[layer][:, db, do], want), (t, layer)
