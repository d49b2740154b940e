"""The NIXL transport against the conformance suite, across two processes.

Producer and consumer engines run in separate spawned processes with real
NIXL agents (UCX, host memory). Every check of ``pushkv.transports.conformance``
is one test; bytes that land are compared with the source.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl._api", reason="the nixl package is not installed (pip install nixl)")
pytest.importorskip("zmq", reason="pyzmq is not installed")

from pushkv.transports import conformance
from pushkv.transports.nixl.testing import HostPool, NixlCluster

pytestmark = pytest.mark.nixl


@pytest.mark.parametrize("name", list(conformance.CHECKS))
def test_conformance(pool: HostPool, name: str) -> None:
    fn, kwargs = conformance.CHECKS[name]
    fn(lambda topo: NixlCluster(topo, pool), **kwargs)
