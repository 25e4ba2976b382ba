"""A sweep from a validated spec: expand, group into packed jobs, run them, collect results.

Every stage leaves a file in the run directory (spec.yaml, configs.parquet, plan.json,
jobs/<id>/job.yaml, adapters/<id>/…, results.parquet), so a person can open each one and
each stage can be re-run on its own. This module is the library behind `plora sweep`; the
CLI only renders what it returns.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from plora.data import load_split
from plora.spec import AdapterConfig, SweepSpec


@dataclass
class PlannedJob:
    """One packed job: its adapters (with their step budgets) and where it runs."""

    job_id: str
    adapters: list[AdapterConfig]
    steps: dict[str, int]
    tp: int = 1
    gpus: list[int] = field(default_factory=list)
    predicted_start: float | None = None
    predicted_end: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "adapters": [a.id for a in self.adapters],
            "tp": self.tp,
            "gpus": self.gpus,
            "predicted_start": self.predicted_start,
            "predicted_end": self.predicted_end,
            "steps": self.steps,
        }


@dataclass
class SweepPlan:
    jobs: list[PlannedJob]
    grouping: str  # how adapters were grouped into jobs, said to the user
    details: dict[str, Any] = field(default_factory=dict)


def dataset_size(spec: SweepSpec) -> int:
    """Training examples the adapters' epoch budgets are counted in."""
    return len(load_split(data_config(spec), "train"))


def data_config(spec: SweepSpec) -> dict[str, Any]:
    data = spec.data.model_dump(mode="json")
    for key in ("train", "eval"):
        if data.get(key) is not None:
            data[key] = str(data[key])
    return data


def plan_jobs(spec: SweepSpec, configs: Sequence[AdapterConfig], steps: dict[str, int]) -> SweepPlan:
    """Group adapters into jobs of at most `planner.max_adapters_per_job`.

    A placeholder for the cost-model planner: adapters are sorted by their step budget so
    that the adapters of one job finish close together and the pack stays full.
    """
    cap = spec.planner.max_adapters_per_job
    ordered = sorted(configs, key=lambda c: (-steps[c.id], c.batch_size, c.id))
    n_jobs = max(1, math.ceil(len(ordered) / cap))
    jobs = []
    for j in range(n_jobs):
        members = ordered[j * cap : (j + 1) * cap]
        jobs.append(PlannedJob(f"job-{j:03d}", members, {c.id: steps[c.id] for c in members}))
    return SweepPlan(jobs, f"placeholder grouping: up to {cap} adapters per job by step budget (no cost model yet)")


def job_config(spec: SweepSpec, job: PlannedJob, run_dir: Path, *, eval_base: bool) -> dict[str, Any]:
    """The recipe config of one job (what `tune run` reads)."""
    return {
        "job_id": job.job_id,
        "output_dir": str(run_dir),
        "job_dir": str(run_dir / "jobs" / job.job_id),
        "seed": spec.space.seed,
        "device": spec.hardware.device,
        "num_threads": 1 if spec.hardware.device == "cpu" else None,
        "model": {
            "path": str(spec.model.resolved_path()),
            "family": spec.model.family,
            "dtype": spec.model.dtype,
            "max_seq_len": spec.model.max_seq_len,
        },
        "data": data_config(spec),
        "lora": {"targets": spec.lora.resolved_targets(), "dropout": spec.lora.dropout},
        "adapters": [{**a.to_dict(), "steps": job.steps[a.id]} for a in job.adapters],
        "training": {
            "warmup_steps": spec.training.warmup_steps,
            "warmup_ratio": spec.training.warmup_ratio,
            "scheduler": spec.training.scheduler,
            "grad_clip": spec.training.grad_clip,
            "weight_decay": spec.training.weight_decay,
            "divergence_loss": spec.training.divergence_loss,
        },
        "eval": {
            "metrics": list(spec.eval.metrics),
            "max_new_tokens": spec.eval.max_new_tokens,
            "max_eval_samples": spec.data.max_eval_samples,
            "every_steps": spec.eval.every_steps,
        },
        "eval_base": eval_base,
    }


@dataclass
class PreparedSweep:
    spec: SweepSpec
    run_dir: Path
    configs: list[AdapterConfig]
    steps: dict[str, int]
    plan: SweepPlan


def prepare(spec: SweepSpec, run_dir: Path | None = None) -> PreparedSweep:
    """Everything a sweep decides before training; touches no file."""
    configs = spec.expand()
    n_train = dataset_size(spec)
    steps = {c.id: spec.steps_for(c, n_train) for c in configs}
    return PreparedSweep(spec, spec.run_dir(run_dir), configs, steps, plan_jobs(spec, configs, steps))


def write_run_files(prep: PreparedSweep, *, restart: bool = False) -> None:
    """spec.yaml, configs.parquet, plan.json and every job's job.yaml."""
    run_dir = prep.run_dir
    if restart and run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "jobs").mkdir(parents=True, exist_ok=True)
    (run_dir / "adapters").mkdir(exist_ok=True)
    (run_dir / "spec.yaml").write_text(prep.spec.to_yaml())
    configs_frame(prep).to_parquet(run_dir / "configs.parquet", index=False)
    plan = {
        "grouping": prep.plan.grouping,
        "jobs": [j.to_dict() for j in prep.plan.jobs],
        **prep.plan.details,
    }
    (run_dir / "plan.json").write_text(json.dumps(plan, indent=2))
    for i, job in enumerate(prep.plan.jobs):
        job_dir = run_dir / "jobs" / job.job_id
        job_dir.mkdir(exist_ok=True)
        cfg = job_config(prep.spec, job, run_dir, eval_base=(i == 0))
        (job_dir / "job.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))


def configs_frame(prep: PreparedSweep) -> pd.DataFrame:
    return pd.DataFrame([{**c.to_dict(), "steps": prep.steps[c.id]} for c in prep.configs])


def run_prepared(
    prep: PreparedSweep,
    *,
    on_tick: Callable[[list, list], None] | None = None,
    on_snapshot: Callable[[Any], None] | None = None,
    slots: list[str] | None = None,
    max_retries: int = 2,
) -> pd.DataFrame:
    """Run every adapter that has no result yet through the engine, then collect the table.

    On an existing run directory this resumes: finished adapters are kept, the rest are
    re-queued in their planned jobs. `on_tick(running, finished)` gets the job processes
    (e.g. to watch their files); `on_snapshot` gets the engine's state for a live view.
    """
    from plora.engine.journal import Journal
    from plora.engine.local import default_slots
    from plora.engine.runner import Engine, QueuedJob

    by_id = {c.id: c for c in prep.configs}
    journal = Journal(prep.run_dir / "journal.sqlite")
    journal.add_adapters(by_id)
    first_job = prep.plan.jobs[0].job_id if prep.plan.jobs else None

    def write_job(job: QueuedJob) -> Path:
        job_dir = prep.run_dir / "jobs" / job.job_id
        job_dir.mkdir(parents=True, exist_ok=True)
        planned = PlannedJob(job.job_id, [by_id[a] for a in job.adapters], {a: prep.steps[a] for a in job.adapters}, job.tp)
        eval_base = job.job_id == first_job and not (prep.run_dir / "base_metrics.json").is_file()
        cfg = job_config(prep.spec, planned, prep.run_dir, eval_base=eval_base)
        (job_dir / "job.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
        return job_dir

    def tick(snapshot) -> None:
        if on_snapshot is not None:
            on_snapshot(snapshot)
        if on_tick is not None:
            on_tick([rj.proc for rj in snapshot.running], list(engine.finished))

    engine = Engine(
        prep.run_dir, journal, slots or default_slots(prep.spec.hardware.device), write_job,
        max_retries=max_retries, predicted_makespan_s=prep.plan.details.get("predicted_makespan_s"), on_tick=tick,
    )
    try:
        engine.reconcile()
        engine.submit([
            QueuedJob(j.job_id, [a.id for a in j.adapters], j.tp,
                      predicted_start=j.predicted_start, predicted_end=j.predicted_end, gpus=list(j.gpus))
            for j in prep.plan.jobs
        ])
        engine.run()
    finally:
        journal.close()
    frame = collect_results(prep)
    from plora.optuna import record_sweep  # the sweep as an Optuna study; warns, never raises

    record_sweep(prep, frame)
    return frame


def _adapter_finished(run_dir: Path, adapter_id: str) -> bool:
    path = run_dir / "adapters" / adapter_id / "metrics.json"
    if not path.is_file():
        return False
    return json.loads(path.read_text()).get("status") in ("done", "diverged", "pruned")


RESULT_COLUMNS = [
    "adapter_id", "rank", "alpha", "learning_rate", "batch_size", "seed", "job_id", "status",
    "steps", "train_loss", "eval_loss", "eval_exact_match", "wall_time_s", "checkpoint_path",
]


def collect_results(prep: PreparedSweep, crashed_jobs: dict[str, str] | None = None) -> pd.DataFrame:
    """One row per adapter from adapters/<id>/metrics.json; adapters with none are `failed`."""
    crashed_jobs = crashed_jobs or {}
    job_of = {a.id: j.job_id for j in prep.plan.jobs for a in j.adapters}
    rows = []
    for c in prep.configs:
        path = prep.run_dir / "adapters" / c.id / "metrics.json"
        row: dict[str, Any] = {"adapter_id": c.id, **{k: v for k, v in c.to_dict().items() if k != "id"}}
        if path.is_file():
            m = json.loads(path.read_text())
            if m.get("status") == "failed" and crashed_jobs.get(m.get("job_id", "")):
                m["reason"] = f"job crashed; see {crashed_jobs[m['job_id']]}"
            row.update({k: m.get(k) for k in RESULT_COLUMNS if k in m and k not in row})
            row["reason"] = m.get("reason") or ""
        else:
            row.update({"job_id": job_of.get(c.id), "status": "failed", "steps": 0})
            log = crashed_jobs.get(job_of.get(c.id, ""))
            row["reason"] = f"job crashed; see {log}" if log else "no result"
        rows.append(row)
    frame = pd.DataFrame(rows)
    for col in RESULT_COLUMNS + ["reason"]:
        if col not in frame.columns:
            frame[col] = None
    frame = frame[RESULT_COLUMNS + ["reason"]]
    frame.to_parquet(prep.run_dir / "results.parquet", index=False)
    frame.to_csv(prep.run_dir / "results.csv", index=False)
    return frame


def base_metrics(run_dir: Path) -> dict[str, float]:
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
