"""An improvement pass over finished plans: local search on which adapters share a job.

The scheduler (PLoRA Alg. 2) decides greedily in simulated time, and the configuration
LP's plan minimises GPU-seconds; neither looks at the finished schedule as a whole, and
each can miss what the exact solver finds on small sweeps: a longest adapter started last
that leaves a tail, a job that would end sooner at a wider TP degree, two jobs that should
trade an adapter. This pass starts from such plans and applies the best of these moves
while one shortens the plan (or, at equal makespan, saves GPU-seconds):

* change a job's TP degree;
* move one adapter to another job or to a job of its own;
* swap two adapters between jobs;
* merge two jobs.

Each candidate set of jobs is scheduled anew -- exactly (:func:`plora.planner.exact.
schedule_jobs`, which also starts the long jobs first where that shortens the tail) while
there are few jobs, else by list scheduling in several priority orders -- and a move is
only scheduled when a lower bound (longest job; GPU-seconds over the GPUs, full-width jobs
apart) says it could win. Job times are memoised per (adapter set, degree).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

from plora.planner.exact import OutOfTime, assign_gpus, schedule_jobs
from plora.planner.plan import Job
from plora.planner.workload import Workload

__all__ = ["Improved", "JobPricer", "improve"]

#: up to this many jobs a candidate is scheduled exactly (node-limited); beyond, by list scheduling
EXACT_JOBS = 9
EXACT_NODES = 4000
#: the most moves one descent takes
MAX_ROUNDS = 200
_REL = 1e-9

Spec = tuple[int, int]  # (adapter bitmask, TP degree)


class JobPricer:
    """Job times on the cost model for adapter sets given as bitmasks over ``wl.loads``."""

    def __init__(self, wl: Workload):
        self.wl = wl
        self.loads = list(wl.loads)
        self.index = {a.id: i for i, a in enumerate(self.loads)}
        self.mem = {d: [wl.cost_model.memory_per_adapter(a, d) for a in self.loads] for d in wl.degrees}
        self.room = {d: wl.budget * (1 + 1e-9) - wl.mem_base[d] for d in wl.degrees}
        self._time: dict[Spec, float | None] = {}
        self._options: dict[int, list[int]] = {}

    def members(self, mask: int) -> list:
        return [self.loads[i] for i in _bits(mask)]

    def time(self, mask: int, d: int) -> float | None:
        """Seconds of the job, None when it does not fit (memory, cap)."""
        key = (mask, d)
        if key not in self._time:
            idx = _bits(mask)
            ok = len(idx) <= self.wl.cap and sum(self.mem[d][i] for i in idx) <= self.room[d]
            self._time[key] = self.wl.cost_model.job_time([self.loads[i] for i in idx], d) if ok else None
        return self._time[key]

    def options(self, mask: int) -> list[int]:
        """The degrees a job of these adapters can run at, a wider one only where it is faster."""
        if mask not in self._options:
            out, fastest = [], float("inf")
            for d in sorted(self.wl.degrees):
                t = self.time(mask, d)
                if t is not None and t < fastest * (1 - 1e-12):
                    out.append(d)
                    fastest = t
            self._options[mask] = out
        return self._options[mask]

    def mask_of(self, job: Job) -> int:
        m = 0
        for a in job.adapters:
            m |= 1 << self.index[a]
        return m


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def list_schedule_times(jobs: Sequence[tuple[int, float]], gpus: int, order: Sequence[int]) -> list[float]:
    """Start times when the jobs, in ``order``, each take the GPUs free earliest."""
    free = [0.0] * gpus
    starts = [0.0] * len(jobs)
    for j in order:
        d, p = jobs[j]
        free.sort()
        s = free[d - 1]
        starts[j] = s
        for g in range(d):
            free[g] = s + p
    return starts


def _list_schedule(jobs: Sequence[tuple[int, float]], gpus: int) -> tuple[float, list[float]]:
    """The best of list scheduling in a few priority orders: longest first, widest first,
    most GPU-seconds first."""
    n = len(jobs)
    orders = [
        sorted(range(n), key=lambda j: (-jobs[j][1], -jobs[j][0])),
        sorted(range(n), key=lambda j: (-jobs[j][0], -jobs[j][1])),
        sorted(range(n), key=lambda j: (-jobs[j][0] * jobs[j][1], -jobs[j][1])),
    ]
    best: tuple[float, list[float]] | None = None
    for order in orders:
        starts = list_schedule_times(jobs, gpus, order)
        ms = max((s + p for s, (_, p) in zip(starts, jobs)), default=0.0)
        if best is None or ms < best[0] * (1 - _REL):
            best = (ms, starts)
    assert best is not None
    return best


def _bound(jobs: Sequence[tuple[int, float]], gpus: int) -> float:
    """No schedule of these jobs ends sooner: the longest, and GPU-seconds over the GPUs with
    full-width jobs (which nothing runs beside) counted whole."""
    longest = max(p for _, p in jobs)
    wide = sum(p for d, p in jobs if d == gpus)
    rest = sum(d * p for d, p in jobs if d < gpus)
    return max(longest, wide + rest / gpus)


class _Search:
    def __init__(self, pricer: JobPricer, gpus: int, deadline: float | None):
        self.p = pricer
        self.gpus = gpus
        self.deadline = deadline
        # per multiset of jobs: (makespan, starts, the jobs in the order of starts) when known,
        # or (a makespan it cannot beat, None, None)
        self.memo: dict[tuple, tuple[float, list[float] | None, list | None]] = {}
        self.evaluated = 0

    def jobs(self, specs: Sequence[Spec]) -> list[tuple[int, float]]:
        return [(d, self.p.time(m, d)) for m, d in specs]

    def makespan(self, specs: Sequence[Spec], below: float = float("inf")) -> float | None:
        """The makespan of a good schedule of the jobs, or None when it is not below ``below``
        (then the search is cut short by that bound)."""
        jobs = self.jobs(specs)
        key = tuple(sorted(jobs))
        known = self.memo.get(key)
        if known is not None:
            if known[1] is not None:
                return known[0] if known[0] < below else None
            if known[0] <= below:
                return None
        self.evaluated += 1
        ms, starts = _list_schedule(jobs, self.gpus)
        if len(jobs) <= EXACT_JOBS:
            try:
                sched = schedule_jobs(jobs, self.gpus, upper_bound=min(ms, below), max_nodes=EXACT_NODES,
                                      deadline=self.deadline)
            except OutOfTime:
                sched = None
            if sched is not None:
                ms, starts = sched.makespan, sched.starts
            elif ms >= below:
                self.memo[key] = (below, None, None)
                return None
        self.memo[key] = (ms, starts, jobs)
        return ms if ms < below else None

    def starts(self, specs: Sequence[Spec]) -> list[float]:
        """Start times, in the order of ``specs``, of the schedule `makespan` found for them."""
        jobs = self.jobs(specs)
        key = tuple(sorted(jobs))
        if key not in self.memo or self.memo[key][1] is None:
            self.memo.pop(key, None)
            self.makespan(specs)
        _, starts, order = self.memo[key]
        by_job: dict[tuple[int, float], list[float]] = {}
        for job, t in zip(order, starts):
            by_job.setdefault(job, []).append(t)
        return [by_job[job].pop() for job in jobs]

    def candidates(self, specs: list[Spec]) -> Iterator[list[Spec]]:
        opts = self.p.options
        n = len(specs)
        # a job's degree
        for i, (m, d) in enumerate(specs):
            for e in opts(m):
                if e != d:
                    yield specs[:i] + [(m, e)] + specs[i + 1:]
        # one adapter to another job, or alone
        for i, (mi, di) in enumerate(specs):
            for a in _bits(mi):
                bit = 1 << a
                rest = mi ^ bit
                rest_opts = [None] if rest == 0 else opts(rest)
                if not rest_opts:
                    continue
                others = [s for k, s in enumerate(specs) if k != i]
                for j in range(n):
                    if j == i:
                        continue
                    mj = specs[j][0] | bit
                    for ej in opts(mj):
                        for ei in rest_opts:
                            new = [s for k, s in enumerate(specs) if k not in (i, j)] + [(mj, ej)]
                            if ei is not None:
                                new.append((rest, ei))
                            yield new
                if rest:
                    for ea in opts(bit):
                        for ei in rest_opts:
                            yield others + [(rest, ei), (bit, ea)]
        # two adapters trade places
        for i in range(n):
            for j in range(i + 1, n):
                mi, mj = specs[i][0], specs[j][0]
                keep = [s for k, s in enumerate(specs) if k not in (i, j)]
                for a in _bits(mi):
                    for b in _bits(mj):
                        ni, nj = mi ^ (1 << a) | (1 << b), mj ^ (1 << b) | (1 << a)
                        for ei in opts(ni):
                            for ej in opts(nj):
                                yield keep + [(ni, ei), (nj, ej)]
        # two jobs become one
        for i in range(n):
            for j in range(i + 1, n):
                m = specs[i][0] | specs[j][0]
                keep = [s for k, s in enumerate(specs) if k not in (i, j)]
                for e in opts(m):
                    yield keep + [(m, e)]

    def descend(self, specs: list[Spec], ms: float) -> tuple[list[Spec], float, float, int]:
        """Take the first move that shortens the plan (or, at the same makespan, saves
        GPU-seconds) until none does or time runs out, from jobs whose schedule ends at
        ``ms``; the final jobs, their makespan and GPU-seconds, and the moves taken."""
        area = sum(d * t for d, t in self.jobs(specs))
        moves = 0
        for _ in range(MAX_ROUNDS):
            moved = False
            for cand in self.candidates(specs):
                if self.deadline is not None and time.perf_counter() > self.deadline:
                    return specs, ms, area, moves
                jobs = self.jobs(cand)
                lb = _bound(jobs, self.gpus)
                if lb > ms * (1 + _REL):
                    continue  # cannot even tie
                c_area = sum(d * t for d, t in jobs)
                saves = c_area < area * (1 - 1e-6)
                if lb >= ms * (1 - _REL) and not saves:
                    continue  # could at best tie, and would not save GPU-seconds
                c_ms = self.makespan(cand, ms * (1 + _REL) if saves else ms * (1 - _REL))
                if c_ms is None:
                    continue
                specs, ms, area, moved = cand, c_ms, c_area, True
                moves += 1
                break
            if not moved:
                break
        return specs, ms, area, moves


@dataclass
class Improved:
    """What the search reached: jobs with start times and GPUs, the plan it started from
    (an index into the plans given) and the moves it took from there."""

    jobs: list[Job]
    start: int
    moves: int


def improve(wl: Workload, plans: Sequence[Sequence[Job]], *, deadline: float | None = None,
            prefix: str = "i") -> Improved | None:
    """The best plan local search reaches from any of ``plans`` (each a full covering of
    ``wl``'s adapters, already scheduled), or None when it shortens none of them."""
    pricer = JobPricer(wl)
    search = _Search(pricer, wl.gpus, deadline)
    best: tuple[tuple[float, float], list[Spec], int, int] | None = None
    seen: set[tuple] = set()
    target = min((max(j.end for j in jobs) for jobs in plans if jobs), default=float("inf"))
    for k, jobs in enumerate(plans):
        specs = [(pricer.mask_of(j), j.tp) for j in jobs]
        key = tuple(sorted(specs))
        if key in seen or any(pricer.time(m, d) is None for m, d in specs):
            continue
        seen.add(key)
        ms = max(j.end for j in jobs)
        own = search.makespan(specs)
        specs, ms, area, moves = search.descend(specs, min(ms, own if own is not None else ms))
        if moves and (best is None or (ms, area) < best[0]):
            best = ((ms, area), specs, k, moves)
        if deadline is not None and time.perf_counter() > deadline:
            break
    if best is None or best[0][0] >= target * (1 - _REL):
        return None
    specs = best[1]
    return Improved(build_jobs(pricer, specs, search.starts(specs), wl.gpus, prefix), best[2], best[3])


def build_jobs(pricer: JobPricer, specs: Sequence[Spec], starts: Sequence[float], gpus: int, prefix: str) -> list[Job]:
    """Jobs with GPU sets for a schedule given as start times (in the order of ``specs``)."""
    cm = pricer.wl.cost_model
    times = [pricer.time(m, d) for m, d in specs]
    ends = [s + t for s, t in zip(starts, times)]
    order = sorted(range(len(specs)), key=lambda j: (starts[j], -specs[j][1]))
    gpu_sets = assign_gpus([d for _, d in specs], starts, ends, order, gpus)
    jobs = []
    for k, j in enumerate(sorted(range(len(specs)), key=lambda j: (starts[j], gpu_sets[j]))):
        m, d = specs[j]
        members = pricer.members(m)
        jobs.append(Job(id=f"{prefix}{k:04d}", adapters=[a.id for a in members], tp=d, gpus=gpu_sets[j],
                        start=starts[j], end=ends[j], step_time=cm.step_time(members, d),
                        peak_memory=cm.memory(members, d)))
    return jobs
