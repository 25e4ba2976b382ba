"""Shift every job of a plan as early as its GPUs allow.

A plan is executed -- by the engine, and replayed by :func:`plora.planner.simulate` -- in
the order of its jobs' starts, each job on its own GPUs as soon as the jobs before it on
those GPUs have ended. A schedule built in simulated time can leave a job waiting on GPUs
that were free all along (the scheduler decided at a later event); compacting it first
makes the plan's predicted times the ones it will run at, and lets plans be compared by
the makespan they will actually have.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from plora.planner.plan import Job

__all__ = ["compact"]


def compact(jobs: Sequence[Job]) -> list[Job]:
    """The jobs in start order, each started when the earlier ones on its GPUs have ended
    (never later than before; durations and GPU sets unchanged)."""
    free_at: dict[int, float] = {}
    out: list[Job] = []
    for j in sorted(jobs, key=lambda j: (j.start, j.id)):
        start = max((free_at.get(g, 0.0) for g in j.gpus), default=0.0)
        start = min(start, j.start)  # float noise must never move a job later
        moved = dataclasses.replace(j, start=start, end=start + (j.end - j.start))
        for g in j.gpus:
            free_at[g] = moved.end
        out.append(moved)
    out.sort(key=lambda j: (j.start, j.gpus, j.id))
    return out
