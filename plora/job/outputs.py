"""What a job process leaves in its folder and how it exits: the schemas that the recipe
writes and the engine (and the report) reads.

* ``summary.json`` (`JobSummary`): written once, when the job has trained its last adapter.
* ``progress.json`` (`JobProgress`): rewritten (atomically) as the job runs, at most every
  half second, and a last time with ``final`` set.
* ``error.json`` (`JobError`): a model, data or config error that no retry can fix, with
  exit code `EXIT_UNFIXABLE`.
* ``oom.json`` (`JobError`): the job ran out of memory, with exit code `EXIT_OOM` (torchrun
  reports any failed worker as 1: the file is what tells the engine).

Imports nothing of plora: the recipe (`plora.train`) and the engine (`plora.engine`) both
import this, and neither imports the other.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypedDict

#: exit code of a job that ran out of memory: the engine splits it and re-queues the halves
EXIT_OOM = 3
#: exit code of a job whose model, data or config cannot be used (retrying cannot fix it)
EXIT_UNFIXABLE = 4
#: exit code of a job stopped by SIGTERM after saving its checkpoint (128 + SIGTERM)
EXIT_STOPPED = 143

SUMMARY_FILE = "summary.json"
PROGRESS_FILE = "progress.json"
ERROR_FILE = "error.json"
OOM_FILE = "oom.json"
#: the longest message error.json and oom.json keep
MESSAGE_CHARS = 2000


class JobSummary(TypedDict):
    """summary.json: what a finished job did."""

    job_id: str
    steps: int  # packed steps taken
    resumed_from: dict[str, int]  # adapter -> its step it resumed from (empty: a fresh start)
    wall_time_s: float
    first_step_s: float | None
    step_time_s: float | None  # steps 2..n
    adapters: dict[str, str]  # adapter -> done / diverged / pruned / failed
    joined: dict[str, int]  # adapter -> the job step it joined at (adapters that joined a running job)
    tokens: dict[str, int]  # "real" and "stepped" (padding included) tokens
    phases: dict[str, Any]  # `plora.job.phases.PhaseClock.to_dict`


class JobProgress(TypedDict):
    """progress.json: where a running job is."""

    job_id: str
    step: int
    adapter_steps_done: int
    adapter_steps_total: int
    adapters_finished: int
    adapters_total: int
    #: steps each adapter has taken (one that left: its whole budget), in packed steps
    adapter_steps: dict[str, int]
    #: the mean loss of each training adapter's last steps
    train_loss: dict[str, float]
    adapters_joined: int
    joins_waiting: int
    lingering: bool
    elapsed_s: float
    final: bool
    attempt: int
    resumed_step: int | None
    resumed: dict[str, int]
    #: each pack composition so far (`plora.job.phases.PhaseClock.phases`)
    phases: list[dict[str, Any]]


class JobError(TypedDict):
    """error.json and oom.json: why the job stopped."""

    error: str


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_summary(job_dir: Path, summary: JobSummary) -> None:
    (Path(job_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))


def read_summary(job_dir: str | Path) -> JobSummary | None:
    """A job's summary.json; None where it wrote none (or it does not parse)."""
    data = _read(Path(job_dir) / SUMMARY_FILE)
    return data if isinstance(data, dict) else None


def has_summary(job_dir: str | Path) -> bool:
    return (Path(job_dir) / SUMMARY_FILE).is_file()


def write_progress(job_dir: Path, progress: JobProgress) -> None:
    """progress.json, replaced at once (a reader never sees half a file)."""
    tmp = Path(job_dir) / (PROGRESS_FILE + ".tmp")
    tmp.write_text(json.dumps(progress))
    tmp.replace(Path(job_dir) / PROGRESS_FILE)


def read_progress(job_dir: str | Path) -> JobProgress | dict:
    """A job's progress.json; empty where it has written none yet."""
    data = _read(Path(job_dir) / PROGRESS_FILE)
    return data if isinstance(data, dict) else {}


def _message(message: str) -> str:
    return message[:MESSAGE_CHARS]


def write_error(job_dir: Path, message: str) -> None:
    """error.json: the model, data or config error that failed the job (one line)."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / ERROR_FILE).write_text(json.dumps(JobError(error=_message(message))))


def error_file(job_dir: str | Path) -> Path:
    return Path(job_dir) / ERROR_FILE


def read_error(job_dir: str | Path) -> str | None:
    """The message of a job's error.json; None where there is none (or it does not say)."""
    data = _read(error_file(job_dir))
    if not isinstance(data, dict) or "error" not in data:
        return None
    return str(data["error"])


def write_oom(job_dir: Path, message: str) -> None:
    (Path(job_dir) / OOM_FILE).write_text(json.dumps(JobError(error=_message(message))))


def oom_file(job_dir: str | Path) -> Path:
    return Path(job_dir) / OOM_FILE
