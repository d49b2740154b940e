"""The fabric: each node's NICs move one transfer at a time, first come first served.

A transfer takes the prefill node's egress and the decode node's ingress (in
that order, so two transfers can never wait on each other in a cycle). KV
always flows from prefill to decode, whether the decode side reads (pull) or
the prefill side writes (push). One transfer at a time per NIC is a
simplification of bandwidth sharing: the total throughput and the order of
completions are the same as with fair sharing, only the individual finish
times inside a burst differ.

**Posting and the wire overlap.** NIXL's LIBFABRIC backend hands each
descriptor to the NIC as it posts it (one ``fi_read`` / ``fi_writedata`` and
its doorbell per descriptor, ``libfabric_backend.cpp`` ``postXfer``), so data
moves while the rest is still being posted. A transfer is therefore started
when its posting starts; it holds the NICs for
:func:`~pushkv.sim.costs.pipelined_s` seconds -- the wire time, or the rest of
the posting if that is longer -- and is done when both are.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from .costs import pipelined_s
from .profile import NetworkProfile


class Network:
    """NIC queues of every engine, and byte counters."""

    def __init__(self, env: simpy.Environment, profile: NetworkProfile) -> None:
        self.env = env
        self.profile = profile
        self._egress: dict[str, simpy.Resource] = {}
        self._ingress: dict[str, simpy.Resource] = {}
        self.bytes_moved = 0
        self.transfers = 0
        self.busy_s = 0.0

    def add_node(self, engine_id: str) -> None:
        self._egress[engine_id] = simpy.Resource(self.env, capacity=1)
        self._ingress[engine_id] = simpy.Resource(self.env, capacity=1)

    def transfer(
        self, src: str, dst: str, nbytes: int, descriptors: int, *, read: bool,
        posted_at: float | None = None,
    ) -> Generator[Any, Any, float]:
        """SimPy sub-process: move one rank's slice from ``src`` to ``dst``.

        Started when posting starts; ``posted_at`` is when the last descriptor
        is posted (``None``: already). Returns the seconds the NICs were held
        (without the wait for them).
        """
        with self._egress[src].request() as out:
            yield out
            with self._ingress[dst].request() as inp:  # only after egress: no cycles
                yield inp
                left = 0.0 if posted_at is None else max(0.0, posted_at - self.env.now)
                duration = pipelined_s(self.profile, nbytes, descriptors, read=read,
                                       posting_left_s=left)
                yield self.env.timeout(duration)
        self.bytes_moved += nbytes
        self.transfers += 1
        self.busy_s += duration
        return duration
