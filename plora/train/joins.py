"""The job's side of the join protocol: control.json read, joins queued, taken or refused.

`JoinDesk` reads ``<job_dir>/control.json`` (`plora.job.control`) at each step boundary,
only when it has changed (one stat per step); says which adapters are to be pruned; queues
the joins that are new to the job; and, when the pack has room (``streaming.max_active``,
``max_active_rank``, a join's ``after``), chooses which waiting joins enter, recording each
in joins.jsonl before its first step. Where they go in the pack (a freed slot of their rank,
or a pack laid out again) is the pack's (`plora.train.adapter_pack.AdapterPack`). A relaunched
job learns from joins.jsonl which adapters joined its earlier attempts (`rejoined`).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from pydantic import ValidationError

from plora.job.config import JobAdapter, JobStreaming
from plora.job.control import CONTROL_FILE, JobControl, JoinRecord, append_join, read_joins
from plora.train.adapter_run import FINAL_STATUSES, AdapterRun
from plora.train.packed.tp import TensorParallel

#: what identifies every adapter's configuration (metrics.json's ``config`` has them all)
BASE_HYPERPARAMETERS = ("rank", "alpha", "learning_rate", "batch_size", "seed")


class JoinDesk:
    """Joins and prunes asked of a running job through its control.json.

    ``adapters``: the job's own (from its config); ``complete``: an adapter with every
    training setting of its own (the job's where it gives none)."""

    def __init__(self, job_dir: Path, output_dir: Path, job_id: str, adapters: Sequence[JobAdapter],
                 streaming: JobStreaming, *, complete: Callable[[JobAdapter], JobAdapter], is_main: bool,
                 attempt: int, tp: TensorParallel | None = None, device: torch.device | None = None):
        self.job_dir = Path(job_dir)
        self.output_dir = Path(output_dir)
        self.job_id = job_id
        self.own = {a.id for a in adapters}
        self.limits = streaming
        self.complete = complete
        self.is_main = is_main
        self.attempt = attempt
        self.tp = tp
        self.device = device
        self.pending: list[JobAdapter] = []  # asked for, not taken yet (no room)
        self.after: dict[str, set[str]] = {}  # join id -> adapters it waits for to leave
        self.closed = False  # control.json said no more joins will come
        self.joined_before: set[str] = set()  # every id ever taken or refused: never taken again
        self._seen: tuple[int, int, int] | None = None  # control.json's (inode, mtime, size) last read

    @property
    def may_change_pack(self) -> bool:
        """Whether a join may still change the pack (one waits, or the job lingers for them)."""
        return bool(self.pending) or (self.limits.linger_s > 0 and not self.closed)

    # ------------------------------------------------------------ relaunch
    def rejoined(self) -> list[tuple[JobAdapter, int]]:
        """Adapters that joined an earlier attempt of this job (joins.jsonl) and have no
        result yet, with the job step they joined at: they train again, from their mid-job
        checkpoint where there is one. Every id in the file is never taken again."""
        records = read_joins(self.job_dir)
        self.joined_before = {rec.adapter.id for rec in records}
        out: dict[str, tuple[JobAdapter, int]] = {}
        for rec in records:
            a = rec.adapter
            if rec.refused is None and a.id not in self.own and a.id not in out and not self._has_result(a):
                out[a.id] = (a, rec.job_step)
        return list(out.values())

    def _has_result(self, a: JobAdapter) -> bool:
        """Whether this job already wrote ``a``'s final metrics (an earlier attempt)."""
        try:
            m = json.loads((self.output_dir / "adapters" / a.id / "metrics.json").read_text())
        except (OSError, ValueError):
            return False
        saved, want = m.get("config") or {}, self.complete(a).hyperparameters()
        # an earlier plora wrote the five alone: the settings it does not show are not compared
        same = all(saved.get(k) == v for k, v in want.items() if k in saved or k in BASE_HYPERPARAMETERS)
        return m.get("status") in FINAL_STATUSES and m.get("job_id") == self.job_id and same

    # ------------------------------------------------------------ each step
    def poll(self) -> JobControl | None:
        """control.json (`plora.job.control`), read only when it has changed (None when it has
        not, and on every rank but the main one): one stat per step, so a request takes
        effect at the next step however fast the steps are."""
        if not self.is_main:
            return None
        path = self.job_dir / CONTROL_FILE
        try:
            st = path.stat()
        except OSError:
            return None
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return None
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):  # half-written by a writer without an atomic rename: next step
            return None
        self._seen = seen
        try:
            return JobControl.model_validate(raw)
        except ValidationError as e:  # a whole file that is wrong: said once, until it changes
            print(f"control.json ignored: {' '.join(str(e).split())[:1000]}", file=sys.stderr, flush=True)
            return None

    def to_prune(self, control: JobControl | None, runs: Sequence[AdapterRun]) -> set[str]:
        """The adapters ``control`` prunes; under TP rank 0 read the file, and every rank
        prunes at the same step."""
        prune = set(control.prune) if control is not None else set()
        if self.tp is not None:
            flags = torch.tensor([r.id in prune for r in runs], dtype=torch.uint8, device=self.device)
            prune = {r.id for r, f in zip(runs, self.tp.broadcast_(flags).tolist()) if f}
        return prune

    def note(self, control: JobControl, step: int, held: dict[str, JobAdapter]) -> None:
        """What ``control`` says besides prunes: ``close``, each join's ``after``, and the joins
        that are new to this job, queued in the order asked (``held``: the adapters the job
        holds, by id)."""
        self.closed = self.closed or control.close
        for a, waits in control.after.items():
            self.after.setdefault(a, set()).update(waits)
        waiting = {a.id for a in self.pending}
        for a in map(self.complete, control.join):
            if a.id in waiting or a.id in self.joined_before:
                continue
            if a.id in held:
                if held[a.id] != a:
                    self.refuse(a, step, "the job already holds another adapter of this id")
                continue
            self.pending.append(a)
            waiting.add(a.id)

    def refuse(self, a: JobAdapter, step: int, reason: str) -> None:
        self.joined_before.add(a.id)
        if self.is_main:
            append_join(self.job_dir, JoinRecord(adapter=a, job_step=step, attempt=self.attempt, time=time.time(),
                                                 refused=reason))
            print(f"join of {a.id} refused: {reason}", file=sys.stderr, flush=True)

    def choose(self, step: int, active: Sequence[AdapterRun]) -> list[JobAdapter]:
        """Waiting joins, in the order asked, that enter the pack now: while
        ``streaming.max_active`` and ``max_active_rank`` allow, each whose ``after`` names no
        adapter still training (a join that waits lets later ones pass). Each is in
        joins.jsonl before it is returned. A tensor-parallel job refuses every join."""
        if self.tp is not None:
            for a in self.pending:
                self.refuse(a, step, "adapters cannot join a tensor-parallel job")
            self.pending = []
            return []
        limits = self.limits
        count, ranks = len(active), sum(r.cfg.rank for r in active)
        training = {r.id for r in active}
        taking: list[JobAdapter] = []
        for a in self.pending:
            if self.after.get(a.id, set()) & training:
                continue  # chosen for the room adapters still training leave: it waits for them
            if limits.max_active is not None and count + 1 > limits.max_active:
                break
            if limits.max_active_rank is not None and ranks + a.rank > limits.max_active_rank:
                break
            taking.append(a)
            count, ranks = count + 1, ranks + a.rank
        if not taking:
            return []
        taken = {a.id for a in taking}
        self.pending = [a for a in self.pending if a.id not in taken]
        for a in taking:
            self.joined_before.add(a.id)
            if self.is_main:
                append_join(self.job_dir, JoinRecord(adapter=a, job_step=step, attempt=self.attempt, time=time.time()))
        return taking
