"""The ports the tests and benchmarks give servers they start later.

A port the kernel picks for a bind to port 0 is an ephemeral one: between the
pick and the server's bind any outgoing connection may take it. A vLLM decode
server told such a side-channel port once found it taken ('Address already in
use' in its NIXL handshake listener) and never became healthy, which cost a
benchmark run 600 s and a point. ``free_port`` picks below the ephemeral range,
where the kernel binds nothing implicitly.
"""

from __future__ import annotations

import socket

import pytest

from pushkv.vllm import testing
from pushkv.vllm.testing import ephemeral_ports, free_port


def test_ports_lie_below_the_ephemeral_range_bind_and_never_repeat() -> None:
    lo, hi = ephemeral_ports()
    assert 0 < lo <= hi
    got = [free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(p < lo for p in got)
    with socket.socket() as s:  # the last one is still free
        s.bind(("127.0.0.1", got[-1]))


def test_an_outgoing_connection_never_takes_a_handed_out_port() -> None:
    """Outgoing connections take their local ports from the ephemeral range, so none of
    them can be a port ``free_port`` handed out."""
    handed = {free_port() for _ in range(50)}
    lo, hi = ephemeral_ports()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        clients = [socket.create_connection(listener.getsockname()) for _ in range(50)]
        try:
            local = {c.getsockname()[1] for c in clients}
        finally:
            for c in clients:
                c.close()
    assert all(lo <= p <= hi for p in local)
    assert not local & handed


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(testing, "ephemeral_ports", lambda: (1024, 65535))
    got = [free_port() for _ in range(20)]
    assert len(set(got)) == len(got)
    assert all(p >= 1024 for p in got)
