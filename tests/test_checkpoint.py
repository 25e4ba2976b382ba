"""Mid-job checkpoints: a job SIGKILLed mid-way resumes from its last checkpoint, and its
adapters equal those of an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import inject_fault, tiny_space_file
from plora.engine.journal import Journal
from plora.planner.plan import Job, Plan
from plora.spec.loading import load_spec
from plora.sweep import prepare, run_prepared, write_run_files

CONFIGS = [
    {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
    {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 2},
]


def prepared(tmp_path: Path, every_steps: int = 5):
    path = tiny_space_file(
        tmp_path, name="ck", space={"strategy": "list", "configs": CONFIGS},
        training={"steps": 20, "scheduler": "cosine", "warmup_steps": 3, "weight_decay": 0.01,
                  "checkpoint_every_steps": every_steps, "checkpoint_every_minutes": None},
        eval={"max_new_tokens": 2, "metrics": ["loss"]})
    prep = prepare(load_spec(path))
    prep.plan = Plan([Job("job-000", [c.id for c in prep.configs])], grouping="one job for the test")
    write_run_files(prep)
    return prep


def test_spec_checkpoint_settings_are_validated(tmp_path):
    from plora.spec.loading import parse_spec

    with pytest.raises(ValueError, match="checkpoint_every_steps"):
        parse_spec({"name": "x", "training": {"checkpoint_every_steps": 0}})
    spec = parse_spec({"name": "x"})
    assert spec.training.checkpoint_every_steps and spec.training.checkpoint_every_minutes


def test_sigkilled_job_resumes_from_its_checkpoint_and_matches_an_uninterrupted_run(tmp_path, monkeypatch):
    """The job is SIGKILLed at step 12 (checkpoints at 5 and 10); the engine relaunches it,
    it goes on from step 10, and the adapters equal a run that was never interrupted."""
    inject_fault(monkeypatch, "kill@job-000@12@1")
    prep = prepared(tmp_path)
    frame = run_prepared(prep, slots=["cpu:0"])
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]
    run = prep.run_dir
    job_dir = run / "jobs" / "job-000"

    journal = Journal(run / "journal.sqlite")
    assert journal.job("job-000").attempt == 2 and journal.job("job-000").status == "finished"
    journal.close()
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["resumed_from"] == {c.id: 10 for c in prep.configs}
    progress = json.loads((job_dir / "progress.json").read_text())
    assert progress["resumed_step"] == 10 and progress["attempt"] == 2
    assert not (job_dir / "checkpoint" / "state.rank0.pt").exists()  # every adapter finished: dropped

    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    first = [r["adapter_step"] for r in rows if r["attempt"] == 1 and r["adapter"] == prep.configs[0].id]
    second = [r["adapter_step"] for r in rows if r["attempt"] == 2 and r["adapter"] == prep.configs[0].id]
    # the log is flushed with each checkpoint; steps 10-12 were trained twice, nothing else
    assert first[:10] == list(range(10)) and set(first) <= set(range(13)) and second == list(range(10, 20))

    # the same job, uninterrupted, in this process
    from plora.train.packed_lora import PackedLoRARecipe

    cfg = yaml.safe_load((job_dir / "job.yaml").read_text())
    ref_dir = tmp_path / "ref"
    cfg.update(output_dir=str(ref_dir), job_dir=str(ref_dir / "jobs" / "job-000"), eval_base=False)
    cfg["training"]["checkpoint_every_steps"] = None
    PackedLoRARecipe(cfg).run()
    for c in prep.configs:
        got = load_file(run / "adapters" / c.id / "adapter_model.safetensors")
        want = load_file(ref_dir / "adapters" / c.id / "adapter_model.safetensors")
        assert got.keys() == want.keys()
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5)
        m = json.loads((run / "adapters" / c.id / "metrics.json").read_text())
        assert m["steps"] == 20 and m["attempt"] == 2

    from plora.cli import app

    out = CliRunner().invoke(app, ["status", str(run)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "resumed at" in out.output and "step 10" in out.output


def test_a_checkpoint_of_other_training_settings_is_not_resumed(tmp_path):
    """A changed spec (another learning-rate schedule) must not pick up old states."""
    from plora.job.config import JobConfig
    from plora.train.checkpoint import fingerprint

    base = {"job_id": "j", "output_dir": "out", "seed": 0, "model": {"path": "m", "max_seq_len": 64},
            "data": {"task": "t"}, "lora": {"targets": ["q_proj"]},
            "adapters": [{"id": "a", "rank": 2, "alpha": 4.0, "learning_rate": 1e-3, "batch_size": 2, "seed": 0,
                          "steps": 10}],
            "training": {"scheduler": "cosine", "checkpoint_every_steps": 5}}
    same = json.loads(json.dumps(base))
    same["training"]["checkpoint_every_steps"] = 50  # how often to save changes nothing learned
    same["adapters"][0]["id"] = "b"  # the pack is not the fingerprint's: adapters are matched one by one
    other = json.loads(json.dumps(base))
    other["training"]["scheduler"] = "linear"
    fp = [fingerprint(JobConfig.parse(c)) for c in (base, same, other)]
    assert fp[0] == fp[1] != fp[2]


def test_sigterm_saves_a_checkpoint_at_the_end_of_the_step_and_stops(tmp_path):
    """How the engine stops jobs on Ctrl-C: the job saves where it is and exits 143; the
    next attempt resumes from that step, not from the last periodic checkpoint."""
    import signal
    import time

    from plora.engine.local import launch
    from plora.job.outputs import EXIT_STOPPED
    from plora.job.from_spec import job_config

    prep = prepared(tmp_path, every_steps=1000)  # no periodic checkpoint before the signal
    prep.spec.training.steps = 400
    job = Job("job-000", [c.id for c in prep.configs])
    job_dir = prep.run_dir / "jobs" / "job-000"
    job_dir.mkdir(parents=True, exist_ok=True)
    job_config(prep.spec, job, prep.configs, {c.id: 400 for c in prep.configs}, prep.run_dir,
               eval_base=False).write(job_dir / "job.yaml")
    proc = launch("job-000", job_dir, "cpu:0", extra_env={"PLORA_ATTEMPT": "1"})
    deadline = time.time() + 120
    while time.time() < deadline and proc.proc.poll() is None:
        try:
            if json.loads((job_dir / "progress.json").read_text())["step"] >= 5:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.05)
    proc.signal(signal.SIGTERM)
    assert proc.proc.wait(timeout=60) == EXIT_STOPPED, (job_dir / "log.txt").read_text()[-2000:]
    proc.log.close()
    state = torch.load(job_dir / "checkpoint" / "state.rank0.pt", weights_only=True)
    assert 5 <= state["job_step"] < 400
    assert {a["step"] for a in state["adapters"].values()} == {state["job_step"]}
    assert not list((prep.run_dir / "adapters").glob("*/metrics.json"))  # nothing reported finished
