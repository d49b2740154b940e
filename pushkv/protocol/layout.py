"""What an engine and one of its ranks look like to a peer.

These are exchanged once, in the handshake, and let each side check and plan
every later transfer without trusting the peer again:

* :class:`EngineSpec` -- engine-wide facts: parallelism, model shape.
* :class:`KVLayout` -- how one rank's KV cache sits in memory, as *regions*:
  one region per (local layer, plane), where a plane is K or V (or the single
  latent plane of MLA). A region is ``num_blocks`` blocks, ``block_stride``
  bytes apart; inside a block, tokens and heads are ordered ``NHD``
  (token-major) or ``HND`` (head-major), or the block is opaque (``BLOCK``).
  Region ``i`` is local layer ``i // planes``, plane ``i % planes``. Addresses
  stay with the transport:
  the protocol only speaks of (region, byte offset).

Both are msgspec structs, so they travel inside :class:`~pushkv.protocol.messages.Hello`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from .errors import ConfigError

#: Upper bounds that keep every size computation far from overflow and every
#: table bounded, whatever a peer claims.
MAX_RANKS = 1024
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_BLOCKS = 1 << 31
MAX_BLOCK_SIZE = 1 << 16
MAX_HEAD_DIM = 1 << 16
MAX_ID_LEN = 256

Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCKS)]
Index = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LEN)]
#: In-block order: token-major (``NHD``), head-major (``HND``), or ``BLOCK`` when
#: the layout inside a block is private to the engine (vLLM's CPU cache stores K
#: transposed): such blocks only move whole, between identical layouts.
Order = Literal["NHD", "HND", "BLOCK"]


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Engine-wide facts both sides need for the TP/PP mapping."""

    engine_id: Name
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)] = 1
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_RANKS)] = 1
    num_layers: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    #: Total KV heads of the model (1 for MLA: the latent is one replicated "head").
    num_kv_heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]
    #: True for multi-head latent attention: the latent is replicated on every rank.
    mla: bool = False
    #: Layers per pipeline stage; empty for the default split (vLLM's rule: even,
    #: with the remainder on the stages before the last, last-but-one first).
    pp_layers: Annotated[tuple[Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)], ...],
                         msgspec.Meta(max_length=MAX_RANKS)] = ()

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def validate(self) -> None:
        """Raise :class:`ConfigError` unless this spec is internally consistent."""
        h, tp = self.num_kv_heads, self.tp_size
        if self.mla and h != 1:
            raise ConfigError(f"MLA has one latent head, not {h}")
        if h >= tp and h % tp:
            raise ConfigError(f"{h} KV heads do not divide over TP {tp}")
        if h < tp and tp % h:
            raise ConfigError(f"TP {tp} is not a multiple of {h} KV heads (replication)")
        if self.pp_size > self.num_layers:
            raise ConfigError(f"PP {self.pp_size} exceeds {self.num_layers} layers")
        if self.pp_layers and (len(self.pp_layers) != self.pp_size
                               or sum(self.pp_layers) != self.num_layers):
            raise ConfigError(
                f"pp_layers {list(self.pp_layers)} must give {self.pp_size} stages "
                f"summing to {self.num_layers} layers"
            )

    def rank_of(self, tp_rank: int, pp_rank: int = 0) -> int:
        """Global rank of (tp_rank, pp_rank): ``pp_rank * tp_size + tp_rank``."""
        if not (0 <= tp_rank < self.tp_size and 0 <= pp_rank < self.pp_size):
            raise ConfigError(
                f"rank (tp={tp_rank}, pp={pp_rank}) outside world "
                f"(tp_size={self.tp_size}, pp_size={self.pp_size})"
            )
        return pp_rank * self.tp_size + tp_rank

    def split(self, rank: int) -> tuple[int, int]:
        """(tp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} outside world of size {self.world_size}")
        return rank % self.tp_size, rank // self.tp_size

    def stage_sizes(self) -> tuple[int, ...]:
        """Layers per pipeline stage (``pp_layers``, or the default split)."""
        if self.pp_layers:
            return self.pp_layers
        n, pp = self.num_layers, self.pp_size
        sizes = [n // pp] * pp
        for i in range(2, n % pp + 2):  # the remainder before the last stage
            sizes[-i] += 1
        return tuple(sizes)

    def layers_of(self, pp_rank: int) -> range:
        """Global layer indices held by pipeline stage ``pp_rank``."""
        sizes = self.stage_sizes()
        start = sum(sizes[:pp_rank])
        return range(start, start + sizes[pp_rank])

    def heads_of(self, tp_rank: int) -> range:
        """Global KV head indices held by ``tp_rank`` (one replicated head if heads < TP)."""
        h, tp = self.num_kv_heads, self.tp_size
        if h >= tp:
            per = h // tp
            return range(tp_rank * per, (tp_rank + 1) * per)
        head = tp_rank // (tp // h)
        return range(head, head + 1)

    def holders_of(self, head: int) -> range:
        """TP ranks that hold global KV head ``head``."""
        h, tp = self.num_kv_heads, self.tp_size
        if h >= tp:
            per = h // tp
            return range(head // per, head // per + 1)
        rep = tp // h
        return range(head * rep, (head + 1) * rep)


class KVLayout(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """How one rank's KV cache is laid out in its registered memory."""

    num_blocks: Count
    #: Tokens per block.
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    #: KV heads held by this rank.
    num_heads: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEADS)]
    head_dim: Annotated[int, msgspec.Meta(ge=1, le=MAX_HEAD_DIM)]
    dtype_bytes: Annotated[int, msgspec.Meta(ge=1, le=16)]
    #: Global layers held by this rank: ``[layer_start, layer_end)``.
    layer_start: Annotated[int, msgspec.Meta(ge=0, le=MAX_LAYERS)] = 0
    layer_end: Annotated[int, msgspec.Meta(ge=1, le=MAX_LAYERS)]
    #: 2 for separate K and V regions per layer, 1 for MLA's single latent.
    planes: Annotated[int, msgspec.Meta(ge=1, le=2)] = 2
    order: Order = "NHD"
    #: Bytes from one block to the next inside a region; 0 means packed
    #: (equal to :attr:`block_bytes`). Larger when K and V interleave per block.
    block_stride: Annotated[int, msgspec.Meta(ge=0, le=1 << 40)] = 0

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_regions(self) -> int:
        return self.num_layers * self.planes

    @property
    def token_bytes(self) -> int:
        """Bytes of one token of one plane of one layer on this rank."""
        return self.num_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.token_bytes

    @property
    def stride(self) -> int:
        return self.block_stride or self.block_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes addressable in one region (the last block need not be padded)."""
        return (self.num_blocks - 1) * self.stride + self.block_bytes

    def region_index(self, layer: int, plane: int) -> int:
        """Region of global ``layer`` and ``plane`` on this rank."""
        if not (self.layer_start <= layer < self.layer_end and 0 <= plane < self.planes):
            raise ConfigError(f"layer {layer}, plane {plane} not held by this rank")
        return (layer - self.layer_start) * self.planes + plane

    def validate(self) -> None:
        if self.layer_end <= self.layer_start:
            raise ConfigError(
                f"empty layer range [{self.layer_start}, {self.layer_end})"
            )
        if self.block_stride and self.block_stride < self.block_bytes:
            raise ConfigError(
                f"block_stride {self.block_stride} is smaller than a block "
                f"({self.block_bytes} bytes): blocks would overlap"
            )


class RankInfo(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One rank of an engine, as announced in the handshake."""

    engine: EngineSpec
    rank: Annotated[int, msgspec.Meta(ge=0, le=MAX_RANKS * MAX_RANKS)]
    layout: KVLayout

    @property
    def engine_id(self) -> str:
        return self.engine.engine_id

    def validate(self) -> None:
        """Raise :class:`ConfigError` unless spec, rank and layout agree."""
        self.engine.validate()
        self.layout.validate()
        tp_rank, pp_rank = self.engine.split(self.rank)
        layers = self.engine.layers_of(pp_rank)
        lo = self.layout
        if (lo.layer_start, lo.layer_end) != (layers.start, layers.stop):
            raise ConfigError(
                f"rank {self.rank} holds layers [{lo.layer_start}, {lo.layer_end}) "
                f"but stage {pp_rank} of {self.engine.num_layers} layers is "
                f"[{layers.start}, {layers.stop})"
            )
        heads = len(self.engine.heads_of(tp_rank))
        if lo.num_heads != heads:
            raise ConfigError(
                f"rank {self.rank} declares {lo.num_heads} KV heads, the TP split gives {heads}"
            )
        if self.engine.mla and lo.planes != 1:
            raise ConfigError("an MLA cache has one plane (the latent), not K and V")


def uniform_ranks(
    engine_id: str,
    *,
    tp: int = 1,
    pp: int = 1,
    num_layers: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 16,
    dtype_bytes: int = 2,
    num_blocks: int = 64,
    block_size: int = 16,
    order: Order = "NHD",
    mla: bool = False,
    block_stride: int = 0,
) -> list[RankInfo]:
    """RankInfo of every rank of an engine whose ranks share one cache layout."""
    spec = EngineSpec(engine_id=engine_id, tp_size=tp, pp_size=pp, num_layers=num_layers,
                      num_kv_heads=num_kv_heads, mla=mla)
    spec.validate()
    out = []
    for rank in range(spec.world_size):
        tp_rank, pp_rank = spec.split(rank)
        layers = spec.layers_of(pp_rank)
        lo = KVLayout(num_blocks=num_blocks, block_size=block_size,
                      num_heads=len(spec.heads_of(tp_rank)), head_dim=head_dim,
                      dtype_bytes=dtype_bytes, layer_start=layers.start, layer_end=layers.stop,
                      planes=1 if mla else 2, order=order, block_stride=block_stride)
        info = RankInfo(engine=spec, rank=rank, layout=lo)
        info.validate()
        out.append(info)
    return out
