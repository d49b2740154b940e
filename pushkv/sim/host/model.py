"""The interface every host model implements: the hooks the engines, the transport and
the router call where host processes would cost time.

A *side* is ``"prefill"`` or ``"decode"``: the instances whose processes a hook is
about. A *process* names one frontend process (an instance's API server by its engine
id, or the router). Every hook of :class:`~pushkv.sim.host.dedicated.Dedicated`
costs nothing beyond what the profile's own keys say.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

import simpy

if TYPE_CHECKING:
    from ..profile import Profile
    from ..request import SimRequest

Side = str  #: "prefill" or "decode"


class HostModel(Protocol):
    """What a host does to the processes of a simulated deployment."""

    name: str  #: as ``host.model`` spells it
    #: the profile the engines run under (the shared CPU stretches host times by the
    #: share of a core each side gets): the runner simulates with this one
    profile: Profile
    hop_wake_s: float  #: what wake-ups add to one router hop
    return_wake_s: float  #: what wake-ups add to a token's way from decode to the client

    @property
    def busy_s(self) -> float:
        """Core-seconds the host's shared cores served (0 without them)."""
        ...

    @property
    def busy_by_process(self) -> dict[str, float]:
        """:attr:`busy_s` by the process served: an engine's loop (``"prefill engine"``),
        the work beside its steps (``"prefill beside"``), an API server (its engine's
        id), the relay (router and client); empty without shared cores."""
        ...

    def spread(self, seconds: float) -> float:
        """One draw of a host time the profile gives as a median (a connector key)."""
        ...

    def split(self, seconds: float) -> tuple[float, float]:
        """One draw of such a time as (work, wait): the part that holds a core, the part
        a stalled process waits holding none."""
        ...

    def work(self, seconds: float, side: Side) -> simpy.Event:
        """``seconds`` of one engine process's work (a step, or its part after the lock):
        its engine loop's, on ``side``'s core where the engines are pinned."""
        ...

    def beside(self, side: Side, dt: float) -> None:
        """An engine step of ``dt`` seconds ran: the work of the processes around it,
        which the step does not wait for."""
        ...

    def idle(self, side: Side, holding: bool,
             sleep: Callable[[], simpy.Event]) -> Generator[Any, Any, float]:
        """An engine loop with nothing to compute waits on ``sleep()`` until poked
        (``holding``: a request of its waits on a transfer) and wakes up; returns how long
        it stepped empty meanwhile."""
        ...

    def thread_wake(self, side: Side) -> Generator[Any, Any, None]:
        """A background thread of ``side`` (posting writes or reads) wakes for a job."""
        ...

    def wake_s(self, side: Side) -> float:
        """What the receiving thread of ``side`` adds to a message's way by waking."""
        ...

    def ingest(self, process: str, work_s: float, wait_s: float,
               started: Callable[[], None], then: Callable[[], None]) -> None:
        """A leg's time at the API server ``process``: ``started()`` when the server takes
        it up, ``then()`` when it is through (``work_s`` held, ``wait_s`` stalled)."""
        ...

    def answer(self, process: str, work_s: float, wait_s: float,
               after: Callable[[float], None]) -> None:
        """A prefill answer leaving the API server ``process``: ``after(extra)`` when
        the rest of its way (the hop) starts, ``extra`` the answer's own time when the
        host does not queue it."""
        ...

    def token(self, req: SimRequest) -> None:
        """Decode emitted a token of ``req`` now, on its way to the client."""
        ...

    def intake_wait(self, process: str) -> float:
        """How long ``process`` (the router) takes to take up a request reaching it now."""
        ...

    def drain(self, env: simpy.Environment) -> None:
        """Run ``env`` until the host's own work (tokens still on their way) is done."""
        ...


def token_return_s(profile: Profile, return_wake_s: float) -> float:
    """A token's way from decode to the client: the hop, the client's way, the wake-ups
    and decode's ``return_s``."""
    net = profile.network
    return net.router_hop_s + net.client_hop_s + return_wake_s + profile.decode.return_s
