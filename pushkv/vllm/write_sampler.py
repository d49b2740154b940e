"""Per-write facts of a producer rank (duration, bytes, descriptors), for the histograms.

The runtime keeps its last writes (:attr:`RuntimeView.recent_writes`, newest
last) on its I/O thread. A small daemon thread here reads them every
``period_s`` with :meth:`NixlRuntime.inspect` -- never on vLLM's engine
thread, which must not block -- and keeps the ones it has not seen, for the
worker to drain with its stats. Writes that scroll out of the runtime's window
between two reads are not sampled (256 writes per period).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..transports.nixl import NixlRuntime

logger = logging.getLogger(__name__)


class WriteSampler:
    """Collects a producer runtime's completed writes in the background."""

    def __init__(self, runtime: NixlRuntime, period_s: float = 1.0) -> None:
        self._runtime = runtime
        self._period_s = period_s
        self._lock = threading.Lock()
        self._new: list[Any] = []
        self._last: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pushkv-write-sampler",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            self.sample()

    def sample(self) -> None:
        """Read the runtime's recent writes now and keep the new ones."""
        try:
            recent = self._runtime.inspect(timeout_s=self._period_s * 5).recent_writes
        except Exception:  # the runtime is closing, or busy: try again next period
            return
        start = 0
        for i in range(len(recent) - 1, -1, -1):
            if recent[i] is self._last:
                start = i + 1
                break
        fresh = recent[start:]
        if fresh:
            with self._lock:
                self._new.extend(fresh)
                self._last = fresh[-1]

    def take(self) -> list[Any]:
        """Writes completed since the last call (WriteResult objects)."""
        with self._lock:
            out, self._new = self._new, []
        return out

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(RuntimeError):
            self._thread.join(self._period_s * 10)
