"""vLLM's KV cache tensors, described in the protocol's terms.

``register_kv_caches`` hands the worker one tensor per attention layer. This
module reads their shapes and strides (never their values) and produces the
:class:`~pushkv.protocol.RankInfo` the handshake announces, plus the address of
every region, in the protocol's region order (local layer major, then plane).

Three families of per-layer tensors are understood:

* **packed pages** -- vLLM's CPU backend: ``[num_blocks, heads, block_size,
  2 * head_dim]``. One (block, head) page holds K *and* V, and K is stored
  transposed inside it, so a page is only meaningful whole. Such a layout is
  described with a protocol "token" equal to a whole vLLM block: ``block_size
  = 1`` and an element of ``block_size * 2 * head_dim`` values per head. The
  planner can then only ever move whole (block, head) pages; TP resharding
  works per head, and two sides whose vLLM block sizes differ are refused by
  the protocol (their elements differ) instead of silently corrupted.
* **split planes** -- GPU attention backends: ``[2, num_blocks, block_size,
  heads, head_dim]`` (K and V planes apart) or ``[num_blocks, 2, block_size,
  heads, head_dim]`` (K and V interleaved per block), physically token-major
  (``NHD``) or head-major (``HND``) as the strides say. Each plane of each
  layer is one region; tokens map one to one, so block sizes may differ.
* **latent** (MLA): ``[num_blocks, block_size, latent_dim]``, one plane, one
  replicated "head".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..protocol.errors import ConfigError
from ..protocol.layout import EngineSpec, KVLayout, Order, RankInfo


class TensorLike(Protocol):
    """What is read from a KV cache tensor (``torch.Tensor`` satisfies it)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def stride(self) -> Sequence[int]: ...

    def element_size(self) -> int: ...

    def data_ptr(self) -> int: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class KVRegions:
    """One rank's KV memory: its protocol description and where each region lives."""

    info: RankInfo
    #: Address of region ``i`` (layer ``i // planes``, plane ``i % planes``).
    bases: tuple[int, ...]
    #: vLLM tokens per protocol token: the vLLM block size for packed pages, else 1.
    token_unit: int
    #: Distinct memory ranges to register with the transport: (address, bytes).
    buffers: tuple[tuple[int, int], ...]

    @property
    def layout(self) -> KVLayout:
        return self.info.layout

    def units(self, num_tokens: int) -> int:
        """Protocol tokens covering ``num_tokens`` vLLM tokens (rounded up to whole units)."""
        return -(-num_tokens // self.token_unit)

    def first_unit(self, first_token: int) -> int:
        """Protocol token of vLLM token ``first_token``, which must start a unit."""
        if first_token % self.token_unit:
            raise ConfigError(
                f"token {first_token} does not start a block of {self.token_unit} "
                "(packed pages move whole blocks only)"
            )
        return first_token // self.token_unit


_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_index(name: str) -> int:
    """Model layer index of a vLLM attention layer name (``model.layers.7.self_attn.attn``)."""
    m = _LAYER.search(name)
    if m is None:
        raise ConfigError(f"cannot tell the layer index of KV cache {name!r}")
    return int(m.group(1))


def describe_kv_caches(
    kv_caches: Mapping[str, TensorLike],
    *,
    engine: EngineSpec,
    rank: int,
    block_size: int,
    head_dim: int,
) -> KVRegions:
    """Describe this rank's KV caches. Raises :class:`ConfigError` for anything it
    cannot describe exactly (an unknown shape, padding inside a block, layers of
    different layouts, layers that are not this stage's)."""
    if not kv_caches:
        raise ConfigError("no KV cache tensors to describe")
    tp_rank, pp_rank = engine.split(rank)
    heads = len(engine.heads_of(tp_rank))
    ordered = sorted(kv_caches.items(), key=lambda kv: layer_index(kv[0]))
    indices = [layer_index(name) for name, _ in ordered]
    stage = engine.layers_of(pp_rank)
    if indices != list(range(indices[0], indices[0] + len(indices))) or (
        indices[0], indices[-1] + 1) != (stage.start, stage.stop):
        raise ConfigError(
            f"KV cache layers {indices} are not stage {pp_rank}'s layers "
            f"[{stage.start}, {stage.stop}) of a {engine.num_layers}-layer model"
        )
    shapes = []
    bases: list[int] = []
    for name, tensor in ordered:
        shape = _describe_one(name, tensor, engine, heads, block_size, head_dim)
        shapes.append(shape)
        bases.extend(tensor.data_ptr() + off for off in shape.plane_offsets)
    first = shapes[0]
    for (name, _), shape in zip(ordered, shapes, strict=True):
        if shape.layout_key != first.layout_key:
            raise ConfigError(f"layer {name!r} is laid out unlike layer {ordered[0][0]!r}")
    layout = KVLayout(
        num_blocks=first.num_blocks,
        block_size=first.block_size,
        num_heads=heads,
        head_dim=first.head_dim,
        dtype_bytes=first.dtype_bytes,
        layer_start=stage.start,
        layer_end=stage.stop,
        planes=first.planes,
        order=first.order,
        block_stride=first.block_stride,
    )
    info = RankInfo(engine=engine, rank=rank, layout=layout)
    info.validate()
    buffers = _merge_buffers(
        [(t.data_ptr(), s.nbytes) for (_, t), s in zip(ordered, shapes, strict=True)]
    )
    return KVRegions(info=info, bases=tuple(bases), token_unit=first.token_unit,
                     buffers=buffers)


@dataclass(frozen=True, slots=True)
class _Shape:
    num_blocks: int
    block_size: int  # protocol tokens per block
    head_dim: int  # protocol element width, in values
    dtype_bytes: int
    planes: int
    order: Order
    block_stride: int  # bytes
    plane_offsets: tuple[int, ...]  # bytes from data_ptr to each plane's first block
    token_unit: int
    nbytes: int  # bytes spanned by the tensor

    @property
    def layout_key(self) -> tuple[object, ...]:
        return (self.num_blocks, self.block_size, self.head_dim, self.dtype_bytes,
                self.planes, self.order, self.block_stride, self.token_unit,
                tuple(o for o in self.plane_offsets))


def _describe_one(
    name: str, t: TensorLike, engine: EngineSpec, heads: int, block_size: int, head_dim: int
) -> _Shape:
    shape = tuple(int(s) for s in t.shape)
    stride = tuple(int(s) for s in t.stride())
    e = int(t.element_size())

    def bad(why: str) -> ConfigError:
        return ConfigError(f"KV cache {name!r} of shape {list(shape)}, strides "
                           f"{list(stride)}: {why}")

    if engine.mla:
        if len(shape) != 3 or shape[1] != block_size or stride[2] != 1 or stride[1] != shape[2]:
            raise bad("expected a packed [num_blocks, block_size, latent_dim] MLA cache")
        nb, _, latent = shape
        page = block_size * latent
        if stride[0] < page:
            raise bad("blocks overlap")
        return _Shape(nb, block_size, latent, e, 1, "NHD", stride[0] * e, (0,), 1,
                      _span(shape, stride, e))
    if len(shape) == 4:  # packed pages: [num_blocks, heads, block_size, 2 * head_dim]
        nb, h, bs, width = shape
        if (h, bs, width) != (heads, block_size, 2 * head_dim):
            raise bad(f"expected [num_blocks, {heads}, {block_size}, {2 * head_dim}]")
        if stride[3] != 1 or stride[2] != width or stride[1] != bs * width:
            raise bad("a (block, head) page is not contiguous")
        if stride[0] < h * bs * width:
            raise bad("blocks overlap")
        return _Shape(nb, 1, bs * width, e, 1, "HND", stride[0] * e, (0,), block_size,
                      _span(shape, stride, e))
    if len(shape) == 5:
        if shape[0] == 2 and shape[1] != 2:
            plane_dim, block_dim = 0, 1
        elif shape[1] == 2:
            plane_dim, block_dim = 1, 0
        else:
            raise bad("no K/V plane dimension of size 2 in front")
        nb = shape[block_dim]
        bs, h, d = shape[2:]
        if (bs, h, d) != (block_size, heads, head_dim):
            raise bad(f"expected blocks of [{block_size}, {heads}, {head_dim}]")
        s_tok, s_head, s_dim = stride[2:]
        if s_dim != 1:
            raise bad("head_dim is not contiguous")
        if (s_tok, s_head) == (h * d, d):
            order: Order = "NHD"
        elif (s_tok, s_head) == (d, bs * d):
            order = "HND"
        else:
            raise bad("a block is not packed token-major or head-major")
        block_bytes = bs * h * d * e
        block_stride = stride[block_dim] * e
        if block_stride < block_bytes:
            raise bad("blocks overlap")
        plane = stride[plane_dim] * e
        return _Shape(nb, bs, d, e, 2, order, block_stride, (0, plane), 1,
                      _span(shape, stride, e))
    raise bad("unknown KV cache layout")


def _span(shape: tuple[int, ...], stride: tuple[int, ...], e: int) -> int:
    """Bytes from the first element to one past the last (non-negative strides)."""
    return (sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) + 1) * e


def _merge_buffers(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Merge adjacent or overlapping (address, bytes) ranges."""
    out: list[list[int]] = []
    for addr, n in sorted(ranges):
        if out and addr <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], addr + n - out[-1][0])
        else:
            out.append([addr, n])
    return tuple((a, n) for a, n in out)
