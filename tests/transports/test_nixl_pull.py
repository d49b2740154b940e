"""Pull over the NIXL runtime, across two processes: the consumer's reader thread
reads the producer's published blocks (the pull checks of the conformance suite,
faults included)."""

from __future__ import annotations

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.transports import conformance
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("name", list(conformance.PULL_CHECKS))
def test_pull_conformance(pool: HostPool, name: str) -> None:
    fn, kwargs = conformance.PULL_CHECKS[name]
    fn(lambda topo: NixlCluster(topo, pool), **kwargs)
