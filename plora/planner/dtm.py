"""DTM: split the free GPUs into jobs of power-of-two TP degrees.

For ``g`` free GPUs, try each degree ``d <= g`` the model supports, take the best
pack F(d, remaining) for it, and recurse on ``g - d`` GPUs with the adapters left
(PLoRA's recursion). Degrees are tried in non-increasing order along a branch:
the same multiset of degrees in another order gives the same GPU usage, so this
visits each split once instead of once per permutation. Every prefix of a
branch is also a candidate (the GPUs not yet given a job stay idle until the
next job ends), which lets the scheduler wait to assemble a wider job.

Candidates are compared by a predicted makespan (:func:`estimate`), which is
where the whole remaining sweep, not only the jobs being started, is priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from plora.planner.ilp import Pack, PackSolver
from plora.planner.workload import Workload

__all__ = ["Candidate", "SchedulerState", "dtm", "estimate"]


@dataclass
class SchedulerState:
    """What the scheduler knows at a decision time ``now``."""

    now: float
    free: int  # number of free GPUs
    remaining: tuple[int, ...]  # adapters left per type
    running: list[tuple[int, float]]  # (TP degree, end time) of jobs still running


@dataclass
class Candidate:
    packs: list[Pack]
    estimate: float
    busy: float  # GPU-seconds committed from now on (running + new + idle GPUs)

    def key(self) -> tuple[float, float, int]:
        return (self.estimate, self.busy, -len(self.packs))


def estimate(wl: Workload, state: SchedulerState, packs: list[Pack]) -> Candidate:
    """Predicted makespan if ``packs`` start now and the rest of the sweep runs ideally.

    The largest of: the last end among running and new jobs; the time all GPUs
    need for what they are committed to from now on (running and new jobs, plus
    idle GPUs until the next job ends) and for the ideal work of the adapters
    still unassigned (``Workload.work``), spread over every GPU; and the next job
    end (the next decision) plus the longest single-adapter time among those
    adapters.
    """
    now, g = state.now, wl.gpus
    left = np.asarray(state.remaining, dtype=float)
    for p in packs:
        left -= np.asarray(p.counts)
    ends = [e for _, e in state.running] + [now + p.job_time for p in packs]
    idle = state.free - sum(p.d for p in packs)
    committed = sum(d * (e - now) for d, e in state.running) + sum(p.d * p.job_time for p in packs)
    t_next = min(ends) if ends else math.inf
    if idle > 0 and left.sum() > 0:  # GPUs left idle while work waits cost until the next decision
        if not ends:
            return Candidate(packs, math.inf, math.inf)
        committed += idle * (t_next - now)
    rest = float(left @ wl.work)
    busy_bound = now + (committed + rest) / g
    last_end = max(ends) if ends else now
    straggler = now
    if left.sum() > 0:
        # The next decision is at the next job end; nothing left can start before it.
        straggler = t_next + float(wl.single_time[left > 0].max())
    return Candidate(packs, max(last_end, busy_bound, straggler), committed)


def dtm(wl: Workload, solver: PackSolver, state: SchedulerState, t_max: float | None, *, greedy: bool = False) -> Candidate:
    """The best set of new jobs for the free GPUs (possibly none, if waiting predicts better).

    ``greedy`` keeps only the best branch at each level (one F call per degree and
    level instead of a full search) -- the fallback once the planning time budget is spent.
    """
    best: list[Candidate] = [estimate(wl, state, [])]

    def visit(g: int, max_d: int, remaining: np.ndarray, packs: list[Pack]) -> None:
        children: list[tuple[Candidate, int, Pack]] = []
        for d in sorted(wl.degrees, reverse=True):
            if d > g or d > max_d:
                continue
            pack = solver.solve(d, tuple(int(x) for x in remaining), t_max)
            if pack is None:
                continue
            cand = estimate(wl, state, packs + [pack])
            if cand.key() < best[0].key():
                best[0] = cand
            children.append((cand, d, pack))
        if greedy and children:
            children = [min(children, key=lambda c: c[0].key())]
        for cand, d, pack in children:
            rest = remaining - np.asarray(pack.counts)
            if rest.sum() > 0 and g - d > 0:
                visit(g - d, d, rest, packs + [pack])

    visit(state.free, max(wl.degrees), np.asarray(state.remaining), [])
    return best[0]
