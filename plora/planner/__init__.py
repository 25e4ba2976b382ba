"""Planning packed LoRA sweeps: which adapters share a job, at which TP degree, when.

* :mod:`~plora.planner.workload` -- adapters grouped into interchangeable types.
* :mod:`~plora.planner.ilp` -- F(D, K), the best pack for one job, as an ILP (cvxpy).
* :mod:`~plora.planner.dtm` -- DTM, splitting free GPUs into jobs of power-of-two degrees.
* :mod:`~plora.planner.columns` -- a second packed plan from the configuration LP's columns.
* :mod:`~plora.planner.scheduler` -- the job scheduler (PLoRA Alg. 2) and :func:`plan_sweep`.
* :mod:`~plora.planner.compact` -- every job as early as its GPUs allow (how plans run).
* :mod:`~plora.planner.improve` -- local search over finished plans.
* :mod:`~plora.planner.exact` -- the exact optimum of small sweeps (branch and bound).
* :mod:`~plora.planner.baselines`, :mod:`~plora.planner.bounds` -- what a plan is judged against.
* :mod:`~plora.planner.simulate` -- replay and check any plan on a cost model.
"""

from plora.planner.baselines import BASELINES, baseline_jobs
from plora.planner.bounds import lower_bound
from plora.planner.compact import compact
from plora.planner.errors import PlannerError
from plora.planner.exact import EXACT_MAX_ADAPTERS, ExactResult, solve_exact
from plora.planner.ilp import GUROBI_SIZE_LIMIT, Pack, PackSolver, SolverLog
from plora.planner.plan import Job, Plan
from plora.planner.scheduler import PLANNING_BUDGET_S, baseline_plan, plan_sweep, schedule
from plora.planner.simulate import SimulationResult, simulate
from plora.planner.workload import AdapterType, Workload

__all__ = [
    "BASELINES",
    "EXACT_MAX_ADAPTERS",
    "ExactResult",
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
    "compact",
    "lower_bound",
    "baseline_plan",
    "plan_sweep",
    "schedule",
    "simulate",
    "solve_exact",
]
