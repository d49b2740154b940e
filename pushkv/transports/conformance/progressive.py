"""Conformance checks for progressive push (partial readiness), opt-in.

A transport opts in with a cluster that has ``range_ready(transfer_id,
src_block_ids, tokens, layers=None)`` (see
:meth:`pushkv.protocol.Producer.range_ready`). The source memory is made
final range by range, like a prefill: every source byte starts zeroed and is
restored only when its range is reported ready, so a write that reads a range
before it is ready lands zeros and fails the byte check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .cluster import (
    MakeCluster,
    Snapshot,
    Topology,
    _await,
    _element,
    _settled,
    assert_clean,
    assert_destination,
    reference_destination,
    registered,
)

#: A range: tokens [a, b) of layers [l0, l1).
Range = tuple[int, int, int, int]


class _Prefill:
    """The source of one transfer, made final range by range."""

    def __init__(self, c: Any, src: Sequence[int]) -> None:
        self.c, self.src = c, list(src)
        producers = c.topology.producer_ranks()
        self.ranks = [(p, c.source_memory(p.rank)) for p in producers]
        self.full = [[np.array(r, copy=True) for r in mem] for _, mem in self.ranks]
        # A cluster whose source memory lives elsewhere (other processes) is not
        # staged: its bytes are final from the start; parts and fences still count.
        self.staged = bool(getattr(c, "stages_source", True))
        for (p, mem) in self.ranks if self.staged else ():  # nothing is final yet
            lo = p.layout
            for region in mem:
                for b in self.src:
                    region[b * lo.stride:(b + 1) * lo.stride] = 0

    def ready(self, tid: str, rng: Range) -> None:
        a, b, l0, l1 = rng
        for (p, mem), full in zip(self.ranks if self.staged else (), self.full, strict=False):
            lo = p.layout
            es = lo.head_dim * lo.dtype_bytes
            for layer in range(max(l0, lo.layer_start), min(l1, lo.layer_end)):
                for plane in range(lo.planes):
                    i = lo.region_index(layer, plane)
                    if lo.order == "BLOCK":
                        for blk in range(a // lo.block_size, -(-b // lo.block_size)):
                            o = self.src[blk] * lo.stride
                            mem[i][o:o + lo.block_bytes] = full[i][o:o + lo.block_bytes]
                        continue
                    for t in range(a, b):
                        for h in range(lo.num_heads):
                            o = _element(lo, self.src, t, h)
                            mem[i][o:o + es] = full[i][o:o + es]
        self.c.range_ready(tid, self.src, (a, b), (l0, l1))

    def finish(self, tid: str, n: int) -> None:
        for (_, mem), full in zip(self.ranks if self.staged else (), self.full, strict=False):
            for region, want in zip(mem, full, strict=True):
                region[:] = want
        self.c.prefill_finished(tid, self.src, n)


def _writes(s: Snapshot) -> int:
    """Writes started so far, every producer rank's."""
    return sum(s.writes.values())


def chunks(n: int, size: int, layers: int) -> list[Range]:
    """Chunked prefill: each step makes all layers of its tokens final."""
    return [(a, min(n, a + size), 0, layers) for a in range(0, n, size)]


def layerwise(n: int, size: int, layers: int) -> list[Range]:
    """Layer-wise push within chunked prefill: one layer of one chunk at a time."""
    return [(a, min(n, a + size), layer, layer + 1)
            for a in range(0, n, size) for layer in range(layers)]


def check_progressive(make: MakeCluster, topo: Topology | None = None, *, n: int = 70,
                      size: int = 32, split: Callable[[int, int, int], list[Range]] = chunks,
                      register_after: int = 1, shuffle: bool = False,
                      first_token: int = 0) -> None:
    """Ranges reported as they become final, the registration arriving after
    ``register_after`` of them: READY, and the bytes are the whole request's."""
    topo = topo or Topology()
    c = make(topo)
    try:
        layers = topo.producer_ranks()[0].engine.num_layers
        bs = topo.producer_ranks()[0].layout.block_size
        src = [40 + i for i in range(-(-n // bs))]
        dst = [3 + 2 * i for i in range(-(-n // topo.consumer_ranks()[0].layout.block_size))]
        ranges = split(n, size, layers)
        if shuffle:
            np.random.default_rng(topo.seed).shuffle(ranges)
        prefill = _Prefill(c, src)
        for i, rng in enumerate(ranges):
            if i == register_after:
                c.register("t", dst, n, first_token)
                _await(c, registered(topo, "t"), "the producer took the registration in")
            before = _writes(c.snapshot())
            prefill.ready("t", rng)
            if i >= register_after and rng[1] > first_token:
                # Registered legs write a range at once (rule 9): let its write start
                # before the next range is final. A producer that writes nothing new
                # (one that took an earlier range for the whole prefill) is left to
                # the byte check.
                c.wait(lambda s, before=before: _writes(s) > before, 20)
        if register_after >= len(ranges):
            c.register("t", dst, n, first_token)
        prefill.finish("t", n)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        assert_destination(c, [(src, dst, n, first_token)])
        assert_clean(c)
    finally:
        c.close()


def check_progressive_cancel(make: MakeCluster, topo: Topology | None = None) -> None:
    """Cancelled between two ranges, then a range becomes ready: nothing is written
    after the fence, the blocks come back once every posted part landed, the
    source is released once."""
    topo = topo or Topology()
    c = make(topo)
    try:
        layers = topo.producer_ranks()[0].engine.num_layers
        prefill = _Prefill(c, [40, 41, 42])
        c.register("t", [1, 2, 3], 40)
        prefill.ready("t", (0, 16, 0, layers))
        c.abort("t")
        prefill.ready("t", (16, 32, 0, layers))  # after the cancel: never written
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "cancelled"), 20)
        assert _settled(snap, topo, ["t"], "cancelled"), snap.outcomes
        prefill.finish("t", 40)
        assert_clean(c)
    finally:
        c.close()


def check_progressive_reissue(make: MakeCluster, topo: Topology | None = None) -> None:
    """Preempted after a part was written, reissued into other blocks: the new
    attempt gets every range (those ready before it at once), the old blocks
    are released only after the old part's fence."""
    topo = topo or Topology()
    c = make(topo)
    try:
        layers = topo.producer_ranks()[0].engine.num_layers
        src = [40, 41, 42]
        prefill = _Prefill(c, src)
        c.register("t", [1, 2, 3], 40)
        prefill.ready("t", (0, 16, 0, layers))
        _await(c, lambda s: all(s.writes.get(p.rank, 0) >= 1 for p in topo.producer_ranks()),
               "every producer rank started writing the first part")
        c.preempt("t")
        prefill.ready("t", (16, 32, 0, layers))
        c.wait(lambda s: not any(s.lent.values()), 20)
        c.reissue("t", [10, 11, 12])
        prefill.finish("t", 40)
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "ready"), 20)
        assert _settled(snap, topo, ["t"], "ready"), snap.outcomes
        producers = topo.producer_ranks()
        srcmem = [c.source_memory(p.rank) for p in producers]
        for cr in topo.consumer_ranks():  # the new blocks hold the request
            got = c.destination_memory(cr.rank)
            want = reference_destination(producers, srcmem, cr, [(src, [10, 11, 12], 40, 0)],
                                         base=got)
            assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True))
        assert_clean(c)
    finally:
        c.close()


def check_progressive_aborted(make: MakeCluster, topo: Topology | None = None) -> None:
    """The local request aborts with a part in flight: the consumer fails, fenced;
    the source is released once, after the part finished."""
    topo = topo or Topology()
    c = make(topo)
    try:
        layers = topo.producer_ranks()[0].engine.num_layers
        prefill = _Prefill(c, [40, 41, 42])
        c.register("t", [1, 2, 3], 40)
        prefill.ready("t", (0, 16, 0, layers))
        c.prefill_aborted("t")
        snap = c.wait(lambda s: _settled(s, topo, ["t"], "failed"), 20)
        assert _settled(snap, topo, ["t"], "failed"), snap.outcomes
        snap = assert_clean(c)
        assert all(n == 1 for n in snap.src_released.values()), snap.src_released
    finally:
        c.close()


_TP2 = Topology(producer={"tp": 2, "num_kv_heads": 2}, consumer={"num_kv_heads": 2})
_PP = Topology(producer={"pp": 2, "num_layers": 4}, consumer={"num_layers": 4})

#: Every progressive check, by name, as (function, keyword arguments).
PROGRESSIVE_CHECKS: dict[str, tuple[Callable[..., None], dict[str, Any]]] = {
    "chunks_register_between": (check_progressive, {}),
    "chunks_register_first": (check_progressive, {"register_after": 0}),
    "chunks_register_last": (check_progressive, {"register_after": 99}),
    "layers_register_between": (check_progressive, {"split": layerwise, "register_after": 3}),
    "layers_any_order": (check_progressive, {"split": layerwise, "shuffle": True}),
    "layers_tp2-1": (check_progressive, {"topo": _TP2, "split": layerwise}),
    "layers_pp2": (check_progressive, {"topo": _PP, "split": layerwise, "register_after": 2}),
    "chunks_partial_prefix": (check_progressive, {"first_token": 37}),
    "cancel_between_ranges": (check_progressive_cancel, {}),
    "reissue_between_ranges": (check_progressive_reissue, {}),
    "aborted_with_a_part_in_flight": (check_progressive_aborted, {}),
}
