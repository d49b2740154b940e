"""What the kernel says of processes and CPUs: ``/proc`` readings, in one place.

The chaos harness (:mod:`pushkv.vllm.chaos`: threads and memory a fleet leaves
behind) and the fitting pipeline (:mod:`pushkv.fit`: where a deployment's CPU goes,
how long its threads wait for a core, what the host takes) read the same files:

* per process and process group, from ``/proc/PID/stat``: the threads
  (:func:`group_threads`), the members (:func:`group_pids`), CPU time
  (:func:`process_cpu_s`, :func:`group_cpu_s`), and resident memory from
  ``/proc/PID/status`` (:func:`group_rss_kib`);
* per thread, from ``/proc/PID/task/TID/schedstat``: time on a CPU, time runnable on
  a run queue, slices (:func:`schedstat`), summed over a process's threads pinned to
  one CPU and floating apart (:func:`thread_sched`, :func:`group_thread_sched`,
  :func:`runq_wait_s`) or kept per thread with its name (:class:`ThreadReader`);
* per CPU, from ``/proc/stat``: cumulative ticks (:func:`cpu_times`) and, between
  two readings, the share a virtual machine's host took (:func:`steal`);
* the kernel's setting of grouping by session (:func:`autogroup`).

Linux only; a process or thread that is gone reads as missing (None, NaN, left out),
never as an error. The standard library alone: nothing of pushkv is imported.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------- processes, groups


def _proc_stat(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp..
    except OSError:
        return None


def group_threads(pgid: int) -> int:
    """Threads of every process of the group ``pgid`` now."""
    total = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _proc_stat(entry)) and int(fields[2]) == pgid:
            total += int(fields[17])  # num_threads
    return total


def group_pids(pgids: Sequence[int]) -> list[int]:
    """The processes of the groups ``pgids`` now, by pid."""
    groups = set(pgids)
    return sorted(int(entry) for entry in os.listdir("/proc")
                  if entry.isdigit() and (fields := _proc_stat(entry))
                  and int(fields[2]) in groups)


def group_cpu_s(pgids: Sequence[int]) -> float:
    """CPU time (user + system, seconds) the processes of the groups ``pgids`` used so
    far (a process that ended is no longer counted)."""
    groups = set(pgids)
    return sum(_cpu_s(fields) for entry in os.listdir("/proc")
               if entry.isdigit() and (fields := _proc_stat(entry)) and int(fields[2]) in groups)


def process_cpu_s(pid: int) -> float:
    """CPU time (user + system, seconds, all threads) the process ``pid`` used so far;
    NaN once it is gone."""
    fields = _proc_stat(str(pid))
    return float("nan") if fields is None else _cpu_s(fields)


def _cpu_s(fields: list[str]) -> float:
    """utime + stime of a /proc stat line (fields after the name), in seconds."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_rss_kib(pgids: Sequence[int]) -> dict[int, int]:
    """Resident memory (KiB) of every process group of ``pgids``."""
    out = dict.fromkeys(pgids, 0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not (fields := _proc_stat(entry)):
            continue
        if int(fields[2]) not in out:
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[int(fields[2])] += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return out


# ------------------------------------------------------------------- threads


def schedstat(pid: int | str, tid: int | str) -> tuple[int, int, int]:
    """Thread ``tid`` of process ``pid`` so far: nanoseconds on a CPU, nanoseconds
    runnable on a run queue waiting for one, and slices (times put on a CPU; every
    wake-up is one). OSError or ValueError once the thread is gone."""
    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
        run, wait, slices = (int(x) for x in f.read().split()[:3])
    return run, wait, slices


@dataclass(frozen=True, slots=True)
class Sched:
    """How threads have been scheduled so far (``/proc/PID/task/TID/schedstat``):
    seconds on a CPU, seconds runnable on a run queue waiting for one, and how many
    times they were put on a CPU (every wake-up is one)."""

    run_s: float = 0.0
    wait_s: float = 0.0
    slices: int = 0

    def __add__(self, other: Sched) -> Sched:
        return Sched(self.run_s + other.run_s, self.wait_s + other.wait_s,
                     self.slices + other.slices)

    def __sub__(self, other: Sched) -> Sched:
        return Sched(self.run_s - other.run_s, self.wait_s - other.wait_s,
                     self.slices - other.slices)


@dataclass(frozen=True, slots=True)
class ThreadSched:
    """:class:`Sched` of a process's threads by placement: ``pinned``, the threads
    allowed on one CPU only (vLLM CPU's worker, bound by ``VLLM_CPU_OMP_THREADS_BIND``,
    and the threads it starts), and ``floating``, those the kernel may put on any of
    several (the engine core, the API server, a router)."""

    pinned: Sched = Sched()
    floating: Sched = Sched()

    def __add__(self, other: ThreadSched) -> ThreadSched:
        return ThreadSched(self.pinned + other.pinned, self.floating + other.floating)

    def __sub__(self, other: ThreadSched) -> ThreadSched:
        return ThreadSched(self.pinned - other.pinned, self.floating - other.floating)


def thread_sched(pid: int) -> ThreadSched | None:
    """How the threads of process ``pid`` have been scheduled so far, pinned and
    floating apart (:class:`ThreadSched`); a thread that ended is no longer counted;
    None once the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    pinned, floating = Sched(), Sched()
    for tid in tids:
        try:
            run, wait, slices = schedstat(pid, tid)
            one = len(os.sched_getaffinity(int(tid))) == 1
        except (OSError, ValueError):  # the thread ended meanwhile
            continue
        got = Sched(run / 1e9, wait / 1e9, slices)
        if one:
            pinned += got
        else:
            floating += got
    return ThreadSched(pinned, floating)


def group_thread_sched(pgids: Sequence[int]) -> ThreadSched:
    """:func:`thread_sched` summed over the processes of the groups ``pgids``."""
    groups = set(pgids)
    total = ThreadSched()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _proc_stat(entry)) and int(fields[2]) in groups:
            got = thread_sched(int(entry))
            if got is not None:
                total += got
    return total


def runq_wait_s(pid: int) -> float:
    """Seconds the threads of process ``pid`` have waited on a run queue so far, runnable
    but not running (:func:`thread_sched`, pinned and floating together); a thread that
    ended is no longer counted; NaN once the process is gone."""
    got = thread_sched(pid)
    return float("nan") if got is None else got.pinned.wait_s + got.floating.wait_s


def group_runq_wait_s(pgids: Sequence[int]) -> float:
    """:func:`runq_wait_s` summed over the processes of the groups ``pgids``."""
    got = group_thread_sched(pgids)
    return got.pinned.wait_s + got.floating.wait_s


#: one :class:`ThreadReader` reading: per thread id, (run ns, run-queue wait ns, slices)
ThreadRow = dict[str, tuple[int, int, int]]


class ThreadReader:
    """Every thread's :func:`schedstat` of ``parts`` (name -> pids), read on each call;
    ``names[tid]`` is (part, the thread's name from ``/proc/PID/task/TID/comm``), kept
    from the first reading that saw it. Threads and processes that are gone are left
    out."""

    def __init__(self, parts: Mapping[str, Sequence[int]]) -> None:
        self.parts = parts
        self.names: dict[str, tuple[str, str]] = {}

    def __call__(self) -> ThreadRow:
        row: ThreadRow = {}
        for part, pids in self.parts.items():
            for pid in pids:
                try:
                    tids = os.listdir(f"/proc/{pid}/task")
                except OSError:
                    continue
                for tid in tids:
                    try:
                        got = schedstat(pid, tid)
                        if tid not in self.names:
                            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                                self.names[tid] = (part, f.read().strip())
                    except (OSError, ValueError):
                        continue
                    row[tid] = got
        return row



# ---------------------------------------------------------------------- CPUs

#: the fields of a ``cpuN`` line of ``/proc/stat`` (proc(5)), in order
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def cpu_times(stat: str | None = None) -> dict[int, dict[str, int]]:
    """Each CPU's cumulative times in clock ticks from ``/proc/stat`` (or ``stat``, its
    text): ``{cpu: {field: ticks}}`` for :data:`STAT_FIELDS`. On a virtual machine
    ``steal`` counts the ticks the CPU had work but its host ran something else."""
    if stat is None:
        try:
            stat = Path("/proc/stat").read_text()
        except OSError:  # not Linux: no CPU is reported
            return {}
    got: dict[int, dict[str, int]] = {}
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()):
            continue
        ticks = [int(x) for x in rest.split()]
        got[int(name[3:])] = {f: (ticks[i] if i < len(ticks) else 0)
                              for i, f in enumerate(STAT_FIELDS)}
    return got


def steal(before: dict[int, dict[str, int]],
          after: dict[int, dict[str, int]]) -> dict[int, dict[str, float]]:
    """Between two :func:`cpu_times`, per CPU: ``of_wall``, the share of the interval the
    host took (steal ticks / all ticks), and ``of_work``, the share of the time the CPU
    wanted that it did not get (steal / (steal + busy ticks)): a step that needs the CPU
    throughout runs ``1 / (1 - of_work)`` times as long. Zeros where nothing ticked."""
    out: dict[int, dict[str, float]] = {}
    for cpu, b in before.items():
        a = after.get(cpu)
        if a is None:
            continue
        d = {f: max(0, a[f] - b[f]) for f in STAT_FIELDS}
        total = sum(d.values())
        busy = total - d["idle"] - d["iowait"] - d["steal"]
        out[cpu] = {"of_wall": d["steal"] / total if total else 0.0,
                    "of_work": d["steal"] / (d["steal"] + busy) if d["steal"] + busy else 0.0}
    return out


# ---------------------------------------------------------- the kernel's settings

#: where the kernel says whether it groups processes by session for CPU time
AUTOGROUP = Path("/proc/sys/kernel/sched_autogroup_enabled")


def autogroup(path: Path = AUTOGROUP) -> bool | None:
    """Whether the kernel shares the CPUs among sessions before the threads in them
    (``sched(7)``, "The autogroup feature": each ``setsid`` session one task group);
    None where ``path`` is absent or unreadable (a kernel built without it, not Linux)."""
    try:
        return path.read_text().strip() != "0"
    except OSError:
        return None
