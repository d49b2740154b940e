"""``pushkv plan``: search prefill/decode configurations for goodput under SLOs.

:mod:`.bounds` holds the closed-form floors and capacity, :mod:`.measure` one
simulated point and its SLO attainment, :mod:`.search` the configurations, the
pruning and the rate bisection, :mod:`.report` the table, JSON and Pareto plot,
:mod:`.backends` where the searches run (local processes or Ray), :mod:`.cli` the
command. Searching needs ``simpy``, the plot ``matplotlib``
(``pip install pushkv[sim]``), each imported where used.
"""

from .backends import BACKENDS, BackendError, WorkerLostError
from .measure import SLO, Sample, Verdict, judge
from .search import Candidate, Outcome, Plan, PlanError, PlanSpec, run_plan

__all__ = ["BACKENDS", "SLO", "BackendError", "Candidate", "Outcome", "Plan", "PlanError",
           "PlanSpec", "Sample", "Verdict", "WorkerLostError", "judge", "run_plan"]
