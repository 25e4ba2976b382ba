"""The strategies a packed plan has to beat, scheduled on the same cost model.

* ``min_gpu``: one adapter per job at the smallest TP degree it fits, jobs side by
  side (longest first, each on the GPUs that free up first).
* ``max_gpu``: one adapter per job at the largest TP degree the model supports
  within the GPU count (all GPUs when the model's heads allow it), list-scheduled
  the same way (so a model limited to TP 4 on 8 GPUs runs two such jobs at a time).
* ``sequential``: one adapter at a time at its smallest fitting degree.
"""

from __future__ import annotations

from typing import Sequence

from plora.cost.model import AdapterLoad, CostModel
from plora.planner.plan import Job

__all__ = ["BASELINES", "baseline_jobs", "list_schedule"]

BASELINES = ("min_gpu", "max_gpu", "sequential")


def _degrees(cm: CostModel, a: AdapterLoad, gpus: int, load_factor: float) -> list[int]:
    return [d for d in cm.degrees if d <= gpus and cm.fits([a], d, load_factor)]


def _job(cm: CostModel, adapters: list[AdapterLoad], d: int, gpus: list[int], start: float, jid: str) -> Job:
    return Job(
        id=jid,
        adapters=[a.id for a in adapters],
        tp=d,
        gpus=sorted(gpus),
        start=start,
        end=start + cm.job_time(adapters, d),
        step_time=cm.step_time(adapters, d),
        peak_memory=cm.memory(adapters, d),
    )


def list_schedule(cm: CostModel, items: Sequence[tuple[list[AdapterLoad], int]], gpus: int, prefix: str = "j") -> list[Job]:
    """Longest-first list scheduling: each job takes the d GPUs that are free earliest."""
    free_at = [0.0] * gpus
    order = sorted(items, key=lambda it: -cm.job_time(it[0], it[1]))
    jobs = []
    for n, (adapters, d) in enumerate(order):
        chosen = sorted(range(gpus), key=lambda g: (free_at[g], g))[:d]
        start = max(free_at[g] for g in chosen)
        job = _job(cm, adapters, d, chosen, start, f"{prefix}{n:04d}")
        for g in chosen:
            free_at[g] = job.end
        jobs.append(job)
    jobs.sort(key=lambda j: (j.start, j.gpus))
    return jobs


def baseline_jobs(name: str, loads: Sequence[AdapterLoad], cm: CostModel, gpus: int, load_factor: float = 0.9) -> list[Job]:
    """The job list of baseline ``name``; assumes every adapter fits at some degree <= gpus."""
    if name == "min_gpu":
        return list_schedule(cm, [([a], min(_degrees(cm, a, gpus, load_factor))) for a in loads], gpus, "min")
    if name == "max_gpu":
        return list_schedule(cm, [([a], max(_degrees(cm, a, gpus, load_factor))) for a in loads], gpus, "max")
    if name == "sequential":
        jobs, t = [], 0.0
        for n, a in enumerate(loads):
            d = min(_degrees(cm, a, gpus, load_factor))
            job = _job(cm, [a], d, list(range(d)), t, f"seq{n:04d}")
            jobs.append(job)
            t = job.end
        return jobs
    raise ValueError(f"unknown baseline {name!r}; expected one of {', '.join(BASELINES)}")


def makespan(jobs: Sequence[Job]) -> float:
    return max((j.end for j in jobs), default=0.0)
