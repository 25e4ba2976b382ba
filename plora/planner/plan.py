"""The planner's output: a queue of packed jobs with their GPUs and predicted times.

`Job` is the one job type from the planner to the engine: the planner predicts its
times, the engine runs it (and makes new ones when it splits a job that ran out of
memory). `Plan` owns ``plan.json``: it writes the file and every reader (the sweep, the
report, ``plora tune``, the benchmarks) reads it back through `Plan.load`. Everything
here is plain data: reading a plan back runs no solver.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from plora.cost.model import AdapterLoad

__all__ = ["PLAN_FILE", "Job", "Plan"]

#: The plan's file in a run directory.
PLAN_FILE = "plan.json"
#: What ``plan.json`` says it is; a file of another kind is not read as a plan.
PLAN_KIND = "plora.plan/v2"


def _opt_float(v: Any) -> float | None:
    return None if v is None else float(v)


@dataclass
class Job:
    """Adapters trained together on one base-model copy, on ``gpus`` at TP degree ``tp``.

    ``start`` and ``end`` are the predicted start and end (seconds from the plan's start),
    ``step_time`` the predicted time of a full-pack step (the first one; later steps get
    cheaper as adapters finish) and ``peak_memory`` the predicted peak bytes per GPU. A job
    the engine makes (a half of a job that ran out of memory) has no GPUs and no
    predictions: it takes any free slots.
    """

    id: str
    adapters: list[str]
    tp: int = 1
    gpus: list[int] = field(default_factory=list)
    start: float | None = None
    end: float | None = None
    step_time: float | None = None
    peak_memory: float | None = None

    @property
    def predicted_seconds(self) -> float | None:
        """The predicted wall time (None without predictions)."""
        return None if self.start is None or self.end is None else self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Job":
        return cls(
            id=str(d["id"]),
            adapters=[str(a) for a in d["adapters"]],
            tp=int(d.get("tp", 1)),
            gpus=[int(g) for g in d.get("gpus") or []],
            start=_opt_float(d.get("start")),
            end=_opt_float(d.get("end")),
            step_time=_opt_float(d.get("step_time")),
            peak_memory=_opt_float(d.get("peak_memory")),
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

    A plan no planner made (jobs fixed by hand, or the union of a tune's batches) has
    jobs and zeros: ``makespan`` 0 means nothing was predicted. ``grouping`` says to the
    user how adapters were grouped, ``hardware`` and ``cost_model_source`` what the plan
    was made for and with; ``batches`` are ``plora tune``'s records of its batches (each
    with its ``batch`` number and its ``jobs``' ids), opaque to the planner.
    """

    jobs: list[Job]
    adapters: list[AdapterLoad] = field(default_factory=list)
    gpus: int = 0
    makespan: float = 0.0
    lower_bound: float = 0.0
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
    grouping: str = ""
    hardware: str = ""
    cost_model_source: str = ""
    #: adapter id -> the micro-batch the planner chose where its batch does not fit one pass
    #: (`plora.planner.micro_batch`); absent: one pass, or the sweep's ``training.micro_batch_size``
    micro_batches: dict[str, int] = field(default_factory=dict)
    batches: list[dict[str, Any]] = field(default_factory=list)
    #: the makespan once the engine streams queued adapters into running jobs
    #: (`plora.engine.stream_forecast`); 0: the sweep does not stream, or it was not forecast
    streamed_makespan: float = 0.0

    @property
    def expected_makespan(self) -> float:
        """What the sweep is predicted to take as the engine will run it: the streamed
        forecast where there is one, else the plan's own makespan."""
        return self.streamed_makespan or self.makespan

    @property
    def bound_ratio(self) -> float:
        """Predicted makespan over the lower bound (1.0 is provably optimal)."""
        return self.makespan / self.lower_bound if self.lower_bound > 0 else float("inf")

    def job_of(self) -> dict[str, str]:
        """Adapter id -> job id."""
        return {a: j.id for j in self.jobs for a in j.adapters}

    def batch_of(self) -> dict[str, int]:
        """Job id -> the tune batch it belongs to (empty for a sweep's plan)."""
        return {str(jid): int(b["batch"]) for b in self.batches for jid in b.get("jobs", [])}

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PLAN_KIND,
            "grouping": self.grouping,
            "hardware": self.hardware,
            "cost_model_source": self.cost_model_source,
            "gpus": self.gpus,
            "makespan": self.makespan,
            "streamed_makespan": self.streamed_makespan or None,
            "lower_bound": self.lower_bound,
            "bound_ratio": self.bound_ratio if self.lower_bound > 0 else None,
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
            "batches": list(self.batches),
            "micro_batches": dict(self.micro_batches),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if d.get("kind") != PLAN_KIND:
            raise ValueError(f"not a plan of this plora version (kind {d.get('kind')!r}, expected {PLAN_KIND!r})")
        cap = d.get("max_adapters_per_job")
        return cls(
            jobs=[Job.from_dict(j) for j in d["jobs"]],
            adapters=[AdapterLoad.from_dict(a) for a in d.get("adapters", [])],
            gpus=int(d.get("gpus", 0)),
            makespan=float(d.get("makespan", 0.0)),
            streamed_makespan=float(d.get("streamed_makespan") or 0.0),
            lower_bound=float(d.get("lower_bound", 0.0)),
            baselines={str(k): float(v) for k, v in d.get("baselines", {}).items()},
            packed_makespan=float(d.get("packed_makespan", 0.0)),
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
            grouping=str(d.get("grouping", "")),
            hardware=str(d.get("hardware", "")),
            cost_model_source=str(d.get("cost_model_source", "")),
            batches=[dict(b) for b in d.get("batches", [])],
            micro_batches={str(k): int(v) for k, v in d.get("micro_batches", {}).items()},
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        """The plan in ``path``; ValueError (with the path) for a file that is no plan."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except KeyError as e:
            raise ValueError(f"{path}: no {e} in it") from None
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def of_run(cls, run_dir: str | Path) -> Plan | None:
        """A run directory's plan (its ``plan.json``); None when it has none."""
        path = Path(run_dir) / PLAN_FILE
        return cls.load(path) if path.is_file() else None
