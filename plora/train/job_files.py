"""What a running job writes besides its adapters' weights: its logs and its records.

`JobFiles` owns the job's files in its folder and the run directory (rank 0 writes; every
other rank writes nothing): ``metrics.jsonl`` (a line per adapter per optimizer step),
``evals.jsonl`` (intermediate evals), ``progress.json`` and ``summary.json`` (the schemas of
`plora.job.outputs`), ``base_metrics.json``, and each adapter's ``metrics.json`` (through the
`AdapterWriter`, after the adapter's weights). Every line carries the job's clock (seconds
since it started) and its attempt.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from plora.job.outputs import JobProgress, JobSummary, write_progress, write_summary
from plora.train.adapter_run import AdapterRun
from plora.train.adapter_writer import AdapterWriter

#: seconds between two progress.json writes while a job steps
PROGRESS_EVERY_S = 0.5


class JobFiles:
    """The job's logs and records; ``started_at``: the job's clock's zero."""

    def __init__(self, job_dir: Path, output_dir: Path, job_id: str, *, is_main: bool, attempt: int,
                 writer: AdapterWriter, started_at: float):
        self.job_dir = Path(job_dir)
        self.output_dir = Path(output_dir)
        self.job_id = job_id
        self.is_main = is_main
        self.attempt = attempt
        self.writer = writer
        self.started_at = started_at
        self._metrics = open(self.job_dir / "metrics.jsonl", "a") if is_main else None
        self._last_progress = 0.0

    def elapsed(self) -> float:
        return time.time() - self.started_at

    def log(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl line."""
        if self._metrics is None:
            return
        row["time"] = round(self.elapsed(), 4)
        row["attempt"] = self.attempt
        self._metrics.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        if self._metrics is not None:
            self._metrics.flush()

    def evals(self, records: list[dict[str, Any]]) -> None:
        """evals.jsonl lines (`plora.train.evaluator.Evaluator.intermediate`)."""
        if not self.is_main:
            return
        with open(self.job_dir / "evals.jsonl", "a") as f:
            for rec in records:
                rec.update({"time": round(self.elapsed(), 4), "attempt": self.attempt})
                f.write(json.dumps(rec) + "\n")

    def progress_due(self, urgent: bool) -> bool:
        """Whether progress.json is to be written now (at most every `PROGRESS_EVERY_S`,
        unless ``urgent``); the metrics log is flushed first when it is."""
        if not self.is_main:
            return False
        now = time.time()
        if not urgent and now - self._last_progress < PROGRESS_EVERY_S:
            return False
        self._last_progress = now
        self.flush()
        return True

    def progress(self, progress: JobProgress) -> None:
        write_progress(self.job_dir, progress)

    def summary(self, summary: JobSummary) -> None:
        if self.is_main:
            write_summary(self.job_dir, summary)

    def base_metrics(self, metrics: dict[str, float]) -> None:
        if self.is_main:
            (self.output_dir / "base_metrics.json").write_text(json.dumps(metrics, indent=2))

    def adapter_result(self, r: AdapterRun, m: dict[str, Any], checkpoint: Path | None, *, targets: list[str],
                       epochs: bool) -> None:
        """An adapter's metrics.json: the file that says it is finished, written after its
        weights (the writer keeps the order) and after its steps' metrics.jsonl lines (flushed
        now: the sweep forwards a finished adapter's curve to its trackers once, when its
        metrics.json appears, and a curve read before the buffered lines reached the file was
        forwarded cut short). ``epochs``: it was scored at each epoch end."""
        if not self.is_main:
            return
        self.flush()
        tail = r.losses[-10:]
        row = {
            "adapter_id": r.id,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "status": r.status,
            "reason": r.reason,
            "steps": r.step,
            "total_steps": r.total_steps,
            "train_loss": sum(tail) / len(tail) if tail else None,
            **m,
            "wall_time_s": r.earlier_s + (r.finished_at or time.time()) - self.started_at,
            "checkpoint_path": str(checkpoint) if checkpoint else None,
            "config": r.cfg.hyperparameters(),
            "targets": targets,  # the layers it adapts (its PEFT target_modules)
            "warmup_steps": r.warmup,
        }
        if epochs and r.epochs:
            row["epoch"] = r.best_epoch  # the epoch whose weights and scores these are
            row["epochs"] = r.epochs
        self.writer.metrics(self.output_dir / "adapters" / r.id, row)

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
