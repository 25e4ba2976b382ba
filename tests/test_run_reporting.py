"""What a sweep or a tune tells its user while it runs and after (issue 46): counts that
agree with each other, a run directory that holds one space at a time, progress in a log,
numbers shown as the user knows them.

Each test drives the `plora` command as a user does (typer's CliRunner, whose output is not
a terminal), or the function that renders a line where a real run would be too slow.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import optuna

from typer.testing import CliRunner

from plora.cli import app
from test_new_user import one_error_line, write_space

runner = CliRunner()


# --------------------------------------------------------------------------- JSON errors


def test_json_errors_name_the_position_once(tmp_path, tiny_model):
    train = tmp_path / "train.jsonl"
    train.write_text('{"input": "abc+", "output": "bca"}\n{"input": "abc+", "output": "bca}\n')
    text = one_error_line(runner.invoke(app, ["sweep", str(write_space(tmp_path, data={"train": str(train)}))]))
    assert "train.jsonl line 2: not valid JSON (Unterminated string starting at column 29)" in text, text

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "config.json").write_text('{"model_type": "llama", "name": "tiny}')
    space = write_space(tmp_path, "m.yaml", model={"path": str(model), "max_seq_len": 48})
    text = one_error_line(runner.invoke(app, ["sweep", str(space)]))
    assert "config.json: not valid JSON (Unterminated string starting at line 1 column 33)" in text, text


# --------------------------------------------------------------------------- one space per run directory


def test_a_run_directory_resumes_only_its_own_space(tmp_path):
    """Another space into the same run directory is refused (what differs, what to do), and
    nothing of the run changes; the same space, its configurations in another order,
    resumes and trains nothing again."""
    configs = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
               {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 4}]
    space = write_space(tmp_path, training={"steps": 2}, eval={"metrics": ["loss"]})
    assert runner.invoke(app, ["sweep", str(space)]).exit_code == 0
    run = tmp_path / "runs" / "t"
    before = {p: p.read_bytes() for p in (run / "spec.yaml", run / "configs.parquet", run / "results.parquet")}

    ranks = write_space(tmp_path, "ranks.yaml", training={"steps": 2}, eval={"metrics": ["loss"]},
                        space={"strategy": "list", "configs": [{**c, "rank": 8} for c in configs]})
    text = one_error_line(runner.invoke(app, ["sweep", str(ranks)]))
    assert f"{run} holds a sweep of another space (space.configs: " in text, text
    assert text.endswith("start over there with --restart, or choose another run directory with -o"), text
    steps = write_space(tmp_path, "steps.yaml", training={"steps": 3}, eval={"metrics": ["loss"]})
    assert "(training.steps: 2 there, 3 here)" in one_error_line(runner.invoke(app, ["sweep", str(steps)]))
    assert {p: p.read_bytes() for p in before} == before
    status = runner.invoke(app, ["status", str(run)])
    assert status.exit_code == 0 and "adapters: done 2" in status.output, status.output

    reordered = write_space(tmp_path, "reordered.yaml", training={"steps": 2}, eval={"metrics": ["loss"]},
                            space={"strategy": "list", "configs": configs[::-1]})
    again = runner.invoke(app, ["sweep", str(reordered)])
    assert again.exit_code == 0, again.output
    assert "started" not in again.output and "adapters 2/2 finished (done 2, diverged 0, failed 0)" in again.output


# --------------------------------------------------------------------------- progress in a log


def test_a_log_shows_each_job_progressing(tmp_path, monkeypatch):
    """Off a terminal, a running job gets a progress line every PLORA_LOG_PROGRESS_S seconds
    between its start and finish lines (a SmolLM2 job on CPU said nothing for 4 minutes)."""
    monkeypatch.setenv("PLORA_LOG_PROGRESS_S", "0")  # at every engine tick
    space = write_space(tmp_path, space={"strategy": "list", "configs": [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4}]}, training={"steps": 300},
        eval={"metrics": ["loss"]})
    result = runner.invoke(app, ["sweep", str(space)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    started = next(i for i, ln in enumerate(lines) if re.fullmatch(r"\d\d:\d\d:\d\d started job-000 .*", ln))
    finished = next(i for i, ln in enumerate(lines) if re.fullmatch(r"\d\d:\d\d:\d\d finished job-000", ln))
    progress = re.compile(r"\d\d:\d\d:\d\d job-000: adapter steps (\d+)/300 \(\d+%\), adapters 0/1 finished, "
                          r"loss [\d.]+, \S+ elapsed, ETA \S+")
    steps = [int(m.group(1)) for ln in lines[started + 1:finished] if (m := progress.fullmatch(ln))]
    assert steps and 0 < steps[0] < 300, result.output


# --------------------------------------------------------------------------- numbers that agree


def test_adapters_finished_inside_a_running_job_are_counted_at_once(tmp_path, monkeypatch):
    """The adapters line counts an adapter when its job has written its result, as the
    job's own progress does, not when the whole job exits ("adapters 0/16 finished" while
    the jobs table showed 8 done)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # one slot: both adapters in one job
    space = write_space(tmp_path, data={"task": "builtin:shift", "num_train": 400, "num_eval": 4},
                        space={"strategy": "list", "configs": [
                            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 16},
                            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 1}]},
                        training={"epochs": 1}, eval={"metrics": ["loss"]})
    result = runner.invoke(app, ["sweep", str(space)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert sum(bool(re.fullmatch(r"\d\d:\d\d:\d\d started job-\d+ .*", ln)) for ln in lines) == 1, result.output
    one = lines.index("adapters 1/2 finished (done 1, diverged 0, failed 0)")
    assert one < next(i for i, ln in enumerate(lines) if re.fullmatch(r"\d\d:\d\d:\d\d finished job-000", ln))


# --------------------------------------------------------------------------- a tune's numbers, named


def test_an_asynchronous_tune_has_no_batches_and_names_its_objective(tmp_path):
    space = write_space(tmp_path, training={"steps": 2}, eval={"metrics": ["loss"]})
    result = runner.invoke(app, ["tune", str(space), "--sampler", "random", "--trials", "2", "--batch", "2",
                                 "--async"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert not [ln for ln in lines if ln.startswith("batch ")] and "batch #" not in result.output, result.output
    assert any(ln.startswith("asynchronous run: 2 trials, 2 adapters trained in ") for ln in lines), result.output
    told = [ln for ln in lines if ln.startswith("trial ")]
    assert len(told) == 2 and all(re.fullmatch(r"trial \d: complete, eval_loss [\d.]+ \(a-\w+, 2 steps in b01-job-\d+\)",
                                               ln) for ln in told), told
    assert "┃ eval_loss ┃" in result.output and "trials: complete 2 — " in result.output


def test_a_pruned_trial_shows_the_objective_it_was_pruned_on(tmp_path):
    """Optuna keeps a pruned trial's last intermediate value, the objective scored on the
    intermediate eval rows: the line shows it, named, and the share of its budget it had seen."""
    from plora import views
    from plora.spec.loading import load_spec
    from plora.tuning.loop import BatchReport

    spec = load_spec(write_space(tmp_path))  # eval.objective: exact_match
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    for k, v in {"adapter_id": "a-1", "steps": 17, "job_id": "b01-job-000"}.items():
        trial.set_user_attr(k, v)
    trial.report(0.125, 333)  # resource: the per-mille of its budget seen (`plora.tuning.fidelity`)
    study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    done = study.ask()
    done.set_user_attr("adapter_id", "a-2")
    study.tell(done, 0.25)
    pruned, complete = study.get_trials(deepcopy=False)
    assert pruned.value == 0.125
    assert views.trial_line(pruned, spec) == ("trial 0: pruned, eval_exact_match 0.125 at 33.3% of its budget "
                                              "(a-1, 17 steps in b01-job-000)")
    report = BatchReport(1, [pruned, complete], ["a-1", "a-2"], [], ["a-1"], ["b01-job-000"], 3.0, complete)
    assert views.batch_line(report, spec) == ("batch 1: 2 trials, 2 adapters trained in 1 job, 1 pruned; batch best "
                                              "eval_exact_match 0.25; best so far eval_exact_match 0.25 (trial 1) — 3 s")
    assert views.trials_line(study, 3.0, "t", "sqlite://").startswith("trials: complete 1, pruned 1 — ")


def test_pruned_adapters_are_counted_with_the_finished():
    import io

    from rich.console import Console

    from plora.engine.runner import EngineSnapshot
    from plora.views import EventLog

    out = io.StringIO()
    log = EventLog(Console(file=out, width=200), lambda snap: 10)
    log(EngineSnapshot([], [], {"done": 7, "pruned": 3}, 1.0, None, []))
    assert out.getvalue().splitlines() == ["adapters 10/10 finished (done 7, diverged 0, pruned 3, failed 0)"]


def test_a_resumed_adapter_counts_the_time_of_every_attempt(tmp_path, monkeypatch):
    """An adapter whose job crashed and resumed from its checkpoint shows the time of both
    attempts, not only the last one's (2.4 s of about 31 s)."""
    import pandas as pd

    from conftest import inject_fault
    from fault_hooks import SLOW_S

    inject_fault(monkeypatch, "slow@job-000@1@1,crash@job-000@3@1")  # attempt 1: a slow step, then a crash
    space = write_space(tmp_path, space={"strategy": "list", "configs": [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4}]},
        training={"steps": 6, "checkpoint_every_steps": 1}, eval={"metrics": ["loss"]})
    result = runner.invoke(app, ["sweep", str(space)])
    assert result.exit_code == 0 and "job-000 crashed (exit 1); retry 1/2" in result.output, result.output
    run = tmp_path / "runs" / "t"
    rows = [json.loads(ln) for ln in (run / "jobs" / "job-000" / "metrics.jsonl").read_text().splitlines()]
    assert {r["attempt"] for r in rows} == {1, 2} and min(r["step"] for r in rows if r["attempt"] == 2) > 0
    last_attempt = max(r["time"] for r in rows if r["attempt"] == 2)
    wall = float(pd.read_parquet(run / "results.parquet").wall_time_s.iloc[0])
    assert wall >= SLOW_S + last_attempt, (wall, last_attempt)
    row = next(ln for ln in result.output.splitlines() if ln.startswith("│ a-"))
    assert row.rstrip(" │").endswith(f"{wall:.1f}"), row
