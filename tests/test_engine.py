"""The engine: resume after SIGKILL, out-of-memory splits, bounded crash retries."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import inject_fault, tiny_space_file
from plora.engine.journal import Journal
from plora.planner.plan import Job, Plan
from plora.spec.loading import load_spec
from plora.sweep import prepare, run_prepared, write_run_files


def space(tmp_path: Path, steps: list[int] | None = None, per_job: int = 3, name: str = "e") -> Path:
    configs = [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
        {"rank": 4, "alpha": 4, "learning_rate": 3e-3, "batch_size": 2},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 1},
        {"rank": 2, "alpha": 2, "learning_rate": 5e-3, "batch_size": 8},
    ]
    return tiny_space_file(
        tmp_path, name=name, num_train=32, num_eval=8, space={"strategy": "list", "configs": configs},
        training={"epochs": 2},  # 16, 32, 64 and 8 steps: adapters leave their packs at different times
        eval={"max_new_tokens": 4, "metrics": ["loss"]}, planner={"max_adapters_per_job": per_job})


def prepared(tmp_path: Path, groups=((0, 1, 2), (3,))):
    """The sweep with a fixed grouping (job-000: adapters 0-2, job-001: adapter 3): these
    tests are about the engine, not about the planner's choices."""
    prep = prepare(load_spec(space(tmp_path)))
    jobs = [Job(f"job-{j:03d}", [prep.configs[i].id for i in g]) for j, g in enumerate(groups)]
    prep.plan = Plan(jobs, grouping="fixed for the test")
    write_run_files(prep)
    return prep


def launches(run: Path) -> list[tuple[str, list[str]]]:
    j = Journal(run / "journal.sqlite")
    try:
        return [(subject, json.loads(detail)["adapters"]) for _, kind, subject, detail in j.events() if kind == "launch"]
    finally:
        j.close()


def test_oom_splits_the_job_and_requeues(tmp_path, monkeypatch):
    inject_fault(monkeypatch, "oom@job-000@2")
    prep = prepared(tmp_path)
    frame = run_prepared(prep, slots=["cpu:0", "cpu:1"])
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]
    j = Journal(prep.run_dir / "journal.sqlite")
    jobs = {r.id: r for r in j.jobs()}
    j.close()
    assert jobs["job-000"].status == "split"
    kids = [r for r in jobs.values() if r.parent == "job-000"]
    assert len(kids) == 2 and all(k.status == "finished" for k in kids)
    assert sorted(a for k in kids for a in k.adapters) == sorted(jobs["job-000"].adapters)
    assert set(frame.job_id) >= {k.id for k in kids}


def test_single_adapter_oom_is_failed_and_the_sweep_goes_on(tmp_path, monkeypatch):
    inject_fault(monkeypatch, "oom@job-001@1")
    prep = prepared(tmp_path)  # job-001 holds one adapter
    frame = run_prepared(prep, slots=["cpu:0", "cpu:1"])
    failed = frame[frame.status == "failed"]
    assert len(failed) == 1 and "out of memory" in failed.reason.iloc[0]
    assert (frame.status == "done").sum() == 3


def test_crash_is_retried_then_succeeds(tmp_path, monkeypatch):
    inject_fault(monkeypatch, "crash@job-000@3@1")  # first attempt only
    prep = prepared(tmp_path)
    frame = run_prepared(prep, slots=["cpu:0", "cpu:1"])
    assert set(frame.status) == {"done"}
    j = Journal(prep.run_dir / "journal.sqlite")
    assert j.job("job-000").attempt == 2 and j.job("job-000").status == "finished"
    j.close()


def test_crash_retries_are_bounded(tmp_path, monkeypatch):
    inject_fault(monkeypatch, "crash@job-000@1")  # every attempt
    prep = prepared(tmp_path)
    frame = run_prepared(prep, slots=["cpu:0", "cpu:1"], max_retries=1)
    bad = frame[frame.job_id == "job-000"]
    assert len(bad) == 3 and set(bad.status) == {"failed"}
    assert bad.reason.str.contains("crashed 2 times").all()
    assert set(frame[frame.job_id != "job-000"].status) == {"done"}
    assert len([1 for job, _ in launches(prep.run_dir) if job == "job-000"]) == 2


def _wait_for(pred, timeout: float) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_sigkill_mid_job_resumes_and_trains_each_adapter_once(tmp_path):
    path = space(tmp_path, per_job=4, name="k")
    run = tmp_path / "runs" / "k"
    cmd = [sys.executable, "-m", "plora.cli", "sweep", str(path)]
    sweep = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def some_adapter_done() -> bool:
        return any((p / "metrics.json").is_file() for p in (run / "adapters").glob("*")) if (run / "adapters").is_dir() else False

    assert _wait_for(some_adapter_done, 120), "no adapter finished"
    os.killpg(sweep.pid, signal.SIGKILL)  # the sweep and, through the parent-death signal, its job
    sweep.wait()
    frame_before = {p.parent.name for p in run.glob("adapters/*/metrics.json")}
    assert 0 < len(frame_before) < 4, "kill came too late to test a resume"

    restarted = time.time()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    frame = pd.read_parquet(run / "results.parquet")
    assert set(frame.status) == {"done"} and len(frame) == 4

    j = Journal(run / "journal.sqlite")
    journal = {a["id"]: a for a in j.adapters()}
    after = [json.loads(detail)["adapters"] for at, kind, _, detail in j.events() if kind == "launch" and at >= restarted]
    j.close()
    for _, row in frame.iterrows():
        m = json.loads((run / "adapters" / row.adapter_id / "metrics.json").read_text())
        assert journal[row.adapter_id]["status"] == "done"
        assert journal[row.adapter_id]["trained_by"] == f"{m['job_id']}#{m['attempt']}"
        assert Path(m["checkpoint_path"], "adapter_model.safetensors").is_file()
    # adapters finished before the kill were not launched again; each other one exactly once
    relaunched = [a for job in after for a in job]
    assert not (set(relaunched) & frame_before)
    assert sorted(relaunched) == sorted(set(frame.adapter_id) - frame_before)


def test_drift_from_the_plan_replans_the_jobs_not_started(tmp_path):
    """A cost model 100× too optimistic: after the first job, the waiting ones are re-planned."""
    from plora.cost.profiling.cache import sweep_cache_path
    from plora.cost.profiling.record import Profile

    spec = load_spec(space(tmp_path, per_job=1))
    first = prepare(spec)
    wrong = first.cost_model.scaled(0.01)
    wrong = wrong.with_meta(plan_source="a cost model 100x too fast")
    cached = sweep_cache_path(spec)  # as if this machine had a profile of the model
    Profile(wrong, [], [], {"model": "test"}).save(cached)
    prep = prepare(spec, cost_model=wrong)
    write_run_files(prep)
    assert len(prep.plan.jobs) == 4
    frame = run_prepared(prep, slots=["cpu:0"])
    assert set(frame.status) == {"done"} and len(frame) == 4
    j = Journal(prep.run_dir / "journal.sqlite")
    replans = [json.loads(d) for _, kind, _, d in j.events() if kind == "replan"]
    jobs = {r.id: r for r in j.jobs()}
    adapters = {a["id"]: a for a in j.adapters()}
    j.close()
    assert replans and replans[0]["drift"] > 2
    # the jobs said how long their steps took, so the re-plan learned their fixed overhead apart
    summaries = [json.loads(p.read_text()) for p in (prep.run_dir / "jobs").glob("*/summary.json")]
    assert summaries and all(s["step_time_s"] > 0 and s["first_step_s"] > 0 for s in summaries)
    assert replans[0]["overhead_s"] is not None and replans[0]["overhead_s"] > 0
    # and the cached profile keeps what the sweep measured, for the next sweep's first plan
    assert Profile.load(cached).cost_model.job_overhead_s > 0
    assert all(jobs[old].status == "replanned" for old in replans[0]["old"])
    assert all(jobs[new].status == "finished" for new in replans[-1]["new"])
    ran = [a for job, members in launches(prep.run_dir) for a in members]
    assert sorted(ran) == sorted(adapters)  # every adapter launched exactly once
    assert all(a["attempts"] == 1 for a in adapters.values())


def test_a_replan_that_cannot_be_made_keeps_the_plan_and_the_sweep_finishes(tmp_path, monkeypatch):
    """A re-plan the planner refuses (on a GPU: an adapter that fits no GPU by what was
    measured) is a note and a journal event, tried again only after `REPLAN_RETRY_S`; the
    jobs planned before run, every adapter once."""
    import plora.sweep as sweep_module
    from plora.cost.profiling.cache import sweep_cache_path
    from plora.cost.profiling.record import Profile
    from plora.planner.errors import PlannerError

    spec = load_spec(space(tmp_path, per_job=1))
    wrong = prepare(spec).cost_model.scaled(0.01).with_meta(plan_source="a cost model 100x too fast")
    Profile(wrong, [], [], {"model": "test"}).save(sweep_cache_path(spec))
    prep = prepare(spec, cost_model=wrong)
    write_run_files(prep)

    def refuse(*args, **kwargs):
        raise PlannerError("adapter a-x (rank 2, batch size 2) fits at no TP degree <= 1 GPUs")

    monkeypatch.setattr(sweep_module, "planned", refuse)  # the first plan is made: only re-plans refuse
    frame = run_prepared(prep, slots=["cpu:0"])
    assert set(frame.status) == {"done"} and len(frame) == 4
    j = Journal(prep.run_dir / "journal.sqlite")
    kinds = [kind for _, kind, _, _ in j.events()]
    jobs = {r.id: r for r in j.jobs()}
    adapters = j.adapters()
    j.close()
    assert kinds.count("replan_failed") == 1 and "replan" not in kinds  # the jobs end before a retry is due
    assert sorted(jobs) == sorted(job.id for job in prep.plan.jobs)
    assert all(r.status == "finished" for r in jobs.values())
    assert all(a["attempts"] == 1 for a in adapters)


def test_jobs_get_the_gpus_the_sweep_sees():
    """Under CUDA_VISIBLE_DEVICES=2,3 the pool's GPU 0 is the machine's GPU 2."""
    from plora.engine.local import visible_gpu_ids

    assert visible_gpu_ids([0, 1], None) == ["0", "1"]
    assert visible_gpu_ids([1], "") == ["1"]
    assert visible_gpu_ids([0], "2,3") == ["2"]
    assert visible_gpu_ids([0, 1], "GPU-a, GPU-b") == ["GPU-a", "GPU-b"]
    with pytest.raises(ValueError, match="not among"):
        visible_gpu_ids([2], "2,3")


def test_replan_corrects_step_time_and_job_overhead_apart():
    """Jobs that spend 20 s outside their steps and run their steps as predicted: the
    re-plan keeps the step coefficients and learns the 20 s overhead (one factor for both
    would make every step 3x slower, and packing look no better than running alone)."""
    from plora.cost.model import AdapterLoad, CostModel, MemoryCoeffs, TimeCoeffs
    from plora.engine.runner import Drift
    from plora.cost.sweep_model import recalibrated

    cm = CostModel(80 * 2**30, 256, {1: TimeCoeffs(0.1, 1e-5, 0.0, 0.0, 0.0)},
                   {1: MemoryCoeffs(2**30, 0.0, 0.0, 0.0, 0.0)})
    drift = Drift()
    for _ in range(3):
        drift.add(wall_s=30.0, predicted_s=10.0, step_s=10.0)
    assert drift.factor == pytest.approx(3.0) and drift.overhead_s == pytest.approx(20.0)
    fixed = recalibrated(cm, drift)
    assert fixed.job_overhead_s == pytest.approx(20.0)
    assert fixed.time[1].c0 == pytest.approx(0.1) and fixed.time[1].c_tok == pytest.approx(1e-5)
    job = [AdapterLoad("a", 8, 4, 100)]
    assert fixed.job_time(job, 1) == pytest.approx(cm.job_time(job, 1) + 20.0)

    blind = Drift()  # a job without the steps' share: every time scales by the whole drift
    blind.add(wall_s=30.0, predicted_s=10.0, step_s=None)
    assert blind.overhead_s is None
    assert recalibrated(cm, blind).time[1].c0 == pytest.approx(0.3)
