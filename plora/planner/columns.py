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
list-scheduled longest first -- or, when every job runs on one GPU, assigned to GPUs by a
second small integer program that balances their loads exactly (longest-first leaves a
late single job sticking out: 7% past the mean load on an H200 profile of the 0.5B
shape). The cheapest covering is not always the shortest (it may keep GPUs idle), so a
second covering minimises a makespan bound instead. `plan_sweep` keeps whichever plan
predicts the shorter makespan.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from plora.planner.baselines import _job, list_schedule, makespan
from plora.planner.lp_bound import ConfigurationLP, column_key
from plora.planner.plan import Job
from plora.planner.workload import Workload

__all__ = ["column_jobs", "balanced_one_gpu_jobs"]

#: seconds for the GPU assignment of one-GPU jobs (a good one comes fast; proving it best does not)
BALANCE_LIMIT_S = 3.0


def column_jobs(wl: Workload, lp: ConfigurationLP, *, also: Sequence[Job] = (), time_limit_s: float = 10.0,
                prefix: str = "c", objective: str = "gpu_seconds") -> list[Job] | None:
    """An exact covering of the sweep by ``lp``'s columns and the jobs of ``also`` (another
    plan's: the LP's columns are the ones its fractional optimum needed, not always enough
    for a good integer one), list-scheduled; None when the integer program finds no
    covering in time.

    ``objective``: ``gpu_seconds``, the cheapest covering; or ``makespan``, the covering
    with the least makespan bound -- the larger of its GPU-seconds over the GPUs and its
    longest job -- GPU-seconds breaking ties. The cheapest covering can leave GPUs idle:
    one TP-2 job of every adapter on 4 GPUs costs fewer GPU-seconds than the TP-4 job, and
    takes 1.5x as long."""
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
    if objective == "makespan":
        res = _least_makespan_bound(wl, A, counts, costs / scale, np.asarray(degrees), time_limit_s)
    else:
        res = milp(costs / scale, constraints=LinearConstraint(A, lb=counts, ub=counts),
                   integrality=np.ones(len(costs)), bounds=Bounds(0, np.inf),
                   options={"time_limit": float(time_limit_s), "disp": False})
    if res is None or res.x is None:
        return None
    x = np.round(res.x[:len(costs)]).astype(int)
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
    jobs = list_schedule(wl.cost_model, items, wl.gpus, prefix)
    if all(d == 1 for _, d in items) and wl.gpus > 1:
        balanced = balanced_one_gpu_jobs(wl.cost_model, items, wl.gpus, prefix=prefix,
                                         time_limit_s=min(time_limit_s, BALANCE_LIMIT_S))
        if balanced is not None and makespan(balanced) < makespan(jobs) - 1e-9:
            return balanced
    return jobs


def _least_makespan_bound(wl: Workload, A: np.ndarray, counts: np.ndarray, cost: np.ndarray, degrees: np.ndarray,
                          time_limit_s: float):
    """min T + eps * GPU-seconds over exact coverings x (integer), with T >= GPU-seconds / G
    and T >= the time of every column used (y_c = 1 where x_c > 0); costs in scaled units."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(cost)
    times = cost / degrees  # a column's job time, scaled
    ub = np.maximum(1.0, np.min(np.where(A > 0, counts[:, None] / np.maximum(A, 1), np.inf), axis=0))
    # variables: x (n, integer), y (n, binary), T
    nv = 2 * n + 1
    rows, lo, hi = [], [], []
    cover = np.zeros((len(counts), nv))
    cover[:, :n] = A
    rows.append(cover), lo.append(counts), hi.append(counts)
    area = np.zeros((1, nv))
    area[0, :n] = cost / wl.gpus
    area[0, -1] = -1.0
    rows.append(area), lo.append([-np.inf]), hi.append([0.0])
    link = np.zeros((n, nv))  # x_c <= ub_c * y_c
    link[np.arange(n), np.arange(n)] = 1.0
    link[np.arange(n), n + np.arange(n)] = -ub
    rows.append(link), lo.append(np.full(n, -np.inf)), hi.append(np.zeros(n))
    longest = np.zeros((n, nv))  # times_c * y_c <= T
    longest[np.arange(n), n + np.arange(n)] = times
    longest[:, -1] = -1.0
    rows.append(longest), lo.append(np.full(n, -np.inf)), hi.append(np.zeros(n))
    objective = np.zeros(nv)
    objective[-1] = 1.0
    objective[:n] = 1e-4 * cost / wl.gpus
    integrality = np.concatenate([np.ones(2 * n), [0]])
    upper = np.concatenate([ub, np.ones(n), [np.inf]])
    return milp(objective, constraints=[LinearConstraint(np.vstack(rows), np.concatenate(lo), np.concatenate(hi))],
                integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
                options={"time_limit": float(time_limit_s), "disp": False})


def balanced_one_gpu_jobs(cm, items, gpus: int, *, prefix: str = "c", time_limit_s: float = 10.0) -> list[Job] | None:
    """One-GPU jobs assigned to ``gpus`` GPUs with the least makespan (P||Cmax as an integer
    program, within the time limit); each GPU runs its jobs longest first. None when HiGHS
    finds no assignment in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n = len(items)
    if n == 0:
        return None
    times = np.array([cm.job_time(adapters, 1) for adapters, _ in items], dtype=float)
    scale = max(float(times.max()), 1e-9)
    t = times / scale
    # variables: y[j, g] (n * gpus binaries, j-major), then the makespan C
    nv = n * gpus + 1
    assign = np.zeros((n, nv))
    for j in range(n):
        assign[j, j * gpus:(j + 1) * gpus] = 1.0
    load = np.zeros((gpus, nv))
    for g in range(gpus):
        load[g, g:n * gpus:gpus] = t
        load[g, -1] = -1.0
    cost = np.zeros(nv)
    cost[-1] = 1.0
    integrality = np.ones(nv)
    integrality[-1] = 0
    # symmetry: job j (longest first) only on GPUs 0..j
    order = np.argsort(-t, kind="stable")
    upper = np.ones(nv)
    upper[-1] = np.inf
    for rank, j in enumerate(order):
        upper[j * gpus + min(rank, gpus - 1) + 1:(j + 1) * gpus] = 0.0
    res = milp(cost, constraints=[LinearConstraint(assign, lb=1, ub=1), LinearConstraint(load, ub=0)],
               integrality=integrality, bounds=Bounds(np.zeros(nv), upper),
               options={"time_limit": float(time_limit_s), "disp": False})
    if res.x is None:
        return None
    y = np.round(res.x[:-1]).reshape(n, gpus)
    if not np.all(y.sum(axis=1) == 1):
        return None
    jobs, k = [], 0
    for g in range(gpus):
        start = 0.0
        for j in sorted(np.flatnonzero(y[:, g]), key=lambda j: -times[j]):
            job = _job(cm, items[j][0], 1, [g], start, f"{prefix}{k:04d}")
            jobs.append(job)
            start, k = job.end, k + 1
    jobs.sort(key=lambda j: (j.start, j.gpus))
    return jobs
