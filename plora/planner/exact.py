"""The exact optimum of a small sweep's makespan, by branch and bound.

The problem is the planner's own: split the adapters into jobs (any subset that fits one
job's memory and the pack cap, at any TP degree the cost model supports within the GPU
count), and run the jobs on the G identical GPUs, each on any ``d`` of them, without
preemption; a job lasts ``CostModel.job_time``. Minimise the end of the last job.

Two nested searches:

* **Partitions** (:func:`solve_exact`): the block holding the lowest adapter left, then the
  next, ... (each partition once); each block at each degree that fits and is not
  dominated (a wider degree that is no faster). A partial partition is cut when a lower
  bound on every completion reaches the best makespan found: the jobs so far and the
  least GPU-seconds that can cover the adapters left (a dynamic program over subsets,
  exact on the cost model), full-width jobs counted apart since nothing runs beside them,
  and the longest job.
* **Schedules** of one partition's jobs (:func:`schedule_jobs`): jobs are placed in the
  order of their start times, each as early as that order allows (when its degree's
  worth of GPUs are free, and not before the previous job's start). Any schedule can be
  rebuilt that way, job by job in its start order, without starting any job later; and
  from a start on, all GPUs free by then are interchangeable, so starting a job later
  than it could leaves every GPU free no earlier -- never better. So a schedule is a
  permutation of the jobs; jobs starting at the same time are taken in index order and
  identical jobs once, and the state is the sorted list of GPU free times.

Job times are memoised per (adapter subset, degree). Small sweeps (up to about ten
adapters on a few GPUs) solve in well under a second; past :data:`EXACT_MAX_ADAPTERS` the
subset tables grow as 3^n and the search is not attempted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from plora.cost.model import AdapterLoad
from plora.planner.plan import Job
from plora.planner.workload import Workload

__all__ = ["EXACT_MAX_ADAPTERS", "ExactResult", "JobSchedule", "OutOfTime", "schedule_jobs", "solve_exact"]

#: the most adapters `solve_exact` takes on (its subset tables hold 2^n entries, its cover
#: bound takes 3^n steps)
EXACT_MAX_ADAPTERS = 11

_REL = 1e-9  # a solution must beat the best by this much (relative) to replace it


@dataclass
class ExactResult:
    """The best jobs found; ``proven`` when the search finished (the makespan is optimal)."""

    jobs: list[Job]
    makespan: float
    proven: bool
    nodes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class OutOfTime(Exception):
    """The search passed its deadline."""


class _NodeLimit(Exception):
    pass


class _SearchBudget:
    """Search nodes counted against a node limit (`_NodeLimit`) and a deadline (`OutOfTime`,
    read every 1,024 nodes: the clock costs more than a node)."""

    def __init__(self, deadline: float | None, max_nodes: int | None) -> None:
        self.deadline, self.max_nodes, self.nodes = deadline, max_nodes, 0

    def tick(self) -> None:
        self.nodes += 1
        if self.max_nodes is not None and self.nodes > self.max_nodes:
            raise _NodeLimit
        if self.deadline is not None and self.nodes & 1023 == 0 and time.perf_counter() > self.deadline:
            raise OutOfTime


@dataclass
class JobSchedule:
    """Start times of rigid jobs; ``proven`` when no shorter schedule exists."""

    makespan: float
    starts: list[float]  # per job (in the input order)
    order: list[int]  # job indices in start order
    proven: bool = True


def schedule_jobs(
    jobs: Sequence[tuple[int, float]],
    gpus: int,
    *,
    upper_bound: float = float("inf"),
    deadline: float | None = None,
    max_nodes: int | None = None,
) -> JobSchedule | None:
    """The shortest non-preemptive schedule of rigid jobs ``(degree, seconds)`` on ``gpus``
    identical GPUs; None when none beats ``upper_bound``. Exact (see the module docstring)
    unless ``max_nodes`` search nodes do not suffice: then the best found, not ``proven``.
    ``deadline`` (a `time.perf_counter` value) raises `OutOfTime` when passed."""
    n = len(jobs)
    if n == 0:
        return JobSchedule(0.0, [], [])
    if all(dj in (1, gpus) for dj, _ in jobs):
        return _narrow_and_full(jobs, gpus, upper_bound, deadline, max_nodes)
    # Longest first: good schedules come early, which makes the bound bite sooner.
    idx = sorted(range(n), key=lambda j: (-jobs[j][1], -jobs[j][0]))
    d = [jobs[j][0] for j in idx]
    p = [jobs[j][1] for j in idx]
    if max(d) > gpus:
        return None
    same_as_prev = [k > 0 and d[k] == d[k - 1] and p[k] == p[k - 1] for k in range(n)]
    best = [upper_bound]
    best_seq: list[list[tuple[int, float]]] = [[]]
    seq: list[tuple[int, float]] = []
    full = (1 << n) - 1
    # per set of jobs (a bitmask): GPU-seconds, narrowest degree, seconds of full-width jobs
    area = [0.0] * (1 << n)
    narrowest = [gpus] * (1 << n)
    wide = [0.0] * (1 << n)
    for m in range(1, 1 << n):
        low = (m & -m).bit_length() - 1
        prev = m & (m - 1)
        area[m] = area[prev] + d[low] * p[low]
        narrowest[m] = min(narrowest[prev], d[low])
        wide[m] = wide[prev] + (p[low] if d[low] == gpus else 0.0)
    budget = _SearchBudget(deadline, max_nodes)

    def visit(free: list[float], s: float, last: int, done: int, end: float) -> None:
        if done == full:
            if end < best[0] * (1 - _REL):
                best[0] = end
                best_seq[0] = list(seq)
            return
        budget.tick()
        left = full & ~done
        clamped = [f if f > s else s for f in free]
        # nothing left starts before the narrowest job left could; full-width jobs run alone
        t0 = clamped[narrowest[left] - 1]
        lb = max(end, (sum(c if c > t0 else t0 for c in clamped) + area[left]) / gpus, clamped[-1] + wide[left])
        if lb >= best[0] * (1 - _REL):
            return
        for k in range(n):
            if not (left >> k) & 1:
                continue
            if clamped[d[k] - 1] + p[k] >= best[0] * (1 - _REL):
                return  # free is sorted: the earliest start of this job already runs too late
        for k in range(n):
            if not (left >> k) & 1:
                continue
            if same_as_prev[k] and (left >> (k - 1)) & 1:
                continue  # identical to an unplaced job before it: place that one first
            dk = d[k]
            t = clamped[dk - 1]  # the earliest start with dk GPUs free (free is sorted)
            if t == s and k < last:
                continue  # simultaneous starts in index order
            e = t + p[k]
            if e >= best[0] * (1 - _REL):
                continue
            # the dk GPUs free latest among those free by t (all equivalent from t on)
            usable = [g for g in range(gpus) if clamped[g] <= t]
            taken = set(usable[-dk:])
            nxt = sorted(e if g in taken else clamped[g] for g in range(gpus))
            seq.append((k, t))
            visit(nxt, t, k, done | (1 << k), max(end, e))
            seq.pop()

    proven = True
    try:
        visit([0.0] * gpus, 0.0, -1, 0, 0.0)
    except _NodeLimit:
        proven = False
    if not best_seq[0]:
        return None
    starts = [0.0] * n
    order = []
    for k, t in best_seq[0]:
        starts[idx[k]] = t
        order.append(idx[k])
    return JobSchedule(best[0], starts, order, proven)


def _narrow_and_full(jobs: Sequence[tuple[int, float]], gpus: int, upper_bound: float, deadline: float | None,
                     max_nodes: int | None) -> JobSchedule | None:
    """Jobs of one GPU or of all of them: the full-width ones run alone, back to back, and
    the rest is the classic P||Cmax -- which GPU runs which one-GPU jobs -- searched by
    branch and bound over assignments (longest job first, GPUs of equal load tried once).
    A schedule that interleaves them is no shorter: cutting out the full-width jobs' time
    leaves a schedule of the one-GPU jobs."""
    full = [j for j, (d, _) in enumerate(jobs) if d == gpus and gpus > 1]
    narrow = sorted((j for j, (d, _) in enumerate(jobs) if not (d == gpus and gpus > 1)), key=lambda j: -jobs[j][1])
    full_s = sum(jobs[j][1] for j in full)
    p = [jobs[j][1] for j in narrow]
    even = sum(p) / gpus  # no assignment ends before the work spread evenly
    load = [0.0] * gpus
    where = [0] * len(p)
    best = [upper_bound - full_s]
    best_where: list[list[int] | None] = [None]
    budget = _SearchBudget(deadline, max_nodes)

    def visit(k: int, top: float) -> None:
        if k == len(p):
            if top < best[0] * (1 - _REL):
                best[0] = top
                best_where[0] = list(where)
            return
        budget.tick()
        if max(top, even) >= best[0] * (1 - _REL):
            return
        tried: set[float] = set()
        for g in sorted(range(gpus), key=lambda g: load[g]):
            if load[g] in tried:
                continue  # GPUs of equal load are interchangeable
            tried.add(load[g])
            new = load[g] + p[k]
            if max(top, new) >= best[0] * (1 - _REL):
                break  # GPUs come least loaded first: the others end later still
            load[g] = new
            where[k] = g
            visit(k + 1, max(top, new))
            load[g] = new - p[k]

    proven = True
    if not p:
        if full_s >= upper_bound * (1 - _REL):
            return None
        best[0], best_where[0] = 0.0, []
    else:
        try:
            visit(0, 0.0)
        except _NodeLimit:
            proven = False
    if best_where[0] is None:
        return None
    starts = [0.0] * len(jobs)
    t = 0.0
    for j in full:
        starts[j] = t
        t += jobs[j][1]
    at = [full_s] * gpus
    for k, j in enumerate(narrow):
        starts[j] = at[best_where[0][k]]
        at[best_where[0][k]] += jobs[j][1]
    order = sorted(range(len(jobs)), key=lambda j: (starts[j], -jobs[j][0]))
    return JobSchedule(full_s + best[0], starts, order, proven)


def assign_gpus(degrees: Sequence[int], starts: Sequence[float], ends: Sequence[float], order: Sequence[int],
                 gpus: int) -> list[list[int]]:
    """GPU ids for a schedule given as start times: in start order, each job takes GPUs free
    by its start, an aligned block of neighbours when one is free (any set is allowed)."""
    free_at = [0.0] * gpus
    out: list[list[int]] = [[] for _ in degrees]
    eps = 1e-9
    for j in order:
        d, t = degrees[j], starts[j]
        ok = [g for g in range(gpus) if free_at[g] <= t * (1 + eps) + eps]
        chosen = None
        for s in range(0, gpus - d + 1, d):
            block = list(range(s, s + d))
            if all(g in ok for g in block):
                chosen = block
                break
        if chosen is None:
            chosen = sorted(ok, key=lambda g: (-free_at[g], g))[:d]
        for g in chosen:
            free_at[g] = ends[j]
        out[j] = sorted(chosen)
    return out


def solve_exact(
    wl: Workload,
    *,
    upper_bound: float = float("inf"),
    time_limit_s: float | None = None,
    prefix: str = "x",
) -> ExactResult | None:
    """The optimal plan of ``wl``'s adapters on its GPUs, or the best found within the time.

    ``upper_bound``: a makespan already achieved (another plan's); only better plans are
    searched for, and when none is found the result has no jobs (if ``proven``, that other
    plan is optimal). None when the sweep is larger than :data:`EXACT_MAX_ADAPTERS`.
    """
    t0 = time.perf_counter()
    deadline = None if time_limit_s is None else t0 + time_limit_s
    loads = list(wl.loads)
    n = len(loads)
    if n == 0 or n > EXACT_MAX_ADAPTERS:
        return None
    cm, G = wl.cost_model, wl.gpus
    full = (1 << n) - 1
    mem = {d: [cm.memory_per_adapter(a, d) for a in loads] for d in wl.degrees}
    room = {d: wl.budget * (1 + 1e-9) - wl.mem_base[d] for d in wl.degrees}

    # Every feasible job: (mask, degree) -> seconds, wider degrees kept only when faster.
    options: list[list[tuple[int, float]]] = [[] for _ in range(1 << n)]
    area = [float("inf")] * (1 << n)
    members = [[loads[i] for i in range(n) if (m >> i) & 1] for m in range(1 << n)]
    for m in range(1, 1 << n):
        if bin(m).count("1") > wl.cap:
            continue
        fastest = float("inf")
        for d in sorted(wl.degrees):
            if sum(mem[d][i] for i in range(n) if (m >> i) & 1) > room[d]:
                continue
            t = cm.job_time(members[m], d)
            if t >= fastest * (1 - 1e-12):
                continue  # a wider job that is no faster only takes more GPUs
            fastest = t
            options[m].append((d, t))
            area[m] = min(area[m], d * t)

    # cover[R]: the least GPU-seconds of jobs covering exactly the adapters in R.
    cover = [0.0] + [float("inf")] * full
    for r in range(1, 1 << n):
        low = r & -r
        rest = r ^ low
        best = float("inf")
        sub = rest
        while True:
            blk = sub | low
            a = area[blk]
            if a < best:
                c = a + cover[r ^ blk]
                if c < best:
                    best = c
            if sub == 0:
                break
            sub = (sub - 1) & rest
        cover[r] = best

    alone = [min((t for _, t in options[1 << i]), default=float("inf")) for i in range(n)]
    if any(t == float("inf") for t in alone):
        return None  # an adapter fits no job (Workload refuses such sweeps first)

    # Identical adapters: a block takes the first ones left of each kind (each partition once).
    kinds: dict[tuple[int, int, int], int] = {}
    for i, a in enumerate(loads):
        key = (a.rank, a.batch_size, a.steps)
        kinds[key] = kinds.get(key, 0) | (1 << i)
    kind_masks = [k for k in kinds.values() if k & (k - 1)]

    # Blocks by their lowest adapter, cheapest GPU-seconds per adapter first.
    by_low: list[list[tuple[int, int, float, float]]] = [[] for _ in range(n)]
    for m in range(1, 1 << n):
        low = (m & -m).bit_length() - 1
        k = bin(m).count("1")
        for d, t in options[m]:
            by_low[low].append((m, d, t, d * t))
    for lst in by_low:
        lst.sort(key=lambda x: (x[3] / bin(x[0]).count("1"), x[2]))

    best = [upper_bound]
    best_jobs: list[list[tuple[int, int, float]]] = [[]]
    best_sched: list[JobSchedule | None] = [None]
    memo: dict[tuple, JobSchedule | None] = {}
    nodes = [0]
    chosen: list[tuple[int, int, float]] = []

    def canonical(blk: int, r: int) -> bool:
        for km in kind_masks:
            sub = blk & km
            if not sub:
                continue
            avail = r & km & ~sub
            top = sub.bit_length() - 1
            if avail & ((1 << top) - 1):
                return False
        return True

    def leaf() -> None:
        jobs = [(d, t) for _, d, t in chosen]
        key = tuple(sorted(jobs))
        if key in memo:  # scheduled before, against a bound at least as loose: nothing new
            return
        sched = schedule_jobs(jobs, G, upper_bound=best[0], deadline=deadline)
        memo[key] = sched
        if sched is not None and sched.makespan < best[0] * (1 - _REL):
            best[0] = sched.makespan
            best_jobs[0] = list(chosen)
            best_sched[0] = sched

    def visit(r: int, area_part: float, wide: float, longest: float, narrow: float) -> None:
        nodes[0] += 1
        if deadline is not None and nodes[0] & 255 == 0 and time.perf_counter() > deadline:
            raise OutOfTime
        if r == 0:
            leaf()
            return
        low = (r & -r).bit_length() - 1
        for blk, d, t, a in by_low[low]:
            if blk & ~r:
                continue
            if kind_masks and not canonical(blk, r):
                continue
            rest = r ^ blk
            if d == G:
                w, ap, nw = wide + t, area_part, narrow
            else:
                w, ap, nw = wide, area_part + a, max(narrow, t)
            # full-width jobs run alone: after them, the longest other job, or the rest's work
            lb = max(longest, t, w + max(nw, (ap + cover[rest]) / G))
            if lb >= best[0] * (1 - _REL):
                continue
            chosen.append((blk, d, t))
            visit(rest, ap, w, max(longest, t), nw)
            chosen.pop()

    proven = True
    notes: list[str] = []
    try:
        visit(full, 0.0, 0.0, max(alone), 0.0)
    except OutOfTime:
        proven = False
        notes.append(f"exact search stopped at its time limit ({time_limit_s:g} s)")
    seconds = time.perf_counter() - t0
    if best_sched[0] is None:  # nothing beats upper_bound (if proven, the plan it came from is optimal)
        return ExactResult([], upper_bound, proven, nodes[0], seconds, notes)
    sched = best_sched[0]
    spec = best_jobs[0]
    ends = [sched.starts[j] + spec[j][2] for j in range(len(spec))]
    gpu_sets = assign_gpus([d for _, d, _ in spec], sched.starts, ends, sched.order, G)
    jobs: list[Job] = []
    for k, j in enumerate(sorted(range(len(spec)), key=lambda j: (sched.starts[j], gpu_sets[j]))):
        blk, d, t = spec[j]
        mem_of: list[AdapterLoad] = members[blk]
        jobs.append(Job(id=f"{prefix}{k:04d}", adapters=[a.id for a in mem_of], tp=d, gpus=gpu_sets[j],
                        start=sched.starts[j], end=sched.starts[j] + t, step_time=cm.step_time(mem_of, d),
                        peak_memory=cm.memory(mem_of, d)))
    return ExactResult(jobs, max(j.end for j in jobs), proven, nodes[0], seconds, notes)
