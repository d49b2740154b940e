"""The producer's background writer thread.

The I/O thread hands it one :class:`WriteJob` per ``IssueWrite`` (a queue put:
microseconds). The writer turns the plan's compact runs into NIXL's Nx3
descriptor arrays, posts the WRITE with the job's notification, polls the
request until it finishes, and reports a :class:`WriteResult` through a
callback -- the I/O thread then tells the protocol (``write_completed``).

A packed write (rule 10, ``WriteJob.packed``) is gathered here first, from the
KV regions into this rank's staging (:mod:`.runtime_staging`), then written
as one descriptor per wire chunk into the consumer's staging.

Failures, time-outs, cancellation and polling are the shared
:class:`~.nixl_poster.Poster`'s: a write that fails to prepare, post or
complete becomes ``WriteResult(ok=False)`` with the NIXL status named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..protocol.errors import ConfigError
from ..protocol.events import PackedWrite, Peer
from ..protocol.planner import TransferPlan
from .nixl_agent import Agent
from .nixl_memory import KVMemory, MemKind
from .nixl_poster import Poster, PostResult

if TYPE_CHECKING:
    from .runtime_staging import StagingMemory

#: How one WRITE ended.
WriteResult = PostResult


@dataclass(slots=True, kw_only=True)
class WriteJob:
    """One WRITE to post: the plan and where the peer's regions are."""

    transfer_id: str
    attempt: int
    peer: Peer
    plan: TransferPlan
    incarnation: int
    notif: bytes  #: the encoded Notify the consumer receives with the bytes
    remote_agent: str
    remote_bases: np.ndarray
    remote_kind: MemKind
    remote_device: int
    packed: PackedWrite | None = None  #: rule 10: gather, then write into remote staging
    remote_staging: int = 0  #: the peer's staging base address (0: it has none)


class Writer(Poster):
    """Posts WRITEs for one producer rank on a thread of its own."""

    kind = "write"

    def __init__(self, agent: Agent, memory: KVMemory, *, poll_s: float, timeout_s: float,
                 on_done: Callable[[WriteResult], None], name: str = "pushkv-writer",
                 staging: StagingMemory | None = None) -> None:
        self._staging = staging
        super().__init__(agent, memory, poll_s=poll_s, timeout_s=timeout_s, on_done=on_done,
                         name=name)

    def _prepare(self, job: WriteJob) -> Any | None:
        if job.packed is not None:
            return self._prepare_packed(job, job.packed)
        plan = job.plan
        if plan.descriptor_count == 0:  # nothing to copy: the notification alone
            self._agent.notify(job.remote_agent, job.notif)
            return None
        local, remote = plan.descriptors(self._bases, job.remote_bases, self._device,
                                         job.remote_device)
        return self._agent.prepare_write(local, remote, job.remote_agent, job.notif,
                                         job.remote_kind)

    def _prepare_packed(self, job: WriteJob, pw: PackedWrite) -> Any:
        staging = self._staging
        if staging is None or not job.remote_staging:
            raise ConfigError("a packed write needs staging memory on both ranks")
        staging.gather(pw.packed, pw.src_offset)
        local, remote = staging.descriptors(pw, job.remote_staging, job.remote_device)
        return self._agent.prepare_write(local, remote, job.remote_agent, job.notif,
                                         job.remote_kind)

    def _result(self, job: Any, ok: bool, error: str, **kw: Any) -> PostResult:
        r = super()._result(job, ok, error, **kw)
        pw = getattr(job, "packed", None)
        return r if pw is None else replace(r, descriptors=pw.packed.wire_descriptors)
