"""The host the engines run on, behind one interface (:class:`~.model.HostModel`).

The profile's ``[host]`` section names the model (``host.model``), and the runner
builds it with :func:`host_model` and hands it to the transport, the engines and the
router, which call its hooks wherever a host process would cost time:

* ``"dedicated"`` (:class:`~.dedicated.Dedicated`, default): every process has cores
  of its own; every hook costs nothing, so the GPU path runs no host code;
* ``"shared-cpu"`` (:class:`~.shared_cpu.SharedCpu`): one machine's cores shared by
  the engines and the frontends -- a share of a core, wake-ups, one processor-sharing
  pool (:mod:`.cores`), the frontends as a queue (:mod:`.frontend`), host times around
  their medians (:mod:`.spread`).

The section's keys (:mod:`.profile`) load with numpy alone; the models need SimPy and
are imported when one is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .profile import DEDICATED, MODELS, SHARED_CPU, HostProfile, HostSide

if TYPE_CHECKING:
    import numpy as np
    import simpy

    from ..profile import Profile
    from .model import HostModel

__all__ = ["DEDICATED", "MODELS", "SHARED_CPU", "HostProfile", "HostSide", "host_model"]


def host_model(profile: Profile, env: simpy.Environment, seeds: np.random.SeedSequence,
               in_flight: Callable[[], int] = lambda: 0) -> HostModel:
    """The host model ``profile.host.model`` names, for one run in ``env``: ``seeds``
    is the run's seed sequence (a model with random draws spawns its streams from it),
    ``in_flight`` counts the requests in flight now. Use the returned model's
    ``profile``: the one the engines run under."""
    name = profile.host.model
    if name == DEDICATED:
        from .dedicated import Dedicated

        return Dedicated(env, profile)
    if name == SHARED_CPU:
        from .shared_cpu import SharedCpu

        return SharedCpu(env, profile, seeds, in_flight)
    raise ValueError(f"unknown host model {name!r} (known: {', '.join(MODELS)})")
