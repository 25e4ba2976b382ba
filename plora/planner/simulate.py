"""Replay a plan on a cost model and check what it commits GPUs and memory to.

Used to test the planner, to re-predict an existing ``plan.json`` with a newly
fitted cost model, and by the engine to compare predictions with reality.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from plora.cost.model import AdapterLoad, CostModel
from plora.planner.errors import PlannerError
from plora.planner.plan import Plan

__all__ = ["SimulationResult", "simulate"]

_EPS = 1e-6


@dataclass
class SimulationResult:
    """Replayed times per job, the resulting makespan and every broken commitment."""

    makespan: float
    starts: dict[str, float] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)
    peak_memory: dict[str, float] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def simulate(
    plan: Plan,
    cost_model: CostModel,
    loads: Sequence[AdapterLoad] | None = None,
    *,
    load_factor: float | None = None,
    strict: bool = False,
) -> SimulationResult:
    """Replay ``plan`` as the engine runs it and check it.

    Replay: jobs launch in the plan's order (by start time); each starts on its own GPUs
    as soon as the jobs before it on those GPUs have ended, and lasts
    ``cost_model.job_time`` -- what the engine does (`plora.engine.runner`). With the cost
    model the plan was made with, this reproduces its predicted times: `plan_sweep`'s
    plans are compacted (`plora.planner.compact`), so no job waits on free GPUs.

    Checks: every adapter in exactly one job; each job on ``tp`` distinct GPUs that
    exist (a TP job may use any such set: on NVSwitch machines every pair of GPUs is
    linked alike), at a degree the model supports, within ``load_factor`` of GPU memory;
    and, in the plan's own recorded times, no GPU running two jobs at once. ``strict``
    raises :class:`PlannerError` on the first violation instead of listing them.
    """
    loads = list(loads) if loads is not None else list(plan.adapters)
    by_id = {a.id: a for a in loads}
    lf = plan.load_factor if load_factor is None else load_factor
    budget = lf * cost_model.gpu_memory_bytes
    violations: list[str] = []

    seen: dict[str, str] = {}
    for j in plan.jobs:
        for a in j.adapters:
            if a in seen:
                violations.append(f"adapter {a} is in jobs {seen[a]} and {j.id}")
            elif a not in by_id:
                violations.append(f"adapter {a} of job {j.id} is unknown")
            seen.setdefault(a, j.id)
    for a in by_id:
        if a not in seen:
            violations.append(f"adapter {a} is in no job")

    res = SimulationResult(makespan=0.0)
    for j in plan.jobs:
        if len(j.gpus) != j.tp or len(set(j.gpus)) != len(j.gpus):
            violations.append(f"job {j.id}: TP degree {j.tp} on GPUs {j.gpus}")
        if any(g < 0 or g >= plan.gpus for g in j.gpus):
            violations.append(f"job {j.id}: GPUs {j.gpus} outside 0..{plan.gpus - 1}")
        if j.tp not in cost_model.degrees:
            violations.append(f"job {j.id}: TP degree {j.tp} not supported by the cost model")
            continue
        members = [by_id[a] for a in j.adapters if a in by_id]
        mem = cost_model.memory(members, j.tp)
        res.peak_memory[j.id] = mem
        if mem > budget * (1 + 1e-9):
            violations.append(f"job {j.id}: {mem / 2**30:.2f} GiB per GPU over the {budget / 2**30:.2f} GiB budget")

    # The recorded schedule: at most one job per GPU at any time.
    per_gpu: dict[int, list[tuple[float, float, str]]] = {}
    for j in plan.jobs:
        if j.end < j.start - _EPS:
            violations.append(f"job {j.id}: ends before it starts")
        for g in j.gpus:
            per_gpu.setdefault(g, []).append((j.start, j.end, j.id))
    for g, spans in per_gpu.items():
        spans.sort()
        for (s0, e0, a), (s1, _e1, b) in zip(spans, spans[1:]):
            if s1 < e0 - _EPS * max(1.0, e0):
                violations.append(f"GPU {g}: jobs {a} and {b} overlap ({s1:.1f} < {e0:.1f})")

    # Replay in launch order.
    free_at: dict[int, float] = {}
    for j in sorted(plan.jobs, key=lambda j: (j.start, j.id)):
        if j.tp not in cost_model.degrees:
            continue
        members = [by_id[a] for a in j.adapters if a in by_id]
        start = max((free_at.get(g, 0.0) for g in j.gpus), default=0.0)
        end = start + cost_model.job_time(members, j.tp)
        for g in j.gpus:
            free_at[g] = end
        res.starts[j.id], res.ends[j.id] = start, end
    res.makespan = max(res.ends.values(), default=0.0)
    res.violations = violations
    if strict and violations:
        raise PlannerError(f"plan check failed: {violations[0]}")
    return res
