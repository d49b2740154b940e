"""Per-request timelines: when each hop of a P/D request happened, in every process.

Each process that takes part in a request (the proxy or benchmark client, the
prefill and decode schedulers, their workers and transport threads) records
*marks*: ``(transfer id, event name, time.monotonic())``. Marks are written as
JSON lines into one file per process under a directory (``timeline-<pid>.jsonl``)
and correlated afterwards by transfer id. ``time.monotonic()`` is the host's
``CLOCK_MONOTONIC``, shared by all processes of one machine, so marks of a
single-host deployment compare directly; across hosts only segments whose two
marks come from the same host are meaningful.

Recording is off unless :func:`configure` was called with a directory (the
connector's ``timeline_dir`` setting, ``pushkv proxy --timeline-dir``); when off,
:func:`mark` is one global lookup and a return. While it is on, the process's
garbage-collector pauses of 0.5 ms or more go into the same file
(:func:`record_gc`, :func:`read_pauses`): a collection stops every thread of the
process, and every request in its hands waits for it. Work of a process that is no
request's -- an engine loop's steps, its worker's model runs -- goes there as *spans*
(:func:`span`, :func:`read_spans`).

:data:`EVENTS` names every mark in the order a request normally meets them,
:data:`ENDINGS` the marks of a request that ends early, :data:`INTAKE` the marks
inside vLLM's processes that only the benchmarks' instrumentation records, and
:data:`REPORT` the intervals the report (``python -m pushkv.timeline``) prints:
median and p90 of each segment, side by side per mode::

    python -m pushkv.timeline push=/tmp/tl/push vllm-push=/tmp/tl/vllm-push [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

#: Marks, in the order a request meets them (a push's two branches interleave).
EVENTS: tuple[str, ...] = (
    "received",              # router: the client's request arrived
    "legs_sent",             # router or client: both legs handed to the network
    "prefill_arrived",       # prefill API server: the request parsed, about to be tokenized
    "decode_arrived",        # decode API server: the request parsed, about to be tokenized
    "prefill_seen",          # prefill scheduler: the request is considered for a step
    "decode_seen",           # decode scheduler: the request is considered for a step
    "registration_shipped",  # decode scheduler: the registration goes into a step's orders
    "registration_handed",   # decode worker: the registration handed to the transport
    "registration_sent",     # decode transport: Register sent to the producer
    "registration_received",  # prefill transport: Register arrived
    "prefill_finished",      # prefill scheduler: the prompt's KV is complete
    "write_handed",          # prefill worker: the push handed to the transport
    "write_posted",          # prefill transport: the write handed to the NIXL writer
    "write_completed",       # prefill transport: the write (and its notification) done
    "notify_received",       # decode transport: the write's notification arrived
    "ready",                 # decode worker: TransferReady reached the connector
    "ready_scheduled",       # decode scheduler: vLLM learnt the KV landed
    "decode_scheduled",      # decode scheduler: the request admitted for its first step
    "first_token",           # router or client: the first token arrived
    "last_token",            # router or client: the last token arrived
    "answer_sent",           # router: the answer finished
)

#: Marks of a request that ends early; a request that completes meets none of them.
ENDINGS: tuple[str, ...] = (
    "client_left",     # router: the client went away before its answer was complete
    "abandoned",       # decode scheduler: vLLM ended the request before it registered
    "decode_aborted",  # decode scheduler: vLLM ended the request while its KV was in flight
)

#: Marks inside vLLM's own processes, each leg's way from its API server to its engine
#: loop, recorded only by the benchmarks' instrumentation of vLLM
#: (``pushkv/vllm/cpu_tuning``): after ``*_arrived`` (the API server's ``arrival_time``)
#: and before ``*_seen`` (its scheduler's first look at it).
INTAKE: tuple[str, ...] = (
    "prefill_sent",    # prefill API server: the request handed to its engine core client
    "decode_sent",     # decode API server: the same
    "prefill_queued",  # prefill engine core's input thread: decoded, on the loop's queue
    "decode_queued",   # decode engine core's input thread: the same
    "prefill_taken",   # prefill engine loop: taken from its queue, between two steps
    "decode_taken",    # decode engine loop: the same
)

#: (name, from, to): the intervals of the report. A segment is counted for a
#: request only when both marks were recorded for it.
SEGMENTS: tuple[tuple[str, str, str], ...] = (
    ("proxy in -> legs out", "received", "legs_sent"),
    ("legs out -> decode sees", "legs_sent", "decode_seen"),
    ("legs out -> decode arrives", "legs_sent", "decode_arrived"),
    ("decode arrives -> sees", "decode_arrived", "decode_seen"),
    ("legs out -> prefill sees", "legs_sent", "prefill_seen"),
    ("legs out -> prefill arrives", "legs_sent", "prefill_arrived"),
    ("prefill arrives -> sees", "prefill_arrived", "prefill_seen"),
    ("decode sees -> registration shipped", "decode_seen", "registration_shipped"),
    ("registration shipped -> handed", "registration_shipped", "registration_handed"),
    ("registration handed -> sent", "registration_handed", "registration_sent"),
    ("registration sent -> received", "registration_sent", "registration_received"),
    ("prefill sees -> prefill finished", "prefill_seen", "prefill_finished"),
    ("prefill finished -> write handed", "prefill_finished", "write_handed"),
    ("write handed -> posted", "write_handed", "write_posted"),
    ("registration received -> posted", "registration_received", "write_posted"),
    ("write posted -> completed", "write_posted", "write_completed"),
    ("write posted -> notification", "write_posted", "notify_received"),
    ("notification -> ready", "notify_received", "ready"),
    ("ready -> scheduler knows", "ready", "ready_scheduled"),
    ("prefill finished -> scheduler knows", "prefill_finished", "ready_scheduled"),
    ("scheduler knows -> decode step", "ready_scheduled", "decode_scheduled"),
    ("decode step -> first token", "decode_scheduled", "first_token"),
    ("first token -> last token", "first_token", "last_token"),
    ("last token -> answer sent", "last_token", "answer_sent"),
    ("legs out -> first token", "legs_sent", "first_token"),
    ("legs out -> last token", "legs_sent", "last_token"),
)

#: The intervals of a leg's intake (:data:`INTAKE`), reported after :data:`SEGMENTS`:
#: the API server's work before the hand-off, the way to the engine core's input
#: thread, the wait for the loop to end its step, the scheduler's first look.
INTAKE_SEGMENTS: tuple[tuple[str, str, str], ...] = tuple(
    (f"{side} {a} -> {b}", f"{side}_{a}", f"{side}_{b}")
    for side in ("prefill", "decode")
    for a, b in itertools.pairwise(("arrived", "sent", "queued", "taken", "seen")))

#: Every interval the report prints, in its order.
REPORT: tuple[tuple[str, str, str], ...] = SEGMENTS + INTAKE_SEGMENTS


#: Protocol steps (:func:`step`), each with fields naming the use and ranks it
#: belongs to: ``inc`` (incarnation), ``att`` (attempt), ``src`` and ``dst`` (the
#: producer and consumer rank, ``"<engine id>:<rank>"``). The auditor
#: (``python -m pushkv.audit DIR``) checks the protocol's invariants on them.
#: ``write_posted``, ``write_completed`` and ``notify_received`` are the marks of
#: :data:`EVENTS`, given fields.
STEPS: dict[str, str] = {
    "registration_sent": "consumer: Register of attempt att sent to producer rank src",
    "write_posted": "producer: a write handed to the transport (part, parts, chunks)",
    "write_completed": "producer: the endpoint learnt the write ended (ok)",
    "answer_sent": "producer: CancelAck or Fail (reason) sent, with posted and failed",
    "source_released": "producer: the source of the use released",
    "notify_received": "consumer: a write's notification (part, parts, chunk, chunks, "
                       "sealed: it carries a digest this rank checks)",
    "digest_checked": "consumer: a landed write's (or pull read's) digest checked (ok)",
    "dest_released": "consumer: the attempt's destination blocks given back (grace: its "
                     "fence_grace_s)",
    "read_posted": "consumer (pull): a read from producer rank src posted",
    "read_completed": "consumer (pull): the endpoint learnt the read from producer rank src "
                      "ended (ok; sealed: its bytes are checked against the producer's "
                      "published digest)",
    "outcome": "consumer: the use's outcome on this rank (kind: ready, failed, cancelled)",
}


class Recorder:
    """Appends marks of this process to ``<directory>/timeline-<pid>.jsonl``."""

    def __init__(self, directory: str | os.PathLike[str], process: str = "") -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.process = process or f"pid{os.getpid()}"
        self.path = path / f"timeline-{os.getpid()}.jsonl"
        self._lock = threading.Lock()
        self._file: TextIO = self.path.open("a", buffering=1, encoding="utf-8")

    def mark(self, transfer_id: str, event: str, t: float | None = None,
             fields: Mapping[str, object] | None = None) -> None:
        d = {"id": transfer_id, "ev": event,
             "t": time.monotonic() if t is None else t, "p": self.process}
        if fields:
            d["a"] = fields  # a protocol step's fields (:data:`STEPS`)
        line = json.dumps(d)
        with self._lock:
            self._file.write(line + "\n")

    def pause(self, kind: str, t0: float, t1: float) -> None:
        """A pause of this whole process (``kind``: ``gc0``-``gc2``, the garbage
        collector's generation) from ``t0`` to ``t1``: a line of its own, no request's."""
        line = json.dumps({"pause": kind, "t0": t0, "t1": t1, "p": self.process,
                           "pid": os.getpid()})  # a forked child writes its parent's file
        with self._lock:
            self._file.write(line + "\n")

    def span(self, kind: str, t0: float, t1: float) -> None:
        """Work of this process that is no request's, from ``t0`` to ``t1`` (``kind``:
        ``step``, an engine loop's step; ``forward``, its worker's model run)."""
        line = json.dumps({"span": kind, "t0": t0, "t1": t1, "p": self.process,
                           "pid": os.getpid()})
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()


_recorder: Recorder | None = None
#: the shortest garbage-collector pause :func:`record_gc` writes down
GC_MIN_S = 0.0005
_gc_started = [0.0]
_gc_min_s = [GC_MIN_S]


def configure(directory: str | os.PathLike[str] | None, process: str = "") -> None:
    """Record this process's marks under ``directory`` from now on (None or "": stop).

    Called once per process by whatever owns the setting; a second call with a
    directory keeps the first recorder (one file per process). The process's
    garbage-collector pauses are recorded beside its marks (:func:`record_gc`)."""
    global _recorder
    if not directory:
        if _recorder is not None:
            _recorder.close()
        _recorder = None
    elif _recorder is None:
        _recorder = Recorder(directory, process)
        record_gc()


def enabled() -> bool:
    return _recorder is not None


def mark(transfer_id: str, event: str, t: float | None = None) -> None:
    """Record ``event`` of ``transfer_id`` at ``t`` (``time.monotonic()``; default now),
    nothing when recording is off."""
    rec = _recorder
    if rec is not None:
        rec.mark(transfer_id, event, t)


def span(kind: str, t0: float, t1: float) -> None:
    """Record this process's work of ``kind`` from ``t0`` to ``t1``
    (:meth:`Recorder.span`), nothing when recording is off."""
    rec = _recorder
    if rec is not None:
        rec.span(kind, t0, t1)


def step(transfer_id: str, event: str, t: float | None = None, **fields: object) -> None:
    """Record protocol step ``event`` (:data:`STEPS`) of ``transfer_id`` with its
    ``fields`` (incarnation, attempt, ranks...); nothing when recording is off."""
    rec = _recorder
    if rec is not None:
        rec.mark(transfer_id, event, t, fields)


def node(engine_id: str, rank: int) -> str:
    """A rank's name in :data:`STEPS` fields."""
    return f"{engine_id}:{rank}"


def actions(me: str, acts: Iterable[object], t: float | None = None,
            grace: float | None = None) -> None:
    """Record the protocol steps among endpoint ``me``'s actions ``acts`` (call it only
    while :func:`enabled`); ``grace``: a consumer's ``fence_grace_s``, the bound it may
    fence unlanded writes by (kept with each ``dest_released``)."""
    from .protocol.events import (
        IssueRead,
        IssueWrite,
        ReleaseDestination,
        ReleaseSource,
        SendMessage,
        TransferCancelled,
        TransferFailed,
        TransferReady,
    )
    from .protocol.messages import CancelAck, Fail, Register

    t = time.monotonic() if t is None else t
    for a in acts:
        if isinstance(a, IssueWrite):
            n = a.notify
            step(a.transfer_id, "write_posted", t, inc=a.incarnation, att=a.attempt, src=me,
                 dst=node(*a.peer), part=n.part, parts=n.parts,
                 chunks=a.packed.chunks if a.packed is not None else 1)
        elif isinstance(a, SendMessage):
            m = a.message
            if isinstance(m, CancelAck | Fail):
                step(m.transfer_id, "answer_sent", t, inc=m.incarnation, att=m.attempt, src=me,
                     dst=node(*a.peer), posted=m.posted, failed=m.failed,
                     reason=m.reason.name if isinstance(m, Fail) else "")
            elif isinstance(m, Register):
                step(m.transfer_id, "registration_sent", t, inc=m.incarnation, att=m.attempt,
                     src=node(*a.peer), dst=me)
        elif isinstance(a, ReleaseSource):
            step(a.transfer_id, "source_released", t, inc=a.incarnation, src=me)
        elif isinstance(a, ReleaseDestination):
            step(a.transfer_id, "dest_released", t, inc=a.incarnation, att=a.attempt, dst=me,
                 grace=grace)
        elif isinstance(a, IssueRead):
            step(a.transfer_id, "read_posted", t, inc=a.incarnation, att=a.attempt,
                 src=node(*a.peer), dst=me)
        elif isinstance(a, TransferReady | TransferFailed | TransferCancelled):
            kind = ("ready" if isinstance(a, TransferReady) else
                    "failed" if isinstance(a, TransferFailed) else "cancelled")
            step(a.transfer_id, "outcome", t, inc=a.incarnation, att=a.attempt, dst=me,
                 kind=kind)


def completed(me: str, transfer_id: str, incarnation: int, attempt: int, peer: tuple[str, int],
              ok: bool, t: float | None = None) -> None:
    """Producer ``me`` learnt its write of ``transfer_id`` to ``peer`` ended."""
    step(transfer_id, "write_completed", t, inc=incarnation, att=attempt, src=me,
         dst=node(*peer), ok=ok)


def notified(me: str, msg: object, sealed: bool, t: float | None = None) -> None:
    """Consumer ``me`` received notification ``msg`` (a :class:`~pushkv.protocol.messages.Notify`;
    ``sealed``: with a digest this rank checks)."""
    from .protocol.messages import Notify

    if isinstance(msg, Notify):
        step(msg.transfer_id, "notify_received", t, inc=msg.incarnation, att=msg.attempt,
             src=node(msg.engine_id, msg.rank), dst=me, part=msg.part, parts=msg.parts,
             chunk=msg.chunk, chunks=msg.chunks, sealed=sealed)


def read_done(me: str, transfer_id: str, incarnation: int, attempt: int, src: tuple[str, int],
              ok: bool, sealed: bool, t: float | None = None) -> None:
    """Consumer ``me`` (pull) learnt its read of ``transfer_id`` from ``src`` ended
    (``sealed``: its landed bytes are checked against a published digest)."""
    step(transfer_id, "read_completed", t, inc=incarnation, att=attempt, src=node(*src),
         dst=me, ok=ok, sealed=sealed)


def checked(me: str, transfer_id: str, incarnation: int, attempt: int, src: tuple[str, int],
            ok: bool, t: float | None = None) -> None:
    """Consumer ``me`` checked the digest of producer rank ``src``'s landed write."""
    step(transfer_id, "digest_checked", t, inc=incarnation, att=attempt, src=node(*src),
         dst=me, ok=ok)


def record_gc(min_s: float = GC_MIN_S) -> None:
    """Write down every garbage collection of this process that lasts at least
    ``min_s`` from now on, as a :meth:`Recorder.pause` (while recording is on; one
    callback a process, the latest ``min_s`` holds). A collection stops every thread
    of the interpreter: each request in the process's hands waits for it."""
    import gc

    _gc_min_s[0] = min_s
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.monotonic()
        return
    t1, rec = time.monotonic(), _recorder
    if rec is not None and t1 - _gc_started[0] >= _gc_min_s[0]:
        rec.pause(f"gc{info.get('generation', 0)}", _gc_started[0], t1)


def from_wall(t_wall: float) -> float:
    """``time.monotonic()`` at the wall-clock time ``t_wall`` (``time.time()``) -- for a
    time another layer took by the wall clock, such as vLLM's ``Request.arrival_time``."""
    return time.monotonic() - (time.time() - t_wall)


# ------------------------------------------------------------------ reading


@dataclass(frozen=True, slots=True)
class Mark:
    transfer_id: str
    event: str
    t: float
    process: str


def read(directory: str | os.PathLike[str]) -> list[Mark]:
    """Every mark recorded under ``directory`` (all processes)."""
    out: list[Mark] = []
    for path in sorted(Path(directory).glob("timeline-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                d = json.loads(line)
                out.append(Mark(str(d["id"]), str(d["ev"]), float(d["t"]), str(d.get("p", ""))))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed process
    return out


@dataclass(frozen=True, slots=True)
class Pause:
    process: str
    kind: str
    t0: float
    t1: float
    pid: int = 0


def _intervals(directory: str | os.PathLike[str], key: str) -> list[Pause]:
    """Every line of ``key`` (``pause`` or ``span``) recorded under ``directory``."""
    out: list[Pause] = []
    for path in sorted(Path(directory).glob("timeline-*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if f'"{key}"' not in line:
                continue
            try:
                d = json.loads(line)
                out.append(Pause(str(d.get("p", "")), str(d[key]), float(d["t0"]),
                                 float(d["t1"]), int(d.get("pid", 0))))
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line of a killed process
    return sorted(out, key=lambda p: p.t0)


def read_pauses(directory: str | os.PathLike[str]) -> list[Pause]:
    """Every :meth:`Recorder.pause` recorded under ``directory`` (all processes), by
    start."""
    return _intervals(directory, "pause")


def read_spans(directory: str | os.PathLike[str]) -> list[Pause]:
    """Every :meth:`Recorder.span` recorded under ``directory`` (all processes), by
    start (a :class:`Pause` each, its ``kind`` the span's)."""
    return _intervals(directory, "span")


def by_request(marks: Iterable[Mark]) -> dict[str, dict[str, float]]:
    """Per transfer id, each event's first time (a retried or repeated mark keeps its first)."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for m in sorted(marks, key=lambda m: m.t):
        out[m.transfer_id].setdefault(m.event, m.t)
    return dict(out)


def segments(requests: Mapping[str, Mapping[str, float]]) -> dict[str, list[float]]:
    """Durations (ms) of every segment, over the requests that recorded both of its ends."""
    out: dict[str, list[float]] = {}
    for name, start, end in REPORT:
        values = [(r[end] - r[start]) * 1000 for r in requests.values()
                  if start in r and end in r]
        if values:
            out[name] = values
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation."""
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(dirs: Mapping[str, str | os.PathLike[str]]) -> dict[str, dict[str, dict[str, float]]]:
    """``{mode: {segment: {"median": ms, "p90": ms, "n": count}}}``."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for mode, directory in dirs.items():
        segs = segments(by_request(read(directory)))
        out[mode] = {name: {"median": round(statistics.median(v), 3),
                            "p90": round(percentile(v, 0.9), 3), "n": len(v)}
                     for name, v in segs.items()}
    return out


def table(stats: Mapping[str, Mapping[str, Mapping[str, float]]]) -> str:
    """A markdown table: a row per segment, median / p90 (ms) per mode."""
    modes = list(stats)
    head = ["segment", *(f"{m} median / p90 (ms)" for m in modes)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, _, _ in REPORT:
        if not any(name in stats[m] for m in modes):
            continue
        cells = [name]
        for m in modes:
            s = stats[m].get(name)
            cells.append(f"{s['median']:.1f} / {s['p90']:.1f}" if s else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pushkv.timeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dirs", nargs="+", metavar="MODE=DIR",
                   help="a mode's name and the directory its processes recorded into")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    args = p.parse_args(argv)
    dirs: dict[str, str] = {}
    for item in args.dirs:
        mode, sep, directory = item.partition("=")
        if not sep:
            p.error(f"expected MODE=DIR, got {item!r}")
        dirs[mode] = directory
    stats = summary(dirs)
    print(json.dumps(stats) if args.json else table(stats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
