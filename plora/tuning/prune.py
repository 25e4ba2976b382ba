"""The prune protocol: a pruner's decision reaches a running job through its control.json."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna

from plora.tuning.fidelity import Rungs


def intermediate_value(rec: Mapping[str, Any], sign: float) -> float | None:
    """The value an evals.jsonl record reports to its trial, in the study's direction: the
    objective (``eval_<objective>``, scored on the intermediate slice) where the record has
    it, as it is; else the eval loss times ``sign`` (`plora.tuning.study.intermediate_sign`:
    -1 where the study maximizes). None where neither is a finite number."""
    objective = rec.get("objective")
    try:
        if objective is not None and f"eval_{objective}" in rec:
            value = float(rec[f"eval_{objective}"])
        else:
            value = sign * float(rec["eval_loss"])
    except (KeyError, TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _finished_status(run_dir: Path, adapter_id: str) -> str | None:
    path = run_dir / "adapters" / adapter_id / "metrics.json"
    with contextlib.suppress(OSError, ValueError):
        status = json.loads(path.read_text()).get("status")
        return status if status in ("done", "diverged", "pruned") else None
    return None


class _PruneWatcher:
    """Reads the intermediate evals of running jobs, reports them to their trials (the
    objective where the evals score it, else the signed eval loss: `intermediate_value`)
    and, when a trial's pruner says so, asks the job to drop that adapter (``control.json``).

    An eval at an adapter's step is reported at the share of its budget seen then
    (``rungs.resource`` of its ``totals`` steps: `plora.tuning.fidelity`), so that trials of
    every batch size compare at the same fractions; without ``rungs``, at the step."""

    def __init__(self, trials: Mapping[str, Sequence[optuna.Trial]], sign: float, can_prune: bool,
                 rungs: Rungs | None = None, totals: Mapping[str, int] | None = None) -> None:
        self.trials = trials
        self.sign = sign
        self.can_prune = can_prune
        self.rungs = rungs
        self.totals = totals if totals is not None else {}
        self.offsets: dict[Path, int] = {}
        self.reported: dict[int, set[int]] = {}
        self.pruned: set[str] = set()

    def __call__(self, running: Sequence[Any], finished: Sequence[Any]) -> None:
        for jp in running:
            self.poll(Path(jp.job_dir), prune=self.can_prune)

    def poll(self, job_dir: Path, *, prune: bool, request: bool = True) -> list[str]:
        """Report the job's new intermediate evals; returns the adapters the pruner stops
        now, whose prune this writes to the job's control.json unless ``request`` is off
        (a caller that writes it with other requests)."""
        path = job_dir / "evals.jsonl"
        stopped: list[str] = []
        if not path.is_file():
            return stopped
        with open(path, "rb") as f:
            f.seek(self.offsets.get(path, 0))
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1  # only whole lines; the rest is read next time
        self.offsets[path] = self.offsets.get(path, 0) + end
        for line in chunk[:end].decode().splitlines():
            try:
                rec = json.loads(line)
                adapter, step = rec["adapter"], int(rec["adapter_step"])
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
            value = intermediate_value(rec, self.sign)
            trials = self.trials.get(adapter, ())
            if not trials or value is None or adapter in self.pruned:
                continue
            if self.rungs is not None and adapter in self.totals:
                step = self.rungs.resource(step, int(self.totals[adapter]))
            for t in trials:
                done = self.reported.setdefault(t.number, set())
                if step not in done:
                    t.report(value, step)
                    done.add(step)
            if prune and trials[0].should_prune():
                self.pruned.add(adapter)
                stopped.append(adapter)
                if request:
                    request_prune(job_dir, [adapter])
        return stopped


def request_prune(job_dir: Path, adapter_ids: Iterable[str]) -> None:
    """Ask a running job to drop adapters: they leave the pack at its next step, with status
    ``pruned`` (the job reads control.json whenever it changes)."""
    path = Path(job_dir) / "control.json"
    try:
        control = json.loads(path.read_text())
    except (OSError, ValueError):
        control = {}
    prune = list(dict.fromkeys([*control.get("prune", []), *adapter_ids]))
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**control, "prune": prune}))
    tmp.replace(path)
