"""A SimPy timing model of pull vs push KV transfer, driving the real protocol endpoints.

Configuration (profiles, scenarios, workloads) and the command line import
with numpy alone; running a simulation needs ``simpy``, plotting
``matplotlib`` and sweeps ``tqdm`` (``pip install pushkv[sim]``), each
imported where used.
"""

from typing import Any

from .profile import DEFAULT, Profile, ProfileError, load_profile
from .scenario import (
    ConfigError,
    Dispatch,
    FaultConfig,
    ProtocolSettings,
    RouterPolicy,
    SimConfig,
    TransferMode,
)
from .workload import WorkloadConfig, WorkloadError

__all__ = [
    "DEFAULT", "ConfigError", "Dispatch", "FaultConfig", "Profile", "ProfileError",
    "ProtocolSettings", "RouterPolicy", "RunResult", "SimConfig", "SimulationError",
    "TransferMode", "WorkloadConfig", "WorkloadError", "load_profile", "run",
]


def __getattr__(name: str) -> Any:
    """``run``, ``RunResult`` and ``SimulationError`` load SimPy on first use."""
    if name in ("run", "RunResult", "SimulationError"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
