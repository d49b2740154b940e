"""Dedicated hardware: every engine and frontend process has cores of its own.

The default (``host.model = "dedicated"``), as on the GPU nodes of the post: no host
code runs. A step lasts what the profile's costs say, a woken process runs at once,
an output reaches the client ``return_s`` after decode emitted it, and a host time the
profile gives as a median is that median. The one queue left is the profile's own:
an instance's API server takes legs one at a time, each ``ingest_s`` long.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import simpy

if TYPE_CHECKING:
    from ..profile import Profile
    from ..request import SimRequest
    from .model import Side


class Dedicated:
    """The host model of cores for every process: each hook costs nothing."""

    name = "dedicated"
    hop_wake_s = 0.0
    return_wake_s = 0.0

    def __init__(self, env: simpy.Environment, profile: Profile) -> None:
        self.env = env
        self.profile = profile
        self._api: dict[str, simpy.Resource] = {}  #: each instance's API server

    @property
    def busy_s(self) -> float:
        return 0.0

    @property
    def busy_by_process(self) -> dict[str, float]:
        return {}

    def spread(self, seconds: float) -> float:
        return seconds

    def split(self, seconds: float) -> tuple[float, float]:
        return seconds, 0.0

    def work(self, seconds: float, side: Side) -> simpy.Event:
        return self.env.timeout(seconds)

    def beside(self, side: Side, dt: float) -> None:
        return None

    def idle(self, side: Side, holding: bool,
             sleep: Callable[[], simpy.Event]) -> Generator[Any, Any, float]:
        yield sleep()
        return 0.0

    def thread_wake(self, side: Side) -> Generator[Any, Any, None]:
        yield from ()

    def wake_s(self, side: Side) -> float:
        return 0.0

    def ingest(self, process: str, work_s: float, wait_s: float,
               started: Callable[[], None], then: Callable[[], None]) -> None:
        """The API server takes legs one at a time, each for its whole time."""
        api = self._api.get(process)
        if api is None:
            api = self._api[process] = simpy.Resource(self.env, capacity=1)
        ingest_s = work_s + wait_s

        def serve() -> Generator[Any, Any, None]:
            with api.request() as slot:
                yield slot
                started()
                yield self.env.timeout(ingest_s)
            then()

        self.env.process(serve())

    def answer(self, process: str, work_s: float, wait_s: float,
               after: Callable[[float], None]) -> None:
        after(work_s + wait_s)

    def token(self, req: SimRequest) -> None:
        return None

    def intake_wait(self, process: str) -> float:
        return 0.0

    def drain(self, env: simpy.Environment) -> None:
        return None
