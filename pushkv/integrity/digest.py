"""The digest of a written range, defined over the logical KV.

A write moves one rectangle of the KV -- layers ``[l0, l1)``, tokens ``[a, b)``
and a run of heads -- from a producer rank's blocks into a consumer rank's.
The two sides lay it out differently (block sizes, ``NHD``/``HND`` orders,
heterogeneous TP: the producer's local head ``h`` is the consumer's ``h'``), so
the digest is defined over *logical* cells, never over addresses:

* a cell is one element -- (layer, plane, token, head): ``head_dim *
  dtype_bytes`` bytes, zero-padded to whole 8-byte words -- or, for an opaque
  (``BLOCK``) layout, one whole logical block of the request (the element is
  then the block, its token the block's first);
* word ``w`` of a cell is salted with its coordinates,
  ``salt = layer*C1 + plane*C2 + token*C3 + (head*W + w)*C5`` (mod 2**64, ``W``
  words per element, ``head`` the cell's head as the *consumer* rank numbers
  it: both sides know it from the mapping's head runs);
* the digest is ``sum(mix(word ^ salt)) mod 2**64`` over every word of every
  cell of the rectangle, where ``mix`` is ``x *= M1; x ^= x >> 32; x *= M2``.

Why this shape:

* **identical everywhere.** Only 64-bit integer xor, multiply, shift and a
  wrapping sum: numpy on host memory and torch (CPU or CUDA) give the same
  bits, and the sum does not depend on the order cells are visited, so each
  side gathers in whatever order its memory favours;
* **every single-word change is caught**, every single-bit flip included:
  ``mix`` is a bijection (xor, multiplication by an odd constant and an
  xor-shift are each invertible), so a changed word changes its term, and the
  sum by exactly that difference, never zero;
* **position matters**: a block swapped with another, written at the wrong
  offset, replayed from a stale range or zeroed puts other bytes under the
  salts of the cells it covers; the terms differ and the sum collides with
  probability about ``2**-64``;
* **vectorised**: a handful of passes over cache-sized chunks of words, no
  Python loop per token or block.

A well-kept library hash (``xxhash``'s XXH3, ``crc32c``) is faster on
contiguous host bytes, but it hashes a byte *stream*: both sides would first
gather the cells into the same canonical order (a copy), and there is no torch
implementation with the same bits for CUDA memory. The measurements that
decided it are in ``benchmarks/bench_integrity.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from pushkv.protocol.errors import ConfigError
from pushkv.protocol.events import WriteScope
from pushkv.protocol.layout import KVLayout

#: Salt multipliers and mixing constants (odd; splitmix64's and the golden ratio's).
C1 = 0xD6E8FEB86659FD93  # layer
C2 = 0xA0761D6478BD642F  # plane
C3 = 0xE7037ED1A0B428DB  # token
C5 = 0x94D049BB133111EB  # word of a cell row
M1 = 0x9E3779B97F4A7C15
M2 = 0xBF58476D1CE4E5B9
MASK = (1 << 64) - 1

#: Words mixed per numpy step: small enough to stay in the L2 cache.
CHUNK_WORDS = 1 << 15
#: Words per torch step (device memory: large steps, bounded temporaries).
TORCH_CHUNK_WORDS = 1 << 24

U64 = np.uint64
HeadRun = tuple[int, int, int]  #: (local head, logical head, count)


#: The logical rectangle a write covers on one side: the core's
#: :class:`~pushkv.protocol.events.WriteScope` (block ids, tokens ``[first_token,
#: num_tokens)``, global layers, head runs ``(local head, logical head, count)``).
Scope = WriteScope


def check_scope(scope: WriteScope, layout: KVLayout) -> None:
    """ConfigError unless the rectangle lies inside ``layout`` and its blocks."""
    if not 0 <= scope.first_token <= scope.num_tokens:
        raise ConfigError(f"token range [{scope.first_token}, {scope.num_tokens}) is reversed")
    if scope.layers.start < layout.layer_start or scope.layers.stop > layout.layer_end:
        raise ConfigError(f"layers [{scope.layers.start}, {scope.layers.stop}) not held "
                          f"by this rank ([{layout.layer_start}, {layout.layer_end}))")
    for h, g, n in scope.heads:
        if h < 0 or g < 0 or n < 1 or h + n > layout.num_heads:
            raise ConfigError(f"head run {(h, g, n)} outside the rank's "
                              f"{layout.num_heads} heads")
    need = -(-scope.num_tokens // layout.block_size)
    if len(scope.block_ids) < need:
        raise ConfigError(f"{len(scope.block_ids)} blocks hold fewer than "
                          f"{scope.num_tokens} tokens")
    if len(scope.block_ids) and (min(scope.block_ids) < 0
                                 or max(scope.block_ids) >= layout.num_blocks):
        raise ConfigError(f"a block id lies outside [0, {layout.num_blocks})")


def _mix_sum(words: npt.NDArray[np.uint64], salt: npt.NDArray[np.uint64],
             tmp: npt.NDArray[np.uint64]) -> int:
    """sum(mix(words ^ salt)); overwrites ``salt``."""
    np.bitwise_xor(salt, words, out=salt)
    np.multiply(salt, U64(M1), out=salt)
    np.right_shift(salt, U64(32), out=tmp)
    np.bitwise_xor(salt, tmp, out=salt)
    np.multiply(salt, U64(M2), out=salt)
    return int(salt.sum(dtype=np.uint64))


def _rows_digest(rows: npt.NDArray[np.uint64], bases: npt.NDArray[np.uint64]) -> int:
    """Digest of ``rows`` (R, W words), row ``r`` salted ``bases[r] + w*C5``."""
    r, w = rows.shape
    if r == 0 or w == 0:
        return 0
    step = max(1, CHUNK_WORDS // w)
    col = np.arange(w, dtype=U64) * U64(C5)
    salt = np.empty((min(step, r), w), dtype=U64)
    tmp = np.empty_like(salt)
    total = 0
    with np.errstate(over="ignore"):
        for lo in range(0, r, step):
            hi = min(r, lo + step)
            s, t = salt[: hi - lo], tmp[: hi - lo]
            np.add(bases[lo:hi, None], col[None, :], out=s)
            total += _mix_sum(rows[lo:hi], s, t)
    return total & MASK


def _cells(layout: KVLayout, scope: Scope) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64],
                                                    npt.NDArray[np.int64], int]:
    """Byte offsets (inside a region) of every cell, their tokens, their first word
    index in the salt's row, and the cell's byte length."""
    ids = np.asarray(scope.block_ids, dtype=np.int64)
    bs, stride = layout.block_size, layout.stride
    if layout.order == "BLOCK":
        blocks = np.arange(scope.first_token // bs, -(-scope.num_tokens // bs), dtype=np.int64)
        off = ids[blocks] * stride
        return off[:, None], (blocks * bs)[:, None], np.zeros((blocks.size, 1), np.int64), \
            layout.block_bytes
    es = layout.head_dim * layout.dtype_bytes
    words = -(-es // 8)
    tokens = np.arange(scope.first_token, scope.num_tokens, dtype=np.int64)
    local = np.array([h + i for h, _, n in scope.heads for i in range(n)], dtype=np.int64)
    logical = np.array([g + i for _, g, n in scope.heads for i in range(n)], dtype=np.int64)
    block = ids[tokens // bs] * stride
    within = tokens % bs
    if layout.order == "NHD":
        inner = within[:, None] * (layout.num_heads * es) + local[None, :] * es
    else:
        inner = local[None, :] * (bs * es) + within[:, None] * es
    off = block[:, None] + inner
    tok = np.broadcast_to(tokens[:, None], off.shape)
    first_word = np.broadcast_to((logical * words)[None, :], off.shape)
    return off, tok, first_word, es


def _whole_rows(layout: KVLayout, scope: Scope) -> bool:
    """Token rows hold exactly the scope's heads in logical order, whole words."""
    return (layout.order == "NHD" and scope.heads == ((0, 0, layout.num_heads),)
            and (layout.head_dim * layout.dtype_bytes) % 8 == 0)


def _region_words(region: Any) -> npt.NDArray[np.uint8]:
    """A flat uint8 numpy view of a host region (numpy array or CPU tensor)."""
    if isinstance(region, np.ndarray):
        arr = region
    elif hasattr(region, "numpy"):  # a CPU torch tensor: same memory, no copy
        arr = region.detach().contiguous().view(-1).numpy()
    else:
        arr = np.frombuffer(region, dtype=np.uint8)
    return arr.reshape(-1).view(np.uint8)


def _bases(layer: int, plane: int, tokens: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
    with np.errstate(over="ignore"):
        return (U64((layer * C1 + plane * C2) & MASK)
                + tokens.astype(U64) * U64(C3))


def digest(regions: Sequence[Any], layout: KVLayout, scope: Scope) -> int:
    """The digest (an int in ``[0, 2**64)``) of ``scope`` in ``regions``.

    ``regions[i]`` is region ``i`` of ``layout`` (local layer ``i // planes``,
    plane ``i % planes``): numpy uint8 arrays or torch tensors (CUDA tensors go
    through :func:`digest_torch`, with the same result). Raises ConfigError for
    a scope outside the layout or memory too small for it.
    """
    if regions and _is_cuda(regions[0]):
        return digest_torch(regions, layout, scope)
    check_scope(scope, layout)
    if len(regions) != layout.num_regions:
        raise ConfigError(f"{len(regions)} regions given, the layout has {layout.num_regions}")
    total = 0
    if scope.num_tokens == scope.first_token or not scope.heads:
        return 0
    if _whole_rows(layout, scope):
        for layer in scope.layers:
            for plane in range(layout.planes):
                mem = _region_words(regions[layout.region_index(layer, plane)])
                total += _block_rows_digest(mem, layout, scope, layer, plane)
        return total & MASK
    off, tok, first_word, nbytes = _cells(layout, scope)
    words = -(-nbytes // 8)
    flat_off, flat_tok = off.reshape(-1), tok.reshape(-1)
    flat_first = first_word.reshape(-1).astype(U64)
    aligned = nbytes % 8 == 0 and bool(np.all(flat_off % 8 == 0))
    # Cells at whole multiples of their own size (the common case): a region is a
    # table of cells, and a chunk of them is gathered by one np.take (a memcpy per
    # cell) instead of an index per word.
    tiled = aligned and bool(np.all(flat_off % nbytes == 0))
    step = max(1, CHUNK_WORDS // words)
    wcol = np.arange(words, dtype=np.int64)[None, :]
    bcol = np.arange(nbytes, dtype=np.int64)[None, :]
    buf = np.empty((min(step, max(1, flat_off.size)), words), dtype=U64) if tiled else None
    for layer in scope.layers:
        for plane in range(layout.planes):
            mem = _region_words(regions[layout.region_index(layer, plane)])
            if flat_off.size and int(flat_off.max()) + nbytes > mem.size:
                raise ConfigError("a region is smaller than the layout addresses")
            with np.errstate(over="ignore"):
                bases = _bases(layer, plane, flat_tok) + flat_first * U64(C5)
            table = np.lib.stride_tricks.as_strided(
                mem, shape=(mem.size // nbytes, nbytes), strides=(nbytes, 1),
                writeable=False) if tiled else None
            w = mem[: mem.size - mem.size % 8].view(U64) if (
                aligned and mem.ctypes.data % 8 == 0) else None
            for lo in range(0, flat_off.size, step):
                o = flat_off[lo: lo + step]
                if table is not None and buf is not None:
                    rows = buf[: o.size]
                    np.take(table, o // nbytes, axis=0, out=rows.view(np.uint8))
                elif w is not None:
                    rows = w[(o // 8)[:, None] + wcol]
                else:
                    cells = np.zeros((o.size, words * 8), dtype=np.uint8)
                    cells[:, :nbytes] = mem[o[:, None] + bcol]
                    rows = cells.view(U64)
                total += _rows_digest(rows, bases[lo: lo + step])
    return total & MASK


def _block_rows_digest(mem: npt.NDArray[np.uint8], layout: KVLayout, scope: Scope,
                       layer: int, plane: int) -> int:
    """Whole token rows (:func:`_whole_rows`): gather a cache-sized run of blocks at a
    time and digest their rows in the scope's tokens."""
    if mem.size < layout.region_bytes:
        raise ConfigError("a region is smaller than the layout addresses")
    bs, tb, bb = layout.block_size, layout.token_bytes, layout.block_bytes
    ids = np.asarray(scope.block_ids, dtype=np.int64)
    first, n = scope.first_token, scope.num_tokens
    b0, b1 = first // bs, -(-n // bs)
    view = np.lib.stride_tricks.as_strided(
        mem, shape=(layout.num_blocks, bb), strides=(layout.stride, 1), writeable=False)
    per = max(1, (CHUNK_WORDS * 8) // bb)
    buf = np.empty((min(per, b1 - b0), bb), dtype=np.uint8)
    total = 0
    for c0 in range(b0, b1, per):
        c1 = min(b1, c0 + per)
        got = buf[: c1 - c0]
        np.take(view, ids[c0:c1], axis=0, out=got)
        lo, hi = max(first, c0 * bs), min(n, c1 * bs)
        rows = got.reshape(-1, tb)[lo - c0 * bs: hi - c0 * bs].view(U64)
        total += _rows_digest(rows, _bases(layer, plane, np.arange(lo, hi, dtype=np.int64)))
    return total


def _is_cuda(obj: Any) -> bool:
    dev = getattr(obj, "device", None)
    return getattr(dev, "type", None) == "cuda"


def _signed(x: int) -> int:
    x &= MASK
    return x - (1 << 64) if x >> 63 else x


def digest_torch(regions: Sequence[Any], layout: KVLayout, scope: Scope) -> int:
    """:func:`digest` over torch tensors where they live (CUDA or CPU), with torch's
    int64 arithmetic (wrapping like uint64; the shift is masked to a logical one):
    the same bits as the numpy path."""
    import torch

    check_scope(scope, layout)
    if len(regions) != layout.num_regions:
        raise ConfigError(f"{len(regions)} regions given, the layout has {layout.num_regions}")
    if scope.num_tokens == scope.first_token or not scope.heads:
        return 0
    dev = regions[0].device
    off, tok, first_word, nbytes = _cells(layout, scope)
    words = -(-nbytes // 8)
    flat = off.reshape(-1)
    flat_off = torch.as_tensor(flat, device=dev)
    flat_tok = torch.as_tensor(np.ascontiguousarray(tok.reshape(-1)), device=dev)
    flat_first = torch.as_tensor(np.ascontiguousarray(first_word.reshape(-1)), device=dev)
    col = torch.arange(words, device=dev, dtype=torch.int64) * _signed(C5)
    tiled = nbytes % 8 == 0 and bool(np.all(flat % nbytes == 0))
    step = max(1, TORCH_CHUNK_WORDS // words)
    total = 0
    for layer in scope.layers:
        for plane in range(layout.planes):
            mem = regions[layout.region_index(layer, plane)].reshape(-1).view(torch.uint8)
            if flat.size and int(flat.max()) + nbytes > mem.numel():
                raise ConfigError("a region is smaller than the layout addresses")
            base = (flat_tok * _signed(C3) + _signed(layer * C1 + plane * C2)
                    + flat_first * _signed(C5))
            table = None
            if tiled and mem.data_ptr() % 8 == 0:  # one row gather per cell, in place
                n = mem.numel() // nbytes
                table = mem[: n * nbytes].view(n, nbytes).view(torch.int64)
            for lo in range(0, flat.size, step):
                o = flat_off[lo: lo + step]
                if table is not None:
                    x = table.index_select(0, o // nbytes)
                else:
                    cells = torch.zeros((o.numel(), words * 8), dtype=torch.uint8, device=dev)
                    cells[:, :nbytes] = mem[o[:, None] + torch.arange(nbytes, device=dev)]
                    x = cells.view(torch.int64)
                y = (x ^ (base[lo: lo + step, None] + col[None, :])) * _signed(M1)
                y = y ^ ((y >> 32) & 0xFFFFFFFF)
                y = y * _signed(M2)
                total += int(y.sum())
    return total & MASK


__all__ = ["Scope", "check_scope", "digest", "digest_torch"]
