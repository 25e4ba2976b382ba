"""The job scheduler (PLoRA Alg. 2) and the planner's entry point, :func:`plan_sweep`.

The scheduler simulates time on the cost model: at time 0 and whenever a job
ends, it asks DTM how to fill the free GPUs with new jobs from the adapters left,
starts them, and advances to the next job end. The queue of jobs it started, in
order, is the plan the engine executes.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from plora.costmodel import AdapterLoad, CostModel
from plora.planner.baselines import BASELINES, baseline_jobs, makespan
from plora.planner.bounds import lower_bound
from plora.planner.dtm import SchedulerState, dtm
from plora.planner.errors import PlannerError
from plora.planner.ilp import PackSolver, SolverLog
from plora.planner.plan import Job, Plan
from plora.planner.workload import Workload

__all__ = ["plan_sweep", "schedule"]

#: Each scheduling run sizes jobs to at most ``slack`` times the time it predicts is left;
#: plan_sweep tries these and keeps the best plan (the first is usually it).
SLACKS = (1.0, 0.8, 1.25)


def _take_gpus(free: set[int], d: int, gpus: int) -> list[int]:
    """d free GPUs, an aligned block when one is free (keeps TP groups on neighbouring devices)."""
    for s in range(0, gpus - d + 1, d):
        block = list(range(s, s + d))
        if all(g in free for g in block):
            return block
    return sorted(free)[:d]


def schedule(
    wl: Workload,
    solver: PackSolver,
    *,
    slack: float = 1.0,
    deadline: float | None = None,
    prefix: str = "j",
) -> list[Job]:
    """Run Alg. 2 on ``wl`` and return the jobs in launch order."""
    cm = wl.cost_model
    pools = [list(ids) for ids in wl.ids]
    remaining = np.array(wl.counts, dtype=int)
    free = set(range(wl.gpus))
    running: list[Job] = []
    jobs: list[Job] = []
    now = 0.0
    while remaining.sum() > 0:
        if free:
            committed = sum(j.tp * (j.end - now) for j in running)
            target_left = (committed + float(remaining @ wl.work)) / wl.gpus
            state = SchedulerState(now, len(free), tuple(int(x) for x in remaining), [(j.tp, j.end) for j in running])
            greedy = deadline is not None and time.perf_counter() > deadline
            cand = dtm(wl, solver, state, slack * target_left, greedy=greedy)
            for pack in sorted(cand.packs, key=lambda p: -p.d):
                members: list[AdapterLoad] = []
                for t, n in enumerate(pack.counts):
                    for _ in range(n):
                        members.append(wl.by_id[pools[t].pop(0)])
                remaining -= np.asarray(pack.counts)
                gpus = _take_gpus(free, pack.d, wl.gpus)
                free -= set(gpus)
                job = Job(
                    id=f"{prefix}{len(jobs):04d}",
                    adapters=[a.id for a in members],
                    tp=pack.d,
                    gpus=gpus,
                    start=now,
                    end=now + cm.job_time(members, pack.d),
                    step_time=cm.step_time(members, pack.d),
                    peak_memory=cm.memory(members, pack.d),
                )
                jobs.append(job)
                running.append(job)
        if remaining.sum() == 0:
            break
        if not running:
            left = next(pools[t][0] for t in range(len(pools)) if pools[t])
            raise PlannerError(f"adapter {left}: no job could be formed for it on {wl.gpus} GPUs")
        now = min(j.end for j in running)
        for j in [j for j in running if j.end <= now * (1 + 1e-12)]:
            running.remove(j)
            free |= set(j.gpus)
    return jobs


def plan_sweep(
    loads: list[AdapterLoad],
    cost_model: CostModel,
    gpus: int,
    *,
    solver: str = "auto",
    load_factor: float = 0.9,
    max_adapters_per_job: int | None = None,
    objective: str = "makespan",
    time_limit_s: float | None = None,
) -> Plan:
    """Plan a sweep: which adapters train together, at which TP degree, on which GPUs, when.

    ``solver``: ``auto`` (Gurobi within its pip licence's size limit, else HiGHS),
    ``gurobi`` or ``highs``. ``load_factor``: the fraction C of GPU memory a job may
    plan to use. ``objective``: ``makespan`` or ``paper`` (see
    :mod:`plora.planner.ilp`). ``time_limit_s``: a soft budget for planning; each ILP
    solve gets a share of it, and once it is spent the scheduler stops exploring
    alternative GPU splits. The returned plan is never predicted worse than the
    baselines: if one of them predicts a shorter makespan, it is returned instead
    (``strategy`` says so).
    """
    t0 = time.perf_counter()
    if not loads:
        raise PlannerError("adapters: nothing to plan (empty list)")
    wl = Workload(loads, cost_model, gpus, load_factor=load_factor, max_adapters_per_job=max_adapters_per_job)
    log = SolverLog()
    per_solve = 10.0 if time_limit_s is None else max(0.05, min(10.0, time_limit_s / 8))
    pack_solver = PackSolver(wl, objective=objective, solver=solver, log=log, time_limit_s=per_solve)
    deadline = None if time_limit_s is None else t0 + time_limit_s

    candidates: dict[str, list[Job]] = {}
    best_dtm: list[Job] | None = None
    for slack in SLACKS:
        if deadline is not None and time.perf_counter() > deadline and best_dtm is not None:
            break
        jobs = schedule(wl, pack_solver, slack=slack, deadline=deadline)
        if best_dtm is None or makespan(jobs) < makespan(best_dtm) * (1 - 1e-9):
            best_dtm = jobs
    assert best_dtm is not None
    candidates["dtm"] = best_dtm
    baselines: dict[str, float] = {}
    for name in BASELINES:
        jobs = baseline_jobs(name, wl.loads, cost_model, gpus, load_factor)
        candidates[name] = jobs
        baselines[name] = makespan(jobs)

    strategy = min(candidates, key=lambda k: (makespan(candidates[k]), k != "dtm"))
    chosen = candidates[strategy]
    notes = list(dict.fromkeys(log.fallbacks))
    if strategy != "dtm":
        notes.append(f"the packed schedule predicted {makespan(candidates['dtm']):.1f}s; kept {strategy}")
    lb = lower_bound(wl)
    return Plan(
        jobs=chosen,
        adapters=list(loads),
        gpus=gpus,
        makespan=makespan(chosen),
        lower_bound=lb,
        baselines=baselines,
        solver=log.summary,
        solver_calls=dict(log.calls),
        planning_seconds=time.perf_counter() - t0,
        objective=objective,
        strategy=strategy,
        load_factor=load_factor,
        max_adapters_per_job=max_adapters_per_job,
        cost_model=cost_model.name,
        notes=notes,
    )
