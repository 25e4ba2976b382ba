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

import importlib
from typing import Any

#: each public name, and the module it comes from: imported when first asked for, so that
#: importing a light part of the planner (its errors, `plora.planner.plan`) does not import
#: cvxpy (2.7 s on an H200 machine, 5 s and more on a first use, before the sweep could plan)
_EXPORTS = {
    "BASELINES": "plora.planner.baselines",
    "baseline_jobs": "plora.planner.baselines",
    "lower_bound": "plora.planner.bounds",
    "compact": "plora.planner.compact",
    "PlannerError": "plora.planner.errors",
    "EXACT_MAX_ADAPTERS": "plora.planner.exact",
    "ExactResult": "plora.planner.exact",
    "solve_exact": "plora.planner.exact",
    "GUROBI_SIZE_LIMIT": "plora.planner.ilp",
    "Pack": "plora.planner.ilp",
    "PackSolver": "plora.planner.ilp",
    "SolverLog": "plora.planner.ilp",
    "Job": "plora.planner.plan",
    "Plan": "plora.planner.plan",
    "PLANNING_BUDGET_S": "plora.planner.scheduler",
    "baseline_plan": "plora.planner.scheduler",
    "plan_sweep": "plora.planner.scheduler",
    "schedule": "plora.planner.scheduler",
    "SimulationResult": "plora.planner.simulate",
    "simulate": "plora.planner.simulate",
    "AdapterType": "plora.planner.workload",
    "Workload": "plora.planner.workload",
}


__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'plora.planner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
