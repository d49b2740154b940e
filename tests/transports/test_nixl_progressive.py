"""Progressive push over NIXL across two processes: ranges posted as they are
reported, one write in flight per leg, READY only once every part notified."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.transports.conformance import PROGRESSIVE_CHECKS
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl

#: A few of the in-memory checks: the transport adds nothing rule-specific, so
#: one of each kind (streamed writes, faults mid-stream) covers it.
NIXL_CHECKS = ("layers_register_between", "layers_tp2-1", "cancel_between_ranges",
               "aborted_with_a_part_in_flight")


@pytest.mark.parametrize("name", NIXL_CHECKS)
def test_progressive_conformance(pool: HostPool, name: str) -> None:
    fn, kwargs = PROGRESSIVE_CHECKS[name]
    fn(lambda topo: NixlCluster(topo, pool), **kwargs)


class _Event:
    """Stands for a CUDA event: ``query()`` is true once the layer's work is done."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done.is_set()


@pytest.fixture
def runtimes() -> Iterator[tuple[Any, Any, list[Any], list[Any]]]:
    """A producer and a consumer runtime in this process, connected."""
    import numpy as np

    from pushkv.protocol import uniform_ranks
    from pushkv.transports.inmemory import region_memory
    from pushkv.transports.nixl import NixlRuntime

    p_info, c_info = uniform_ranks("prefill-0")[0], uniform_ranks("decode-0")[0]
    src = region_memory(p_info.layout, rng=np.random.default_rng(3))
    dst = region_memory(c_info.layout)
    prod = NixlRuntime(p_info, src, role="producer")
    cons = NixlRuntime(c_info, dst, role="consumer")
    try:
        cons.connect("prefill-0", [prod.address])
        yield prod, cons, src, dst
    finally:
        prod.close()
        cons.close()


def _until_ready(cons: Any, deadline: float) -> bool:
    from pushkv.protocol import TransferReady

    seen: list[object] = []
    while not any(isinstance(e, TransferReady) for e in seen) and time.monotonic() < deadline:
        cons.wait(0.05)
        seen += cons.poll()
    return any(isinstance(e, TransferReady) for e in seen)


def test_a_range_is_posted_only_once_its_event_completed(runtimes) -> None:
    import numpy as np

    from pushkv.protocol import TransferReady

    prod, cons, src, dst = runtimes
    cons.register("t", "prefill-0", [5, 6], 32)
    tb = src[0].size // 64  # bytes per block (16 tokens)
    event = _Event()
    prod.range_ready("t", [1, 2], (0, 16), ready=event)  # a hand-off: never waits
    deadline = time.monotonic() + 30
    while event.queries < 3 and time.monotonic() < deadline:
        prod.wait(0.05)
    assert event.queries >= 3, "the I/O thread does not poll the event"
    assert not dst[0][5 * tb:6 * tb].any(), "a range was posted before its event"
    event.done.set()
    while (not np.array_equal(dst[0][5 * tb:6 * tb], src[0][tb:2 * tb])
           and time.monotonic() < deadline):
        cons.wait(0.05)
    assert np.array_equal(dst[0][5 * tb:6 * tb], src[0][tb:2 * tb])
    assert not [e for e in cons.poll() if isinstance(e, TransferReady)]
    prod.prefill_finished("t", [1, 2], 32)
    assert _until_ready(cons, deadline)
    for region in range(len(src)):
        assert np.array_equal(dst[region][5 * tb:7 * tb], src[region][tb:3 * tb])


def test_prefill_finished_waits_for_a_range_still_computing(runtimes) -> None:
    """A GPU engine finishes the prefill as the step's forward is queued: the whole
    prompt goes out only after the event of its last range completed."""
    import numpy as np

    from pushkv.protocol import TransferReady

    prod, cons, src, dst = runtimes
    cons.register("t", "prefill-0", [5, 6], 32)
    tb = src[0].size // 64  # bytes per block (16 tokens)
    event = _Event()
    prod.range_ready("t", [1, 2], (0, 32), ready=event)
    prod.prefill_finished("t", [1, 2], 32)  # right behind: it must wait too
    deadline = time.monotonic() + 30
    while event.queries < 3 and time.monotonic() < deadline:
        prod.wait(0.05)
    assert event.queries >= 3, "the I/O thread does not poll the event"
    assert not any(region[5 * tb:7 * tb].any() for region in dst), \
        "the finished prefill was written before its range was final"
    assert not [e for e in cons.poll() if isinstance(e, TransferReady)]
    event.done.set()
    assert _until_ready(cons, deadline)
    for region in range(len(src)):
        assert np.array_equal(dst[region][5 * tb:7 * tb], src[region][tb:3 * tb])
