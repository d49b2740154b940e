"""The producer's background writer thread.

The I/O thread hands it one :class:`WriteJob` per ``IssueWrite`` (a queue put:
microseconds). The writer turns the plan's compact runs into NIXL's Nx3
descriptor arrays, posts the WRITE with the job's notification, polls the
request until it finishes, and reports a :class:`WriteResult` through a
callback -- the I/O thread then tells the protocol (``write_completed``).

A packed write (rule 10, ``WriteJob.packed``) is gathered here first, from the
KV regions into this rank's staging (:mod:`.staging`), then written
as one descriptor per wire chunk into the consumer's staging. A pipelined one
(``PackedWrite.bounds`` of several chunks) is gathered and posted chunk by
chunk, each with its own notification (``IssueWrite.chunk_notify``), so the
consumer scatters early chunks while later ones are gathered and sent.

Failures, time-outs, cancellation and polling are the shared
:class:`~.poster.Poster`'s: a write that fails to prepare, post or
complete becomes ``WriteResult(ok=False)`` with the NIXL status named.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pushkv.integrity import Tag, seal, unseal
from pushkv.protocol.errors import ConfigError
from pushkv.protocol.events import PackedWrite, Peer, notify_chunk
from pushkv.protocol.messages import Notify, decode, encode
from pushkv.protocol.planner import TransferPlan

from .agent import Agent
from .memory import KVMemory, MemKind
from .poster import Poster, PostResult

if TYPE_CHECKING:
    from .staging import StagingMemory

log = logging.getLogger(__name__)

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
    tag: Tag | None = None  #: rule 11: the digest every chunk's notification is sealed with


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
        if pw.chunks > 1:
            return self._pipelined(job, pw, staging)
        staging.gather(pw.packed, pw.src_offset)
        local, remote = staging.descriptors(pw, job.remote_staging, job.remote_device)
        return self._agent.prepare_write(local, remote, job.remote_agent, job.notif,
                                         job.remote_kind)

    def _pipelined(self, job: WriteJob, pw: PackedWrite, staging: StagingMemory) -> Any:
        """A pipelined packed write: chunk by chunk, gather it into staging and post it
        with its own notification (the consumer scatters it as soon as it lands), then
        go on to the next while it is on the wire. The last chunk's request is returned
        (the poster posts and polls it) only once every earlier one completed, so the
        write's completion still means all of it landed; on any failure every earlier
        request is finished or cancelled first, so nothing of the write lands after its
        failure is reported (and its staging goes back)."""
        first = decode(unseal(job.notif)[0])
        assert isinstance(first, Notify)
        live: list[Any] = []
        last = None
        try:
            for k in range(pw.chunks):
                a, b = pw.span(k)
                staging.gather(pw.packed, pw.src_offset, a, b)
                local, remote = staging.chunk_descriptors(
                    pw, pw.packed.wire_between(a, b), job.remote_staging, job.remote_device)
                notif = job.notif if k == 0 else encode(notify_chunk(first, k))
                if k and job.tag is not None:
                    notif = seal(notif, job.tag)
                h = self._agent.prepare_write(local, remote, job.remote_agent, notif,
                                              job.remote_kind)
                if k == pw.chunks - 1:
                    last = h
                    break
                live.append(h)
                if self._agent.post(h) not in ("DONE", "PROC"):
                    raise RuntimeError(f"chunk {k} of the packed write ended ERR on post")
                live = self._reap(live, wait=False)
            self._reap(live, wait=True)
            live = []
            return last
        except BaseException:
            for h in live:
                self._finish(h)
            if last is not None:
                self._release(last)
            raise

    def _reap(self, live: list[Any], *, wait: bool) -> list[Any]:
        """Release the chunk requests that completed; with ``wait``, until all did
        (within the write time-out). Raises on a failed or timed-out one."""
        end = time.monotonic() + self._timeout_s
        while True:
            keep = []
            for h in live:
                state = self._agent.state(h)
                if state == "PROC":
                    keep.append(h)
                    continue
                if state != "DONE":
                    raise RuntimeError("a chunk of the packed write ended ERR")
                self._release(h)
            if not wait or not keep:
                return keep
            live = keep
            if time.monotonic() > end:
                raise TimeoutError("a chunk of the packed write timed out")
            time.sleep(self._poll_s)

    def _finish(self, h: Any) -> None:
        """End one chunk request of a failed write: cancelled, or waited for."""
        end = time.monotonic() + self._timeout_s
        while not self._release(h):
            try:
                if self._agent.state(h) != "PROC" or time.monotonic() > end:
                    log.warning("a chunk of a failed packed write could not be cancelled")
                    return
            except Exception:
                return
            time.sleep(self._poll_s)

    def _result(self, job: Any, ok: bool, error: str, **kw: Any) -> PostResult:
        r = super()._result(job, ok, error, **kw)
        pw = getattr(job, "packed", None)
        return r if pw is None else replace(r, descriptors=pw.packed.wire_descriptors)
