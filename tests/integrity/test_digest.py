"""The digest over the logical KV: equal across layouts, block sizes, TP and
devices; every single-bit flip and each injected fault changes it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pushkv.integrity import (
    KINDS,
    Injector,
    IntegrityConfig,
    Scope,
    Tag,
    digest,
    digest_torch,
    seal,
    unseal,
)
from pushkv.integrity.inject import corrupt
from pushkv.protocol.errors import ConfigError, DecodeError
from pushkv.protocol.layout import EngineSpec, KVLayout
from pushkv.protocol.mapping import assignment
from pushkv.protocol.planner import plan_transfer
from pushkv.transports.inmemory import copy_plan, region_memory


def _layout(**kw):
    base = dict(num_blocks=24, block_size=4, num_heads=2, head_dim=8, dtype_bytes=2,
                layer_end=2)
    base.update(kw)
    return KVLayout(**base)


def _moved(src, dst, src_spec, dst_spec, src_rank, dst_rank, n, first=0, seed=0):
    """Source memory (random), destination memory after the planner's copy, and
    the two sides' scopes of that write."""
    rng = np.random.default_rng(seed)
    sm = region_memory(src, rng=rng)
    dm = region_memory(dst, rng=rng)  # garbage where nothing lands
    a = assignment(src_spec, dst_spec, src_rank, dst_rank)
    s_ids = rng.permutation(src.num_blocks)[: -(-n // src.block_size)].tolist()
    d_ids = rng.permutation(dst.num_blocks)[: -(-n // dst.block_size)].tolist()
    copy_plan(plan_transfer(src, dst, a, s_ids, d_ids, n, first), sm, dm)
    s_scope = Scope(tuple(s_ids), first, n, a.layers, a.heads)
    d_scope = Scope(tuple(d_ids), first, n, a.layers, tuple((d, d, k) for _, d, k in a.heads))
    return sm, dm, s_scope, d_scope


CASES = {
    # name: (src layout, dst layout, src spec, dst spec, pairs (src rank, dst rank), tokens, first)
    "same layout": (_layout(), _layout(), 1, 1, [(0, 0)], 13, 0),
    "block sizes 4 -> 16, NHD -> HND": (_layout(), _layout(block_size=16, order="HND"),
                                        1, 1, [(0, 0)], 13, 0),
    "block sizes 16 -> 4, cached prefix": (_layout(block_size=16), _layout(), 1, 1,
                                           [(0, 0)], 29, 5),
    "TP 1 -> 2 (heads split)": (_layout(num_heads=4), _layout(), 1, 2, [(0, 0), (0, 1)],
                                11, 0),
    "TP 2 -> 1 (two writers)": (_layout(), _layout(num_heads=4, order="HND"), 2, 1,
                                [(0, 0), (1, 0)], 11, 0),
    "odd element (3 bytes)": (_layout(head_dim=3, dtype_bytes=1),
                              _layout(head_dim=3, dtype_bytes=1, block_size=2), 1, 1,
                              [(0, 0)], 9, 0),
    "opaque blocks": (_layout(order="BLOCK"), _layout(order="BLOCK"), 1, 1, [(0, 0)], 10, 0),
}


def _spec(name, tp, heads, layers=2):
    return EngineSpec(engine_id=name, tp_size=tp, num_layers=layers, num_kv_heads=heads)


@pytest.mark.parametrize("case", list(CASES))
def test_producer_and_consumer_agree_whatever_the_layouts(case):
    src, dst, ptp, dtp, pairs, n, first = CASES[case]
    heads = src.num_heads * ptp
    for sr, dr in pairs:
        sm, dm, ss, ds = _moved(src, dst, _spec("P", ptp, heads), _spec("D", dtp, heads),
                                sr, dr, n, first)
        want = digest(sm, src, ss)
        assert digest(dm, dst, ds) == want
        # torch (CPU here; CUDA takes the same path) gives the same bits
        assert digest_torch([torch.from_numpy(m) for m in dm], dst, ds) == want
        assert digest_torch([torch.from_numpy(m) for m in sm], src, ss) == want


def test_a_progressive_rectangle_agrees_and_differs_from_the_whole():
    src, dst = _layout(layer_end=3), _layout(block_size=8, layer_end=3)
    sm, dm, ss, ds = _moved(src, dst, _spec("P", 1, 2, 3), _spec("D", 1, 2, 3), 0, 0, 20)
    part_s = Scope(ss.block_ids, 4, 12, range(1, 3), ss.heads)
    part_d = Scope(ds.block_ids, 4, 12, range(1, 3), ds.heads)
    assert digest(sm, src, part_s) == digest(dm, dst, part_d) != digest(sm, src, ss)


def test_every_single_bit_flip_is_caught():
    src, dst = _layout(num_blocks=4, head_dim=2), _layout(num_blocks=6, head_dim=2,
                                                          block_size=2, order="HND")
    sm, dm, ss, ds = _moved(src, dst, _spec("P", 1, 2), _spec("D", 1, 2), 0, 0, 3)
    want = digest(dm, dst, ds)
    assert want == digest(sm, src, ss)
    plan = plan_transfer(src, dst, assignment(_spec("P", 1, 2), _spec("D", 1, 2), 0, 0),
                         list(ss.block_ids), list(ds.block_ids), 3)
    written = sorted({(r, int(o) + j) for r in range(dst.num_regions)
                      for o, ln in zip(plan.runs[:, 1], plan.runs[:, 2], strict=True)
                      for j in range(int(ln))})
    assert len(written) == 2 * 2 * 3 * 2 * 2 * 2  # layers, planes, tokens, heads, bytes
    for region, at in written:
        for bit in range(8):
            dm[region][at] ^= 1 << bit
            assert digest(dm, dst, ds) != want, (region, at, bit)
            dm[region][at] ^= 1 << bit
    assert digest(dm, dst, ds) == want


def test_position_matters_swapped_blocks_change_the_digest():
    lay = _layout()
    mem = region_memory(lay, rng=np.random.default_rng(3))
    scope = Scope((5, 9, 2), 0, 12, range(0, 2), ((0, 0, 2),))
    swapped = Scope((9, 5, 2), 0, 12, range(0, 2), ((0, 0, 2),))
    assert digest(mem, lay, scope) != digest(mem, lay, swapped)
    # the same bytes under other layers or heads are other cells
    assert digest(mem, lay, scope) != digest(mem, lay, Scope((5, 9, 2), 0, 12, range(0, 2),
                                                              ((0, 1, 2),)))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("order", ["NHD", "HND", "BLOCK"])
def test_each_injected_fault_is_caught(kind, order):
    lay = _layout(order=order)
    for seed in range(6):
        mem = region_memory(lay, rng=np.random.default_rng(seed))
        ids = (3, 7, 11, 1) if seed % 2 else (4,)
        scope = Scope(ids, 0, 4 * len(ids) - 1 if order != "BLOCK" else 4 * len(ids),
                      range(0, 2), ((0, 0, 2),))
        want = digest(mem, lay, scope)
        assert corrupt(kind, scope, mem, lay, random.Random(seed))
        assert digest(mem, lay, scope) != want, (kind, order, seed)


def test_the_injector_corrupts_one_write_in_every_and_logs_it():
    lay = _layout()
    mem = region_memory(lay, rng=np.random.default_rng(0))
    inj = Injector.parse("flip,zero:3")
    scope = Scope((1, 2), 0, 8, range(0, 2), ((0, 0, 2),))
    hits = [inj.maybe(("t", 0, 0, 0), scope, mem, lay) for _ in range(7)]
    assert hits == [True, False, False, True, False, False, True]
    assert inj.injected == 3 and [k[-1] for k in inj.log] == ["flip", "zero", "flip"]


def test_bad_input_is_a_typed_error():
    lay = _layout()
    mem = region_memory(lay)
    with pytest.raises(ConfigError, match="layers"):
        digest(mem, lay, Scope((1,), 0, 4, range(0, 3), ((0, 0, 2),)))
    with pytest.raises(ConfigError, match="head run"):
        digest(mem, lay, Scope((1,), 0, 4, range(0, 2), ((1, 0, 2),)))
    with pytest.raises(ConfigError, match="fewer than"):
        digest(mem, lay, Scope((1,), 0, 5, range(0, 2), ((0, 0, 2),)))
    with pytest.raises(ConfigError, match="outside"):
        digest(mem, lay, Scope((99,), 0, 4, range(0, 2), ((0, 0, 2),)))
    with pytest.raises(ConfigError, match="regions"):
        digest(mem[:1], lay, Scope((1,), 0, 4, range(0, 2), ((0, 0, 2),)))
    with pytest.raises(ConfigError, match="injector kinds"):
        Injector.parse("melt:3")
    for bad in ("maybe", "on:3", "sample:x", "sample:0"):
        with pytest.raises(ConfigError):
            IntegrityConfig.parse(bad)


def test_sampling_picks_the_same_transfers_everywhere():
    cfg = IntegrityConfig.parse("sample:4")
    picked = [t for t in range(400) if cfg.checks(f"req-{t}", 7)]
    assert 60 < len(picked) < 140  # about one in four
    assert picked == [t for t in range(400) if IntegrityConfig("sample", 4).checks(f"req-{t}", 7)]
    assert all(IntegrityConfig("on").checks(f"r{t}") for t in range(5))
    assert not any(IntegrityConfig("off").checks(f"r{t}") for t in range(5))


def test_the_envelope_round_trips_and_a_plain_frame_passes_unchanged():
    tag = Tag(3, 40, range(1, 5), (1 << 64) - 3)
    frame = b"PK\x03" + b"x" * 20
    assert unseal(seal(frame, tag)) == (frame, tag)
    assert unseal(frame) == (frame, None)
    with pytest.raises(DecodeError, match="shorter"):
        unseal(seal(frame, tag)[:10])
    with pytest.raises(DecodeError, match="version"):
        unseal(b"PD\x09" + seal(frame, tag)[3:])


def test_device_memory_is_viewed_through_its_tensors_whatever_the_layout():
    """CUDA KV is digested with torch where it lies: the runtime views each region
    by address inside the tensors the memory was built from. Checked here with
    CPU tensors standing in (the same code path, the same bits): vLLM's
    ``[num_blocks, 2, block, heads, dim]`` cache, K and V interleaved per block."""
    import dataclasses

    from pushkv.transports.nixl.memory import KVMemory, region_views

    nb, bs, h, d = 8, 4, 2, 8
    lay = KVLayout(num_blocks=nb, block_size=bs, num_heads=h, head_dim=d, dtype_bytes=4,
                   layer_end=2, block_stride=2 * bs * h * d * 4)
    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(nb, 2, bs, h, d, generator=gen) for _ in range(2)]
    bases = [t.data_ptr() + p * bs * h * d * 4 for t in layers for p in (0, 1)]
    mem = dataclasses.replace(KVMemory.from_addresses(bases, lay.region_bytes, kind="VRAM"),
                              owners=tuple(layers))
    ref = []
    for t in layers:
        for p in (0, 1):
            buf = np.zeros(lay.region_bytes, np.uint8)
            for b in range(nb):
                page = t[b, p].contiguous().numpy().view(np.uint8).reshape(-1)
                buf[b * lay.stride:b * lay.stride + page.size] = page
            ref.append(buf)
    scope = Scope((3, 5), 0, 7, range(0, 2), ((0, 0, 2),))
    views = region_views(mem)
    assert digest(views, lay, scope) == digest(ref, lay, scope)
    assert digest_torch(views, lay, scope) == digest(ref, lay, scope)
    with pytest.raises(ConfigError, match="no tensor"):
        region_views(dataclasses.replace(mem, owners=()))
