"""A sweep's results table: one row per adapter (results.parquet and results.csv), from each
adapter's metrics.json, its configuration and the sweep's searched settings; adapters with
no result are ``failed``. Ranked by the objective (`ranked`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from plora.spec.adapter import AdapterConfig
from plora.spec.schema import SweepSpec


RESULT_COLUMNS = [
    "adapter_id", "rank", "alpha", "learning_rate", "batch_size", "seed", "job_id", "status",
    "steps", "train_loss", "eval_loss", "eval_exact_match", "wall_time_s", "checkpoint_path",
]


def result_columns(spec: SweepSpec) -> list[str]:
    """RESULT_COLUMNS with the dimensions the space searches per adapter after the seed (each
    adapter's effective value), the sweep's other metrics (`eval_<name>`) after exact match,
    and, where each epoch is scored, the epoch kept and each epoch's objective and loss
    (`epoch_columns`) after them."""
    extra = [f"eval_{n}" for n in spec.eval.metric_names if f"eval_{n}" not in RESULT_COLUMNS]
    at = RESULT_COLUMNS.index("eval_exact_match") + 1
    columns = RESULT_COLUMNS[:at] + extra + epoch_columns(spec) + RESULT_COLUMNS[at:]
    seed = columns.index("seed") + 1
    return columns[:seed] + spec.space.searched() + columns[seed:]


def epoch_columns(spec: SweepSpec) -> list[str]:
    """``epoch`` (the epoch whose weights an adapter keeps) and ``<score>_epoch<e>`` for the
    objective and the loss of each epoch; none where only the end is scored."""
    count = spec.scored_epochs
    if count <= 1:
        return []
    scores = list(dict.fromkeys([f"eval_{spec.eval.objective}"]
                                + (["eval_loss"] if "loss" in spec.eval.metric_names else [])))
    return ["epoch"] + [f"{s}_epoch{e}" for e in range(1, count + 1) for s in scores]


def result_row(spec: SweepSpec, run_dir: Path, c: AdapterConfig, job_id: str | None,
               crashed_jobs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An adapter's row of results.parquet, from its metrics.json (``failed`` without one;
    ``job_id``: the job it was planned in)."""
    crashed_jobs = crashed_jobs or {}
    path = run_dir / "adapters" / c.id / "metrics.json"
    row: dict[str, Any] = {"adapter_id": c.id, **{k: v for k, v in c.to_dict().items() if k != "id"}}
    settings = spec.settings(c)
    row.update({n: settings[n] for n in spec.space.searched()})
    if path.is_file():
        m = json.loads(path.read_text())
        if m.get("status") == "failed" and crashed_jobs.get(m.get("job_id", "")):
            m["reason"] = f"job crashed; see {crashed_jobs[m['job_id']]}"
        row.update({k: m.get(k) for k in result_columns(spec) if k in m and k not in row})
        for e in m.get("epochs") or []:
            row.update({f"{k}_epoch{e['epoch']}": v for k, v in e.items() if k.startswith("eval_")})
        row["reason"] = m.get("reason") or ""
    else:
        row.update({"job_id": job_id, "status": "failed", "steps": 0})
        log = crashed_jobs.get(job_id or "")
        row["reason"] = f"job crashed; see {log}" if log else "no result"
    return row


def write_results(spec: SweepSpec, run_dir: Path, configs: Sequence[AdapterConfig], job_of: Mapping[str, str],
                  crashed_jobs: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per adapter of ``configs`` from adapters/<id>/metrics.json (``job_of``: the job
    each was planned in); adapters with none are `failed`. Written as results.parquet and
    results.csv."""
    rows = [result_row(spec, run_dir, c, job_of.get(c.id), crashed_jobs) for c in configs]
    columns = result_columns(spec)
    frame = pd.DataFrame(rows)
    for col in columns + ["reason"]:
        if col not in frame.columns:
            frame[col] = None
    frame = frame[columns + ["reason"]]
    frame.to_parquet(run_dir / "results.parquet", index=False)
    frame.to_csv(run_dir / "results.csv", index=False)
    return frame


def has_eval_data(spec: SweepSpec) -> bool:
    """Whether the sweep has eval examples (a built-in task makes its own; files need data.eval)."""
    return spec.data.task is not None or spec.data.eval is not None


def write_unmeasured_base_metrics(spec: SweepSpec, run_dir: Path) -> None:
    """base_metrics.json for a sweep without eval data: every metric null, so that nothing
    reads an eval loss of 0.0 that was never measured."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = {f"eval_{m}": None for m in spec.eval.metric_names}
    (run_dir / "base_metrics.json").write_text(json.dumps(metrics, indent=2))


def base_metrics(run_dir: Path) -> dict[str, float | None]:
    path = run_dir / "base_metrics.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def ranked(frame: pd.DataFrame, objective: str, minimize: bool) -> pd.DataFrame:
    """Finished adapters best first by the objective column (`eval_<metric>`)."""
    column = f"eval_{objective}"
    done = frame[frame["status"] == "done"].copy()
    if column not in done.columns or done[column].isna().all():
        return done
    keys, ascending = [column], [minimize]
    if column != "eval_loss" and "eval_loss" in done.columns:
        keys.append("eval_loss")  # ties (common with exact match) go to the lower loss
        ascending.append(True)
    return done.sort_values(keys, ascending=ascending)
