"""KVMemory: how KV caches given as tensors or arrays become NIXL regions."""

from __future__ import annotations

import numpy as np
import pytest

from pushkv.protocol import ConfigError, KVLayout, uniform_ranks
from pushkv.transports.inmemory import region_memory
from pushkv.transports.nixl.memory import KVMemory


def test_memory_from_regions_checks_the_layout() -> None:
    info = uniform_ranks("e")[0]
    mem = KVMemory.from_regions(region_memory(info.layout))
    mem.check(info.layout)
    assert mem.kind == "DRAM" and mem.num_regions == info.layout.num_regions
    with pytest.raises(ConfigError, match="regions"):
        KVMemory.from_regions(region_memory(info.layout)[:-1]).check(info.layout)
    short = [np.zeros(info.layout.region_bytes - 1, np.uint8)] * info.layout.num_regions
    with pytest.raises(ConfigError, match="holds"):
        KVMemory.from_regions(short).check(info.layout)
    with pytest.raises(ConfigError, match="contiguous"):
        KVMemory.from_regions([np.zeros((8, 8), np.uint8)[:, ::2]])


def test_memory_from_kv_and_stacked_order_regions() -> None:
    k = [np.zeros(64, np.uint8) for _ in range(2)]
    v = [np.zeros(64, np.uint8) for _ in range(2)]
    mem = KVMemory.from_kv(k, v)
    assert mem.bases == (k[0].ctypes.data, v[0].ctypes.data, k[1].ctypes.data, v[1].ctypes.data)
    layers = [np.zeros(128, np.uint8) for _ in range(2)]
    st = KVMemory.from_stacked(layers)
    assert st.bases[1] - st.bases[0] == 64 and st.sizes == (64,) * 4


def test_memory_from_torch_cpu_cache_one_region_per_layer() -> None:
    """vLLM's CPU cache: [blocks, kv_heads, block_size, 2 * head_dim] per layer,
    described with planes=1 and K+V counted in head_dim."""
    torch = pytest.importorskip("torch")
    blocks, heads, bs, hd = 32, 1, 16, 64
    caches = [torch.zeros(blocks, heads, bs, 2 * hd, dtype=torch.float32) for _ in range(2)]
    layout = KVLayout(num_blocks=blocks, block_size=bs, num_heads=heads, head_dim=2 * hd,
                      dtype_bytes=4, layer_end=2, planes=1, order="HND")
    mem = KVMemory.from_regions(caches)
    mem.check(layout)
    assert mem.bases[0] == caches[0].data_ptr() and mem.kind == "DRAM"
    view = mem.view(1)
    caches[1][3].fill_(1.0)
    assert view.view(np.float32)[3 * layout.block_bytes // 4] == 1.0
