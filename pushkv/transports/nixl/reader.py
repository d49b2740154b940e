"""The consumer's background reader thread (pull).

In pull mode the consumer copies the producer's published blocks itself. The
I/O thread hands the reader one :class:`ReadJob` per ``IssueRead`` (a queue
put); the reader turns the plan's runs into NIXL's Nx3 descriptor arrays,
posts the READ, polls it until it finishes and reports a :class:`ReadResult`
through a callback -- the I/O thread then tells the protocol
(``read_completed``), which sends ``ReadDone`` to the producer. Neither the
engine thread nor the I/O thread ever builds a descriptor or posts a read.

No NIXL error escapes the thread: a failure to prepare, post or complete a
read (peer gone, descriptors outside the peer's registration, backend error)
becomes ``ReadResult(ok=False)`` with the NIXL status named. A read still
running after ``timeout_s`` is cancelled by releasing its request; only a
release NIXL accepts ends it, otherwise the reader keeps waiting (the bytes of
a read that cannot be cancelled may still land, so its blocks stay lent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pushkv.protocol.events import Peer
from pushkv.protocol.planner import TransferPlan

from .agent import Agent
from .memory import KVMemory, MemKind
from .poster import Poster, PostResult

#: How one READ ended.
ReadResult = PostResult


@dataclass(slots=True, kw_only=True)
class ReadJob:
    """One READ to post: the plan (source = the peer's blocks) and where they are."""

    transfer_id: str
    attempt: int
    peer: Peer
    plan: TransferPlan
    incarnation: int
    remote_agent: str
    remote_bases: np.ndarray
    remote_kind: MemKind
    remote_device: int


class Reader(Poster):
    """Posts READs for one consumer rank on a thread of its own."""

    kind = "read"
    marks = "reader"  #: reader_took, reader_posted, reader_done (timeline)

    def __init__(self, agent: Agent, memory: KVMemory, *, poll_s: float, timeout_s: float,
                 on_done: Callable[[ReadResult], None], name: str = "pushkv-reader") -> None:
        super().__init__(agent, memory, poll_s=poll_s, timeout_s=timeout_s, on_done=on_done,
                         name=name)

    def _prepare(self, job: ReadJob) -> Any | None:
        plan = job.plan
        if plan.descriptor_count == 0:  # nothing to copy
            return None
        # The plan's source is the peer (producer), its destination is us.
        remote, local = plan.descriptors(job.remote_bases, self._bases, job.remote_device,
                                         self._device)
        return self._agent.prepare_read(local, remote, job.remote_agent, job.remote_kind)
