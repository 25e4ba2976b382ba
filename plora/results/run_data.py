"""A run directory read for the report (`load_run` into `RunData`): results, plan, jobs'
timeline, each adapter's span, learning curves, the profile and tune histories.

What the run directory offers, and where it is read:

* ``results.parquet``, ``base_metrics.json``, ``spec.yaml``: the table and the objective
  (ranked by ``eval.greater_is_better``, else the metric's own direction).
* ``jobs/<id>/metrics.jsonl`` / ``evals.jsonl``: learning curves; measured step times.
* ``journal.sqlite`` (the engine's record of each job: slots, start, end, outcome), else the
  recipe's ``summary.json``: the actual timeline. A job the journal marks ``streamed`` (its
  adapters all joined running jobs) never ran and is not drawn. Each adapter's own span in
  its job comes from `plora.results.adapter_spans`. ``plan.json`` (read as a
  :class:`plora.planner.plan.Plan`): the planned one, when its jobs carry predicted times
  and GPUs; the makespan's baselines and lower bound when the planner wrote them.
* ``profile.json`` (a fitted cost model), and each tune's ``tune_history.csv``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import yaml

from plora.job.outputs import PROGRESS_FILE, SUMMARY_FILE
from plora.results.adapter_spans import SPAN_COLUMNS, JobRun, adapter_spans, planned_adapters, read_json, read_jsonl
from plora.job.control import read_joins
from plora.results.metrics import minimize as minimize_objective

if TYPE_CHECKING:
    from plora.planner.plan import Job, Plan


#: what each tune records as trials are told (`plora.tuning.budget` writes it; named here,
#: where the report reads it, so that the report imports no Optuna to find it)
TUNE_HISTORY_FILE = "tune_history.csv"


class Missing(Exception):
    """A section's data is not in the run directory; the message says what is missing."""


# --------------------------------------------------------------------------- loading a run


@dataclass
class RunData:
    """Everything the report reads from a run directory (missing parts are empty/None)."""

    run_dir: Path
    name: str
    objective: str
    minimize: bool
    spec: dict[str, Any]
    results: pd.DataFrame
    base: dict[str, float]
    plan: Plan | None
    jobs: pd.DataFrame  # one row per job that ran: timeline and predictions
    adapter_spans: pd.DataFrame  # per job run and adapter: start, end (same clock as jobs), joined, status
    streamed: dict[str, str]  # jobs that never ran, their adapters having joined running jobs -> that job
    steps: pd.DataFrame  # per job and packed step: time, adapters in the pack
    train_curves: pd.DataFrame  # adapter, adapter_step, loss
    eval_curves: pd.DataFrame  # adapter, adapter_step, eval_loss
    profile: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    #: every tune's (GPU-seconds, best so far) as its trials were told: this run's and the
    #: compared ones' (`load_tune_histories`)
    tune_history: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=HISTORY_COLUMNS))

    @property
    def score(self) -> str:
        """The results column that ranks adapters."""
        return f"eval_{self.objective}"

    def done(self) -> pd.DataFrame:
        """Finished adapters with a score, best first."""
        r = self.results
        if r.empty or self.score not in r:
            return r.iloc[0:0]
        d = r[(r["status"] == "done") & r[self.score].notna()]
        if self.score != "eval_loss" and "eval_loss" in d:  # ties (common with exact match): lower loss first
            return d.sort_values([self.score, "eval_loss"], ascending=[self.minimize, True])
        return d.sort_values(self.score, ascending=self.minimize)


def load_run(run_dir: Path | str, compare: Sequence[Path | str] | str = ()) -> RunData:
    """Read a run directory for the report; ``compare``: more run directories (or one
    os.pathsep-separated string of them) whose tune histories are drawn beside its own."""
    run_dir = Path(run_dir).expanduser().resolve()
    if isinstance(compare, str):
        compare = [c for c in compare.split(os.pathsep) if c]
    spec: dict[str, Any] = {}
    with contextlib.suppress(OSError, yaml.YAMLError):
        spec = yaml.safe_load((run_dir / "spec.yaml").read_text()) or {}
    ev = spec.get("eval") or {}
    objective = ev.get("objective") or ("exact_match" if "exact_match" in (ev.get("metrics") or ["exact_match"]) else "loss")
    results = pd.DataFrame()
    with contextlib.suppress(Exception):
        results = pd.read_parquet(run_dir / "results.parquet")
    base = read_json(run_dir / "base_metrics.json") or {}
    plan = _read_plan(run_dir)
    profile = read_json(run_dir / "profile.json")
    jobs_dir = run_dir / "jobs"
    job_dirs = sorted(p for p in jobs_dir.iterdir() if p.is_dir()) if jobs_dir.is_dir() else []

    train, evals, steps = [], [], []
    for jd in job_dirs:
        metrics = read_jsonl(jd / "metrics.jsonl")
        for m in metrics:
            if "adapter" in m and "loss" in m:
                train.append({"job_id": jd.name, "adapter": m["adapter"], "adapter_step": m.get("adapter_step"),
                              "loss": m["loss"], "time": m.get("time"), "attempt": int(m.get("attempt") or 1)})
        for e in read_jsonl(jd / "evals.jsonl"):
            if "adapter" in e:
                evals.append({"job_id": jd.name, **e, "attempt": int(e.get("attempt") or 1)})
        # a resumed job appends to its files: its step times are the last attempt's
        last = max((int(m.get("attempt") or 1) for m in metrics), default=1)
        by_step: dict[int, dict] = {}
        for m in metrics:
            if "step" in m and "time" in m and int(m.get("attempt") or 1) == last:
                s = by_step.setdefault(int(m["step"]), {"job_id": jd.name, "step": int(m["step"]), "time": 0.0, "adapters": 0})
                s["time"] = max(s["time"], float(m["time"]))
                s["adapters"] += 1
        steps.extend(by_step[k] for k in sorted(by_step))
    jobs, spans = _job_timeline(run_dir, job_dirs, plan, results)
    return RunData(
        run_dir=run_dir,
        name=str(spec.get("name") or run_dir.name),
        objective=str(objective),
        minimize=minimize_objective(str(objective), ev.get("greater_is_better")),
        spec=spec,
        results=results,
        base={k: v for k, v in base.items() if isinstance(v, (int, float))},
        plan=plan,
        jobs=jobs,
        adapter_spans=spans,
        streamed=_streamed_jobs(run_dir),
        steps=pd.DataFrame(steps, columns=["job_id", "step", "time", "adapters"]),
        train_curves=latest_attempts(pd.DataFrame(train, columns=["job_id", "adapter", "adapter_step", "loss", "time",
                                                                  "attempt"])),
        eval_curves=latest_attempts(pd.DataFrame(evals, columns=["job_id", "adapter", "adapter_step", "eval_loss", "time",
                                                                 "attempt"])),
        profile=profile,
        tune_history=load_tune_histories([run_dir, *map(Path, compare)]),
    )


#: a tune_history.csv's columns (`plora.tuning.budget.TuneHistory` writes it)
TUNE_HISTORY_COLUMNS = ("strategy", "trial", "state", "value", "best", "gpu_seconds", "wall_seconds")
#: the tune histories of the report: which run each row is of, then its tune_history.csv row
HISTORY_COLUMNS = ["run", *TUNE_HISTORY_COLUMNS]


def _history_files(folder: Path) -> list[Path]:
    """A run's tune history, else those of the runs in its subfolders (a folder of runs)."""
    own = folder / TUNE_HISTORY_FILE
    if own.is_file():
        return [own]
    return sorted(p for p in folder.glob(f"*/{TUNE_HISTORY_FILE}") if p.is_file())


def load_tune_histories(folders: Sequence[Path]) -> pd.DataFrame:
    """The tune histories of run directories (or folders of them), one frame, ``run`` naming
    each one's directory; unreadable files are left out."""
    frames, seen = [], set()
    for folder in folders:
        for path in _history_files(Path(folder).expanduser().resolve()):
            if path in seen:
                continue
            seen.add(path)
            with contextlib.suppress(Exception):
                f = pd.read_csv(path)
                f["run"] = path.parent.name
                frames.append(f)
    if not frames:
        return pd.DataFrame(columns=HISTORY_COLUMNS)
    out = pd.concat(frames, ignore_index=True)
    for c in ("value", "best", "gpu_seconds", "wall_seconds"):
        out[c] = pd.to_numeric(out.get(c), errors="coerce")
    return out.reindex(columns=HISTORY_COLUMNS)


def latest_attempts(curves: pd.DataFrame) -> pd.DataFrame:
    """Each adapter's curve as its latest attempt trained it.

    A job that was interrupted or crashed runs again and appends to its files, each row
    marked with its attempt (a split job's adapters train on in its child jobs). A row is kept
    unless a later attempt of the same adapter started at or before its step: a job that
    starts over keeps only its last attempt, one that resumed from a checkpoint keeps the
    steps before the checkpoint from the attempt that made them.
    """
    if curves.empty:
        return curves
    # the order runs happen in: a job's attempts in turn; a job split after running out of
    # memory continues as <job>.0 and <job>.1, which sort after it
    curves = curves.sort_values(["adapter", "job_id", "attempt", "adapter_step"], kind="stable")
    keep = pd.Series(True, index=curves.index)
    for _, g in curves.groupby("adapter", sort=False):
        runs = list(g.groupby(["job_id", "attempt"], sort=False)["adapter_step"].min().items())
        for i, ((job, attempt), _) in enumerate(runs):
            later = [first for _, first in runs[i + 1:]]
            if later:
                rows = g[(g["job_id"] == job) & (g["attempt"] == attempt)]
                keep[rows.index[rows["adapter_step"] >= min(later)]] = False
    return curves[keep].reset_index(drop=True)


def _read_plan(run_dir: Path) -> Plan | None:
    """The run's plan; None without one, or with one of another plora version (the
    sections that need it say so)."""
    from plora.planner.plan import Plan

    try:
        return Plan.of_run(run_dir)
    except (OSError, ValueError):
        return None


def _plan_jobs(plan: Plan | None) -> dict[str, Job]:
    return {j.id: j for j in plan.jobs} if plan is not None else {}


def _journal_jobs(run_dir: Path) -> list[dict] | None:
    """Job runs as the engine's journal recorded them (None when the run has no journal)."""
    path = run_dir / "journal.sqlite"
    if not path.is_file():
        return None
    from plora.engine.journal import Journal

    journal = Journal(path)
    try:
        jobs, events = journal.jobs(), journal.events()
    finally:
        journal.close()
    slots: dict[str, list[str]] = {}
    for _, kind, subject, detail in events:
        if kind == "launch":
            with contextlib.suppress(ValueError, AttributeError):
                slots[subject] = list(json.loads(detail).get("slots") or [])
    # a job whose adapters all joined running jobs (planner.streaming) never ran
    return [
        {"job_id": j.id, "slots": slots.get(j.id) or [], "start": j.started, "end": j.ended, "status": j.status,
         "returncode": j.returncode, "adapters": len(j.adapters), "adapter_ids": list(j.adapters), "tp": j.tp,
         "gpus": j.gpus, "predicted_start": j.predicted_start, "predicted_end": j.predicted_end}
        for j in jobs if j.started is not None and j.status != "streamed"
    ]


def _streamed_jobs(run_dir: Path) -> dict[str, str]:
    """Jobs that never ran because their adapters joined running ones: job -> the job that
    took them (the journal's ``streamed`` events)."""
    path = run_dir / "journal.sqlite"
    if not path.is_file():
        return {}
    from plora.engine.journal import Journal

    journal = Journal(path)
    try:
        events = journal.events()
    finally:
        journal.close()
    out = {}
    for _, kind, subject, detail in events:
        if kind == "streamed":
            with contextlib.suppress(ValueError, AttributeError):
                out[subject] = str(json.loads(detail).get("into") or "")
    return out


def _recipe_jobs(job_dirs: list[Path]) -> list[dict]:
    """Job runs from the recipe's own files, for runs without a journal: its clock starts
    after the model is loaded, so process start-up is not included."""
    rows = []
    for jd in job_dirs:
        summ = read_json(jd / SUMMARY_FILE) or {}
        prog = read_json(jd / PROGRESS_FILE) or {}
        for name, rec, key in ((SUMMARY_FILE, summ, "wall_time_s"), (PROGRESS_FILE, prog, "elapsed_s")):
            if rec.get(key) is not None and (jd / name).is_file():
                end = (jd / name).stat().st_mtime
                ids = list(summ.get("adapters") or {}) or [
                    *planned_adapters(jd), *(r.adapter.id for r in read_joins(jd) if r.refused is None)]
                rows.append({"job_id": jd.name, "slots": [], "start": end - float(rec[key]), "end": end,
                             "status": "finished" if summ else "running", "returncode": None,
                             "adapters": len(summ.get("adapters", {})) or None, "adapter_ids": ids})
                break
    return rows


def _job_timeline(run_dir: Path, job_dirs: list[Path], plan: Plan | None,
                  results: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One row per job run: actual start/end (seconds from the first start), its slots, and
    the plan's predictions where plan.json (or the journal) has them; and each adapter's
    span in those runs (`plora.results.adapter_spans`), on the same clock, with its job's lanes."""
    import time

    planned = _plan_jobs(plan)
    batch_of = plan.batch_of() if plan is not None else {}
    runs = _journal_jobs(run_dir)
    source = "journal"
    if not runs:
        runs, source = _recipe_jobs(job_dirs), "recipe"
    rows, job_runs = [], []
    now = time.time()
    for r in runs:
        p = planned.get(r["job_id"])
        job_runs.append(JobRun(r["job_id"], float(r["start"]), float(r["end"] if r["end"] is not None else now),
                               list(r.get("adapter_ids") or (p.adapters if p is not None else [])),
                               running=r["end"] is None, status=r.get("status")))
        pstart = p.start if p is not None and p.start is not None else r.get("predicted_start")
        pend = p.end if p is not None and p.end is not None else r.get("predicted_end")
        end = r["end"] if r["end"] is not None else now  # still running
        rows.append({
            "job_id": r["job_id"], "slots": r["slots"], "start": float(r["start"]), "end": float(end),
            "source": source, "status": r.get("status"), "returncode": r.get("returncode"),
            "adapters": r.get("adapters") or (len(p.adapters) if p is not None else 0),
            "tp": r.get("tp") or (p.tp if p is not None else 1),
            "batch": batch_of.get(r["job_id"]), "gpus": (p.gpus if p is not None else []) or r.get("gpus") or [],
            "planned_start": float(pstart) if isinstance(pstart, (int, float)) else None,
            "planned_end": float(pend) if isinstance(pend, (int, float)) else None,
            "predicted_step_time": p.step_time if p is not None else None,
        })
    cols = ["job_id", "slots", "start", "end", "source", "status", "returncode", "adapters", "tp", "batch", "gpus",
            "planned_start", "planned_end", "predicted_step_time"]
    frame = pd.DataFrame(rows, columns=cols)
    spans = pd.DataFrame([s.row() for s in adapter_spans(run_dir, job_runs)], columns=[*SPAN_COLUMNS, "lanes"])
    if frame.empty:
        return frame, spans
    t0 = frame["start"].min()
    frame["start"] -= t0
    frame["end"] -= t0
    frame = frame.sort_values(["start", "job_id"]).reset_index(drop=True)
    frame["lanes"] = _lanes(frame)
    if not spans.empty:
        spans["start"] -= t0
        spans["end"] -= t0
        lanes = dict(zip(frame["job_id"], frame["lanes"]))
        spans["lanes"] = [lanes.get(j, []) for j in spans["job_id"]]
    return frame, spans


def _lanes(frame: pd.DataFrame) -> list[list[str]]:
    """The slots each job ran on; when nothing recorded them, the first lane free at the
    job's start (what a first-come-first-served pool does)."""
    out: list[list[str]] = []
    free_at: dict[str, float] = {}
    for _, r in frame.iterrows():
        if r["slots"]:
            lanes = list(r["slots"])
        else:
            lanes = [next((k for k, t in sorted(free_at.items()) if t <= r["start"] + 1e-6), f"slot {len(free_at)}")]
        for lane in lanes:
            free_at[lane] = r["end"]
        out.append(lanes)
    return out
