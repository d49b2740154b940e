"""Rule 12 over real NIXL (UCX, host memory): a held source re-targeted to a
second decode engine is written there; the engine left behind fails closed."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.protocol import FailReason, TransferFailed, TransferReady, uniform_ranks
from pushkv.transports.inmemory import region_memory
from pushkv.transports.nixl import NixlRuntime

pytestmark = pytest.mark.nixl


@pytest.fixture
def three() -> Iterator[tuple[NixlRuntime, NixlRuntime, NixlRuntime, list[list[np.ndarray]]]]:
    p_info = uniform_ranks("prefill-0")[0]
    src = region_memory(p_info.layout, rng=np.random.default_rng(5))
    d_mem, e_mem = region_memory(p_info.layout), region_memory(p_info.layout)
    prod = NixlRuntime(p_info, src, role="producer")
    d = NixlRuntime(uniform_ranks("decode-d")[0], d_mem, role="consumer")
    e = NixlRuntime(uniform_ranks("decode-e")[0], e_mem, role="consumer")
    try:
        yield prod, d, e, [src, d_mem, e_mem]
    finally:
        for rt in (prod, d, e):
            rt.close()


def _until(rt: NixlRuntime, pred: type, timeout_s: float = 30.0) -> list[object]:
    seen: list[object] = []
    end = time.monotonic() + timeout_s
    while not any(isinstance(x, pred) for x in seen) and time.monotonic() < end:
        rt.wait(0.05)
        seen += rt.poll()
    return seen


def test_a_held_source_goes_to_the_engine_it_was_retargeted_to(three) -> None:  # type: ignore[no-untyped-def]
    prod, d, e, (src, d_mem, e_mem) = three
    d.connect("prefill-0", [prod.address])
    d.register("t", "prefill-0", [5, 6], 32)
    # The router loses D before prefill ends and sends the leg to E, a turn later.
    e.connect("prefill-0", [prod.address])
    e.register("t", "prefill-0", [2, 3], 32, target=1)
    failed = [x for x in _until(d, TransferFailed) if isinstance(x, TransferFailed)]
    assert failed and failed[0].code is FailReason.RETARGETED, failed
    prod.prefill_finished("t", [1, 4], 32)  # prefill runs once
    assert TransferReady(transfer_id="t", attempt=0) in _until(e, TransferReady)
    tb = src[0].size // 64  # bytes per block
    for got, want in ((2, 1), (3, 4)):
        assert np.array_equal(e_mem[0][got * tb:(got + 1) * tb],
                              src[0][want * tb:(want + 1) * tb])
    assert not np.any(d_mem[0][5 * tb:7 * tb]), "nothing was written into D"
