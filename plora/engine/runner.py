"""The engine: run a queue of packed jobs on a pool of GPUs (or CPU slots), survive faults.

- A planned job runs on its planned GPUs (slot `g` of the pool for the plan's GPU `g`), in
  the plan's order on each of them: it starts once they are free and every job before it
  in the queue that wants one of them has started -- exactly as
  `plora.planner.simulate` replays a plan. Jobs without a plan's GPUs (the halves of a
  split, re-planned jobs) take any `tp` free slots that no waiting planned job before them
  wants.
- Out of memory (the recipe's exit code 3): the adapters not yet finished are split in two
  halves and re-queued; a single adapter that runs out of memory alone is failed.
- A model, data or config error (the recipe's exit code 4, message in error.json): its
  adapters are failed at once with that message; a retry would fail the same way.
- Lost with its node (a Ray node that died): re-queued, and not counted as a crash of its
  adapters (at most `MAX_LOST` times in a row).
- Any other crash: the job is retried with its unfinished adapters, at most `max_retries`
  times; then those adapters are failed and the sweep goes on.
- Resume: adapters with a result file are final whatever the journal says; jobs the
  journal shows running belong to a sweep that died: their processes are killed and their
  unfinished adapters re-queued.
- Ctrl-C: running jobs are stopped, their unfinished adapters go back to pending.
- Streaming (``planner.streaming``, `plora.engine.streaming`): adapters of queued jobs not
  started yet join running one-GPU jobs that have room, as the cost model decides
  (`plora.engine.join_choice`), through their control.json; the journal records them
  under the job they joined, and a job emptied so is not launched. A tensor-parallel job
  takes no joins (a ``no_joins`` event in the journal says so).
- A feed (the asynchronous tuner) may do the same itself at each tick: `Engine.join` sends
  adapters into a running job (with the prunes that free their slots, in one write),
  `Engine.close` tells it no more will come, `Engine.submit` queues new jobs.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from plora.job.outputs import (
    EXIT_OOM,
    EXIT_UNFIXABLE,
    error_file,
    has_summary,
    oom_file,
    read_error,
    read_summary,
)
from plora.settings import ATTEMPT
from plora.engine import local as local_jobs
from plora.engine import spare
from plora.engine.join_choice import (
    JOIN_TP,
    RunningPack,
    choose_joins,
    join_refusal,
    staying,
    steps_left,
)
from plora.engine.journal import FINAL_ADAPTER, Journal
from plora.engine.local import JobProcess, launch
from plora.engine.streaming import StreamPolicy
from plora.job.config import JobAdapter
from plora.job.control import reopen, request
from plora.planner.errors import PlannerError
from plora.planner.plan import Job

#: re-queues of a job lost with its node before it counts as a crash (a cluster that loses
#: every node it is given is not going to finish it)
MAX_LOST = 5


@dataclass
class JobHistory:
    """What the engine knows of a job id beyond the job itself: how often it was launched
    (read back from the journal on resume), how many of those launches were lost with
    their node (not the adapters' crashes), and the job it was split from. A job's retries
    keep its id, so they share its history."""

    attempt: int = 0
    lost: int = 0
    parent: str | None = None


@dataclass
class RunningJob:
    job: Job
    proc: JobProcess
    slots: list[str]
    #: its adapters whose results it wrote while running (recorded in the journal then)
    results: set[str] = field(default_factory=set)


def _gpus_of(slots: Sequence[str]) -> list[int]:
    """The GPU indices of pool slots ("cuda:N"; CPU slots have none)."""
    return [int(s.split(":")[1]) for s in slots if s.startswith("cuda:")]


@dataclass
class EngineSnapshot:
    """What the live view shows."""

    running: list[RunningJob]
    queued: list[Job]
    adapter_status: dict[str, int]
    elapsed_s: float
    predicted_makespan_s: float | None
    events: list[str]


@dataclass
class Drift:
    """Finished planned jobs, measured against the plan.

    A job's wall time is its optimizer steps plus a fixed part (process start, model load,
    evaluation, checkpoints). The two drift apart differently: a profile taken in-process
    knows nothing of the fixed part, and a job of one adapter is mostly fixed part. The
    recipe's summary gives the steps' share (`step_s`), so a re-plan can correct each.
    """

    jobs: int = 0
    wall_s: float = 0.0
    predicted_s: float = 0.0
    #: time of the jobs' optimizer steps at their steady rate (`_step_seconds`), summed;
    #: None once a job did not say
    step_s: float | None = 0.0

    @property
    def factor(self) -> float:
        """Measured over predicted job time."""
        return self.wall_s / self.predicted_s if self.predicted_s > 0 else 1.0

    @property
    def overhead_s(self) -> float | None:
        """Mean measured time of a job outside its timed steps."""
        if self.step_s is None or self.jobs == 0:
            return None
        return max(0.0, (self.wall_s - self.step_s) / self.jobs)

    def add(self, wall_s: float, predicted_s: float, step_s: float | None) -> None:
        self.jobs += 1
        self.wall_s += wall_s
        self.predicted_s += predicted_s
        self.step_s = None if self.step_s is None or step_s is None else self.step_s + step_s


class Calibrator(Protocol):
    """What the engine asks of a sweep's calibration (`plora.cost.profiling.calibrate.SweepCalibrator`)."""

    def observe(self, job_id: str, phases: Any, tp: int = 1) -> bool: ...

    def job_finished(self, job_id: str, run: dict[str, Any] | None, tp: int = 1) -> None: ...

    def drift(self, jobs: Sequence[tuple[Sequence[str], int]]) -> str | None: ...

    def model(self) -> Any: ...

    def planned_with(self, model: Any) -> None: ...

    def describe(self) -> str: ...


WriteJob = Callable[[Job], Path]  # writes jobs/<id>/job.yaml for the job's adapters, returns the job dir
#: (adapters of the jobs not started yet, finished jobs against the plan, seconds since the start,
#: free slots now) -> new jobs for those adapters
Replan = Callable[[list[str], Drift, float, int], list[Job]]
#: re-plan when measured job times drift this far (relative) from the plan's
DRIFT_THRESHOLD = 0.25
#: how often running jobs' measurements are read for the calibration (seconds)
CALIBRATE_EVERY_S = 1.0
#: the tick once nothing is queued: the sweep ends when its last job does, and a tick's
#: wait is the user's (a local job's end is seen from its files, `Engine._done_by_its_files`)
LAST_WAVE_POLL_S = 0.05
#: after a re-plan that failed (`Engine._replan_waiting`), the next try waits this long: each
#: try may spend the planner's time limit, and measurements move the model a little at a time
REPLAN_RETRY_S = 60.0


class Engine:
    def __init__(
        self,
        run_dir: Path,
        journal: Journal,
        slots: Sequence[str],
        write_job: WriteJob,
        *,
        max_retries: int = 2,
        predicted_makespan_s: float | None = None,
        on_tick: Callable[[EngineSnapshot], None] | None = None,
        poll_s: float = 0.25,
        replan: Replan | None = None,
        drift_threshold: float = DRIFT_THRESHOLD,
        launcher: Callable[..., JobProcess] | None = None,
        streaming: StreamPolicy | None = None,
        feed: Callable[[Engine], None] | None = None,
        calibrator: Calibrator | None = None,
        on_model: Callable[[Any], None] | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.journal = journal
        self.slots = list(slots)
        self.free = list(slots)
        self.write_job = write_job
        self.max_retries = max_retries
        self.predicted_makespan_s = predicted_makespan_s
        self.on_tick = on_tick
        self.poll_s = poll_s
        self.queue: list[Job] = []
        self.history: dict[str, JobHistory] = {}
        self.running: dict[str, RunningJob] = {}
        self.recent: list[str] = []
        self.finished: list[JobProcess] = []
        self.start = time.time()
        self.replan = replan
        self.drift_threshold = drift_threshold
        self.drift = Drift()  # finished planned jobs: measured and predicted durations
        self.drift_at_last_plan = 1.0
        self.replans = 0
        self.launch = launcher or launch  # the backend's: local processes, or Ray tasks
        self.streaming = streaming  # None: every adapter trains in the job it was queued in
        self.closed: set[str] = set()  # streaming jobs told that no join will come
        self.no_joins: set[str] = set()  # running jobs that take no joins (tensor-parallel), said once
        #: called at each tick, after finished jobs are reaped, by a caller that steers the
        #: running jobs itself (the asynchronous tuner: `join`, `close`, `submit`)
        self.feed = feed
        #: the sweep's calibration: running jobs' measurements correct the cost model, and the
        #: jobs not started yet are planned again once it has drifted from their plan
        self.calibrator = calibrator
        self.on_model = on_model  # told each corrected model (the sweep's joins fit by it)
        self._calibrated_at = 0.0
        self._replan_failed_at: float | None = None
        self._calibration_note = ""  # the last line the calibration said (said again only when it changes)

    # ------------------------------------------------------------------ resume
    def reconcile(self) -> None:
        """Make the journal agree with what is on disk and with what is still alive."""
        for job in self.journal.jobs("running"):
            if job.pid:
                _kill_group(job.pid)
            self.journal.update_job(job.id, status="stopped", ended=time.time())
            self.journal.event("stale", job.id, {"pid": job.pid})
        for adapter_id, status in self.journal.adapter_status().items():
            result = self.result(adapter_id)
            if result is not None:
                self._record_result(adapter_id, result)
            elif status in ("running", "failed"):
                self.journal.set_adapter(adapter_id, "pending")

    def result(self, adapter_id: str) -> dict | None:
        path = self.run_dir / "adapters" / adapter_id / "metrics.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        # "failed" is final within a run, but a new run retries it: the cause may be fixed.
        return data if data.get("status") in ("done", "diverged", "pruned") else None

    def _record_result(self, adapter_id: str, result: dict) -> None:
        trained_by = f"{result.get('job_id')}#{result.get('attempt', 1)}"
        self.journal.set_adapter(adapter_id, result["status"], job_id=result.get("job_id"), trained_by=trained_by)

    def unfinished(self, adapters: Sequence[str]) -> list[str]:
        status = self.journal.adapter_status()
        return [a for a in adapters if status.get(a) not in FINAL_ADAPTER]

    # -------------------------------------------------------------------- run
    def submit(self, jobs: Sequence[Job]) -> list[Job]:
        """Queue each job with its adapters not finished yet (the caller's jobs are left as
        they are); returns the jobs queued."""
        queued = []
        for job in jobs:
            job = replace(job, adapters=self.unfinished(job.adapters))
            if not job.adapters:
                continue
            self.journal.add_adapters(job.adapters)
            history = self._history(job.id)
            known = self.journal.job(job.id)
            if known is not None:
                history.attempt = known.attempt
            self.journal.add_job(job, parent=history.parent)
            if known is not None:
                self.journal.update_job(job.id, attempt=known.attempt)
            self.queue.append(job)
            queued.append(job)
        return queued

    def _history(self, job_id: str) -> JobHistory:
        return self.history.setdefault(job_id, JobHistory())

    def _to_front(self, jobs: Sequence[Job]) -> None:
        """First in line (a retry whose turn on its GPUs had come, the halves of a split)."""
        rest = [j for j in self.queue if not any(j is k for k in jobs)]
        self.queue[:] = list(jobs) + rest

    def run(self) -> None:
        try:
            while self.queue or self.running:
                self._launch_ready()
                if self.launch is local_jobs.launch:  # local jobs: the next one's process starts ahead
                    spare.keep(self._spare_wanted(), self._next_gpus())
                self._calibrate()
                self._stream()
                self._reap()
                self._record_running_results()
                if self.feed is not None:
                    self.feed(self)
                if self.on_tick:
                    self.on_tick(self.snapshot())
                time.sleep(self.poll_s if self.queue else min(self.poll_s, LAST_WAVE_POLL_S))
        except KeyboardInterrupt:
            self.stop("interrupted")
            raise
        finally:
            if self.launch is local_jobs.launch:
                spare.discard()
            if self.on_tick:
                self.on_tick(self.snapshot())

    def stop(self, why: str) -> None:
        for job_id, rj in list(self.running.items()):
            rj.proc.signal(signal.SIGTERM)
        deadline = time.time() + 15
        for job_id, rj in list(self.running.items()):
            try:
                rj.proc.proc.wait(timeout=max(0.1, deadline - time.time()))
            except Exception:  # noqa: BLE001 - still alive: take it down hard
                rj.proc.signal(signal.SIGKILL)
            self._collect(rj)
            for a in self.unfinished(rj.job.adapters):
                self.journal.set_adapter(a, "pending")
            self.journal.update_job(job_id, status="stopped", ended=time.time())
            self.journal.event("stopped", job_id, why)
        self.running.clear()

    def _spare_wanted(self) -> bool:
        """Whether the next job's process should start ahead now (`plora.engine.spare`): a
        job is queued, no running job is still starting (a spare's imports and CUDA set-up
        beside a job's own set-up slowed that 15 s on an H100 machine), and, streaming, the
        queued adapters have nowhere to go but a new job (a free slot, or a running job
        that takes no joins): otherwise they join a running job and the spare would only
        hold a CUDA context."""
        if not self.queue:
            return False
        if any(not rj.proc.progress() for rj in self.running.values()):
            return False
        if self.streaming is None or self.free:
            return True
        return not any(join_refusal(rj.job.tp) is None and job_id not in self.closed
                       for job_id, rj in self.running.items())

    def _next_gpus(self) -> list[int]:
        """The GPUs the next job to launch is expected on (a spare is started for them): the
        first queued job's planned GPUs, else the first free GPU slot, else the pool's first."""
        slots = (self._planned_slots(self.queue[0]) if self.queue else None) or self.free[:1] or self.slots[:1]
        return _gpus_of(slots)

    def _launch_ready(self) -> None:
        wanted: set[str] = set()  # slots that planned jobs still waiting, earlier in the queue, want
        for job in list(self.queue):
            pinned = self._planned_slots(job)
            if pinned is not None and (wanted & set(pinned) or not set(pinned) <= set(self.free)):
                wanted |= set(pinned)
                continue
            open_slots = [s for s in self.free if s not in wanted]
            if pinned is None and len(open_slots) < job.tp:
                if job.tp > len(self.slots):
                    self._fail(job, f"needs {job.tp} slots, the pool has {len(self.slots)}")
                    self.queue.remove(job)
                continue
            slots = pinned if pinned is not None else open_slots[: job.tp]
            for s in slots:
                self.free.remove(s)
            history = self._history(job.id)
            history.attempt += 1
            attempt = history.attempt
            job_dir = self.write_job(job)
            oom_file(job_dir).unlink(missing_ok=True)  # a marker of an earlier attempt
            error_file(job_dir).unlink(missing_ok=True)
            if self.streaming is not None:  # a relaunched job may take joins again
                reopen(job_dir)
                self.closed.discard(job.id)
            gpus = _gpus_of(slots)
            proc = self.launch(job.id, job_dir, ",".join(slots), gpus=gpus, nproc=job.tp,
                               extra_env={ATTEMPT: str(attempt)})
            self.queue.remove(job)
            self.running[job.id] = RunningJob(job, proc, slots)
            self.journal.update_job(job.id, status="running", attempt=attempt, pid=proc.proc.pid,
                                    gpus=gpus, started=proc.started)
            for a in job.adapters:
                self.journal.set_adapter(a, "running", job_id=job.id)
            self.journal.event("launch", job.id, {"adapters": job.adapters, "attempt": attempt, "slots": slots})
            self._note(f"started {job.id} ({len(job.adapters)} adapters, TP {job.tp}) on {','.join(slots)}")

    def _stream(self) -> None:
        """Send adapters of queued jobs not started yet into running jobs with room, as
        `plora.engine.join_choice` decides; close a running job that has nothing left to
        train and nothing to take. A tensor-parallel job is sent nothing (the journal says
        why, once)."""
        if self.streaming is None:
            return
        packs: list[RunningPack] = []
        for job_id, rj in self.running.items():
            if job_id in self.closed or rj.proc.proc.poll() is not None:
                continue
            refusal = join_refusal(rj.job.tp)
            if refusal is not None:
                self._refuse_joins(job_id, refusal)
                continue
            packs.append(self._running_pack(rj))
        if not packs:
            return
        training = {p.job_id: p.training for p in packs}
        packs = [self._staying(p) for p in packs]
        leaving = {p.job_id: [a.id for a in training[p.job_id] if a not in p.training] for p in packs}
        queued = [j for j in self.queue if self._history(j.id).attempt == 0]
        if not queued and self.feed is None:
            # nothing waits to join: the running jobs know that no join will come, so each
            # ends as its adapters do and plans its last packs' graphs knowing how long they last
            for pack in packs:
                self.close(pack.job_id)
            return
        waiting = [self.streaming.load(a) for j in queued for a in j.adapters]
        first = {a for j in queued if self._history(j.id).parent is not None for a in j.adapters}
        policy = self.streaming
        chosen = choose_joins(packs, waiting, lambda loads: policy.fits(loads, JOIN_TP), policy.cost, first,
                              policy.targets)
        for job_id, taken in chosen.items():
            self.join(job_id, [self.streaming.entry(a) for a in taken], after={a: leaving[job_id] for a in taken})
            self._take_from_queue(set(taken), into=job_id)
        for pack in packs:
            if not training[pack.job_id] and pack.job_id not in chosen:
                self.close(pack.job_id)

    def _running_pack(self, rj: RunningJob) -> RunningPack:
        """A running job's adapters still training, with the steps each has left (from its
        progress.json; an adapter it has not reported, e.g. a join still waiting in its
        control.json, has taken none)."""
        training = [self.streaming.load(a) for a in rj.job.adapters if self.result(a) is None]
        done = rj.proc.progress().get("adapter_steps")
        targets = self.streaming.targets(rj.job.adapters[0]) if self.streaming.targets and rj.job.adapters else None
        return RunningPack(rj.job.id, steps_left(training, done if isinstance(done, dict) else {}), targets)

    def _staying(self, pack: RunningPack) -> RunningPack:
        """The pack as it will be once the adapters about to leave have left
        (`join_choice.staying`): joins sent now wait in the job (``streaming.max_active``)
        and take the slots at the very step boundary where those adapters leave, instead of
        a few engine ticks after it, in pieces."""
        policy = self.streaming
        return RunningPack(pack.job_id, tuple(staying(pack.training, policy.cost if policy else None)), pack.targets)

    def _refuse_joins(self, job_id: str, why: str) -> None:
        if job_id in self.no_joins:
            return
        self.no_joins.add(job_id)
        self.journal.event("no_joins", job_id, why)
        self._note(f"{job_id}: {why}")

    def join(self, job_id: str, entries: Sequence[JobAdapter], prune: Sequence[str] = (),
             after: Mapping[str, Sequence[str]] | None = None) -> None:
        """Send adapters into a running job (its control.json) and record them under it;
        ``prune`` leave in the same write, so a join takes the slot a prune frees at the
        same step boundary; a join waits in the job for the adapters ``after`` names for it
        to leave."""
        rj = self.running[job_id]
        taken = [a.id for a in entries]
        request(rj.proc.job_dir, prune=prune, join=entries, after=after)
        if not taken:
            return
        self.journal.add_adapters(taken)
        rj.job = replace(rj.job, adapters=[*rj.job.adapters, *taken])
        self.journal.update_job(job_id, adapters=rj.job.adapters)
        for a in taken:
            self.journal.set_adapter(a, "running", job_id=job_id)
        self.journal.event("join", job_id, {"adapters": taken})
        self._note(f"{len(taken)} adapters joined {job_id}")

    def wind_down(self, prune: bool) -> None:
        """Launch no more job, and let each running one take no more joins; with ``prune``
        its unfinished adapters leave at its next step too (a tune whose budget is spent)."""
        self.queue.clear()
        for job_id, rj in self.running.items():
            request(rj.proc.job_dir, prune=self.unfinished(rj.job.adapters) if prune else (), close=True)
            self.closed.add(job_id)
        self._note("budget spent: " + ("running adapters pruned" if prune else "running adapters finish"))

    def close(self, job_id: str) -> None:
        """Tell a running job that no join will come (it leaves once its adapters have)."""
        if job_id in self.closed:
            return
        request(self.running[job_id].proc.job_dir, close=True)
        self.closed.add(job_id)

    def _take_from_queue(self, adapters: set[str], into: str) -> None:
        for job in list(self.queue):
            left = [a for a in job.adapters if a not in adapters]
            if len(left) == len(job.adapters):
                continue
            if left:
                self.queue[self.queue.index(job)] = replace(job, adapters=left)
                self.journal.update_job(job.id, adapters=left)
            else:
                self.queue.remove(job)
                self.journal.update_job(job.id, status="streamed", ended=time.time())
                self.journal.event("streamed", job.id, {"into": into})

    def _planned_slots(self, job: Job) -> list[str] | None:
        """The pool's slots for the job's planned GPUs (a TP job may use any set the plan
        gives it); None when it has none or they do not fit this pool."""
        if len(job.gpus) != job.tp or len(set(job.gpus)) != job.tp:
            return None
        if any(not 0 <= g < len(self.slots) for g in job.gpus):
            return None
        return [self.slots[g] for g in job.gpus]

    def _reap(self) -> None:
        for job_id, rj in list(self.running.items()):
            rc = rj.proc.proc.poll()
            if rc is None:
                if not self._done_by_its_files(rj):
                    continue
                rc = 0  # its process is exiting (freeing its CUDA context): nothing waits for that
            del self.running[job_id]
            self.finished.append(rj.proc)
            self.free.extend(rj.slots)
            self.free.sort(key=self.slots.index)
            self._collect(rj, rc)
            self._after_exit(rj.job, rc, lost=rj.proc.lost, ended=rj.proc.ended)
            if rc == 0:
                if self.calibrator is not None:
                    from plora.job.phases import read_phases

                    self.calibrator.job_finished(job_id, read_phases(rj.proc.job_dir, rj.proc.ended), tp=rj.job.tp)
                    self._model_changed()
                self._track_drift(rj)

    def _calibrate(self) -> None:
        """Read the running jobs' measurements (their progress.json ``phases``) into the
        calibration; where they moved the cost model, the streaming choice uses the new one,
        and the jobs not started yet are planned again once it has drifted from their plan."""
        cal = self.calibrator
        if cal is None or time.time() - self._calibrated_at < CALIBRATE_EVERY_S:
            return
        self._calibrated_at = time.time()
        changed = False
        for job_id, rj in self.running.items():
            changed |= cal.observe(job_id, rj.proc.progress().get("phases"), tp=rj.job.tp)
        if changed:
            self._model_changed()

    def _model_changed(self) -> None:
        cal = self.calibrator
        if cal is None:
            return
        model = cal.model()
        if self.streaming is not None:
            self.streaming.cost = model
        if self.on_model is not None:
            self.on_model(model)
        note = cal.describe()
        if note and note != self._calibration_note:
            self._calibration_note = note
            self._note(note)
        waiting = self._waiting()
        reason = cal.drift([(j.adapters, j.tp) for j in waiting])
        if reason is not None and self.replan is not None:
            self._replan_waiting(waiting, reason, {"reason": reason})

    def _record_running_results(self) -> None:
        """Record the adapters that finished inside a running job as soon as their result is
        on disk (the job said so in its progress.json), not once the job exits: the live
        view, the log and `plora status` then count what the job's own progress shows."""
        for rj in self.running.values():
            if (rj.proc.progress().get("adapters_finished") or 0) <= len(rj.results):
                continue
            for a in rj.job.adapters:
                result = None if a in rj.results else self.result(a)
                if result is not None:
                    rj.results.add(a)
                    self._record_result(a, result)

    def _track_drift(self, rj: RunningJob) -> None:
        """Compare finished jobs' measured times with the plan's; past the threshold, the
        jobs not started yet are planned again with what was measured (PLoRA re-plans the
        rest of the queue whenever reality and the cost model part ways)."""
        job = rj.job
        predicted = job.predicted_seconds
        if predicted is None or predicted <= 0 or self._history(job.id).attempt != 1:
            return
        self.drift.add((rj.proc.ended or time.time()) - rj.proc.started, predicted, _step_seconds(rj.proc.job_dir))
        drift = self.drift.factor
        if self.replan is None or abs(drift / self.drift_at_last_plan - 1) <= self.drift_threshold:
            return
        waiting = self._waiting()
        if not waiting:
            return
        if self._replan_waiting(waiting, f"measured/predicted {drift:.2f}",
                                {"drift": drift, "overhead_s": self.drift.overhead_s}):
            self.drift_at_last_plan = drift

    def _waiting(self) -> list[Job]:
        """Planned jobs not started yet (never launched, not the halves of a split)."""
        return [j for j in self.queue if self._history(j.id).attempt == 0 and self._history(j.id).parent is None]

    def _replan_waiting(self, waiting: list[Job], why: str, event: dict[str, Any]) -> bool:
        """Plan the adapters of the ``waiting`` jobs again (the sweep's `Replan`); whether the
        new jobs took their place."""
        if not waiting or self.replan is None:
            return False
        if self._replan_failed_at is not None and time.time() - self._replan_failed_at < REPLAN_RETRY_S:
            return False
        adapters = [a for j in waiting for a in j.adapters]
        try:
            new_jobs = self.replan(adapters, self.drift, time.time() - self.start, len(self.free))
        except PlannerError as e:  # the plan made before still runs; an out-of-memory split is the last resort
            self._replan_failed_at = time.time()
            self._note(f"re-plan failed, the current plan stays: {e}")
            self.journal.event("replan_failed", "", {**event, "error": str(e)})
            return False
        self._replan_failed_at = None
        if sorted(a for j in new_jobs for a in j.adapters) != sorted(adapters):
            self._note("re-plan ignored: it did not cover the waiting adapters exactly once")
            return False
        for j in waiting:
            self.queue.remove(j)
            self.journal.update_job(j.id, status="replanned")
        self.replans += 1
        ends = [j.end for j in new_jobs if j.end is not None]
        if ends and self.predicted_makespan_s is not None:  # the live view compares with the new plan
            self.predicted_makespan_s = max(ends)
        self.journal.event("replan", "", {**event, "adapters": adapters,
                                          "old": [j.id for j in waiting], "new": [j.id for j in new_jobs]})
        self._note(f"{why}: re-planned {len(adapters)} waiting adapters into {len(new_jobs)} jobs")
        if self.calibrator is not None:
            self.calibrator.planned_with(self.calibrator.model())
        for j in new_jobs:  # planned as if every slot were free now, which the running jobs contradict:
            j.gpus = []  # they take any free slots, in the new plan's order
        self.submit(new_jobs)
        return True

    def _done_by_its_files(self, rj: RunningJob) -> bool:
        """Whether a local job whose process has not exited yet is done all the same: nothing is
        queued behind it, its progress is final and its summary written (every adapter's files
        are on disk before that). Its process then only frees its CUDA context (a second or
        more on a GPU), which the sweep's last job need not be waited for."""
        if self.queue or self.launch is not local_jobs.launch:
            return False
        progress = rj.proc.progress()
        # this attempt's files, not those an earlier attempt of the job left in its folder
        if not progress.get("final") or progress.get("attempt") != self._history(rj.job.id).attempt:
            return False
        return has_summary(rj.proc.job_dir)

    def _collect(self, rj: RunningJob, rc: int | None = None) -> None:
        rj.proc.returncode = rj.proc.proc.poll() if rc is None else rc
        rj.proc.ended = time.time()
        if rj.proc.log and not rj.proc.log.closed:
            rj.proc.log.close()
        for a in rj.job.adapters:
            result = self.result(a)
            if result is not None:
                self._record_result(a, result)

    def _after_exit(self, job: Job, rc: int, lost: bool = False, ended: float | None = None) -> None:
        """What follows a job's exit (``ended``: when it was seen, before its results were
        read: the journal's end of the job, as its makespan counts it)."""
        left = self.unfinished(job.adapters)
        now = time.time() if ended is None else ended
        history = self._history(job.id)
        if not left and (rc == 0 or lost):  # lost after its last result: nothing to run again
            self.journal.update_job(job.id, status="finished", ended=now, returncode=rc)
            self._note(f"finished {job.id}")
            return
        if lost and left and history.lost < MAX_LOST:  # its node died: run it elsewhere, from its checkpoint
            history.lost += 1
            self.journal.update_job(job.id, status="lost", ended=now, returncode=None)
            self.journal.event("lost", job.id, {"attempt": history.attempt})
            self._note(f"{job.id} was lost with its node; re-queued")
            self._to_front(self.submit([replace(job, adapters=left)]))  # it has a checkpoint to go on from
            return
        # torchrun reports any failed worker as exit 1: the recipe's marker file says OOM
        if rc == EXIT_OOM or (rc != 0 and oom_file(self.run_dir / "jobs" / job.id).is_file()):
            self.journal.update_job(job.id, status="oom", ended=now, returncode=rc)
            if len(left) == 1:
                self._fail(job, "out of memory with this adapter alone", left)
                return
            half = (len(left) + 1) // 2
            children = [Job(f"{job.id}.{i}", part, job.tp) for i, part in enumerate([left[:half], left[half:]])]
            for child in children:
                self._history(child.id).parent = job.id
            self.journal.event("split", job.id, {"into": [c.id for c in children]})
            self._note(f"{job.id} ran out of memory: split into {', '.join(c.id for c in children)}")
            self.journal.update_job(job.id, status="split")
            self._to_front(self.submit(children))
            return
        unfixable = self.run_dir / "jobs" / job.id
        if rc != 0 and (rc == EXIT_UNFIXABLE or error_file(unfixable).is_file()):  # a retry would fail the same way
            self.journal.update_job(job.id, status="crashed", ended=now, returncode=rc)
            self._fail(job, _unfixable_message(unfixable, rc), left)
            return
        # crashed (or exited 0 with adapters left, which is a crash too)
        self.journal.update_job(job.id, status="crashed", ended=now, returncode=rc)
        crashes = history.attempt - history.lost
        if crashes <= self.max_retries:
            self.journal.event("retry", job.id, {"returncode": rc, "attempt": history.attempt})
            self._note(f"{job.id} crashed (exit {rc}); retry {crashes}/{self.max_retries}")
            # its turn on its GPUs had come: first in line for them again
            self._to_front(self.submit([replace(job, adapters=left)]))
            return
        self._fail(job, f"crashed {crashes} times (last exit code {rc}); see jobs/{job.id}/log.txt", left)

    def _fail(self, job: Job, why: str, adapters: Sequence[str] | None = None) -> None:
        for a in adapters if adapters is not None else job.adapters:
            self.journal.set_adapter(a, "failed", job_id=job.id)
            _write_failure(self.run_dir, a, job.id, why)
        self.journal.update_job(job.id, status="abandoned")
        self.journal.event("failed", job.id, why)
        self._note(f"{job.id}: {why}")

    def _note(self, text: str) -> None:
        self.recent = (self.recent + [f"{time.strftime('%H:%M:%S')} {text}"])[-6:]

    def snapshot(self) -> EngineSnapshot:
        counts: dict[str, int] = {}
        for status in self.journal.adapter_status().values():
            counts[status] = counts.get(status, 0) + 1
        return EngineSnapshot(list(self.running.values()), list(self.queue), counts, time.time() - self.start,
                              self.predicted_makespan_s, list(self.recent))


def _unfixable_message(job_dir: Path, rc: int) -> str:
    return read_error(job_dir) or f"model, data or config error (exit code {rc}); see the job's log.txt"


def _write_failure(run_dir: Path, adapter_id: str, job_id: str, why: str) -> None:
    out = run_dir / "adapters" / adapter_id
    out.mkdir(parents=True, exist_ok=True)
    row = {"adapter_id": adapter_id, "job_id": job_id, "status": "failed", "reason": why, "steps": 0,
           "checkpoint_path": None}
    (out / "metrics.json").write_text(json.dumps(row, indent=2))


def _kill_group(pid: int, sig: int = signal.SIGKILL) -> None:
    """Jobs start in their own session (pgid == pid): signal the whole group (torchrun's workers too)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _step_seconds(job_dir: Path) -> float | None:
    """Seconds a finished job's optimizer steps take at their steady rate (its summary.json
    times steps 2..n; the first, which compiles kernels, counts as fixed overhead)."""
    summary = read_summary(job_dir)
    if summary is None:
        return None
    timed, steps = summary.get("step_time_s"), summary.get("steps")
    if not isinstance(timed, (int, float)) or not isinstance(steps, int) or steps < 2:
        return None
    return float(timed) * steps / (steps - 1)
