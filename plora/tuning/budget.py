"""What a tune spends, in GPU-seconds; its budget; and the best score found against it.

GPU-seconds are counted from the jobs a tune starts: every job process holds its GPUs (a
CPU slot counts as one) from its launch until it exits, busy or waiting for a join, so it
spends ``GPUs × (exit or now − launch)``; the tune's spending is the sum over its jobs.
That is what the machine could not do meanwhile, and what a grid of the same space spends
on the same jobs, so strategies compare on it whatever their wall time.

Each trial told appends (GPU-seconds so far, its value, the best value so far) to the run
directory's ``tune_history.csv``: the report plots the best score found against GPU-seconds
for every strategy run on a space (`plora.results.plots.plot_best_vs_gpu_seconds`).
"""

from __future__ import annotations

import csv
import json
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from plora.results.run_data import TUNE_HISTORY_COLUMNS as HISTORY_COLUMNS
from plora.results.run_data import TUNE_HISTORY_FILE as HISTORY_FILE
from plora.tuning.base import TuneError

SUMMARY_FILE = "tune.json"
ON_BUDGET = ("finish", "stop")
#: the result of a trial whose adapter never trained because the budget was spent first
BUDGET_SPENT = {"status": "pruned", "reason": "the budget was spent before it trained"}
#: the result of a trial not started because it could not have trained to its end within the budget
BUDGET_LEFT_SHORT = {"status": "pruned", "reason": "the budget left could not train it to its end"}

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def never_trained(row: dict[str, Any] | None) -> bool:
    """Whether a result row is an adapter's that no job ever trained (none of its files)."""
    return row is None or (row.get("status") == "failed" and row.get("reason") == "no result")


def parse_gpu_budget(text: str | float | int) -> float:
    """GPU-seconds from ``1800``, ``90s``, ``30m`` or ``2h``; a :class:`TuneError` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|m|min|h)?\s*", str(text), re.IGNORECASE)
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()] if m else math.nan
    if not math.isfinite(value) or value <= 0:
        raise TuneError(f"budget: expected GPU-seconds > 0 (1800) or a duration (90s, 30m, 2h), got {text!r}")
    return value


def check_on_budget(value: str) -> str:
    if value not in ON_BUDGET:
        raise TuneError(f"on-budget: expected one of {', '.join(ON_BUDGET)}, got {value!r}")
    return value


def _seconds(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def _gpus(slot: str) -> int:
    return max(1, len([s for s in str(slot).split(",") if s]))


@dataclass
class GpuClock:
    """GPU-seconds of the job processes a tune has seen (see the module docstring)."""

    #: (job id, launch time) -> (launch time, exit time or None, GPUs)
    spans: dict[tuple[str, float], tuple[float, float | None, int]] = field(default_factory=dict)

    def observe(self, procs: Iterable[Any]) -> None:
        """Note job processes (`plora.engine.local.JobProcess`: running or finished)."""
        for p in procs:
            self.spans[(p.job_id, p.started)] = (p.started, p.ended, _gpus(p.slot))

    def spent(self, now: float | None = None) -> float:
        now = time.time() if now is None else now
        return sum(g * max(0.0, (end if end is not None else now) - start) for start, end, g in self.spans.values())


@dataclass
class Budget:
    """A tune's GPU-second budget (None: no budget) and what it does once spent."""

    gpu_seconds: float | None = None
    on_budget: str = "finish"
    clock: GpuClock = field(default_factory=GpuClock)
    #: set once the budget was found spent: no trial is asked after it
    spent_at: float | None = None

    def __post_init__(self) -> None:
        if self.gpu_seconds is not None:
            self.gpu_seconds = parse_gpu_budget(self.gpu_seconds)
        check_on_budget(self.on_budget)

    def observe(self, running: Iterable[Any], finished: Iterable[Any]) -> None:
        self.clock.observe([*running, *finished])

    @property
    def spent(self) -> float:
        return self.clock.spent()

    @property
    def exhausted(self) -> bool:
        """Whether the budget is spent (it stays spent once it was)."""
        if self.spent_at is None and self.gpu_seconds is not None and self.spent >= self.gpu_seconds:
            self.spent_at = self.spent
        return self.spent_at is not None

    @property
    def stops(self) -> bool:
        """Whether running trials are pruned now (the budget is spent and ``on_budget: stop``)."""
        return self.on_budget == "stop" and self.exhausted

    def ends_within(self, seconds: float) -> bool:
        """Under ``on_budget: stop``, whether ``seconds`` more GPU-seconds end within the
        budget left (what was not would be pruned by it); always true otherwise."""
        if self.on_budget != "stop" or self.gpu_seconds is None:
            return True
        return self.spent + seconds <= self.gpu_seconds

    def describe(self) -> str:
        spent = f"{_seconds(self.spent)} GPU-s"
        if self.gpu_seconds is None:
            return f"{spent} spent"
        return f"{spent} of a {_seconds(self.gpu_seconds)} GPU-s budget ({100 * self.spent / self.gpu_seconds:.0f}%)"

    def summary(self) -> dict[str, Any]:
        return {"budget_gpu_seconds": self.gpu_seconds, "on_budget": self.on_budget,
                "spent_gpu_seconds": round(self.spent, 3), "budget_spent": self.spent_at is not None}


def strategy_name(sampler: Any, pruner: Any, asynchronous: bool) -> str:
    """How a tune is labelled in its history: sampler, pruner, loop or asynchronous."""
    def name(x: Any) -> str:
        return x if isinstance(x, str) else type(x).__name__.removesuffix("Sampler").removesuffix("Pruner").lower()

    parts = [name(sampler)]
    if pruner not in (None, "none", "nop"):
        parts.append(f"+ {name(pruner)}")
    parts.append("async" if asynchronous else "loop")
    return " ".join(parts)


class TuneHistory:
    """``tune_history.csv``: one row per trial told, with the GPU-seconds spent then and the
    best value so far. A tune resumed on the run directory goes on from its last row."""

    def __init__(self, run_dir: Path, strategy: str, budget: Budget, minimize: bool) -> None:
        self.path = Path(run_dir) / HISTORY_FILE
        self.strategy = strategy
        self.budget = budget
        self.minimize = minimize
        self.t0 = time.time()
        self.offset_gpu = self.offset_wall = 0.0
        self.best: float | None = None
        for row in read_history(self.path):
            self.offset_gpu = max(self.offset_gpu, float(row["gpu_seconds"]))
            self.offset_wall = max(self.offset_wall, float(row["wall_seconds"]))
            if row["best"] not in ("", None):
                self.best = self._better(self.best, float(row["best"]))

    def _better(self, a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return b if a is None else a
        return min(a, b) if self.minimize else max(a, b)

    def record(self, trial: FrozenTrial) -> None:
        value = trial.value if trial.state == TrialState.COMPLETE else None
        self.best = self._better(self.best, value)
        new = not self.path.is_file()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(HISTORY_COLUMNS)
            w.writerow([self.strategy, trial.number, trial.state.name.lower(), "" if value is None else value,
                        "" if self.best is None else self.best, round(self.offset_gpu + self.budget.spent, 3),
                        round(self.offset_wall + time.time() - self.t0, 3)])

    def write_summary(self, run_dir: Path, trials: int) -> None:
        """tune.json: the strategy, the budget, what was spent and the best value found."""
        data = {"strategy": self.strategy, "trials": trials, **self.budget.summary(), "best": self.best}
        (Path(run_dir) / SUMMARY_FILE).write_text(json.dumps(data, indent=2))


def read_history(path: Path) -> list[dict[str, str]]:
    """The rows of a ``tune_history.csv`` (none if it is missing or unreadable)."""
    try:
        with open(path, newline="") as f:
            return [r for r in csv.DictReader(f) if r.get("gpu_seconds") not in (None, "")]
    except (OSError, csv.Error):
        return []
