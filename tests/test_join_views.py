"""Adapters that join running jobs, as the report and the views show them: each adapter's
own span in its job (a joined one from the step it joined at), the joins of each job in
`plora status` and the live view, and a queued job emptied by streaming not drawn as a job
that ran."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from conftest import run_streamed_sweep
from plora.results import report as R
from plora import views
from plora.cli import app
from plora.engine.journal import Journal
from plora.job.control import read_joins

runner = CliRunner()


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """planner.streaming on one CPU slot, two planned jobs: job-001's adapter joins job-000
    once an adapter of job-000 has left, and job-001 never runs (as in test_join)."""
    prep, frame = run_streamed_sweep(tmp_path_factory.mktemp("joinview"))
    ids = [c.id for c in prep.configs]
    assert set(frame.status) == {"done"}
    [record] = read_joins(prep.run_dir / "jobs" / "job-000")
    assert record.adapter.id == ids[2]
    return prep.run_dir, ids


def test_report_spans_show_the_joined_adapter_from_its_join(streamed_run):
    run_dir, (first, second, joined) = streamed_run
    run = R.load_run(run_dir)
    assert list(run.jobs["job_id"]) == ["job-000"]  # job-001 was streamed: it never ran
    assert run.streamed == {"job-001": "job-000"}
    job = run.jobs.iloc[0]
    spans = run.adapter_spans.set_index("adapter")
    assert set(spans.index) == {first, second, joined} and set(spans["job_id"]) == {"job-000"}
    assert not spans.loc[first, "joined"] and not spans.loc[second, "joined"]
    assert spans.loc[first, "start"] == spans.loc[second, "start"] == job["start"]
    summary = json.loads((run_dir / "jobs" / "job-000" / "summary.json").read_text())
    assert spans.loc[joined, "joined"] and spans.loc[joined, "joined_step"] == summary["joined"][joined]
    assert spans.loc[joined, "start"] > job["start"]
    # it joined after an adapter of the job had finished, and trained until the job's end
    assert spans.loc[joined, "start"] >= min(spans.loc[first, "end"], spans.loc[second, "end"]) - 0.05
    assert (spans["end"] <= job["end"] + 1e-6).all() and (spans["end"] > spans["start"]).all()
    assert (spans["status"] == "done").all()
    assert all(lanes == ["cpu:0"] for lanes in spans["lanes"])
    assert R.figure_png(R.plot_adapter_gantt(run)).startswith(b"\x89PNG")
    assert R.figure_png(R.plot_gantt(run)).startswith(b"\x89PNG")
    assert set(R.cost_model_points(run)["job_id"]) == {"job-000"}


def test_spans_without_joins_jsonl_come_from_summary_and_metrics(streamed_run, tmp_path):
    """A run directory without joins.jsonl (or the journal): the joined step of summary.json
    and the step times of metrics.jsonl place the join."""
    run_dir, (_, _, joined) = streamed_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    full = R.load_run(copy).adapter_spans.set_index("adapter")
    (copy / "jobs" / "job-000" / "joins.jsonl").unlink()
    spans = R.load_run(copy).adapter_spans.set_index("adapter")
    assert spans.loc[joined, "joined"]
    assert spans.loc[joined, "start"] == pytest.approx(full.loc[joined, "start"], abs=1.0)
    (copy / "journal.sqlite").unlink()
    run = R.load_run(copy)
    assert (run.jobs["source"] == "recipe").all() and not run.streamed
    assert set(run.jobs["job_id"]) == {"job-000"}  # job-001 has no summary or progress: it never ran
    spans = run.adapter_spans.set_index("adapter")
    assert spans.loc[joined, "joined"] and spans.loc[joined, "start"] > run.jobs.iloc[0]["start"]
    assert R.figure_png(R.plot_adapter_gantt(run)).startswith(b"\x89PNG")


def test_status_shows_joins_and_the_streamed_job(streamed_run):
    run_dir, _ = streamed_run
    result = runner.invoke(app, ["status", str(run_dir)], terminal_width=250)
    assert result.exit_code == 0, result.output
    line = next(ln for ln in result.output.splitlines() if "job-000" in ln and "finished" in ln)
    assert "1 joined" in line
    streamed = next(ln for ln in result.output.splitlines() if "job-001" in ln)
    assert "streamed" in streamed and "joined job-000" in streamed


def test_status_shows_a_running_jobs_waiting_joins_and_linger(streamed_run, tmp_path):
    run_dir, _ = streamed_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    journal = Journal(copy / "journal.sqlite")
    try:
        journal.update_job("job-000", status="running", ended=None, returncode=None)
    finally:
        journal.close()
    progress_path = copy / "jobs" / "job-000" / "progress.json"
    progress = json.loads(progress_path.read_text())
    progress.update(adapters_joined=2, joins_waiting=3, lingering=True, final=False)
    progress_path.write_text(json.dumps(progress))
    console = Console(width=250, record=True)
    for part in views.status_tables(copy):
        console.print(part)
    line = next(ln for ln in console.export_text().splitlines() if "job-000" in ln)
    assert "2 joined, 3 waiting, lingering" in line


def test_live_view_shows_joins_per_running_job():
    progress = {"adapter_steps_done": 5, "adapter_steps_total": 20, "adapters_finished": 1, "elapsed_s": 4.0,
                "adapters_joined": 1, "joins_waiting": 2, "lingering": False}
    rj = SimpleNamespace(job=SimpleNamespace(id="job-007", adapters=["a", "b", "c"]), slots=["cuda:0"],
                         proc=SimpleNamespace(progress=lambda: progress))
    snapshot = SimpleNamespace(running=[rj], queued=[], adapter_status={"running": 3}, elapsed_s=4.0,
                               predicted_makespan_s=None, events=[])
    console = Console(width=200, record=True)
    console.print(views.live_view(snapshot, 3))
    line = next(ln for ln in console.export_text().splitlines() if "job-007" in ln)
    assert "1 joined, 2 waiting" in line
    assert views.joins_note({"adapters_joined": 0, "joins_waiting": 0, "lingering": True}, running=True) == "lingering"
    assert views.joins_note({"lingering": True, "joins_waiting": 1}, running=False) == "—"


def test_report_html_draws_the_adapter_gantt(streamed_run, tmp_path):
    run_dir, _ = streamed_run
    out = tmp_path / "report.html"
    result = runner.invoke(app, ["report", str(run_dir), "-o", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "Adapters per job" in html and "could not be drawn" not in html and "Traceback" not in html


def test_an_adapter_an_earlier_attempt_finished_has_no_span_in_the_relaunch(streamed_run, tmp_path):
    run_dir, (_, second, joined) = streamed_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    progress_path = copy / "jobs" / "job-000" / "progress.json"
    progress_path.write_text(json.dumps({**json.loads(progress_path.read_text()), "attempt": 2}))
    for a in (second, joined):  # the relaunch finished these two
        path = copy / "adapters" / a / "metrics.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "attempt": 2}))
    spans = R.load_run(copy).adapter_spans.set_index("adapter")
    assert set(spans.index) == {second, joined}
    assert (spans["status"] == "done").all()
