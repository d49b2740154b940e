"""A SimPy timing model of pull vs push KV transfer, driving the real protocol endpoints.

Importing this package needs ``simpy`` and ``numpy`` (``pip install pushkv[sim]``);
plotting also needs ``matplotlib`` and sweeps ``tqdm``, imported where used.
"""

from .profile import DEFAULT, Profile, ProfileError, load_profile
from .run import RunResult, SimulationError, run
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
