"""F(D, K): the best pack of remaining adapters for one job on D GPUs, as an ILP.

Variables (per adapter type t that fits alone at D): an integer count ``n_t`` of
adapters of that type in the job, a binary ``y_t`` (type present) and the job's
step count ``S = max_t steps_t * y_t``. Constraints: per-GPU memory
``M_base(D) + sum_t n_t M_t(D) <= C * M_gpu``, at most ``cap`` adapters, at least one,
``n_t <= available_t``.

Both objectives are ratios; each is maximised exactly by Dinkelbach's method:
fix the ratio's value ``lam`` at the best one found so far, maximise the linear
``numerator - lam * denominator``, and repeat until no pack beats ``lam``
(usually two or three solves).

* ``paper``: PLoRA's throughput proxy ``sum_t n_t r_t / T_step`` -- rank trained per
  second of a packed step at its start. It ignores step counts, so it happily
  packs an adapter of 10,000 steps with one of 300 and leaves a lone straggler.
* ``makespan``: efficiency ``sum_t n_t w_t / (D * T_job)``, where ``w_t`` is a type's
  ideal GPU-seconds (the lower bound's unit of work) and ``T_job = c0 * S +
  sum_t n_t steps_t m_t`` the exact job time under shrinking packs (linear once S
  is a variable). Subject to ``T_job <= T_max``, the time the scheduler expects to
  be left, so late jobs stay short and GPUs finish together. Because ``T_job``
  counts the fixed per-step cost for ``S`` steps, packs of equal step counts win.

The model for each D is built once per planning run with cvxpy parameters
(``lam``, ``T_max`` and the availabilities), so later solves skip compilation.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import cvxpy as cp
import numpy as np

from plora.planner.errors import PlannerError
from plora.planner.workload import Workload

__all__ = ["GUROBI_SIZE_LIMIT", "Pack", "PackSolver", "SolverLog"]

#: The pip (size-limited) Gurobi licence refuses models above this many variables or constraints.
GUROBI_SIZE_LIMIT = 2000
OBJECTIVES = ("makespan", "paper")
SOLVERS = ("auto", "gurobi", "highs")


@dataclass(frozen=True)
class Pack:
    """One job's contents as counts per adapter type, with its predicted figures."""

    d: int
    counts: tuple[int, ...]
    ratio: float
    job_time: float
    step_time: float
    memory: float

    @property
    def size(self) -> int:
        return sum(self.counts)


class SolverLog:
    """Which solver answered how many ILPs, and why Gurobi was passed over."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.fallbacks: list[str] = []
        self.seconds = 0.0

    def record(self, name: str, seconds: float) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        self.seconds += seconds

    @property
    def summary(self) -> str:
        return ",".join(sorted(self.calls)) if self.calls else "none"


_GUROBI_ENV: Any = None


def gurobi_available() -> bool:
    try:
        import gurobipy  # noqa: F401
    except ImportError:
        return False
    return "GUROBI" in cp.installed_solvers()


def _gurobi_env() -> Any:
    """A quiet Gurobi environment, started once (starting one prints a banner and checks the licence)."""
    global _GUROBI_ENV
    if _GUROBI_ENV is None:
        import gurobipy as gp

        env = gp.Env(empty=True)
        env.setParam("OutputFlag", 0)
        env.start()
        _GUROBI_ENV = env
    return _GUROBI_ENV


def problem_size(prob: cp.Problem) -> tuple[int, int]:
    """(scalar variables, scalar constraints) as cvxpy hands them to the solver."""
    m = prob.size_metrics
    return m.num_scalar_variables, m.num_scalar_eq_constr + m.num_scalar_leq_constr


def solve_problem(prob: cp.Problem, solver: str, log: SolverLog, time_limit_s: float | None = None) -> str:
    """Solve with the requested solver; returns the name of the one that produced the answer.

    ``auto`` takes Gurobi when it is installed and the model is within the pip
    licence's size limit, else HiGHS. Gurobi can still refuse (a licence problem
    that cvxpy reports only as "solver failed"); then HiGHS solves it.
    """
    if solver not in SOLVERS:
        raise PlannerError(f"solver: must be one of {', '.join(SOLVERS)}, got {solver!r}")
    use_gurobi = False
    if solver in ("auto", "gurobi"):
        if not gurobi_available():
            if solver == "gurobi":
                log.fallbacks.append("gurobipy not installed")
        else:
            n_var, n_con = problem_size(prob)
            small = n_var <= GUROBI_SIZE_LIMIT and n_con <= GUROBI_SIZE_LIMIT
            use_gurobi = solver == "gurobi" or small
    if use_gurobi:
        t = time.perf_counter()
        try:
            opts: dict[str, Any] = {"env": _gurobi_env()}
            if time_limit_s is not None:
                opts["TimeLimit"] = float(time_limit_s)
            prob.solve(solver=cp.GUROBI, **opts)
            log.record("gurobi", time.perf_counter() - t)
            return "gurobi"
        except Exception as e:  # cvxpy wraps licence and size errors into a bare SolverError
            n_var, n_con = problem_size(prob)
            log.fallbacks.append(f"gurobi failed on {n_var} variables/{n_con} constraints ({type(e).__name__})")
    t = time.perf_counter()
    opts = {}
    if time_limit_s is not None:
        opts["time_limit"] = float(time_limit_s)
    prob.solve(solver=cp.HIGHS, **opts)
    log.record("highs", time.perf_counter() - t)
    return "highs"


class _DegreeModel:
    """The parametrised ILP for one TP degree (compiled on first solve, then reused)."""

    def __init__(self, wl: Workload, d: int, objective: str) -> None:
        self.d = d
        self.idx = np.flatnonzero(wl.fits[d])  # types that fit alone at d
        k = len(self.idx)
        self.n = cp.Variable(k, integer=True)
        self.ub = cp.Parameter(k, nonneg=True)
        self.lam = cp.Parameter(nonneg=True)
        mem = wl.mem[d][self.idx]
        room = wl.budget - wl.mem_base[d]
        scale = max(float(mem.max()), 1.0)  # keep the memory row near 1 for the solver
        cons = [
            self.n >= 0,
            (mem / scale) @ self.n <= room / scale,
            cp.sum(self.n) <= wl.cap,
            cp.sum(self.n) >= 1,
        ]
        m = wl.step[d][self.idx]
        steps = wl.steps[self.idx]
        if objective == "makespan":
            y = cp.Variable(k, boolean=True)
            s = cp.Variable(nonneg=True)
            self.t_max = cp.Parameter(nonneg=True)
            t_scale = max(float(steps.max() * (wl.c0[d] + m.max())), 1e-9)
            job_time = (wl.c0[d] * s + (steps * m) @ self.n) / t_scale
            cons += [self.n <= cp.multiply(self.ub, y), s >= cp.multiply(steps, y), job_time <= self.t_max]
            num = (wl.work[self.idx] / t_scale) @ self.n
            self.t_scale = t_scale
            obj = num - self.lam * d * job_time
            # Second stage: the most work among packs within a few percent of the best ratio.
            self.rho = cp.Parameter(nonneg=True)
            self.prob_work = cp.Problem(
                cp.Maximize(num + 1e-7 * cp.sum(self.n)), cons + [num - self.rho * d * job_time >= 0]
            )
        else:
            self.t_max = None
            self.t_scale = 1.0
            self.rho = None
            self.prob_work = None
            cons.append(self.n <= self.ub)
            num = wl.rank[self.idx] @ self.n
            obj = num - self.lam * (wl.c0[d] + m @ self.n)
        # A vanishing reward for size breaks ties between packs of equal ratio towards the larger.
        obj = obj + 1e-7 * cp.sum(self.n)
        self.prob = cp.Problem(cp.Maximize(obj), cons)


class PackSolver:
    """Solves F(D, K) for one planning run; memoises answers by (D, remaining counts, T_max)."""

    def __init__(
        self,
        wl: Workload,
        *,
        objective: str = "makespan",
        solver: str = "auto",
        log: SolverLog | None = None,
        time_limit_s: float | None = None,
        efficiency_slack: float = 0.03,
    ) -> None:
        if objective not in OBJECTIVES:
            raise PlannerError(f"objective: must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        if solver not in SOLVERS:
            raise PlannerError(f"solver: must be one of {', '.join(SOLVERS)}, got {solver!r}")
        self.wl = wl
        self.objective = objective
        self.solver = solver
        self.log = log or SolverLog()
        self.time_limit_s = time_limit_s
        self.efficiency_slack = efficiency_slack
        self._models: dict[int, _DegreeModel] = {}
        self._memo: dict[tuple, Pack | None] = {}

    # ---- ratios, evaluated exactly on counts ----------------------------------------------
    def ratio(self, counts: np.ndarray, d: int) -> float:
        wl = self.wl
        counts = np.asarray(counts, dtype=float)
        if self.objective == "makespan":
            return float(counts @ wl.work) / (d * wl.job_time(counts, d))
        return float(counts @ wl.rank) / wl.step_time(counts, d)

    def _pack(self, counts: np.ndarray, d: int) -> Pack:
        c = tuple(int(x) for x in counts)
        return Pack(
            d=d,
            counts=c,
            ratio=self.ratio(counts, d),
            job_time=self.wl.job_time(counts, d),
            step_time=self.wl.step_time(counts, d),
            memory=self.wl.memory(counts, d),
        )

    # ---- F(D, K) -----------------------------------------------------------------------------
    def solve(self, d: int, available: tuple[int, ...], t_max: float | None = None) -> Pack | None:
        """The best pack at degree d from ``available`` adapters per type, or None if none fits.

        ``t_max`` (makespan objective only) bounds the job's time; it is raised to the
        shortest single-adapter job among the candidates so that some pack always
        qualifies when any adapter fits.
        """
        wl = self.wl
        if d not in wl.fits:
            return None
        avail = np.minimum(np.asarray(available, dtype=float), wl.cap)
        cand = (avail > 0) & wl.fits[d]
        if not cand.any():
            return None
        if self.objective == "makespan":
            singles = wl.steps[cand] * (wl.c0[d] + wl.step[d][cand])
            t_floor = float(singles.min())
            t_max = t_floor if t_max is None or not math.isfinite(t_max) else max(t_max, t_floor)
            t_max = t_max if t_max is not None else math.inf
            key = (d, tuple(available), round(t_max, 3))
        else:
            t_max = math.inf
            key = (d, tuple(available))
        if key in self._memo:
            return self._memo[key]
        result = self._dinkelbach(d, avail, cand, t_max)
        self._memo[key] = result
        return result

    def _best_single(self, d: int, cand: np.ndarray, t_max: float) -> np.ndarray:
        best, best_r = None, -math.inf
        for i in np.flatnonzero(cand):
            c = np.zeros(len(self.wl.types))
            c[i] = 1
            if self.objective == "makespan" and self.wl.job_time(c, d) > t_max * (1 + 1e-9):
                continue
            r = self.ratio(c, d)
            if r > best_r:
                best, best_r = c, r
        assert best is not None
        return best

    def _dinkelbach(self, d: int, avail: np.ndarray, cand: np.ndarray, t_max: float) -> Pack:
        wl = self.wl
        model = self._models.get(d)
        if model is None:
            model = self._models[d] = _DegreeModel(wl, d, self.objective)
        model.ub.value = np.where(cand, avail, 0.0)[model.idx]
        if model.t_max is not None:
            cap_t = wl.steps.max() * (wl.c0[d] + wl.step[d].max()) * max(wl.cap, 1) * 2
            model.t_max.value = min(t_max, cap_t) / model.t_scale * (1 + 1e-9)
        best = self._best_single(d, cand, t_max)
        best_r = self.ratio(best, d)
        for _ in range(30):
            model.lam.value = max(best_r, 0.0)
            solve_problem(model.prob, self.solver, self.log, self.time_limit_s)
            if model.n.value is None:
                break
            counts = np.zeros(len(wl.types))
            counts[model.idx] = np.round(model.n.value)
            if not wl.pack_fits(counts, d) or np.any(counts > avail + 1e-9):
                break
            if self.objective == "makespan" and wl.job_time(counts, d) > t_max * (1 + 1e-6):
                break
            r = self.ratio(counts, d)
            if r > best_r * (1 + 1e-9):
                best, best_r = counts, r
                continue
            if r >= best_r * (1 - 1e-9) and counts.sum() > best.sum():
                best = counts  # same ratio, more adapters served
            break
        if model.prob_work is not None and self.efficiency_slack > 0:
            best = self._most_work(model, d, avail, t_max, best, best_r)
        return self._pack(best, d)

    def _most_work(
        self, model: _DegreeModel, d: int, avail: np.ndarray, t_max: float, best: np.ndarray, best_r: float
    ) -> np.ndarray:
        """Among packs within ``efficiency_slack`` of the best ratio, the one with the most work."""
        wl = self.wl
        rho = best_r * (1 - self.efficiency_slack)
        model.rho.value = max(rho, 0.0)
        solve_problem(model.prob_work, self.solver, self.log, self.time_limit_s)
        if model.n.value is None:
            return best
        counts = np.zeros(len(wl.types))
        counts[model.idx] = np.round(model.n.value)
        if (
            not wl.pack_fits(counts, d)
            or np.any(counts > avail + 1e-9)
            or wl.job_time(counts, d) > t_max * (1 + 1e-6)
            or self.ratio(counts, d) < rho * (1 - 1e-6)
        ):
            return best
        return counts if float(counts @ wl.work) > float(best @ wl.work) else best
