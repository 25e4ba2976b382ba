"""What a tracker logs of one adapter, read from the run directory the jobs wrote.

Everything comes from files that exist anyway: each job's ``metrics.jsonl`` (a row per
adapter step: loss, learning rate, gradient norm), its ``evals.jsonl`` (the intermediate
eval loss, with ``eval.every_steps``) and the adapter's ``metrics.json`` (its final status,
eval metrics and hyperparameters). A job that ran again (a crash, a resume, an
out-of-memory split) appended to its files; an adapter's curve is the one its latest
attempts trained (`plora.results.run_data.latest_attempts`, as the report draws it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from plora.results.adapter_spans import read_json, read_jsonl
from plora.results.run_data import latest_attempts

__all__ = ["AdapterRecord", "CurveReader", "finished_adapters"]

#: per-step values of metrics.jsonl a tracker logs, and the name it logs each under
STEP_VALUES: dict[str, str] = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm"}
#: the intermediate eval loss of evals.jsonl
EVAL_VALUE = "eval/loss"


@dataclass
class AdapterRecord:
    """One adapter as a tracker logs it."""

    adapter_id: str
    job_id: str | None
    status: str
    hyperparameters: dict[str, Any]  # rank, alpha, learning_rate, batch_size, seed
    #: ``{adapter_step: {name: value}}``: training values and intermediate evals, by step
    curve: dict[int, dict[str, float]] = field(default_factory=dict)
    #: train_loss and every eval_<metric> measured at the end (numbers only)
    final: dict[str, float] = field(default_factory=dict)

    @property
    def last_step(self) -> int:
        return max(self.curve, default=0)


def finished_adapters(run_dir: Path, adapter_ids: Iterable[str]) -> list[str]:
    """The adapters among ``adapter_ids`` whose metrics.json is written (they left their job:
    done, diverged, pruned or failed)."""
    return [a for a in adapter_ids if (run_dir / "adapters" / a / "metrics.json").is_file()]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(float(value)) else None


class CurveReader:
    """Reads every job's curves of a run directory; a file read before is read again only
    once it has grown (a sweep's finished jobs are not re-read at each call)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self._files: dict[Path, tuple[int, list[dict]]] = {}

    def _rows(self, path: Path) -> list[dict]:
        try:
            size = path.stat().st_size
        except OSError:
            return []
        cached = self._files.get(path)
        if cached is None or cached[0] != size:
            cached = self._files[path] = (size, read_jsonl(path))
        return cached[1]

    def _curves(self, name: str, value_keys: Iterable[str], adapters: set[str]) -> pd.DataFrame:
        keys = list(value_keys)
        rows = []
        for job_dir in sorted(p for p in (self.run_dir / "jobs").glob("*") if p.is_dir()):
            for r in self._rows(job_dir / name):
                if r.get("adapter") in adapters and r.get("adapter_step") is not None:
                    rows.append({"job_id": job_dir.name, "adapter": r["adapter"], "adapter_step": int(r["adapter_step"]),
                                 "attempt": int(r.get("attempt") or 1), **{k: r.get(k) for k in keys}})
        return latest_attempts(pd.DataFrame(rows, columns=["job_id", "adapter", "adapter_step", "attempt", *keys]))

    def records(self, adapter_ids: Iterable[str]) -> list[AdapterRecord]:
        """The records of these adapters (each must have its metrics.json)."""
        ids = list(adapter_ids)
        wanted = set(ids)
        steps = self._curves("metrics.jsonl", STEP_VALUES, wanted)
        evals = self._curves("evals.jsonl", ["eval_loss"], wanted)
        out = []
        for adapter_id in ids:
            m = read_json(self.run_dir / "adapters" / adapter_id / "metrics.json") or {}
            curve: dict[int, dict[str, float]] = {}
            for r in steps[steps["adapter"] == adapter_id].to_dict("records"):
                values = {STEP_VALUES[k]: v for k in STEP_VALUES if (v := _number(r.get(k))) is not None}
                curve.setdefault(int(r["adapter_step"]), {}).update(values)
            for r in evals[evals["adapter"] == adapter_id].to_dict("records"):
                if (v := _number(r.get("eval_loss"))) is not None:
                    curve.setdefault(int(r["adapter_step"]), {})[EVAL_VALUE] = v
            final = {k: v for k, value in m.items()
                     if (k == "train_loss" or k.startswith("eval_")) and (v := _number(value)) is not None}
            out.append(AdapterRecord(adapter_id, m.get("job_id"), str(m.get("status") or "unknown"),
                                     dict(m.get("config") or {}), dict(sorted(curve.items())), final))
        return out
