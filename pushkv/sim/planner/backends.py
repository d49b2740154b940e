"""Where the planner's searches run: local worker processes, or a Ray cluster.

A backend takes the configurations of a plan, one task each (a task bisects one
configuration's rate, :func:`pushkv.sim.planner.search.plan_configuration`), and
yields each task's result as it finishes, in any order; the plan sorts them, so
the order never shows. A task's result depends only on its arguments (the
simulator is seeded by the spec), so every backend gives the same plan, bit for
bit.

* ``process`` (default): ``jobs`` worker processes on this machine (``spawn``),
  or the calling process alone when ``jobs`` is 1.
* ``ray``: one Ray task per configuration, on the cluster at ``address`` or, with
  no address, on a local Ray instance of ``jobs`` CPUs started for the plan and
  shut down after it. Ray is optional (``pip install 'pushkv[ray]'``) and
  imported only here, only when chosen; a Ray instance already running in this
  process (``ray.init`` called before) is used as it is and left running.

A worker that dies or is lost mid-task (killed, out of memory, its node gone)
takes no result with it: its configurations are submitted again, up to
:data:`MAX_RERUNS` times each, then the plan stops with :class:`WorkerLostError`
-- never a plan with configurations silently missing. ``reruns`` counts the
configurations submitted again. An exception raised by the task itself (a bug,
a bad profile) is not a lost worker: it ends the plan with that exception.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
from collections import Counter
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ...protocol.errors import ConfigError

#: the backends, the first the default
BACKENDS = ("process", "ray")
#: how many times one configuration is submitted again after losing its worker
MAX_RERUNS = 3
#: what a Ray worker's process title reads while it runs a plan's task
RAY_TASK_NAME = "plan_configuration"

OnRerun = Callable[[int, str], None]


class BackendError(ConfigError):
    """A backend cannot be used as asked (unknown name, Ray not installed, no cluster
    at the address given)."""


class WorkerLostError(RuntimeError):
    """A configuration lost its worker more than :data:`MAX_RERUNS` times."""


def check_backend(name: str, ray_address: str | None = None) -> None:
    """Refuse a backend that cannot run, before any work: an unknown name, an
    address for a backend that takes none, Ray chosen but not installed (found
    without importing it)."""
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    if ray_address is not None and name != "ray":
        raise BackendError("a Ray address is only for --backend ray")
    if name == "ray" and importlib.util.find_spec("ray") is None:
        raise BackendError("--backend ray needs Ray, an optional dependency: "
                           "pip install 'pushkv[ray]'")


class _Reruns:
    """Counts resubmissions; refuses a configuration that lost its worker too often."""

    def __init__(self, on_rerun: OnRerun | None, labels: Callable[[int], str]) -> None:
        self.count = 0
        self._tries: Counter[int] = Counter()
        self._on_rerun = on_rerun
        self._labels = labels

    def again(self, indices: Sequence[int], why: str) -> None:
        for i in indices:
            self._tries[i] += 1
            if self._tries[i] > MAX_RERUNS:
                raise WorkerLostError(
                    f"{self._labels(i)} lost its worker {self._tries[i]} times ({why}); "
                    "the plan stops rather than leave it out")
        self.count += len(indices)
        if self._on_rerun is not None and indices:
            self._on_rerun(len(indices), why)


class ProcessBackend:
    """Local worker processes (``spawn``); ``jobs == 1`` runs in this process."""

    name = "process"

    def __init__(self, jobs: int) -> None:
        self.workers = max(1, jobs)
        self.reruns = 0

    def run(self, fn: Callable[[Any], Any], args: Sequence[Any], *,
            on_rerun: OnRerun | None = None,
            label: Callable[[int], str] = str) -> Generator[tuple[int, Any], None, None]:
        if self.workers == 1:
            for i, a in enumerate(args):
                yield i, fn(a)
            return
        reruns = _Reruns(on_rerun, label)
        todo = dict(enumerate(args))
        ctx = multiprocessing.get_context("spawn")
        while todo:
            pool = ProcessPoolExecutor(min(self.workers, len(todo)), mp_context=ctx)
            futures: dict[Future[Any], int] = {pool.submit(fn, a): i for i, a in todo.items()}
            broken = finished = False
            try:
                pending = set(futures)
                while pending and not broken:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for f in sorted(done, key=futures.__getitem__):
                        if isinstance(f.exception(), BrokenProcessPool):
                            broken = True
                            continue
                        i = futures[f]
                        result = f.result()  # the task's own exception ends the plan
                        del todo[i]
                        yield i, result
                if broken:  # results that landed before the pool broke are kept
                    for f, i in sorted(futures.items(), key=lambda fi: fi[1]):
                        if i in todo and f.done() and not f.cancelled() \
                                and f.exception() is None:
                            del todo[i]
                            yield i, f.result()
                finished = True
            finally:
                if not finished:  # interrupted, or a task raised: stop the workers now
                    for proc in list((getattr(pool, "_processes", None) or {}).values()):
                        proc.terminate()
                pool.shutdown(wait=finished, cancel_futures=True)
            if broken:
                reruns.again(sorted(todo), "a worker process died")
                self.reruns = reruns.count

    def close(self) -> None:
        pass


class RayBackend:
    """One Ray task per configuration, on a cluster or a local instance."""

    name = "ray"

    def __init__(self, jobs: int, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise BackendError("--backend ray needs Ray, an optional dependency: "
                               "pip install 'pushkv[ray]'") from None
        self._ray = ray
        self._owned = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "logging_level": "WARNING",
                                      "log_to_driver": False}
            if address is None:
                kwargs["num_cpus"] = max(1, jobs)
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = f"at {address}" if address else "on this machine"
                raise BackendError(f"cannot start or reach Ray {where}: "
                                   f"{str(exc).splitlines()[0] if str(exc) else exc!r}"
                                   ) from None
            self._owned = True
        cpus = ray.cluster_resources().get("CPU", 1)  # type: ignore[no-untyped-call]
        self.workers = max(1, int(cpus))
        self.reruns = 0

    def run(self, fn: Callable[[Any], Any], args: Sequence[Any], *,
            on_rerun: OnRerun | None = None,
            label: Callable[[int], str] = str) -> Generator[tuple[int, Any], None, None]:
        ray = self._ray
        from ray import exceptions as rex

        lost = (rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError,
                rex.LocalRayletDiedError)
        # Ray's own retries are off: a lost task comes back here, is counted and resubmitted
        remote = ray.remote(num_cpus=1, max_retries=0)(fn).options(name=RAY_TASK_NAME)
        reruns = _Reruns(on_rerun, label)
        pending = {remote.remote(a): i for i, a in enumerate(args)}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                ref = ready[0]
                i = pending.pop(ref)
                try:
                    result = ray.get(ref)
                except lost as exc:
                    why = f"its Ray worker was lost: {type(exc).__name__}"
                    reruns.again([i], why)
                    self.reruns = reruns.count
                    pending[remote.remote(args[i])] = i
                    continue
                yield i, result
        finally:
            for ref in pending:  # interrupted, or a task raised: cancel the others
                ray.cancel(ref, force=True)

    def close(self) -> None:
        if self._owned:
            self._ray.shutdown()
            self._owned = False


Backend = ProcessBackend | RayBackend


def open_backend(name: str, *, jobs: int, ray_address: str | None = None) -> Backend:
    """The backend ``name`` (:class:`BackendError` if it cannot run); close it after."""
    check_backend(name, ray_address)
    if name == "ray":
        return RayBackend(jobs, ray_address)
    return ProcessBackend(jobs)


__all__ = ["BACKENDS", "MAX_RERUNS", "RAY_TASK_NAME", "Backend", "BackendError",
           "ProcessBackend", "RayBackend", "WorkerLostError", "check_backend", "open_backend"]
