"""Fixtures shared by the NIXL transport tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pushkv.transports.nixl.testing import HostPool


@pytest.fixture(scope="module")
def pool() -> Iterator[HostPool]:
    """One producer host and one consumer host per test module (see HostPool)."""
    p = HostPool()
    try:
        yield p
    finally:
        p.close()
