"""The fabric: each node's NICs, shared fairly by concurrent transfers (or FIFO).

A transfer takes the prefill node's egress and the decode node's ingress. KV
always flows from prefill to decode, whether the decode side reads (pull) or
the prefill side writes (push). The rank the simulator drives stands for all
of its engine's ranks, which move their slices at the same time over their
own GPU's rails; a rank's share of its node is
:func:`~pushkv.sim.costs.transfer_s`.

**Sharing** (``network.sharing``). ``"fair"``: transfers posted by
different threads (different NIXL agents, so different queue pairs) share the
links equally -- processor sharing: each flow progresses at ``1 / n`` of its
full rate, ``n`` being the number of active flows on the busier of its two
links, and every arrival or departure re-divides the links (a p5en rail is
shared by the flows on it). Transfers posted by *one* thread go out through
the same endpoints, whose send queues the NIC serves in order, so among them
only the oldest is on the wire: one poster's transfers are first come first
served, several posters share fairly (two prefill instances writing into one
decode node, pull-async's reader beside another engine's writer). ``"fifo"``:
one transfer at a time per NIC, first come first served (egress, then
ingress, so two transfers never wait on each other in a cycle); total
throughput is the same, finish times inside a burst are not.

**Posting and the wire overlap.** NIXL's LIBFABRIC backend hands each
descriptor to the NIC as it posts it (one ``fi_read`` / ``fi_writedata`` and
its doorbell per descriptor, ``libfabric_backend.cpp`` ``postXfer``), so data
moves while the rest is still being posted. A transfer is therefore started
when its posting starts, and it is done when the wire has moved everything
and the last descriptor is posted (plus one wire latency), whichever is later
(:func:`~pushkv.sim.costs.pipelined_s` alone on the wire).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import simpy

from .costs import pipelined_s, transfer_s
from .sections import NetworkProfile


@dataclass(eq=False)
class _Flow:
    links: tuple[str, str]
    queue: str  #: the posting thread: its flows are served in order
    work: float  #: seconds left at the full rate
    done: simpy.Event
    rate: float = 0.0


class _FairLinks:
    """Processor sharing of named links among the oldest flow of each queue; each such
    flow runs at the share of its busiest link."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.flows: list[_Flow] = []
        self._last = 0.0
        self._gen = 0

    def add(self, links: tuple[str, str], queue: str, work: float) -> simpy.Event:
        self._advance()
        flow = _Flow(links, queue, work, self.env.event())
        self.flows.append(flow)
        self._reshare()
        return flow.done

    def _advance(self) -> None:
        dt = self.env.now - self._last
        self._last = self.env.now
        if dt > 0:
            for f in self.flows:
                f.work -= dt * f.rate

    def _reshare(self) -> None:
        heads: dict[str, _Flow] = {}
        for f in self.flows:
            f.rate = 0.0
            heads.setdefault(f.queue, f)
        load: dict[str, int] = {}
        for f in heads.values():
            for link in f.links:
                load[link] = load.get(link, 0) + 1
        for f in heads.values():
            f.rate = 1.0 / max(load[link] for link in f.links)
        self._gen += 1
        if heads:
            gen = self._gen
            nxt = min(max(0.0, f.work) / f.rate for f in heads.values())
            self.env.timeout(nxt).callbacks.append(lambda _: self._tick(gen))

    def _tick(self, gen: int) -> None:
        if gen != self._gen:
            return  # superseded by a later arrival or departure
        self._advance()
        finished = [f for f in self.flows if f.rate > 0 and f.work <= 1e-12]
        self.flows = [f for f in self.flows if not (f.rate > 0 and f.work <= 1e-12)]
        for f in finished:
            f.done.succeed()
        self._reshare()


class Network:
    """NIC links of every engine, and byte counters."""

    def __init__(self, env: simpy.Environment, profile: NetworkProfile) -> None:
        self.env = env
        self.profile = profile
        self.fair = profile.sharing == "fair"
        self._links = _FairLinks(env)
        self._egress: dict[str, simpy.Resource] = {}
        self._ingress: dict[str, simpy.Resource] = {}
        self.bytes_moved = 0
        self.transfers = 0
        self.busy_s = 0.0  #: full-rate seconds of wire work

    def add_node(self, engine_id: str) -> None:
        self._egress[engine_id] = simpy.Resource(self.env, capacity=1)
        self._ingress[engine_id] = simpy.Resource(self.env, capacity=1)

    def transfer(
        self, src: str, dst: str, nbytes: int, descriptors: int, *, read: bool,
        posted_at: float | None = None, poster: str = "",
    ) -> Generator[Any, Any, float]:
        """SimPy sub-process: move one rank's slice from ``src`` to ``dst``.

        Started when posting starts; ``posted_at`` is when the last descriptor
        is posted (``None``: already); ``poster`` names the posting thread (its
        transfers are served in order). Returns the seconds from start to end.
        """
        start = self.env.now
        if self.fair:
            lat = self.profile.wire_latency_s
            work = transfer_s(self.profile, nbytes, descriptors, read=read) - lat
            if work > 0:
                queue = poster or f"{src}->{dst}"
                yield self._links.add((f"out:{src}", f"in:{dst}"), queue, work)
            end = max(self.env.now, posted_at if posted_at is not None else 0.0) + lat
            yield self.env.timeout(end - self.env.now)
            self.busy_s += work
        else:
            with self._egress[src].request() as out:
                yield out
                with self._ingress[dst].request() as inp:  # only after egress: no cycles
                    yield inp
                    left = 0.0 if posted_at is None else max(0.0, posted_at - self.env.now)
                    duration = pipelined_s(self.profile, nbytes, descriptors, read=read,
                                           posting_left_s=left)
                    yield self.env.timeout(duration)
            self.busy_s += duration
        self.bytes_moved += nbytes
        self.transfers += 1
        return self.env.now - start
