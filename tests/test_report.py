"""The report: `plora report RUN` executes the notebook headless and writes report.html with
its plots as embedded images; sections degrade to a note when their data is missing. Also:
a finished sweep is recorded as an Optuna study."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import optuna
import pandas as pd
import pytest
import yaml
from optuna.trial import TrialState
from typer.testing import CliRunner

from conftest import tiny_space
from plora.results import report as R
from plora.cli import app
from plora.planner.plan import Plan
from plora.spec.loading import parse_spec
from plora.spec.model import ASSETS_DIR

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    """A tiny finished sweep (3 adapters, 2 jobs, intermediate evals), made once per module."""
    from plora.sweep import prepare, run_prepared, write_run_files

    tmp = tmp_path_factory.mktemp("report")
    if (ASSETS_DIR / "tiny-llama" / "config.json").is_file():
        model = "builtin:tiny-llama"
    else:  # a checkout without the shipped demo model
        from conftest import make_tiny_llama

        model = str(make_tiny_llama(tmp / "tiny-llama"))
    spec = parse_spec(tiny_space(
        tmp, name="demo", model_path=model,
        data={"task": "builtin:shift", "num_train": 64, "num_eval": 16, "max_eval_samples": 16},
        space={"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
            {"rank": 4, "alpha": 4, "learning_rate": 3e-3, "batch_size": 8},
            {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]},
        training={"steps": 8}, eval={"max_new_tokens": 8, "every_steps": 2}, planner={"max_adapters_per_job": 2}))
    prep = prepare(spec)
    write_run_files(prep)
    frame = run_prepared(prep)
    assert set(frame.status) == {"done"}
    return prep.run_dir


def test_report_writes_html_with_rendered_plots(demo_run):
    result = runner.invoke(app, ["report", str(demo_run)], terminal_width=200)
    assert result.exit_code == 0, result.output
    html = (demo_run / "report.html").read_text()
    # score vs hyperparameters, best/worst/base, curves, Gantt, makespan, study: as PNGs
    assert html.count("data:image/png;base64,") >= 6 and "<img" in html
    assert "could not be drawn" not in html and "Traceback" not in html
    best = R.load_run(demo_run).done().iloc[0]["adapter_id"]
    assert f"Best configuration:</strong> <code>{best}</code>" in html
    assert "over the base model" in html
    assert "No cost-model predictions" not in html  # the planner's predicted times are plotted
    assert (demo_run / "report.ipynb").is_file()  # the executed notebook, to dig further


def test_report_errors_are_one_line(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert result.exit_code == 2 and result.output.strip().startswith("error:")
    assert len(result.output.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["report", str(empty)])
    assert result.exit_code == 2 and "results.parquet" in result.output


def test_notebook_is_shipped_in_the_package():
    repo, packaged = REPO / "notebooks" / "report.ipynb", REPO / "plora" / "assets" / "report.ipynb"
    assert packaged.is_symlink() and packaged.resolve() == repo.resolve()  # one notebook, installed through a link
    assert R.notebook_path().resolve() == repo.resolve()
    nb = json.loads(repo.read_text())
    params = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1 and R.RUN_DIR_ENV in "".join(params[0]["source"])
    assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")  # stored clean


def test_sections_from_a_run(demo_run):
    run = R.load_run(demo_run)
    assert run.objective == "exact_match" and not run.minimize
    planned = {j.id for j in Plan.load(demo_run / "plan.json").jobs}
    assert set(run.jobs["job_id"]) == planned and (run.jobs["source"] == "journal").all()
    assert all(lanes[0].startswith("cpu:") for lanes in run.jobs["lanes"])  # the slots the engine used
    assert len(run.eval_curves) == 3 * 3  # steps 2, 4, 6 of 3 adapters
    table = R.results_table(run)
    assert list(table["#"]) == [1, 2, 3] and table.iloc[0]["adapter_id"] == run.done().iloc[0]["adapter_id"]
    assert "Best configuration" in R.summary(run)
    for plot in (R.plot_score_vs_hyperparameters, R.plot_best_worst_base, R.plot_learning_curves, R.plot_gantt,
                 R.plot_makespan, R.plot_study, R.plot_cost_model):
        assert R.figure_png(plot(run)).startswith(b"\x89PNG")


def test_plan_predictions_and_profile_are_plotted(demo_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(demo_run, run_dir)
    plan = Plan.load(run_dir / "plan.json")
    replace(plan, jobs=[replace(j, start=0.0, end=5.0 + i, gpus=[i]) for i, j in enumerate(plan.jobs)], makespan=6.0,
            lower_bound=4.0, baselines={"min_gpu": 9.0, "sequential": 11.0}).save(run_dir / "plan.json")
    model = {"gpu_memory_bytes": 8e9, "seq_len": 48,
             "time": {"1": {"c0": 0.01, "c_tok": 2e-5, "c_rtok": 1e-6, "c_ad": 1e-3}},
             "memory": {"1": {"base": 1e8, "adapter": 1e5, "rank": 1e4, "tok": 1e3, "rank_tok": 10.0}}}
    (run_dir / "profile.json").write_text(json.dumps({"cost_model": model, "measurements": []}))
    run = R.load_run(run_dir)
    assert run.jobs["planned_end"].notna().all()
    points = R.cost_model_points(run)
    assert points[["predicted_step_s", "measured_step_s", "predicted_job_s", "measured_job_s"]].notna().all().all()
    assert {"planned (predicted)", "baseline: min_gpu (predicted)", "measured (this run)"} <= set(R.makespan_values(run))
    for plot in (R.plot_gantt, R.plot_makespan, R.plot_cost_model):
        assert R.figure_png(plot(run)).startswith(b"\x89PNG")


def test_sections_degrade_without_their_data(demo_run, tmp_path):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    for name in ("results.parquet", "spec.yaml"):
        shutil.copy(demo_run / name, run_dir / name)
    run = R.load_run(run_dir)
    assert "no base_metrics.json" in R.summary(run)
    assert R.figure_png(R.plot_score_vs_hyperparameters(run))
    for plot, note in ((R.plot_gantt, "No job timings"), (R.plot_learning_curves, "No per-step metrics"),
                       (R.plot_makespan, "No job timings"), (R.plot_study, "No Optuna study")):
        with pytest.raises(R.Missing, match=note):
            plot(run)
    # jobs without the engine's journal: times from the recipe's own summary
    shutil.copytree(demo_run / "jobs", run_dir / "jobs")
    run = R.load_run(run_dir)
    assert (run.jobs["source"] == "recipe").all() and all(ls[0].startswith("slot") for ls in run.jobs["lanes"])
    assert R.figure_png(R.plot_gantt(run))


def test_sweep_is_an_optuna_study(demo_run):
    from plora.tuning.study import record_sweep
    from plora.sweep import collect_results, prepare

    spec = parse_spec(yaml.safe_load((demo_run / "spec.yaml").read_text()))
    study = optuna.load_study(study_name="demo", storage=f"sqlite:///{demo_run / 'study.sqlite'}")
    trials = study.get_trials()
    planned = {j.id for j in Plan.load(demo_run / "plan.json").jobs}
    assert len(trials) == 3 and {t.state for t in trials} == {TrialState.COMPLETE}
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE  # exact match
    for t in trials:
        a = t.user_attrs
        assert t.value == a["eval_exact_match"] and a["job_id"] in planned and a["tp"] == 1
        assert set(t.params) == {"rank", "alpha", "learning_rate", "batch_size"}
        assert (Path(a["checkpoint_path"]) / "adapter_config.json").is_file()
        # intermediate values are the objective (exact match on the intermediate eval rows), as evals.jsonl has it
        assert sorted(t.intermediate_values) == [2, 4, 6] and all(0 <= v <= 1 for v in t.intermediate_values.values())
        evals = [json.loads(x) for x in (demo_run / "jobs" / a["job_id"] / "evals.jsonl").read_text().splitlines()]
        assert t.intermediate_values == {e["adapter_step"]: e["eval_exact_match"] for e in evals
                                         if e["adapter"] == a["adapter_id"]}
    # recording the same results again adds nothing
    prep = prepare(spec, demo_run)
    record_sweep(prep.spec, prep.run_dir, prep.configs, prep.plan, collect_results(prep))
    assert len(optuna.load_study(study_name="demo", storage=f"sqlite:///{demo_run / 'study.sqlite'}").trials) == 3


# --------------------------------------------------------------------------- best score against GPU time


def _tune_history(run: Path, strategy: str, points: list[tuple[float, float]]) -> Path:
    """A run directory with a tune history of (GPU-seconds, value) trials told in order."""
    from plora.tuning.budget import HISTORY_COLUMNS, HISTORY_FILE

    run.mkdir(parents=True, exist_ok=True)
    best = None
    lines = [",".join(HISTORY_COLUMNS)]
    for i, (gpu, value) in enumerate(points):
        best = value if best is None else min(best, value)
        lines.append(f"{strategy},{i},complete,{value},{best},{gpu},{gpu}")
    (run / HISTORY_FILE).write_text("\n".join(lines) + "\n")
    return run


def test_best_score_against_gpu_seconds_one_curve_per_strategy(demo_run, tmp_path):
    with pytest.raises(R.Missing, match="tune history"):
        R.plot_best_vs_gpu_seconds(R.load_run(demo_run))  # a sweep records none
    runs = tmp_path / "space-runs"
    tpe = _tune_history(runs / "tpe", "tpe + hyperband async", [(10, 3.0), (25, 2.5), (40, 2.7)])
    rnd = _tune_history(runs / "random", "random loop", [(20, 3.2), (40, 2.9)])
    run = R.load_run(demo_run, compare=[tpe, rnd])
    assert sorted(run.tune_history["run"].unique()) == ["random", "tpe"]
    ax = R.plot_best_vs_gpu_seconds(run).axes[0]
    labels = {line.get_label() for line in ax.get_lines()}
    assert labels - {"base model"} == {"random loop", "tpe + hyperband async"}
    [tpe_line] = [line for line in ax.get_lines() if line.get_label() == "tpe + hyperband async"]
    assert list(tpe_line.get_ydata()) == [3.0, 2.5, 2.5]  # the best so far, not each trial's value
    # a folder of runs reads each subfolder's history; two runs of one strategy are two curves
    _tune_history(runs / "random-seed1", "random loop", [(15, 3.1)])
    folder = R.load_run(runs)
    assert len(folder.tune_history) == 6
    labels = {line.get_label() for line in R.plot_best_vs_gpu_seconds(folder).axes[0].get_lines()}
    assert {"random loop (random)", "random loop (random-seed1)", "tpe + hyperband async"} <= labels


def test_report_draws_the_curves_of_the_runs_given(demo_run, tmp_path):
    runs = tmp_path / "space-runs"
    tpe = _tune_history(runs / "tpe", "tpe async", [(10, 3.0), (25, 2.5)])
    rnd = _tune_history(runs / "random", "random loop", [(20, 3.2)])
    out = tmp_path / "compared.html"
    result = runner.invoke(app, ["report", str(demo_run), str(tpe), str(rnd), "-o", str(out)], terminal_width=200)
    assert result.exit_code == 0, result.output
    html = out.read_text()
    assert "Best score found against GPU time" in html and "No tune history" not in html
    assert "could not be drawn" not in html
    alone = demo_run / "report.html"
    if alone.is_file():  # the run by itself: the section says there is no history
        assert html.count("data:image/png;base64,") == alone.read_text().count("data:image/png;base64,") + 1
    # a folder of runs, without results of its own: the report is that plot
    result = runner.invoke(app, ["report", str(runs)], terminal_width=200)
    assert result.exit_code == 0, result.output
    folder = (runs / "report.html").read_text()
    assert folder.count("data:image/png;base64,") >= 1 and "No tune history" not in folder
    missing = runner.invoke(app, ["report", str(demo_run), str(tmp_path / "nope")])
    assert missing.exit_code == 2 and missing.output.strip().startswith("error:")


def test_report_ranks_a_lower_is_better_user_metric_lowest_first(tmp_path):
    """``eval.greater_is_better: false`` on a user metric: the report's best adapter is the
    one with the lowest score, whatever the metric's name."""
    run_dir = tmp_path / "lower"
    run_dir.mkdir()
    (run_dir / "spec.yaml").write_text(yaml.safe_dump({
        "name": "lower", "eval": {"metrics": ["loss", "mymetrics:edit_distance"], "objective": "edit_distance",
                                  "greater_is_better": False}}))
    pd.DataFrame({"adapter_id": ["a", "b", "c"], "status": ["done"] * 3, "rank": [2, 4, 8],
                  "eval_edit_distance": [3.0, 1.0, 2.0], "eval_loss": [1.0, 1.0, 1.0]}).to_parquet(
        run_dir / "results.parquet", index=False)
    run = R.load_run(run_dir)
    assert run.minimize and list(run.done()["adapter_id"]) == ["b", "c", "a"]
    (run_dir / "spec.yaml").write_text(yaml.safe_dump({
        "name": "lower", "eval": {"metrics": ["loss", "mymetrics:edit_distance"], "objective": "edit_distance",
                                  "greater_is_better": True}}))
    assert list(R.load_run(run_dir).done()["adapter_id"]) == ["a", "c", "b"]
