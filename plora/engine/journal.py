"""The run's journal: every job's and adapter's state in SQLite, so a sweep resumes.

Adapter states: pending → running → done | diverged | pruned | failed.
Job states: queued → running → finished | oom | crashed | stopped | split | abandoned.

The journal is written by the sweep process only (jobs write files; the engine reads them
and records the outcome), so there is one writer and no locking beyond SQLite's own.
`adapters/<id>/metrics.json` is the ground truth of an adapter's result: the journal is
reconciled with it on every resume, so a sweep killed between a job writing a result and
the journal recording it loses nothing and trains nothing twice.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for its type only: plora.cost.job, under the planner's cost model, reads the journal
    from plora.planner.plan import Job

FINAL_ADAPTER = ("done", "diverged", "pruned", "failed")
SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
  id TEXT PRIMARY KEY, status TEXT NOT NULL, job_id TEXT, trained_by TEXT,
  attempts INTEGER NOT NULL DEFAULT 0, updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
  id TEXT PRIMARY KEY, status TEXT NOT NULL, adapters TEXT NOT NULL, tp INTEGER NOT NULL,
  gpus TEXT, attempt INTEGER NOT NULL DEFAULT 0, pid INTEGER, parent TEXT,
  predicted_start REAL, predicted_end REAL, started REAL, ended REAL, returncode INTEGER,
  updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
  at REAL NOT NULL, kind TEXT NOT NULL, subject TEXT, detail TEXT
);
"""


@dataclass
class JobRow:
    """One job's run as the journal recorded it: a job as submitted (adapters, TP, its
    predicted start and end) and the state of its latest attempt. ``gpus`` are the GPUs
    it was planned on until it starts, then the ones it ran on."""

    id: str
    status: str
    adapters: list[str]
    tp: int
    gpus: list[int]
    attempt: int
    pid: int | None
    parent: str | None
    predicted_start: float | None
    predicted_end: float | None
    started: float | None
    ended: float | None
    returncode: int | None


class Journal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.db = sqlite3.connect(str(self.path), isolation_level=None, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    # ----------------------------------------------------------------- adapters
    def add_adapters(self, ids: Iterable[str]) -> None:
        now = time.time()
        self.db.executemany(
            "INSERT OR IGNORE INTO adapters (id, status, updated) VALUES (?, 'pending', ?)", [(i, now) for i in ids]
        )

    def set_adapter(self, adapter_id: str, status: str, *, job_id: str | None = None, trained_by: str | None = None) -> None:
        self.db.execute(
            "UPDATE adapters SET status=?, job_id=COALESCE(?, job_id), trained_by=COALESCE(?, trained_by), "
            "attempts=attempts + (CASE WHEN ?='running' THEN 1 ELSE 0 END), updated=? WHERE id=?",
            (status, job_id, trained_by, status, time.time(), adapter_id),
        )

    def adapter_status(self) -> dict[str, str]:
        return dict(self.db.execute("SELECT id, status FROM adapters"))

    def adapters(self) -> list[dict]:
        cur = self.db.execute("SELECT id, status, job_id, trained_by, attempts FROM adapters ORDER BY id")
        return [dict(zip(("id", "status", "job_id", "trained_by", "attempts"), row)) for row in cur]

    # --------------------------------------------------------------------- jobs
    def add_job(self, job: Job, *, parent: str | None = None) -> None:
        """Record a queued job (again, for a retry: its run state starts over)."""
        self.db.execute(
            "INSERT OR REPLACE INTO jobs (id, status, adapters, tp, gpus, parent, predicted_start, predicted_end, updated) "
            "VALUES (?, 'queued', ?, ?, ?, ?, ?, ?, ?)",
            (job.id, json.dumps(list(job.adapters)), job.tp, json.dumps(list(job.gpus)), parent, job.start,
             job.end, time.time()),
        )

    def update_job(self, job_id: str, **fields) -> None:
        if "gpus" in fields:
            fields["gpus"] = json.dumps(list(fields["gpus"]))
        if "adapters" in fields:
            fields["adapters"] = json.dumps(list(fields["adapters"]))
        fields["updated"] = time.time()
        keys = ", ".join(f"{k}=?" for k in fields)
        self.db.execute(f"UPDATE jobs SET {keys} WHERE id=?", (*fields.values(), job_id))

    def jobs(self, status: str | None = None) -> list[JobRow]:
        q = "SELECT id, status, adapters, tp, gpus, attempt, pid, parent, predicted_start, predicted_end, started, ended, returncode FROM jobs"
        rows = self.db.execute(q + (" WHERE status=?" if status else "") + " ORDER BY rowid", (status,) if status else ())
        return [
            JobRow(r[0], r[1], json.loads(r[2]), r[3], json.loads(r[4] or "[]"), r[5], r[6], r[7], r[8], r[9], r[10], r[11], r[12])
            for r in rows
        ]

    def job(self, job_id: str) -> JobRow | None:
        for j in self.jobs():
            if j.id == job_id:
                return j
        return None

    # ------------------------------------------------------------------- events
    def event(self, kind: str, subject: str = "", detail: dict | str = "") -> None:
        text = detail if isinstance(detail, str) else json.dumps(detail)
        self.db.execute("INSERT INTO events (at, kind, subject, detail) VALUES (?, ?, ?, ?)", (time.time(), kind, subject, text))

    def events(self) -> list[tuple[float, str, str, str]]:
        return list(self.db.execute("SELECT at, kind, subject, detail FROM events ORDER BY rowid"))


def measured_makespan(run_dir: str | Path) -> float | None:
    """Seconds from a run's first job start to its last job end, from its journal: the
    makespan a plan predicts (the sweep's own set-up and result collection are outside it)."""
    path = Path(run_dir) / "journal.sqlite"
    if not path.is_file():
        return None
    journal = Journal(path)
    try:
        jobs = [j for j in journal.jobs() if j.started is not None and j.ended is not None]
    finally:
        journal.close()
    if not jobs:
        return None
    return max(j.ended for j in jobs) - min(j.started for j in jobs)
