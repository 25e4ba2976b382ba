"""Each adapter's own span of training inside the jobs that ran it, for the report's Gantt.

A job's bar says when its process ran; with adapters joining running jobs (``control.json``'s
join list, ``planner.streaming``) it no longer says when each adapter trained. An adapter
the job started with trains from the job's start; one that joined trains from the step it
joined at; each ends when it finished (done, diverged, pruned, failed) or with the job.

Only what the run directory holds is read, best source first:

* start of a joined adapter: its ``joins.jsonl`` record (the wall-clock time the job took
  it), else the time of the job step before the one ``summary.json``'s ``joined`` names
  (``metrics.jsonl``), else its first ``metrics.jsonl`` row;
* end: ``adapters/<id>/metrics.json``'s ``wall_time_s`` when that job's latest attempt wrote
  it, else the adapter's last ``metrics.jsonl`` row, else the job's end.

The recipe's times count from its own start (after the process has loaded the model);
``progress.json`` (``elapsed_s``, written last at the job's end) or ``summary.json``
(``wall_time_s``) place that start on the wall clock. An adapter that joined an earlier
attempt of a relaunched job is in the relaunch from its start. Every span lies within
its job's.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from plora.job.outputs import PROGRESS_FILE, SUMMARY_FILE
from plora.job.control import read_joins

__all__ = ["SPAN_COLUMNS", "AdapterSpan", "JobRun", "adapter_spans"]

SPAN_COLUMNS = ["job_id", "adapter", "start", "end", "joined", "joined_step", "status"]


@dataclass
class JobRun:
    """One job run as the timeline knows it: wall-clock start and end, and its adapters
    (as the journal or the recipe's files list them, joined ones included). For a job
    that ran more than once, its latest attempt: an adapter an earlier attempt finished has
    no span in it."""

    job_id: str
    start: float
    end: float
    adapters: list[str]
    running: bool = False
    status: str | None = None


@dataclass
class AdapterSpan:
    """When one adapter trained in one job run (wall clock)."""

    job_id: str
    adapter: str
    start: float
    end: float
    joined: bool
    joined_step: int | None
    status: str

    def row(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SPAN_COLUMNS}


def read_json(path: Path) -> Any:
    """A JSON file's content, or None where it is missing or not JSON (a run still being written)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path) -> list[dict]:
    """A JSONL file's object rows; lines that do not parse (one being written) are skipped."""
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict):
                    rows.append(row)
    return rows


def planned_adapters(job_dir: Path) -> list[str]:
    """The adapters a job was launched with (its job.yaml); empty without one."""
    try:
        cfg = yaml.safe_load((job_dir / "job.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return []
    return [str(a["id"]) for a in cfg.get("adapters") or [] if isinstance(a, dict) and "id" in a]


def _recipe_origin(job_dir: Path, run: JobRun) -> float:
    """The wall-clock time the job's latest attempt started its clock (metrics' ``time`` 0)."""
    for name, key in ((PROGRESS_FILE, "elapsed_s"), (SUMMARY_FILE, "wall_time_s")):
        rec = read_json(job_dir / name)
        if isinstance(rec, dict) and isinstance(rec.get(key), (int, float)):
            with contextlib.suppress(OSError):
                origin = (job_dir / name).stat().st_mtime - float(rec[key])
                return min(max(origin, run.start), run.end)
    return run.start


def _job_spans(run_dir: Path, run: JobRun) -> list[AdapterSpan]:
    job_dir = run_dir / "jobs" / run.job_id
    rows = read_jsonl(job_dir / "metrics.jsonl")
    progress = read_json(job_dir / PROGRESS_FILE) or {}
    attempt = max([int(r.get("attempt") or 1) for r in rows] + [int(progress.get("attempt") or 1)])
    rows = [r for r in rows if int(r.get("attempt") or 1) == attempt and isinstance(r.get("time"), (int, float))]
    origin = _recipe_origin(job_dir, run)
    step_time: dict[int, float] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for r in rows:
        t = float(r["time"])
        if "step" in r:
            step_time[int(r["step"])] = max(step_time.get(int(r["step"]), t), t)
        if "adapter" in r:
            a = str(r["adapter"])
            first[a] = min(first.get(a, t), t)
            last[a] = max(last.get(a, t), t)
    summary = read_json(job_dir / SUMMARY_FILE) or {}
    joined_at = {str(k): int(v) for k, v in (summary.get("joined") or {}).items() if isinstance(v, int)}
    records = {}
    for rec in read_joins(job_dir):
        if rec.refused is None:
            records[rec.adapter.id] = rec
    launched = set(planned_adapters(job_dir))

    def clamp(t: float) -> float:
        return min(max(t, run.start), run.end)

    out = []
    for a in dict.fromkeys(run.adapters):
        rec = records.get(a)
        step = joined_at.get(a, rec.job_step if rec is not None else None)
        joined = step is not None or (bool(launched) and a not in launched)
        if joined and rec is not None and rec.attempt < attempt:
            start = run.start  # an earlier attempt's join: the relaunch holds it from its start
        elif joined:
            if rec is not None:
                start = rec.time
            elif step is not None and step - 1 in step_time:
                start = origin + step_time[step - 1]
            elif a in first:
                start = origin + first[a]
            else:
                continue  # waiting to join: not trained yet
        else:
            start = run.start
        metrics = read_json(run_dir / "adapters" / a / "metrics.json") or {}
        if metrics.get("job_id") == run.job_id and int(metrics.get("attempt") or 1) < attempt:
            continue  # finished by an earlier attempt, before this run of the job
        own = metrics.get("job_id") == run.job_id and int(metrics.get("attempt") or 1) == attempt
        if own and isinstance(metrics.get("wall_time_s"), (int, float)):
            end = origin + float(metrics["wall_time_s"])
        elif a in last and not run.running:
            end = origin + last[a]
        else:
            end = run.end
        status = str(metrics.get("status")) if own and metrics.get("status") else (
            "running" if run.running else str(run.status or "unknown"))
        start = clamp(start)
        out.append(AdapterSpan(run.job_id, a, start, max(start, clamp(end)), joined, step, status))
    return out


def adapter_spans(run_dir: Path, runs: list[JobRun]) -> list[AdapterSpan]:
    """Every adapter's span in every job run (an adapter of a split or relaunched job may
    have one per run)."""
    out: list[AdapterSpan] = []
    for run in runs:
        out.extend(_job_spans(Path(run_dir), run))
    return out
