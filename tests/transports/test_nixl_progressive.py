"""Progressive push over NIXL across two processes: ranges posted as they are
reported, one write in flight per leg, READY only once every part notified."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.transports.nixl_testing import HostPool, NixlCluster
from pushkv.transports.testing_progressive import PROGRESSIVE_CHECKS

pytestmark = pytest.mark.nixl

#: A few of the in-memory checks: the transport adds nothing rule-specific, so
#: one of each kind (streamed writes, faults mid-stream) covers it.
NIXL_CHECKS = ("layers_register_between", "layers_tp2-1", "cancel_between_ranges",
               "aborted_with_a_part_in_flight")


@pytest.fixture(scope="module")
def pool() -> Iterator[HostPool]:
    p = HostPool()
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("name", NIXL_CHECKS)
def test_progressive_conformance(pool: HostPool, name: str) -> None:
    fn, kwargs = PROGRESSIVE_CHECKS[name]
    fn(lambda topo: NixlCluster(topo, pool), **kwargs)
