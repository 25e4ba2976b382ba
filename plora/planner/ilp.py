"""F(D, K): the best pack of remaining adapters for one job on D GPUs, as an ILP.

Variables (per adapter type t that fits alone at D): an integer count ``n_t`` of
adapters of that type in the job, and the job's step count ``S`` (its longest
adapter; see :class:`_DegreeModel`). Constraints: per-GPU memory
``M_base(D) + sum_t n_t M_t(D) <= C * M_gpu``, at most ``cap`` adapters, at least one,
``n_t <= available_t``.

Objectives:

* ``paper``: PLoRA's throughput proxy ``sum_t n_t r_t / T_step`` -- rank trained per
  second of a packed step at its start. It ignores step counts, so it will pack
  an adapter of 10,000 steps with one of 300 and leave a lone straggler.
* ``makespan``: work, subject to efficiency. A type's work ``w_t`` is its ideal
  GPU-seconds (the lower bound's unit, :meth:`Workload.ideal_work`); a pack's
  efficiency is ``sum_t n_t w_t / (D * T_job)`` with ``T_job = c0 * S +
  sum_t n_t steps_t m_t``, the exact job time under shrinking packs (linear once S
  is a variable; it charges the fixed per-step cost for the longest adapter's
  steps, so packs of equal step counts are the efficient ones). F maximises
  ``sum_t n_t w_t`` subject to efficiency >= a floor (linear:
  ``sum w n - floor * D * T_job >= 0``) and ``T_job <= T_max``, the time the
  scheduler expects to be left, so that late jobs stay short and the GPUs finish
  together. Most work first is longest-processing-time-first, the classic cure
  for stragglers; the floor keeps it from buying work with waste. If no pack
  reaches the floor, F takes the most efficient pack instead.

Ratios are maximised exactly by Dinkelbach's method: fix the ratio's value
``lam`` at the best one found so far, maximise the linear ``numerator - lam *
denominator``, and repeat until no pack beats ``lam`` (usually two or three
solves). The models for each D are built once per planning run with cvxpy
parameters (``lam``, ``T_max``, the floor and the availabilities), so later solves
skip compilation.
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any

import cvxpy as cp
import numpy as np

from plora.planner.errors import PlannerError
from plora.planner.workload import Workload

__all__ = ["GUROBI_SIZE_LIMIT", "Pack", "PackSolver", "SolverLog"]

#: Optimality gap (relative and absolute; objectives are scaled to O(1)) of the ratio
#: solves, which Dinkelbach needs near-exact.
MIP_GAP = 1e-6
#: Default relative gap and time limit of the most-work solves. Filling a job up to
#: T_max is a subset-sum in disguise: the LP bound sits about one adapter above the
#: best pack, so proving a pack within 1% of the best can take seconds of branching,
#: while any pack within a few percent is as good a scheduling choice.
WORK_GAP = 3e-2
WORK_TIME_LIMIT_S = 0.5
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
_GUROBI_ENV_ERROR: Exception | None = None


@functools.lru_cache(maxsize=None)
def gurobi_available() -> bool:
    """Whether cvxpy can reach Gurobi (asked once: cvxpy's check imports every solver)."""
    try:
        import gurobipy  # noqa: F401
    except ImportError:
        return False
    return "GUROBI" in cp.installed_solvers()


def _gurobi_env() -> Any:
    """A quiet Gurobi environment, started once (starting one prints a banner and checks the licence)."""
    global _GUROBI_ENV, _GUROBI_ENV_ERROR
    if _GUROBI_ENV_ERROR is not None:  # a licence that failed once fails again; do not wait for it
        raise _GUROBI_ENV_ERROR
    if _GUROBI_ENV is None:
        import gurobipy as gp

        try:
            env = gp.Env(empty=True)
            env.setParam("OutputFlag", 0)
            env.start()
        except Exception as e:
            _GUROBI_ENV_ERROR = e
            raise
        _GUROBI_ENV = env
    return _GUROBI_ENV


def problem_size(prob: cp.Problem) -> tuple[int, int]:
    """(scalar variables, scalar constraints) as cvxpy hands them to the solver."""
    m = prob.size_metrics
    return m.num_scalar_variables, m.num_scalar_eq_constr + m.num_scalar_leq_constr


def solve_problem(
    prob: cp.Problem, solver: str, log: SolverLog, time_limit_s: float | None = None, gap: float = MIP_GAP
) -> str:
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
            opts: dict[str, Any] = {"env": _gurobi_env(), "MIPGap": gap, "MIPGapAbs": MIP_GAP}
            if time_limit_s is not None:
                opts["TimeLimit"] = float(time_limit_s)
            with warnings.catch_warnings():  # "infeasible" is an answer here, not a problem
                warnings.simplefilter("ignore", UserWarning)
                prob.solve(solver=cp.GUROBI, **opts)
            log.record("gurobi", time.perf_counter() - t)
            return "gurobi"
        except Exception as e:  # cvxpy wraps licence and size errors into a bare SolverError
            n_var, n_con = problem_size(prob)
            log.fallbacks.append(f"gurobi failed on {n_var} variables/{n_con} constraints ({type(e).__name__})")
    t = time.perf_counter()
    opts = {"mip_rel_gap": gap, "mip_abs_gap": MIP_GAP}
    if time_limit_s is not None:
        opts["time_limit"] = float(time_limit_s)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        prob.solve(solver=cp.HIGHS, **opts)
    log.record("highs", time.perf_counter() - t)
    return "highs"


class _DegreeModel:
    """The parametrised ILPs for one TP degree (compiled on first solve, then reused).

    The job's step count ``S`` (its longest adapter) is chosen among the distinct
    step counts ``s_1 < ... < s_L`` of the candidate types by a one-hot ``z``; a type
    may join only if its steps are at most the chosen level. This is much tighter
    than one big-M indicator per type and keeps the solves in milliseconds.
    """

    def __init__(self, wl: Workload, d: int, objective: str) -> None:
        self.d = d
        self.idx = np.flatnonzero(wl.fits[d])  # types that fit alone at d
        k = len(self.idx)
        self.n = cp.Variable(k, integer=True)
        self.ub = cp.Parameter(k, nonneg=True)
        self.lam = cp.Parameter(nonneg=True)
        cons = pack_limits(wl, d, self.idx, self.n)
        tiny = 1e-5 * cp.sum(self.n)  # among packs of equal work, prefer the one serving more adapters
        self.t_max: cp.Parameter | None = None
        self.rho: cp.Parameter | None = None
        self.prob_work: cp.Problem | None = None
        self.t_scale = 1.0
        self.lam_scale = 1.0  # solver units of the ratio per unit of PackSolver.ratio
        if objective == "makespan":
            self.t_max = cp.Parameter(nonneg=True)
            self.t_scale = t_scale = max(float(wl.single_times(d)[self.idx].max()), 1e-9)
            time_cons, seconds = job_time_model(wl, d, self.idx, self.n, self.ub)
            job_time = seconds / t_scale
            cons += time_cons + [job_time <= self.t_max]
            num = (wl.work[self.idx] / t_scale) @ self.n
            self.rho = cp.Parameter(nonneg=True)
            self.prob_work = cp.Problem(cp.Maximize(num + tiny), cons + [num - self.rho * d * job_time >= 0])
            ratio_obj = num - self.lam * d * job_time
        else:
            cons.append(self.n <= self.ub)
            # rank in units of the largest, time in units of the slowest single-adapter step
            r_max = float(wl.rank[self.idx].max())
            tau = max(c0 + c_bkt + float(step_k[self.idx].max()) for c0, c_bkt, step_k in wl.pieces[d])
            self.lam_scale = tau / r_max
            n_buckets = None
            if any(c_bkt > 0 for _, c_bkt, _ in wl.pieces[d]):  # y[b] = 1 when a type of rank bucket b is in the pack
                sel = bucket_onehot(wl, self.idx)
                y = cp.Variable(sel.shape[1], boolean=True)
                cons.append(self.n <= cp.multiply(self.ub, sel @ y))
                n_buckets = cp.sum(y)
            forms = [c0 + step_k[self.idx] @ self.n + (c_bkt * n_buckets if n_buckets is not None and c_bkt > 0 else 0)
                     for c0, c_bkt, step_k in wl.pieces[d]]
            if len(forms) == 1:
                step = forms[0]
            else:  # the step is the longest piece; maximising rank - lam * step keeps it tight
                step = cp.Variable(nonneg=True)
                cons += [step >= f for f in forms]
            ratio_obj = (wl.rank[self.idx] / r_max) @ self.n - self.lam * (step / tau)
        # No tie-break here: at the optimum the objective is ~0 and any bonus would trade ratio.
        self.prob_ratio = cp.Problem(cp.Maximize(ratio_obj), cons)


def pack_limits(wl: Workload, d: int, idx: np.ndarray, n: cp.Variable) -> list:
    """What any job at degree d of ``n[i]`` adapters of type ``idx[i]`` must respect: memory
    next to the base model, the adapter cap, at least one adapter."""
    mem = wl.mem[d][idx]
    scale = max(float(mem.max()), 1.0)  # keep the memory row near 1 for the solver
    return [
        n >= 0,
        (mem / scale) @ n <= (wl.budget - wl.mem_base[d]) / scale,
        cp.sum(n) <= wl.cap,
        cp.sum(n) >= 1,
    ]


def job_time_model(wl: Workload, d: int, idx: np.ndarray, n: cp.Variable, ub) -> tuple[list, cp.Expression]:
    """The job's exact time in seconds (`Workload.job_time`) as a linear expression, and the
    constraints that make it so (with several step-time pieces, exact at the optimum of a
    problem that minimises it); ``ub`` bounds each count (a parameter or an array).

    The job runs its longest adapter's steps: a one-hot z over the distinct step counts picks
    that level, and a type may be packed only at or below it. Each rank bucket costs c_bkt per
    step while one of its adapters is in: for as many steps as its longest adapter. zb[b, l] = 1
    picks that level (at most one per bucket), exactly like z.
    """
    steps = wl.steps[idx]
    levels = np.unique(steps)
    level_of = np.searchsorted(levels, steps)
    allowed = (np.arange(len(levels))[None, :] >= level_of[:, None]).astype(float)
    z = cp.Variable(len(levels), boolean=True)
    cons = [cp.sum(z) == 1, n <= cp.multiply(ub, allowed @ z)]
    bucket_levels = None
    if any(c_bkt > 0 for _, c_bkt, _ in wl.pieces[d]):
        sel = bucket_onehot(wl, idx)
        zb = cp.Variable((sel.shape[1], len(levels)), boolean=True)
        cons += [cp.sum(zb, axis=1) <= 1, n <= cp.multiply(ub, cp.sum(cp.multiply(allowed, sel @ zb), axis=1))]
        bucket_levels = cp.sum(zb @ levels)
    if len(wl.pieces[d]) == 1:  # one linear piece: the closed form
        c0, c_bkt, step = wl.pieces[d][0]
        seconds = wl.overhead + c0 * (levels @ z) + (steps * step[idx]) @ n
        if c_bkt > 0 and bucket_levels is not None:
            seconds = seconds + c_bkt * bucket_levels
        return cons, seconds
    # Several pieces: the job runs phase by phase (phase l: steps levels[l-1]..levels[l], with
    # the adapters of at least levels[l] steps), each phase's step the longest piece. Which
    # phases run, which buckets are in each and which adapters are all linear in z, zb and n,
    # so t_l >= every piece's phase form is exact once the time is minimised (every
    # objective and constraint wants it small).
    L = len(levels)
    upper = np.triu(np.ones((L, L)))  # upper[l, m] = 1 for m >= l: "reaches level l"
    running = upper @ z
    buckets_in = upper @ cp.sum(zb, axis=0) if bucket_levels is not None else None
    still_in = (steps[None, :] >= levels[:, None]).astype(float)  # [phase, type]
    t = cp.Variable(L, nonneg=True)
    for c0, c_bkt, step in wl.pieces[d]:
        form = c0 * running + (still_in * step[idx][None, :]) @ n
        if c_bkt > 0 and buckets_in is not None:
            form = form + c_bkt * buckets_in
        cons.append(t >= form)
    spans = np.diff(np.concatenate([[0.0], levels]))
    return cons, wl.overhead + spans @ t


def bucket_onehot(wl: Workload, idx: np.ndarray) -> np.ndarray:
    """(types ``idx`` × their rank buckets): which bucket each type is in."""
    used = sorted(set(wl.bucket[idx].tolist()))
    sel = np.zeros((len(idx), len(used)))
    for i, b in enumerate(wl.bucket[idx]):
        sel[i, used.index(int(b))] = 1.0
    return sel


class PackSolver:
    """Solves F(D, K) for one planning run; memoises answers by (D, remaining counts, T_max).

    ``efficiency_floor`` (makespan objective): the least efficiency -- ideal work over
    GPU-seconds, at most 1 -- a pack must reach to be chosen for its work. Among such
    packs the one with the most work wins, which starts long and large packs first
    (longest-processing-time order, the classic cure for stragglers at the end).
    When no pack reaches the floor, the most efficient one is taken.
    """

    def __init__(
        self,
        wl: Workload,
        *,
        objective: str = "makespan",
        solver: str = "auto",
        log: SolverLog | None = None,
        time_limit_s: float | None = None,
        efficiency_floor: float = 0.95,
        work_gap: float = WORK_GAP,
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
        self.efficiency_floor = efficiency_floor
        self.work_gap = work_gap
        self._models: dict[int, _DegreeModel] = {}
        self._memo: dict[tuple, Pack | None] = {}

    # ---- ratios, evaluated exactly on counts ----------------------------------------------
    def ratio(self, counts: np.ndarray, d: int) -> float:
        """The objective's ratio: efficiency (makespan) or rank per step-second (paper)."""
        wl = self.wl
        counts = np.asarray(counts, dtype=float)
        if self.objective == "makespan":
            return float(counts @ wl.work) / (d * wl.job_time(counts, d))
        return float(counts @ wl.rank) / wl.step_time(counts, d)

    def _pack(self, counts: np.ndarray, d: int) -> Pack:
        return Pack(
            d=d,
            counts=tuple(int(x) for x in counts),
            ratio=self.ratio(counts, d),
            job_time=self.wl.job_time(counts, d),
            step_time=self.wl.step_time(counts, d),
            memory=self.wl.memory(counts, d),
        )

    def _model(self, d: int) -> _DegreeModel:
        model = self._models.get(d)
        if model is None:
            model = self._models[d] = _DegreeModel(self.wl, d, self.objective)
        return model

    def _read(self, model: _DegreeModel, d: int, avail: np.ndarray, t_max: float) -> np.ndarray | None:
        """The solver's pack as counts over all types, or None if there is none or it is invalid."""
        if model.n.value is None:
            return None
        counts = np.zeros(len(self.wl.types))
        counts[model.idx] = np.round(model.n.value)
        if not self.wl.pack_fits(counts, d) or np.any(counts > avail + 1e-9):
            return None
        if self.objective == "makespan" and self.wl.job_time(counts, d) > t_max * (1 + 1e-6):
            return None
        return counts

    # ---- F(D, K) -----------------------------------------------------------------------------
    def solve(self, d: int, available: tuple[int, ...], t_max: float | None = None) -> Pack | None:
        """The best pack at degree d from ``available`` adapters per type, or None if none fits.

        ``t_max`` (makespan objective only; None = unbounded) bounds the job's time; it
        is raised to the shortest single-adapter job among the candidates so that some
        pack always qualifies when any adapter fits.
        """
        wl = self.wl
        if d not in wl.fits:
            return None
        avail = np.minimum(np.asarray(available, dtype=float), wl.cap)
        cand = (avail > 0) & wl.fits[d]
        if not cand.any():
            return None
        if self.objective == "makespan":
            t_floor = float(wl.single_times(d)[cand].min())
            t_max = math.inf if t_max is None else max(t_max, t_floor)
            key: tuple = (d, tuple(available), round(t_max, 3), self.efficiency_floor)
        else:
            t_max = math.inf
            key = (d, tuple(available))
        if key in self._memo:
            return self._memo[key]
        model = self._model(d)
        # The tightest count bounds: available, and how many fit in memory next to the base.
        model.ub.value = np.where(cand, np.minimum(avail, wl.fit_alone[d]), 0.0)[model.idx]
        if model.t_max is not None:
            cap_t = wl.overhead + wl.steps.max() * max(
                c0 + c_bkt * len(wl.buckets) + step.max() for c0, c_bkt, step in wl.pieces[d]) * max(wl.cap, 1) * 2
            model.t_max.value = min(t_max, cap_t) / model.t_scale * (1 + 1e-9)
        best = None
        if model.prob_work is not None:
            best = self._most_work(model, d, avail, t_max)
        if best is None:
            best = self._dinkelbach(model, d, avail, cand, t_max)
        result = self._pack(best, d)
        self._memo[key] = result
        return result

    def _most_work(self, model: _DegreeModel, d: int, avail: np.ndarray, t_max: float) -> np.ndarray | None:
        """The pack with the most work among those at least ``efficiency_floor`` efficient."""
        assert model.rho is not None and model.prob_work is not None
        model.rho.value = self.efficiency_floor
        limit = WORK_TIME_LIMIT_S if self.time_limit_s is None else min(self.time_limit_s, WORK_TIME_LIMIT_S)
        solve_problem(model.prob_work, self.solver, self.log, limit, gap=self.work_gap)
        counts = self._read(model, d, avail, t_max)
        if counts is None or self.ratio(counts, d) < self.efficiency_floor * (1 - 1e-6):
            return None
        return counts

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

    def _dinkelbach(self, model: _DegreeModel, d: int, avail: np.ndarray, cand: np.ndarray, t_max: float) -> np.ndarray:
        """The pack of highest ratio: repeatedly maximise numerator - lam * denominator."""
        best = self._best_single(d, cand, t_max)
        best_r = self.ratio(best, d)
        for _ in range(30):
            model.lam.value = max(best_r, 0.0) * model.lam_scale
            solve_problem(model.prob_ratio, self.solver, self.log, self.time_limit_s)
            counts = self._read(model, d, avail, t_max)
            if counts is None:
                break
            r = self.ratio(counts, d)
            if r > best_r * (1 + 1e-9):
                best, best_r = counts, r
                continue
            if r >= best_r * (1 - 1e-9) and counts.sum() > best.sum():
                best = counts  # same ratio, more adapters served
            break
        return best
