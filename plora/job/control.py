"""Talking to a running job: its control.json (requests in) and joins.jsonl (joins taken).

A job (`plora.train.packed_lora`) reads ``<job_dir>/control.json`` at each step boundary
whenever the file has changed (one stat per step). Whoever steers the job (the engine, the
tuning loop) rewrites it whole, atomically (`write_control`: temporary file, rename), and
only ever adds to its lists, so a request stays in the file until the job has ended:

``prune``
    adapter ids that leave the pack at the next step, with status ``pruned``.
``join``
    adapters (`plora.job.config.JobAdapter` entries: id, rank, alpha, learning rate, batch
    size, seed, steps, warm-up) that enter the pack at a step boundary: into the slot of an
    adapter that has left, or into a pack laid out again, as the job's
    ``streaming.max_active`` / ``max_active_rank`` allow; until then they wait in the file.
    A joined adapter trains exactly as it would alone (its own init from its seed, fresh
    optimizer state, its own data stream and schedule from its step 0). An id the job
    already holds (or held) is not taken again.
``after``
    join id -> adapter ids: that join waits until those adapters have left the pack (the
    sender chose it for the room they leave, before they had left, so that it enters at
    the very step boundary where they do). An id the job does not hold counts as left.
``close``
    no more joins will come: a job lingering for joins (``streaming.linger_s``) leaves
    once its adapters have.

The job appends one line to ``<job_dir>/joins.jsonl`` (`JoinRecord`) for each join it
takes, before the adapter's first step, and for each it refuses (``refused``: why). That
file is how a relaunched job knows which adapters joined its earlier attempts (those not
finished are trained again, from their mid-job checkpoint where there is one), and how
the sender learns that a join was taken.

No plora imports but the job config: the recipe, the engine and the tuning loop sit above.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plora.job.config import JobAdapter

__all__ = [
    "CONTROL_FILE",
    "JOINS_FILE",
    "JobControl",
    "JoinRecord",
    "append_join",
    "read_control",
    "read_joins",
    "reopen",
    "request",
    "request_close",
    "request_join",
    "write_control",
]

CONTROL_FILE = "control.json"
JOINS_FILE = "joins.jsonl"


class JobControl(BaseModel):
    """What control.json holds (the module docstring says what each field asks)."""

    model_config = ConfigDict(extra="forbid")

    prune: list[str] = Field(default_factory=list)
    join: list[JobAdapter] = Field(default_factory=list)
    after: dict[str, list[str]] = Field(default_factory=dict)
    close: bool = False


class JoinRecord(BaseModel):
    """One line of joins.jsonl: a join the job took (at its step ``job_step``) or refused."""

    model_config = ConfigDict(extra="forbid")

    adapter: JobAdapter
    job_step: int
    attempt: int
    time: float
    refused: str | None = None


def read_control(job_dir: str | Path) -> JobControl:
    """The job's control.json; empty when there is none. Raises ValueError (JSON or schema)
    on a file that cannot be used."""
    path = Path(job_dir) / CONTROL_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return JobControl()
    try:
        return JobControl.model_validate_json(text)
    except ValidationError as e:
        raise ValueError(f"{path}: {e}") from e


def write_control(job_dir: str | Path, control: JobControl) -> Path:
    """Replace control.json atomically: a job never reads half a file."""
    path = Path(job_dir) / CONTROL_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CONTROL_FILE}.{os.getpid()}.tmp")
    tmp.write_text(control.model_dump_json(exclude_defaults=True))
    tmp.replace(path)
    return path


def request(job_dir: str | Path, *, prune: Iterable[str] = (), join: Iterable[JobAdapter] = (),
            close: bool = False, after: Mapping[str, Iterable[str]] | None = None) -> None:
    """Add prunes, joins (each new one waiting for the adapters ``after`` names for it)
    and a close to control.json in one write: a join sent with the prune that frees its
    slot takes that slot at the same step boundary. Ids already listed are left as they
    are."""
    control = read_control(job_dir)
    control.prune.extend(a for a in dict.fromkeys(prune) if a not in control.prune)
    known = {a.id for a in control.join}
    new = [a for a in join if a.id not in known]
    control.join.extend(new)
    for a in new:
        waits = list(dict.fromkeys((after or {}).get(a.id, ())))
        if waits:
            control.after[a.id] = waits
    control.close = control.close or close
    write_control(job_dir, control)


def request_join(job_dir: str | Path, adapters: Iterable[JobAdapter]) -> None:
    """Ask a running job to take these adapters (added to control.json's join list; an id
    already there is left as it is)."""
    request(job_dir, join=adapters)


def request_close(job_dir: str | Path) -> None:
    """Tell a job lingering for joins that none will come."""
    request(job_dir, close=True)


def reopen(job_dir: str | Path) -> None:
    """Take back an earlier attempt's ``close`` before the job is launched again (its other
    requests stand)."""
    try:
        control = read_control(job_dir)
    except ValueError:
        return
    if control.close:
        control.close = False
        write_control(job_dir, control)


def append_join(job_dir: str | Path, record: JoinRecord) -> None:
    """One more line of joins.jsonl, on disk (fsynced) before the adapter trains."""
    path = Path(job_dir) / JOINS_FILE
    with open(path, "a") as f:
        f.write(record.model_dump_json() + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_joins(job_dir: str | Path) -> list[JoinRecord]:
    """Every whole line of joins.jsonl, in order (a torn last line is left out)."""
    path = Path(job_dir) / JOINS_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(JoinRecord.model_validate(json.loads(line)))
        except (ValueError, ValidationError):
            continue
    return out
