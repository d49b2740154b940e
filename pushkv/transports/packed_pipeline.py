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
  unpipelined packed write stages it (the staging range the protocol lent, of
  ``packed.nbytes`` on each side); no flow control.
* **ring** (``slots=S``): in slot ``k % S`` of ``S`` chunk-sized slots. The
  consumer tells the producer when it has scattered a chunk (an ``ack``
  notification), and the producer reuses a slot only after its ack. A ring of a
  few MiB stays in the CPU's cache: the gather writes it there, the wire reads it
  from there, and the consumer's scatter reads its own ring from there, so the
  write costs about one pass over memory instead of three.

On host memory UCX moves the bytes inside the initiator's ``transfer()`` (CMA,
``process_vm_writev``: the initiator's core copies), so a write leaves the
producer's core paying gather + wire while only the scatter runs beside it. With
``read_share`` a share of the chunks is instead *read* by the consumer (the
producer gathers the chunk and says so; the consumer posts a READ of it, which
its own core copies, then scatters it): on host memory that moves wire copies to
the consumer's core and balances the two. On RDMA or device memory the NIC or
the copy engine moves the bytes, all three stages overlap, and ``read_share``
should stay 0.

Both sides sleep ``poll_s`` between polls while they wait (an ack, a chunk, a
completion): on a machine with few cores a side that spins takes the core the
other side needs.

Notifications carry ``tag + b"/" + k`` (chunk ``k`` written), ``tag + b"/r/" + k``
(chunk ``k`` gathered, to be read) and ``tag + b"/ack/" + k`` (chunk ``k``
scattered: its slots are free).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..protocol.errors import ConfigError
from ..protocol.packing import PackedPlan
from .staging import chunk_bounds, gather_host, scatter_host


class PipelineTimeout(Exception):
    """A chunk, an ack or a write's completion did not come in time."""


class PipelinePlan:
    """The chunk schedule of one pipelined packed write (both sides build the same)."""

    __slots__ = ("bounds", "packed", "read_share", "slot_bytes", "slots")

    def __init__(self, packed: PackedPlan, chunk_bytes: int, slots: int | None = None,
                 read_share: float = 0.0) -> None:
        if slots is not None and slots < 1:
            raise ConfigError(f"a ring needs at least one slot, got {slots}")
        if not 0.0 <= read_share <= 1.0:
            raise ConfigError(f"read_share must be in [0, 1], got {read_share}")
        self.packed = packed
        self.read_share = read_share
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

    def read(self, k: int) -> bool:
        """Whether the consumer reads chunk ``k`` (else the producer writes it): an even
        spread of ``read_share`` of the chunks."""
        return int((k + 1) * self.read_share) > int(k * self.read_share)

    def acked(self, k: int) -> bool:
        """Whether the consumer acks chunk ``k``: every chunk of a ring (its slot is
        reused), and every chunk it reads (the producer's staging must outlive the read)."""
        return self.slots is not None or self.read(k)


WRITTEN, READY, ACK = b"/", b"/r/", b"/ack/"


def _msg(tag: bytes, kind: bytes, k: int) -> bytes:
    return tag + kind + str(k).encode()


def _parse(tag: bytes, message: bytes, kind: bytes) -> int | None:
    prefix = tag + kind
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
    posted_by_peer: int = 0  # chunks the other side moved (reads by the consumer)
    cpu_s: float = 0.0  # the process's CPU time over the write, all threads
    #: the calling thread's CPU time in gather, post (or read) and scatter: the work,
    #: whatever the machine's load did to the wall-clock figures above
    gather_cpu_s: float = 0.0
    post_cpu_s: float = 0.0
    scatter_cpu_s: float = 0.0


class Notifications:
    """Notifications of one agent, drained into a buffer so that several readers
    (this write's chunks, its acks, anything else) each take only theirs."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        self.pending: list[bytes] = []

    def take(self, tag: bytes, *kinds: bytes) -> list[tuple[bytes, int]]:
        """``(kind, chunk)`` of the new and buffered messages of ``tag`` of those kinds;
        other messages stay buffered for their reader."""
        self.pending.extend(m for _, m in self.agent.notifications())
        got, keep = [], []
        for m in self.pending:
            for kind in kinds:
                k = _parse(tag, m, kind)
                if k is not None:
                    got.append((kind, k))
                    break
            else:
                keep.append(m)
        self.pending = keep
        return got


class PackedSender:
    """The producer side: gathers chunks into its staging, writes each into the
    consumer's staging with a notification (or tells the consumer to read it),
    reuses ring slots on acks."""

    def __init__(self, agent: Any, staging: np.ndarray, local_base: int, remote_base: int,
                 peer: str, *, remote_kind: str = "DRAM", poll_s: float = 5e-5,
                 timeout_s: float = 60.0, gather_ahead: bool = False) -> None:
        self.agent = agent
        #: image writes: gather chunk k + 1 on a worker thread while this one posts
        #: chunk k (numpy's copies release the interpreter lock; NIXL's post holds it)
        self.gather_ahead = gather_ahead
        self._pool: Any = None
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
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

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

    def _send_ahead(self, pipe: PipelinePlan, src: Sequence[np.ndarray],
                    tag: bytes) -> StageTimes:
        """An image write with the gather one chunk ahead, on a worker thread."""
        from concurrent.futures import ThreadPoolExecutor

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pushkv-gather")
        times = StageTimes(chunks=pipe.chunks)
        t_start, cpu0 = time.perf_counter(), time.process_time()
        end = time.monotonic() + self.timeout_s

        def gather(k: int) -> tuple[float, float]:
            a, b = pipe.span(k)
            t0, c0 = time.perf_counter(), time.thread_time()
            gather_host(pipe.packed, src, self.staging[a:b], a, b)
            return time.perf_counter() - t0, time.thread_time() - c0

        ahead = self._pool.submit(gather, 0) if pipe.chunks else None
        for k in range(pipe.chunks):
            t0 = time.perf_counter()
            assert ahead is not None
            took, cpu = ahead.result(timeout=self.timeout_s)
            times.wait_s += time.perf_counter() - t0
            times.gather_s += took
            times.gather_cpu_s += cpu
            ahead = self._pool.submit(gather, k + 1) if k + 1 < pipe.chunks else None
            a, b = pipe.span(k)
            t1, c1 = time.perf_counter(), time.thread_time()
            handle = self._handle(a, b - a)
            state = self.agent.post(handle, _msg(tag, WRITTEN, k))
            times.post_s += time.perf_counter() - t1
            times.post_cpu_s += time.thread_time() - c1
            if state == "DONE":
                times.done_at_post += 1
            elif state == "PROC":
                self._live[(a, b - a)] = handle
            else:
                if ahead is not None:
                    ahead.result(timeout=self.timeout_s)
                raise RuntimeError(f"packed chunk {k} of {tag!r} ended {state}")
            self._reap()
        t0 = time.perf_counter()
        self._reap_all(end)
        times.wait_s += time.perf_counter() - t0
        times.total_s = time.perf_counter() - t_start
        times.cpu_s = time.process_time() - cpu0
        return times

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
        if self.gather_ahead and pipe.slots is None and not pipe.read_share:
            return self._send_ahead(pipe, src, tag)
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
                    acked.update(c for _, c in self.inbox.take(tag, ACK))
                    self._check(end, f"ack of chunk {k - pipe.slots}")
                    if self.poll_s:
                        time.sleep(self.poll_s)
            while (off, b - a) in self._live:  # its request is posted again below
                self._reap()
                self._check(end, f"completion of the write before chunk {k}")
            t1, c1 = time.perf_counter(), time.thread_time()
            gather_host(pipe.packed, src, self.staging[off:off + b - a], a, b)
            t2, c2 = time.perf_counter(), time.thread_time()
            times.gather_cpu_s += c2 - c1
            if pipe.read(k):  # the consumer copies it
                self.agent.notify(self.peer, _msg(tag, READY, k))
                times.gather_s += t2 - t1
                times.wait_s += t1 - t0
                times.posted_by_peer += 1
                continue
            handle = self._handle(off, b - a)
            state = self.agent.post(handle, _msg(tag, WRITTEN, k))
            t3 = time.perf_counter()
            times.post_cpu_s += time.thread_time() - c2
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
        reads = {k for k in range(pipe.chunks) if pipe.read(k)}
        while not reads <= acked:  # the consumer's reads of this staging are done
            acked.update(c for _, c in self.inbox.take(tag, ACK))
            self._check(end, "acks of the chunks the consumer reads")
            if self.poll_s:
                time.sleep(self.poll_s)
        times.wait_s += time.perf_counter() - t0
        times.total_s = time.perf_counter() - t_start
        times.cpu_s = time.process_time() - cpu0
        return times

    def _check(self, end: float, what: str) -> None:
        if time.monotonic() > end:
            raise PipelineTimeout(f"no {what} within {self.timeout_s} s")


class PackedReceiver:
    """The consumer side: scatters each chunk out of its staging as its notification
    arrives (in any order), reading it first when the producer leaves that to it, and
    acks it when the producer waits for that (ring slots, reads)."""

    def __init__(self, agent: Any, staging: np.ndarray, peer: str | None = None, *,
                 local_base: int | None = None, remote_base: int | None = None,
                 remote_kind: str = "DRAM", poll_s: float = 5e-5,
                 timeout_s: float = 60.0) -> None:
        self.agent = agent
        self.staging = staging.reshape(-1)
        self.peer = peer
        self.local_base = local_base
        self.remote_base = remote_base
        self.remote_kind = remote_kind
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.inbox = Notifications(agent)
        self._handles: dict[tuple[int, int], Any] = {}

    def close(self) -> None:
        """Release the prepared read requests."""
        for h in self._handles.values():
            self.agent.release(h)
        self._handles.clear()

    def _read(self, off: int, n: int, end: float) -> None:
        """Read the producer's staging ``[off, off + n)`` into ours, to completion."""
        assert self.peer is not None and self.local_base is not None
        assert self.remote_base is not None
        h = self._handles.get((off, n))
        if h is None:
            local = np.array([[self.local_base + off, n, 0]], np.int64)
            remote = np.array([[self.remote_base + off, n, 0]], np.int64)
            h = self._handles[(off, n)] = self.agent.prepare_read(
                local, remote, self.peer, self.remote_kind)
        state = self.agent.post(h)
        while state == "PROC":
            if time.monotonic() > end:
                raise PipelineTimeout(f"a read of {n} staging bytes took over "
                                      f"{self.timeout_s} s")
            state = self.agent.state(h)
        if state != "DONE":
            raise RuntimeError(f"packed chunk read ended {state}")

    def receive(self, pipe: PipelinePlan, dst: Sequence[np.ndarray], tag: bytes) -> StageTimes:
        if (pipe.slots is not None or pipe.read_share) and self.peer is None:
            raise ConfigError("a ring write, or one the consumer reads, needs the producer's "
                              "agent name")
        if pipe.read_share and (self.local_base is None or self.remote_base is None):
            raise ConfigError("reading chunks needs both staging bases")
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
            ready = [(kind, k) for kind, k in self.inbox.take(tag, WRITTEN, READY)
                     if k in left]
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
            for kind, k in sorted(ready, key=lambda r: r[1]):
                a, b = pipe.span(k)
                off = pipe.offset(k)
                if kind == READY:
                    t1, c1 = time.perf_counter(), time.thread_time()
                    self._read(off, b - a, end)
                    times.post_s += time.perf_counter() - t1
                    times.post_cpu_s += time.thread_time() - c1
                    times.posted_by_peer += 1
                t1, c1 = time.perf_counter(), time.thread_time()
                scatter_host(pipe.packed, self.staging[off:off + b - a], dst, a, b)
                times.scatter_s += time.perf_counter() - t1
                times.scatter_cpu_s += time.thread_time() - c1
                left.discard(k)
                if pipe.acked(k) and self.peer is not None:
                    self.agent.notify(self.peer, _msg(tag, ACK, k))
        times.total_s = time.perf_counter() - (t_start or time.perf_counter())
        times.cpu_s = time.process_time() - cpu0
        return times


__all__ = ["Notifications", "PackedReceiver", "PackedSender", "PipelinePlan",
           "PipelineTimeout", "StageTimes"]
