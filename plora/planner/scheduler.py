"""The job scheduler (PLoRA Alg. 2) and the planner's entry point, :func:`plan_sweep`.

The scheduler simulates time on the cost model: at time 0 and whenever a job
ends, it asks DTM how to fill the free GPUs with new jobs from the adapters left,
starts them, and advances to the next job end. The queue of jobs it started, in
order, is the plan the engine executes.
"""

from __future__ import annotations

import time

import numpy as np

from plora.cost.model import AdapterLoad, CostModel
from plora.planner.baselines import BASELINES, baseline_jobs, makespan
from plora.planner.bounds import lower_bound
from plora.planner.columns import column_jobs
from plora.planner.compact import compact
from plora.planner.dtm import SchedulerState, dtm
from plora.planner.errors import PlannerError
from plora.planner.exact import EXACT_MAX_ADAPTERS, solve_exact
from plora.planner.improve import improve
from plora.planner.ilp import PackSolver, SolverLog
from plora.planner.lp_bound import configuration_lp
from plora.planner.plan import Job, Plan
from plora.planner.workload import Workload

__all__ = ["PLANNING_BUDGET_S", "baseline_plan", "plan_sweep", "schedule"]

#: the soft planning budget `plora plan`/`plora sweep` give `plan_sweep` (seconds): once spent,
#: no further scheduling run starts and DTM keeps one branch per level
PLANNING_BUDGET_S = 40.0

#: the strategy name of a plan built from the configuration LP's columns (`plora.planner.columns`)
LP_COLUMNS = "lp_columns"
#: ... of the plan local search reached from the others (`plora.planner.improve`)
SEARCH = "search"
#: ... of the exact solver's plan (`plora.planner.exact`)
EXACT = "exact"
#: seconds of local search without a planning budget; with one, it has what the steps before
#: left of it, and at least this share of it
IMPROVE_LIMIT_S = 10.0
IMPROVE_SHARE = 0.1
#: the share of a planning budget after which no further greedy scheduling run starts
DTM_SHARE = 0.5
#: seconds the exact solver may take on a small sweep (less when the budget has less left)
EXACT_LIMIT_S = 10.0
#: scheduling runs tried on small sweeps (the first ones of RUNS): the search and the exact
#: solver that follow see whole plans, which the greedy runs' variety stood in for
SMALL_SWEEP_RUNS = 3

#: (efficiency floor, slack) of the scheduling runs plan_sweep tries, best first; it keeps
#: the plan predicted shortest. The floor is F's least acceptable pack efficiency
#: (see plora.planner.ilp); a run sizes new jobs to at most ``slack`` times the time it
#: predicts is left. One greedy run is a heuristic whose weak spots depend on the sweep
#: (a floor too high strands odd adapters until the end, one too low wastes GPU time),
#: so a small portfolio of settings is cheap insurance (a run takes seconds).
# Looser slacks let a pack run somewhat past the remaining-time estimate: where a per-job
# start-up cost dominates (small sweeps, CPU), one longer job beats two short ones. Low
# floors (early in the list: they are fast) let incomplete packs of the longest adapters
# start first where a large per-step constant or per-bucket cost makes every incomplete
# pack look inefficient (fitted GPU profiles).
RUNS = ((0.9, 1.0), (0.5, 1.0), (0.5, 1.3), (0.6, 1.0), (0.8, 1.0), (0.95, 1.0), (0.9, 0.8), (0.97, 1.0), (0.9, 1.3),
        (0.8, 1.6), (0.7, 1.0))


def _take_gpus(free: set[int], d: int, gpus: int) -> list[int]:
    """d free GPUs, an aligned block when one is free (keeps TP groups on neighbouring devices)."""
    for s in range(0, gpus - d + 1, d):
        block = list(range(s, s + d))
        if all(g in free for g in block):
            return block
    return sorted(free)[:d]


def _time_left(wl: Workload, now: float, running: list[Job], remaining: np.ndarray) -> float:
    """The time still needed, as the planner prices it: committed plus the waiting work over
    all GPUs, and the longest adapters left, packed with their own kind, starting now.

    The longest adapters are priced as a pack, not alone: where the per-step constant
    dominates, the pack that shares it is longer than any adapter alone, and sizing jobs
    to the lone time would keep the longest adapters from being packed until the end."""
    committed = sum(j.tp * (j.end - now) for j in running)
    spread = (committed + float(remaining @ wl.work)) / wl.gpus
    left = np.flatnonzero(remaining > 0)
    longest = max((wl.pack_time(int(i), int(remaining[i])) for i in left), default=0.0)
    return max(spread, longest)


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
            target_left = _time_left(wl, now, running, remaining)
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
    exact: bool = True,
) -> Plan:
    """Plan a sweep: which adapters train together, at which TP degree, on which GPUs, when.

    ``solver``: ``auto`` (Gurobi within its pip licence's size limit, else HiGHS),
    ``gurobi`` or ``highs``. ``load_factor``: the fraction C of GPU memory a job may
    plan to use. ``objective``: ``makespan`` or ``paper`` (see
    :mod:`plora.planner.ilp`). ``time_limit_s``: a soft budget for planning; each ILP
    solve gets a share of it, and once it is spent DTM keeps only the best branch
    at each level and no further scheduling runs start (the first always finishes).

    Every candidate plan -- DTM's, the configuration LP's columns (cheapest and shortest
    covering), each baseline -- is compacted (:func:`plora.planner.compact.compact`) and
    judged by its makespan; local search (:mod:`plora.planner.improve`) then tries to
    shorten the best ones. ``exact``: on sweeps of at most
    :data:`~plora.planner.exact.EXACT_MAX_ADAPTERS` adapters, the exact solver
    (:mod:`plora.planner.exact`) then looks for a shorter plan within what is left of the
    budget; when its search finishes the plan is optimal (``Plan.optimal``; the lower
    bound is then the makespan). ``strategy`` says which plan was kept. The returned plan
    is never predicted worse than the baselines.
    """
    t0 = time.perf_counter()
    if not loads:
        raise PlannerError("adapters: nothing to plan (empty list)")
    wl = Workload(loads, cost_model, gpus, load_factor=load_factor, max_adapters_per_job=max_adapters_per_job)
    log = SolverLog()
    per_solve = 2.0 if time_limit_s is None else max(0.05, min(2.0, time_limit_s / 20))
    pack_solver = PackSolver(wl, objective=objective, solver=solver, log=log, time_limit_s=per_solve)
    deadline = None if time_limit_s is None else t0 + time_limit_s
    # the greedy runs get the first part of the budget; the rest is the search's
    dtm_deadline = None if time_limit_s is None else t0 + DTM_SHARE * time_limit_s
    small = len(loads) <= EXACT_MAX_ADAPTERS

    candidates: dict[str, list[Job]] = {}
    best_dtm: list[Job] | None = None
    best_run = RUNS[0]
    runs = RUNS if objective == "makespan" else RUNS[:1]  # the paper's F has neither knob
    if small:  # the search below starts from every candidate and sees the whole plan
        runs = runs[:SMALL_SWEEP_RUNS]
    for floor, slack in runs:
        if dtm_deadline is not None and time.perf_counter() > dtm_deadline and best_dtm is not None:
            break
        pack_solver.efficiency_floor = floor
        jobs = compact(schedule(wl, pack_solver, slack=slack, deadline=dtm_deadline))
        if best_dtm is None or makespan(jobs) < makespan(best_dtm) * (1 - 1e-9):
            best_dtm, best_run = jobs, (floor, slack)
    assert best_dtm is not None
    candidates["dtm"] = best_dtm
    baselines: dict[str, float] = {}
    for name in BASELINES:
        jobs = compact(baseline_jobs(name, wl.loads, cost_model, gpus, load_factor))
        candidates[name] = jobs
        baselines[name] = makespan(jobs)

    configuration = configuration_lp(wl, solver=solver)
    if configuration is not None:
        limit = 10.0 if deadline is None else min(10.0, max(1.0, (deadline - time.perf_counter()) / 4))
        coverings = [column_jobs(wl, configuration, also=best_dtm),  # the cheapest: 10 s, as ever
                     column_jobs(wl, configuration, also=best_dtm, objective="makespan", time_limit_s=limit)]
        coverings = [compact(c) for c in coverings if c is not None]
        if coverings:
            candidates[LP_COLUMNS] = min(coverings, key=makespan)
    notes = []
    if objective == "makespan":
        notes.append(f"packed schedule from efficiency floor {best_run[0]}, slack {best_run[1]}")
    names = sorted(candidates, key=lambda k: (makespan(candidates[k]), k != "dtm", k != LP_COLUMNS))
    search_s = IMPROVE_LIMIT_S
    if deadline is not None and time_limit_s is not None:
        search_s = max(deadline - time.perf_counter(), IMPROVE_SHARE * time_limit_s)
    improved = improve(wl, [candidates[k] for k in names], deadline=time.perf_counter() + search_s)
    if improved is not None:
        candidates[SEARCH] = improved.jobs
        notes.append(f"local search: {improved.moves} moves from the {names[improved.start]} plan "
                     f"({makespan(candidates[names[improved.start]]):.1f}s)")
    strategy = min(candidates, key=lambda k: (makespan(candidates[k]), k != "dtm", k != LP_COLUMNS, k != SEARCH))
    chosen = candidates[strategy]
    optimal = False
    if exact and small:
        limit = EXACT_LIMIT_S if deadline is None else min(EXACT_LIMIT_S, max(0.0, deadline - time.perf_counter()))
        found = solve_exact(wl, upper_bound=makespan(chosen), time_limit_s=limit) if limit > 0 else None
        if found is not None:
            optimal = found.proven
            if found.jobs and makespan(found.jobs) < makespan(chosen) * (1 - 1e-9):
                chosen, strategy = found.jobs, EXACT
            notes.append(f"exact search: {'optimal' if found.proven else 'stopped at its time limit'} "
                         f"({found.nodes} nodes, {found.seconds:.1f}s)")
    notes = list(dict.fromkeys(log.fallbacks)) + notes
    if strategy != "dtm":
        notes.append(f"the packed schedule predicted {makespan(candidates['dtm']):.1f}s; kept {strategy}")
    lb = lower_bound(wl, lp=False, configuration=configuration)  # the LP is solved above (None: no convergence)
    if optimal:
        lb = makespan(chosen)  # proven: no plan on this cost model is shorter
    return Plan(
        jobs=chosen,
        adapters=list(loads),
        gpus=gpus,
        makespan=makespan(chosen),
        lower_bound=lb,
        baselines=baselines,
        packed_makespan=makespan(best_dtm),
        solver=log.summary,
        solver_calls=dict(log.calls),
        planning_seconds=time.perf_counter() - t0,
        objective=objective,
        strategy=strategy,
        load_factor=load_factor,
        max_adapters_per_job=max_adapters_per_job,
        cost_model=cost_model.name,
        notes=notes,
        optimal=optimal,
    )


def baseline_plan(
    loads: list[AdapterLoad],
    cost_model: CostModel,
    gpus: int,
    name: str,
    *,
    load_factor: float = 0.9,
) -> Plan:
    """The plan of a baseline strategy (`plora.planner.baselines`: one adapter per job), to
    run on the same engine as a packed plan: what packing saves is then measured, not only
    predicted. Every adapter must fit a GPU set, as for `plan_sweep`."""
    t0 = time.perf_counter()
    if not loads:
        raise PlannerError("adapters: nothing to plan (empty list)")
    wl = Workload(loads, cost_model, gpus, load_factor=load_factor, max_adapters_per_job=1)
    baselines = {b: makespan(compact(baseline_jobs(b, wl.loads, cost_model, gpus, load_factor))) for b in BASELINES}
    chosen = compact(baseline_jobs(name, wl.loads, cost_model, gpus, load_factor))
    return Plan(
        jobs=chosen,
        adapters=list(loads),
        gpus=gpus,
        makespan=makespan(chosen),
        lower_bound=lower_bound(wl, lp=False),
        baselines=baselines,
        packed_makespan=0.0,
        solver="none",
        planning_seconds=time.perf_counter() - t0,
        strategy=name,
        load_factor=load_factor,
        max_adapters_per_job=1,
        cost_model=cost_model.name,
        notes=[f"the {name} baseline, as asked (planner.baseline): one adapter per job"],
    )
