"""A second packed plan, from the configuration LP's columns.

DTM builds jobs greedily in time: at each job end it fills the free GPUs with the packs
that look best for the time it predicts is left. Where packing is costly -- a large fixed
cost per step that every job pays, a cost per rank bucket -- those local choices can add
up to far more GPU-seconds than needed (an H200 profile of the 7B shape: 24% more than
the configuration LP on the paper's space).

The configuration LP (`plora.planner.lp_bound`) already holds the other view: the jobs
that cover the sweep in the fewest GPU-seconds, each priced exactly. Its columns are
turned into a plan here: the integer program over them (which jobs, how many of each,
covering every adapter exactly once) is solved with HiGHS, then the jobs are
list-scheduled longest first. `plan_sweep` keeps whichever plan predicts the shorter
makespan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plora.planner.baselines import list_schedule
from plora.planner.lp_bound import ConfigurationLP, column_key
from plora.planner.plan import Job
from plora.planner.workload import Workload

__all__ = ["column_jobs"]


def column_jobs(wl: Workload, lp: ConfigurationLP, *, also: Sequence[Job] = (), time_limit_s: float = 10.0,
                prefix: str = "c") -> list[Job] | None:
    """The cheapest exact covering of the sweep by ``lp``'s columns and the jobs of ``also``
    (another plan's: the LP's columns are the ones its fractional optimum needed, not always
    enough for a good integer one), list-scheduled; None when the integer program finds no
    covering in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    if not lp.counts:
        return None
    columns, degrees, costs = list(lp.counts), list(lp.degrees), list(lp.costs)
    type_of = {a: t for t, ids in enumerate(wl.ids) for a in ids}
    seen = {column_key(c, d) for c, d in zip(columns, degrees)}
    for job in also:
        c = np.zeros(len(wl.types))
        for a in job.adapters:
            c[type_of[a]] += 1
        if column_key(c, job.tp) not in seen:
            seen.add(column_key(c, job.tp))
            columns.append(c)
            degrees.append(job.tp)
            costs.append(job.tp * wl.job_time(c, job.tp))
    A = np.array(columns, dtype=float).T
    counts = np.asarray(wl.counts, dtype=float)
    costs = np.asarray(costs, dtype=float)
    scale = max(float(costs.max()), 1e-9)  # seconds of very different sizes: keep HiGHS' tolerances meaningful
    res = milp(costs / scale, constraints=LinearConstraint(A, lb=counts, ub=counts),
               integrality=np.ones(len(costs)), bounds=Bounds(0, np.inf),
               options={"time_limit": float(time_limit_s), "disp": False})
    if res.x is None:
        return None
    x = np.round(res.x).astype(int)
    if not np.array_equal(A @ x, counts):
        return None
    pools = [list(ids) for ids in wl.ids]
    items = []
    for j in np.flatnonzero(x):
        for _ in range(int(x[j])):
            members = []
            for t, n in enumerate(columns[j]):
                members += [wl.by_id[pools[t].pop(0)] for _ in range(int(n))]
            items.append((members, degrees[j]))
    return list_schedule(wl.cost_model, items, wl.gpus, prefix)
