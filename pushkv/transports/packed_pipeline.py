"""Pipelined packed writes: gather, wire and scatter of one write overlap, chunk by chunk.

A packed write (:mod:`pushkv.transports.staging`) done in one go costs
gather + wire + scatter one after the other. Cut its staging image into chunks
(:func:`~pushkv.transports.staging.chunk_bounds`) and the three stages overlap:
the producer gathers chunk ``k + 1`` while chunk ``k`` is on the wire, and the
consumer scatters chunk ``k`` as soon as its notification arrives, while the
producer is still on later chunks. The two sides run on different cores (or a
CPU and a GPU), so a write then takes about its slowest stage plus one chunk of
each of the others.

Where chunk ``k`` is staged (the same offset on both sides):

* **image** (``slots=None``): at its own offset of the staging image, as an
  unpipelined packed write stages it (a :class:`StagingPool` range of
  ``packed.nbytes`` on each side); no flow control.
* **ring** (``slots=S``): in slot ``k % S`` of ``S`` chunk-sized slots. The
  consumer tells the producer when it has scattered a chunk (an ``ack``
  notification), and the producer reuses a slot only after its ack. A ring of a
  few MiB stays in the CPU's cache: the gather writes it there, the wire reads it
  from there, and the consumer's scatter reads its own ring from there, so the
  write costs about one pass over memory instead of three.

Notifications carry ``tag + b"/" + k`` (data) and ``tag + b"/ack/" + k`` (acks).
On host memory UCX moves the bytes inside the producer's ``transfer()`` (CMA:
the initiator's core copies), so there the producer's core pays gather + wire
and only the scatter runs beside it; on RDMA or device memory the NIC or the
copy engine moves them and all three stages overlap.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..protocol.errors import ConfigError
from ..protocol.packing import PackedPlan
from .staging import chunk_bounds, gather_host, scatter_host


class PipelineTimeout(Exception):
    """A chunk, an ack or a write's completion did not come in time."""


class PipelinePlan:
    """The chunk schedule of one pipelined packed write (both sides build the same)."""

    __slots__ = ("bounds", "packed", "slot_bytes", "slots")

    def __init__(self, packed: PackedPlan, chunk_bytes: int, slots: int | None = None) -> None:
        if slots is not None and slots < 1:
            raise ConfigError(f"a ring needs at least one slot, got {slots}")
        self.packed = packed
        self.bounds = chunk_bounds(packed, chunk_bytes)
        self.slots = slots
        self.slot_bytes = max((b - a for a, b in itertools.pairwise(self.bounds)), default=0)

    @property
    def chunks(self) -> int:
        return len(self.bounds) - 1

    @property
    def staging_bytes(self) -> int:
        """Staging each side needs: the image, or the ring."""
        if self.slots is None:
            return self.packed.nbytes
        return min(self.slots, self.chunks) * self.slot_bytes

    def span(self, k: int) -> tuple[int, int]:
        """Staging image bytes ``[start, stop)`` of chunk ``k``."""
        return self.bounds[k], self.bounds[k + 1]

    def offset(self, k: int) -> int:
        """Where chunk ``k`` is staged, relative to the staging range, on both sides."""
        return self.bounds[k] if self.slots is None else (k % self.slots) * self.slot_bytes


def _tag_k(tag: bytes, k: int) -> bytes:
    return tag + b"/" + str(k).encode()


def _ack_k(tag: bytes, k: int) -> bytes:
    return tag + b"/ack/" + str(k).encode()


def _parse(tag: bytes, message: bytes, ack: bool) -> int | None:
    prefix = tag + (b"/ack/" if ack else b"/")
    if not message.startswith(prefix):
        return None
    rest = message[len(prefix):]
    return int(rest) if rest.isdigit() else None


@dataclass
class StageTimes:
    """Seconds one side spent per stage of one write (thread time of its loop)."""

    gather_s: float = 0.0
    post_s: float = 0.0  # prepare + transfer(): on host memory UCX copies in here
    wait_s: float = 0.0  # waiting for acks, chunks or completions
    scatter_s: float = 0.0
    total_s: float = 0.0
    chunks: int = 0
    done_at_post: int = 0  # writes transfer() returned DONE for (copied synchronously)
    cpu_s: float = 0.0  # the process's CPU time over the write, all threads
    extra: dict[str, float] = field(default_factory=dict)


class Notifications:
    """Notifications of one agent, drained into a buffer so that several readers
    (this write's chunks, its acks, anything else) each take only theirs."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.pending: list[bytes] = []

    def take(self, tag: bytes, *, ack: bool) -> list[int]:
        self.pending.extend(m for _, m in self.agent.notifications())
        got, keep = [], []
        for m in self.pending:
            k = _parse(tag, m, ack)
            (keep if k is None else got).append(m if k is None else k)
        self.pending = keep
        return got


class PackedSender:
    """The producer side: gathers chunks into its staging, writes each into the
    consumer's staging with a notification, reuses ring slots on acks."""

    def __init__(self, agent: Any, staging: np.ndarray, local_base: int, remote_base: int,
                 peer: str, *, remote_kind: str = "DRAM", poll_s: float = 0.0,
                 timeout_s: float = 60.0) -> None:
        self.agent = agent
        self.staging = staging.reshape(-1)
        self.local_base = local_base
        self.remote_base = remote_base
        self.peer = peer
        self.remote_kind = remote_kind
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.inbox = Notifications(agent)
        # one prepared request per staged (offset, length), posted again for every chunk
        # staged there: a ring's slots, or an image's chunks of a repeated size
        self._handles: dict[tuple[int, int], Any] = {}
        self._live: dict[tuple[int, int], Any] = {}

    def close(self) -> None:
        """Release the prepared requests (after the last write completed)."""
        for h in self._handles.values():
            self.agent.release(h)
        self._handles.clear()
        self._live.clear()

    def _handle(self, off: int, n: int) -> Any:
        key = (off, n)
        h = self._handles.get(key)
        if h is None:
            if len(self._handles) >= 4096:  # many sizes: drop the idle ones
                self._reap_all()
                self.close()
            local = np.array([[self.local_base + off, n, 0]], np.int64)
            remote = np.array([[self.remote_base + off, n, 0]], np.int64)
            h = self._handles[key] = self.agent.prepare_write(
                local, remote, self.peer, b"", self.remote_kind)
        return h

    def _reap_all(self, end: float | None = None) -> None:
        while self._live:
            self._reap()
            if end is not None:
                self._check(end, "the last writes' completion")

    def _reap(self) -> None:
        for key, h in list(self._live.items()):
            state = self.agent.state(h)
            if state == "PROC":
                continue
            del self._live[key]
            if state != "DONE":
                raise RuntimeError(f"packed chunk write at staging {key} ended {state}")

    def send(self, pipe: PipelinePlan, src: Sequence[np.ndarray], tag: bytes) -> StageTimes:
        if pipe.staging_bytes > self.staging.size:
            raise ConfigError(f"the write needs {pipe.staging_bytes} staging bytes, "
                              f"{self.staging.size} registered")
        times = StageTimes(chunks=pipe.chunks)
        t_start, cpu0 = time.perf_counter(), time.process_time()
        end = time.monotonic() + self.timeout_s
        acked: set[int] = set()
        for k in range(pipe.chunks):
            a, b = pipe.span(k)
            off = pipe.offset(k)
            t0 = time.perf_counter()
            if pipe.slots is not None and k >= pipe.slots:
                while k - pipe.slots not in acked:  # the slot's previous chunk is scattered
                    self._reap()
                    acked.update(self.inbox.take(tag, ack=True))
                    self._check(end, f"ack of chunk {k - pipe.slots}")
                    if self.poll_s:
                        time.sleep(self.poll_s)
            while (off, b - a) in self._live:  # its request is posted again below
                self._reap()
                self._check(end, f"completion of the write before chunk {k}")
            t1 = time.perf_counter()
            gather_host(pipe.packed, src, self.staging[off:off + b - a], a, b)
            t2 = time.perf_counter()
            handle = self._handle(off, b - a)
            state = self.agent.post(handle, _tag_k(tag, k))
            t3 = time.perf_counter()
            times.wait_s += t1 - t0
            times.gather_s += t2 - t1
            times.post_s += t3 - t2
            if state == "DONE":
                times.done_at_post += 1
            elif state == "PROC":
                self._live[(off, b - a)] = handle
            else:
                raise RuntimeError(f"packed chunk {k} of {tag!r} ended {state}")
            self._reap()
        t0 = time.perf_counter()
        self._reap_all(end)
        times.wait_s += time.perf_counter() - t0
        times.total_s = time.perf_counter() - t_start
        times.cpu_s = time.process_time() - cpu0
        return times

    def _check(self, end: float, what: str) -> None:
        if time.monotonic() > end:
            raise PipelineTimeout(f"no {what} within {self.timeout_s} s")


class PackedReceiver:
    """The consumer side: scatters each chunk out of its staging as its notification
    arrives (in any order), and acks it to the producer when the write uses a ring."""

    def __init__(self, agent: Any, staging: np.ndarray, peer: str | None = None, *,
                 poll_s: float = 0.0002, timeout_s: float = 60.0) -> None:
        self.agent = agent
        self.staging = staging.reshape(-1)
        self.peer = peer
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.inbox = Notifications(agent)

    def receive(self, pipe: PipelinePlan, dst: Sequence[np.ndarray], tag: bytes) -> StageTimes:
        if pipe.slots is not None and self.peer is None:
            raise ConfigError("a ring write needs the producer's agent name to ack to")
        if pipe.staging_bytes > self.staging.size:
            raise ConfigError(f"the write needs {pipe.staging_bytes} staging bytes, "
                              f"{self.staging.size} registered")
        times = StageTimes(chunks=pipe.chunks)
        t_start: float | None = None
        cpu0 = time.process_time()
        end = time.monotonic() + self.timeout_s
        left = set(range(pipe.chunks))
        while left:
            t0 = time.perf_counter()
            ready = [k for k in self.inbox.take(tag, ack=False) if k in left]
            if not ready:
                if time.monotonic() > end:
                    raise PipelineTimeout(f"chunks {sorted(left)[:4]}... of {tag!r} did not "
                                          f"arrive within {self.timeout_s} s")
                if self.poll_s:
                    time.sleep(self.poll_s)
                if t_start is not None:
                    times.wait_s += time.perf_counter() - t0
                continue
            if t_start is None:
                t_start = t0
            for k in sorted(ready):
                a, b = pipe.span(k)
                off = pipe.offset(k)
                t1 = time.perf_counter()
                scatter_host(pipe.packed, self.staging[off:off + b - a], dst, a, b)
                times.scatter_s += time.perf_counter() - t1
                left.discard(k)
                if pipe.slots is not None and self.peer is not None:
                    self.agent.notify(self.peer, _ack_k(tag, k))
        times.total_s = time.perf_counter() - (t_start or time.perf_counter())
        times.cpu_s = time.process_time() - cpu0
        return times


__all__ = ["Notifications", "PackedReceiver", "PackedSender", "PipelinePlan",
           "PipelineTimeout", "StageTimes"]
