"""What the writer and the reader threads share: one NIXL request poster.

A :class:`Poster` owns a thread that takes jobs from a queue, prepares and
posts each one as a NIXL request (the subclass says how: a WRITE with its
notification, or a READ), polls the requests in flight, and reports one
:class:`PostResult` per job through a callback. No NIXL error escapes the
thread: a failure to prepare, post or complete becomes ``ok=False`` with the
NIXL status named. A request still running after ``timeout_s`` is cancelled by
releasing it; only a release NIXL accepts counts as the fence, otherwise the
poster keeps waiting (the bytes of a request that cannot be cancelled may
still land).

While requests are in flight the thread sleeps ``poll_s`` between checks (a
queue wait, so a new job wakes it at once); with nothing in flight it blocks
on the queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pushkv import timeline
from pushkv.protocol.events import Peer
from pushkv.protocol.planner import TransferPlan

from .agent import Agent, is_disconnect, nixl_status
from .memory import KVMemory, bind_device

log = logging.getLogger(__name__)


class Job(Protocol):
    """What a poster needs of a job: who it is for and its plan."""

    transfer_id: str
    attempt: int
    peer: Peer
    plan: TransferPlan
    incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PostResult:
    """How one posted request ended."""

    transfer_id: str
    attempt: int
    peer: Peer
    ok: bool
    incarnation: int = 0
    error: str = ""
    disconnected: bool = False
    nbytes: int = 0
    descriptors: int = 0
    prepare_s: float = 0.0  #: descriptor preparation (arrays + NIXL request)
    total_s: float = 0.0  #: from the start of preparation to completion


@dataclass(slots=True)
class _InFlight:
    job: Any
    handle: Any
    started: float
    prepare_s: float
    cancel_tried: bool = False


_STOP = object()


class Poster:
    """Posts one kind of NIXL request for one rank on a thread of its own."""

    #: ``"write"`` or ``"read"``: names the thread's work in logs and errors.
    kind = "request"
    #: Timeline marks (:mod:`pushkv.timeline`, while recording) of each job: the thread
    #: took it, posted it, saw it end (``<prefix>_took``, ``_posted``, ``_done``); empty:
    #: none.
    marks = ""

    def __init__(self, agent: Agent, memory: KVMemory, *, poll_s: float, timeout_s: float,
                 on_done: Callable[[PostResult], None], name: str) -> None:
        self._agent = agent
        self._memory = memory
        self._bases = memory.base_array()
        self._device = memory.device
        self._poll_s = poll_s
        self._timeout_s = timeout_s
        self._on_done = on_done
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stop_by = float("inf")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ any thread

    def submit(self, job: Job) -> None:
        self._queue.put(job)

    def stop(self, timeout_s: float) -> None:
        """Finish the requests in flight (cancel them after ``timeout_s``), then end."""
        self._queue.put((_STOP, time.monotonic() + timeout_s))
        self._thread.join(timeout_s + 5.0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ------------------------------------------------------ the subclass's part

    def _prepare(self, job: Any) -> Any | None:
        """Make the NIXL request for ``job`` (not posted yet), or None when there is
        nothing to post (the job is then done)."""
        raise NotImplementedError

    # ---------------------------------------------------------- the thread

    def _run(self) -> None:
        try:
            bind_device(self._memory)
        except Exception:
            log.exception("cannot make the CUDA device current on the %s thread", self.kind)
        inflight: list[_InFlight] = []
        stopping = False
        while True:
            try:
                item = self._queue.get(timeout=self._poll_s if inflight or stopping else None)
            except queue.Empty:
                item = None
            while item is not None:
                if isinstance(item, tuple) and item and item[0] is _STOP:
                    stopping, self._stop_by = True, item[1]
                elif stopping:  # too late: fail it without posting
                    self._report(self._result(item, False, f"{self.kind} thread stopped"))
                else:
                    started = self._start(item)
                    if started is not None:
                        inflight.append(started)
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            if inflight:
                inflight = self._check(inflight, force=stopping and
                                       time.monotonic() > self._stop_by)
            if stopping and not inflight:
                return

    def _mark(self, job: Any, what: str) -> None:
        if self.marks and timeline.enabled():
            timeline.mark(job.transfer_id, f"{self.marks}_{what}")

    def _start(self, job: Any) -> _InFlight | None:
        self._mark(job, "took")
        t0 = time.perf_counter()
        handle = None
        try:
            handle = self._prepare(job)
            if handle is None:
                self._report(self._result(job, True, "", t0=t0))
                return None
            prepared = time.perf_counter() - t0
            state = self._agent.post(handle)
        except Exception as exc:
            if handle is not None:
                self._release(handle)
            self._report(self._result(job, False, nixl_status(exc), t0=t0,
                                      disconnected=is_disconnect(exc)))
            return None
        self._mark(job, "posted")
        if state == "DONE":
            self._mark(job, "done")
            self._release(handle)
            self._report(self._result(job, True, "", t0=t0, prepare_s=prepared))
            return None
        if state == "PROC":
            return _InFlight(job, handle, t0, prepared)
        self._release(handle)
        self._report(self._result(job, False, "ERR on post", t0=t0, prepare_s=prepared))
        return None

    def _check(self, inflight: list[_InFlight], *, force: bool) -> list[_InFlight]:
        keep: list[_InFlight] = []
        now = time.perf_counter()
        for r in inflight:
            try:
                state = self._agent.state(r.handle)
            except Exception as exc:
                self._release(r.handle)
                self._report(self._result(r.job, False, nixl_status(exc), t0=r.started,
                                          prepare_s=r.prepare_s,
                                          disconnected=is_disconnect(exc)))
                continue
            if state == "DONE":
                self._mark(r.job, "done")
                self._release(r.handle)
                self._report(self._result(r.job, True, "", t0=r.started, prepare_s=r.prepare_s))
            elif state != "PROC":
                self._release(r.handle)
                self._report(self._result(r.job, False, "ERR", t0=r.started,
                                          prepare_s=r.prepare_s))
            elif force or now - r.started > self._timeout_s:
                if self._release(r.handle):  # cancelled: nothing more will land
                    why = "cancelled at shutdown" if force else "timed out"
                    self._report(self._result(r.job, False, why, t0=r.started,
                                              prepare_s=r.prepare_s))
                else:
                    if not r.cancel_tried:
                        log.warning("%s of %s#%d cannot be cancelled; still waiting", self.kind,
                                    r.job.transfer_id, r.job.attempt)
                    r.cancel_tried = True
                    keep.append(r)
            else:
                keep.append(r)
        return keep

    def _release(self, handle: Any) -> bool:
        try:
            self._agent.release(handle)
        except Exception as exc:
            log.debug("release of a NIXL request failed: %s", nixl_status(exc))
            return False
        return True

    def _result(self, job: Job, ok: bool, error: str, *, t0: float | None = None,
                prepare_s: float = 0.0, disconnected: bool = False) -> PostResult:
        return PostResult(
            transfer_id=job.transfer_id, attempt=job.attempt, peer=job.peer, ok=ok,
            incarnation=job.incarnation, error=error,
            disconnected=disconnected, nbytes=job.plan.nbytes if ok else 0,
            descriptors=job.plan.descriptor_count, prepare_s=prepare_s,
            total_s=time.perf_counter() - t0 if t0 is not None else 0.0,
        )

    def _report(self, result: PostResult) -> None:
        try:
            self._on_done(result)
        except Exception:  # pragma: no cover - the callback only queues
            log.exception("%s completion callback failed", self.kind)
