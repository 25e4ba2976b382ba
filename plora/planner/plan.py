"""The planner's output: a queue of packed jobs with their GPUs and predicted times.

Everything here is plain data so that ``plan.json`` can be read back by the engine,
the report and ``plora status`` without the planner's solver stack.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plora.costmodel import AdapterLoad

__all__ = ["Job", "Plan"]


@dataclass
class Job:
    """Adapters trained together on one base-model copy, on ``gpus`` at TP degree ``tp``.

    ``step_time`` is the predicted time of a full-pack step (the first one; later
    steps get cheaper as adapters finish) and ``peak_memory`` the predicted peak
    bytes per GPU.
    """

    id: str
    adapters: list[str]
    tp: int
    gpus: list[int]
    start: float
    end: float
    step_time: float
    peak_memory: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        return cls(
            id=str(d["id"]),
            adapters=[str(a) for a in d["adapters"]],
            tp=int(d["tp"]),
            gpus=[int(g) for g in d["gpus"]],
            start=float(d["start"]),
            end=float(d["end"]),
            step_time=float(d["step_time"]),
            peak_memory=float(d["peak_memory"]),
        )


@dataclass
class Plan:
    """Jobs in launch order, with the predictions that justify them.

    ``makespan`` is the predicted end of the last job; ``lower_bound`` no schedule on
    the same cost model can beat (see :func:`plora.planner.bounds.lower_bound`);
    ``baselines`` the predicted makespans of the simple strategies and
    ``packed_makespan`` that of the packed (DTM) schedule; ``strategy`` says which
    schedule was kept (``dtm``; ``lp_columns``, the jobs of the configuration LP's columns,
    see :mod:`plora.planner.columns`; ``search``, local search from those,
    :mod:`plora.planner.improve`; ``exact``, the exact solver's, :mod:`plora.planner.exact`;
    or a baseline's name when it predicted better); ``optimal`` whether the exact solver
    proved that no plan on the cost model is shorter;
    ``solver`` which ILP solver(s) ran, with ``solver_calls`` counting the solves.
    """

    jobs: list[Job]
    adapters: list[AdapterLoad]
    gpus: int
    makespan: float
    lower_bound: float
    baselines: dict[str, float] = field(default_factory=dict)
    packed_makespan: float = 0.0
    solver: str = "none"
    solver_calls: dict[str, int] = field(default_factory=dict)
    planning_seconds: float = 0.0
    objective: str = "makespan"
    strategy: str = "dtm"
    load_factor: float = 0.9
    max_adapters_per_job: int | None = None
    cost_model: str = ""
    notes: list[str] = field(default_factory=list)
    optimal: bool = False

    @property
    def bound_ratio(self) -> float:
        """Predicted makespan over the lower bound (1.0 is provably optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else float("inf")

    def job_of(self) -> dict[str, str]:
        """Adapter id -> job id."""
        return {a: j.id for j in self.jobs for a in j.adapters}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": "plora.plan/v1",
            "gpus": self.gpus,
            "makespan": self.makespan,
            "lower_bound": self.lower_bound,
            "bound_ratio": self.bound_ratio,
            "baselines": dict(self.baselines),
            "packed_makespan": self.packed_makespan,
            "solver": self.solver,
            "solver_calls": dict(self.solver_calls),
            "planning_seconds": self.planning_seconds,
            "objective": self.objective,
            "strategy": self.strategy,
            "load_factor": self.load_factor,
            "max_adapters_per_job": self.max_adapters_per_job,
            "cost_model": self.cost_model,
            "notes": list(self.notes),
            "optimal": self.optimal,
            "adapters": [a.to_dict() for a in self.adapters],
            "jobs": [j.to_dict() for j in self.jobs],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        cap = d.get("max_adapters_per_job")
        return cls(
            jobs=[Job.from_dict(j) for j in d["jobs"]],
            adapters=[AdapterLoad.from_dict(a) for a in d.get("adapters", [])],
            gpus=int(d["gpus"]),
            makespan=float(d["makespan"]),
            lower_bound=float(d["lower_bound"]),
            baselines={str(k): float(v) for k, v in d.get("baselines", {}).items()},
            packed_makespan=float(d.get("packed_makespan", d["makespan"])),
            solver=str(d.get("solver", "none")),
            solver_calls={str(k): int(v) for k, v in d.get("solver_calls", {}).items()},
            planning_seconds=float(d.get("planning_seconds", 0.0)),
            objective=str(d.get("objective", "makespan")),
            strategy=str(d.get("strategy", "dtm")),
            load_factor=float(d.get("load_factor", 0.9)),
            max_adapters_per_job=None if cap is None else int(cap),
            cost_model=str(d.get("cost_model", "")),
            notes=[str(n) for n in d.get("notes", [])],
            optimal=bool(d.get("optimal", False)),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_dict(json.loads(Path(path).read_text()))
