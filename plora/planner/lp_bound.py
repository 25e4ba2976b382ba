"""The configuration-LP lower bound: the least GPU-seconds any set of jobs covering the sweep takes.

A *configuration* is one job: a degree d and a multiset of adapter types that fits d GPUs
(memory, cap). Its cost is exact: d x the job's time on the cost model (`Workload.job_time`:
the per-step constant for its longest adapter, each rank bucket for its longest adapter,
every adapter's own steps; phase by phase where the step is the longest of two pieces). Every schedule is a set of configurations covering every
adapter, and G GPUs supply G x makespan GPU-seconds, so

    makespan >= min { sum_c g_c x_c : sum_c a_c x_c >= counts, x >= 0 } / G.

The LP has a column per configuration -- too many to list -- so it is solved by column
generation: a restricted master over the columns found so far gives duals y (a price per
adapter type); the pricing problem, max y.a - d T over one job at degree d, is the same
integer program as the planner's F(D, K) with another objective; a column with positive
reduced cost joins the master. When pricing finds none, the master's value is the LP's.

This bound sees what the work bound cannot: that a short adapter packed with long ones
pays their steps' constant, and that rank buckets are paid per job.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import cvxpy as cp
import numpy as np

from plora.planner.ilp import SolverLog, job_time_model, pack_limits, solve_problem
from plora.planner.workload import Workload

__all__ = ["ConfigurationLP", "column_key", "configuration_lp", "configuration_lp_bound"]


@dataclass
class ConfigurationLP:
    """The solved configuration LP: its value and the columns column generation found.

    The columns are good jobs in their own right -- each priced exactly, together able to
    cover the sweep at the LP's cost -- which `plora.planner.columns` turns into a plan.
    """

    value: float  # least GPU-seconds of a fractional covering, over G: the bound
    counts: list[np.ndarray]  # per column: adapters of each type in the job
    degrees: list[int]  # per column: its TP degree
    costs: list[float]  # per column: d x the job's time


def column_key(counts: np.ndarray, d: int) -> tuple:
    """What identifies a column (a job): its degree and its adapters of each type."""
    return d, tuple(int(x) for x in counts)


class _Pricing:
    """max y.n - d * T(n) over the packs of one degree, with y a parameter."""

    def __init__(self, wl: Workload, d: int):
        self.d = d
        self.idx = np.flatnonzero(wl.fits[d])
        self.y = cp.Parameter(len(self.idx), nonneg=True)
        self.n = n = cp.Variable(len(self.idx), integer=True)
        counts = np.asarray(wl.counts, dtype=float)[self.idx]
        ub = np.minimum(np.minimum(counts, wl.fit_alone[d][self.idx]), wl.cap)
        time_cons, seconds = job_time_model(wl, d, self.idx, n, ub)
        self.unit = max(float(d * wl.single_times(d)[self.idx].max()), 1e-9)
        self.prob = cp.Problem(cp.Maximize((self.y @ n - d * seconds) / self.unit),
                               pack_limits(wl, d, self.idx, n) + time_cons)

    def best(self, y_all: np.ndarray, wl: Workload, solver: str, log: SolverLog) -> np.ndarray:
        """The most valuable pack, proven optimal; raises `_Unproven` otherwise."""
        self.y.value = np.maximum(y_all[self.idx], 0.0)
        solve_problem(self.prob, solver, log, time_limit_s=5.0, gap=1e-9)
        if self.prob.status != cp.OPTIMAL or self.n.value is None:
            raise _Unproven(self.prob.status)
        counts = np.zeros(len(wl.types))
        counts[self.idx] = np.round(self.n.value)
        if not wl.pack_fits(counts, self.d):
            raise _Unproven("pack does not fit")
        return counts


class _Unproven(Exception):
    """Pricing did not prove its answer optimal: the master's value bounds nothing."""


def configuration_lp_bound(
    wl: Workload, *, solver: str = "auto", time_limit_s: float = 20.0, max_iters: int = 400
) -> float | None:
    """The configuration LP's value over G, or None when column generation did not finish
    within the limits (then it proves nothing and the caller keeps its other bounds)."""
    lp = configuration_lp(wl, solver=solver, time_limit_s=time_limit_s, max_iters=max_iters)
    return None if lp is None else lp.value


def configuration_lp(
    wl: Workload, *, solver: str = "auto", time_limit_s: float = 20.0, max_iters: int = 400
) -> ConfigurationLP | None:
    """Solve the configuration LP by column generation; None when it did not finish within
    the limits."""
    from scipy.optimize import linprog

    if not len(wl.types):
        return ConfigurationLP(0.0, [], [], [])
    t0 = time.perf_counter()
    counts = np.asarray(wl.counts, dtype=float)
    log = SolverLog()
    cols: list[np.ndarray] = []
    degrees: list[int] = []
    costs: list[float] = []
    seen: set[tuple] = set()

    def add(c: np.ndarray, d: int) -> bool:
        key = column_key(c, d)
        if key in seen:
            return False
        seen.add(key)
        cols.append(c)
        degrees.append(d)
        costs.append(d * wl.job_time(c, d))
        return True

    for i in range(len(wl.types)):  # singles: the master is feasible from the start
        for d in wl.degrees:
            if wl.fits[d][i]:
                c = np.zeros(len(wl.types))
                c[i] = 1
                add(c, d)
    pricing = {d: _Pricing(wl, d) for d in wl.degrees if wl.fits[d].any()}
    tol = 1e-7
    for _ in range(max_iters):
        A = np.array(cols).T
        res = linprog(np.array(costs), A_ub=-A, b_ub=-counts, bounds=(0, None), method="highs")
        if res.status != 0:
            return None
        y = -np.asarray(res.ineqlin.marginals)
        added = False
        for d, p in pricing.items():
            try:
                c = p.best(y, wl, solver, log)
            except _Unproven:
                return None
            reduced = float(y @ c) - d * wl.job_time(c, d)
            if reduced > tol * max(1.0, float(res.fun) / max(counts.sum(), 1.0)):
                added |= add(c, d)
        if not added:
            return ConfigurationLP(float(res.fun) / wl.gpus, cols, degrees, costs)
        if time.perf_counter() - t0 > time_limit_s:
            return None
    return None
