"""Planning packed LoRA sweeps: which adapters share a job, at which TP degree, when.

* :mod:`~plora.planner.workload` -- adapters grouped into interchangeable types.
* :mod:`~plora.planner.ilp` -- F(D, K), the best pack for one job, as an ILP (cvxpy).
* :mod:`~plora.planner.dtm` -- DTM, splitting free GPUs into jobs of power-of-two degrees.
* :mod:`~plora.planner.columns` -- a second packed plan from the configuration LP's columns.
* :mod:`~plora.planner.scheduler` -- the job scheduler (PLoRA Alg. 2) and :func:`plan_sweep`.
* :mod:`~plora.planner.baselines`, :mod:`~plora.planner.bounds` -- what a plan is judged against.
* :mod:`~plora.planner.simulate` -- replay and check any plan on a cost model.
"""

from plora.planner.baselines import BASELINES, baseline_jobs
from plora.planner.bounds import lower_bound
from plora.planner.errors import PlannerError
from plora.planner.ilp import GUROBI_SIZE_LIMIT, Pack, PackSolver, SolverLog
from plora.planner.plan import Job, Plan
from plora.planner.scheduler import PLANNING_BUDGET_S, plan_sweep, schedule
from plora.planner.simulate import SimulationResult, simulate
from plora.planner.workload import AdapterType, Workload

__all__ = [
    "BASELINES",
    "GUROBI_SIZE_LIMIT",
    "PLANNING_BUDGET_S",
    "AdapterType",
    "Job",
    "Pack",
    "PackSolver",
    "Plan",
    "PlannerError",
    "SimulationResult",
    "SolverLog",
    "Workload",
    "baseline_jobs",
    "lower_bound",
    "plan_sweep",
    "schedule",
    "simulate",
]
