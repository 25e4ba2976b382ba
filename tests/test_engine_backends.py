"""The engine's backend boundary, with a fake backend: a job lost with its node is re-run
without counting as a crash of its adapters; the launcher and the handle are all it uses."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

from plora.engine.journal import Journal
from plora.engine.local import JobProcess
from plora.engine.runner import MAX_LOST, Engine
from plora.planner.plan import Job


class FakeTask:
    """A task that is lost (its node died) or finishes its adapters at once."""

    pid = None

    def __init__(self, run_dir: Path, adapters: list[str], job_id: str, attempt: int, lose: bool):
        self.run_dir, self.adapters, self.job_id, self.attempt = run_dir, adapters, job_id, attempt
        self.lost, self.returncode, self.signals = lose, None, []

    def poll(self):
        if self.returncode is None:
            if self.lost:
                self.returncode = -1000
            else:
                for a in self.adapters:
                    out = self.run_dir / "adapters" / a
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "metrics.json").write_text(json.dumps(
                        {"adapter_id": a, "job_id": self.job_id, "attempt": self.attempt, "status": "done"}))
                self.returncode = 0
        return self.returncode

    def wait(self, timeout=None):
        return self.poll()

    def send_signal(self, sig):
        self.signals.append(sig)


def run_engine(tmp_path: Path, lose_attempts: int, max_retries: int = 0):
    run = tmp_path / "run"
    (run / "jobs").mkdir(parents=True)
    journal = Journal(run / "journal.sqlite")
    journal.add_adapters(["a", "b"])
    launches = []

    def write_job(job: Job) -> Path:
        d = run / "jobs" / job.id
        d.mkdir(exist_ok=True)
        return d

    def launcher(job_id, job_dir, slot, *, gpus=(), nproc=1, extra_env=None):
        attempt = int(extra_env["PLORA_ATTEMPT"])
        launches.append(attempt)
        task = FakeTask(run, ["a", "b"], job_id, attempt, lose=attempt <= lose_attempts)
        return JobProcess(job_id, job_dir, slot, task, time.time())

    engine = Engine(run, journal, ["ray:0"], write_job, max_retries=max_retries, poll_s=0.001, launcher=launcher)
    engine.submit([Job("job-000", ["a", "b"])])
    engine.run()
    return journal, launches


def test_a_lost_job_is_rerun_and_not_counted_as_a_crash(tmp_path):
    journal, launches = run_engine(tmp_path, lose_attempts=2, max_retries=0)  # no crash retries at all
    try:
        assert launches == [1, 2, 3]
        assert journal.adapter_status() == {"a": "done", "b": "done"}
        job = journal.job("job-000")
        assert job.status == "finished" and job.attempt == 3 and job.pid is None
        kinds = [kind for _, kind, _, _ in journal.events()]
        assert kinds.count("lost") == 2 and "retry" not in kinds
    finally:
        journal.close()


def test_a_job_lost_again_and_again_fails_in_the_end(tmp_path):
    journal, launches = run_engine(tmp_path, lose_attempts=100, max_retries=1)
    try:
        assert len(launches) == MAX_LOST + 2  # MAX_LOST re-queues, then one crash retry
        assert set(journal.adapter_status().values()) == {"failed"}
    finally:
        journal.close()


def test_stop_signals_through_the_handle_not_by_pid(tmp_path):
    run = tmp_path / "run"
    (run / "jobs" / "j").mkdir(parents=True)
    task = FakeTask(run, [], "j", 1, lose=False)
    JobProcess("j", run / "jobs" / "j", "ray:0", task, time.time()).signal(signal.SIGTERM)
    assert task.signals == [signal.SIGTERM]
