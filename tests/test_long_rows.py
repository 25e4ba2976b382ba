"""Long rows (``model.max_seq_len`` up to 8k) and ``training.activation_checkpointing: auto``:
the sweep turns activation checkpointing on only where an adapter fits a GPU with it and not
without it (shape-only, on the analytic memory model); a short CPU job of 8k-token rows runs
on the padding-free path."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from conftest import assert_training_value_refused
from plora.hardware import Hardware

GIB = 2**30


def _space(tmp_path: Path, seq: int, checkpointing, **training) -> Path:
    data = {"name": "long", "model": {"path": "shape:qwen2.5-0.5b", "max_seq_len": seq},
            "data": {"task": "builtin:shift", "num_train": 64, "num_eval": 4}, "lora": {"targets": "all-linear"},
            "space": {"strategy": "grid", "rank": [16], "alpha": [32], "learning_rate": [1e-4], "batch_size": [1, 2]},
            "training": {"epochs": 1, "activation_checkpointing": checkpointing, **training},
            "eval": {"metrics": ["loss"]}, "hardware": {"device": "cuda", "gpus": 1},
            "output": {"dir": str(tmp_path / "runs")}}
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _resolved(path: Path, gib: float, gpu: bool = True):
    from plora.spec.loading import load_spec
    from plora.sweep import resolve_checkpointing

    spec = load_spec(path)
    configs = spec.expand()
    return spec, resolve_checkpointing(spec, configs, {c.id: 4 for c in configs},
                                       Hardware(gpu, 1, int(gib * GIB), local=False))


def test_the_default_is_off_and_auto_is_accepted(tmp_path):
    from plora.spec.loading import load_spec

    from conftest import tiny_space, write_space

    spec = load_spec(write_space(tmp_path / "s.yaml", tiny_space(tmp_path)))
    assert spec.training.activation_checkpointing is False and not spec.training.checkpointing
    auto = load_spec(_space(tmp_path, 8192, "auto"))
    assert auto.model.max_seq_len == 8192
    assert auto.training.activation_checkpointing == "auto" and not auto.training.checkpointing


@pytest.mark.parametrize("value", ["sometimes", 2])
def test_a_bad_activation_checkpointing_is_one_line_naming_the_field(tmp_path, value):
    assert_training_value_refused(tmp_path, "activation_checkpointing", value)


@pytest.mark.parametrize("gib, want", [(24, True), (80, False), (12, False)])
def test_auto_is_on_only_where_it_makes_an_adapter_fit(tmp_path, gib, want):
    """8k-token rows of the 0.5B shape: one row fits 80 GiB without checkpointing (off: the
    step stays fast), 24 GiB only with it (on), 12 GiB with neither (off: it buys nothing)."""
    spec, resolved = _resolved(_space(tmp_path, 8192, "auto"), gib)
    assert resolved.training.activation_checkpointing is want
    assert resolved.training.checkpointing is want


def test_a_users_setting_and_the_cpu_are_left_alone(tmp_path):
    spec, resolved = _resolved(_space(tmp_path, 8192, False), 24)
    assert resolved is spec
    _, on_cpu = _resolved(_space(tmp_path, 8192, "auto"), 24, gpu=False)
    assert on_cpu.training.activation_checkpointing is False


def test_auto_reaches_the_plan_and_the_jobs(tmp_path):
    """Prepared on a 24 GiB GPU, the sweep plans with the checkpointed memory model and every
    job config says so; spec.yaml holds the decision."""
    from plora.job.from_spec import job_config
    from plora.spec.loading import load_spec
    from plora.sweep import prepare

    prep = prepare(load_spec(_space(tmp_path, 8192, "auto")), hardware=Hardware(True, 1, 24 * GIB, local=False))
    assert prep.spec.training.activation_checkpointing is True
    assert prep.cost_model.meta.get("activation_checkpointing") in (True, None)
    by_id = {a.id: a for a in prep.plan.adapters}
    for job in prep.plan.jobs:
        assert prep.cost_model.fits([by_id[a] for a in job.adapters], job.tp, prep.plan.load_factor)
        cfg = job_config(prep.spec, job, [c for c in prep.configs if c.id in job.adapters], prep.steps,
                         tmp_path / "runs", eval_base=False)
        assert cfg.training.activation_checkpointing is True
    assert "activation_checkpointing: true" in prep.spec.to_yaml()


def test_a_job_of_8k_token_rows_runs_on_the_cpu(tiny_model, tmp_path):
    """One packed step of two adapters, one 8192-token row each, rows flattened without
    padding, with activation checkpointing (seconds on the tiny model)."""
    from plora.job.synthetic import synthetic_job_config
    from plora.train.packed_lora import PackedLoRARecipe

    start = time.time()
    cfg = synthetic_job_config("long", tiny_model, [(2, 1), (4, 1)], seq_len=8192, dtype="float32", device="cpu",
                               targets=["q_proj", "v_proj"], output_dir=tmp_path, steps=1, num_samples=2,
                               num_threads=1, activation_checkpointing=True)
    recipe = PackedLoRARecipe(cfg.model_dump(mode="json"))
    summary = recipe.run()
    assert summary["adapters"] == {"long-0": "done", "long-1": "done"}
    assert recipe.stepper.real_tokens == recipe.stepper.stepped_tokens == 2 * 8192  # no padding
    assert time.time() - start < 120


@pytest.mark.slow
def test_bench_long_rows_smoke(tmp_path, monkeypatch):
    """The benchmark's plumbing on the CPU (tiny model, short rows): both parts report."""
    import importlib.util
    import json
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_long_rows.py"
    monkeypatch.syspath_prepend(str(script.parent))
    spec = importlib.util.spec_from_file_location("bench_long_rows", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["bench_long_rows.py", "--smoke", "--out", str(tmp_path)])
    bench.main()
    result = json.loads((tmp_path / "long_rows.json").read_text())
    assert result["rows"]["long_over_short"] > 0
    assert result["sweep"]["exit_code"] == 0 and result["sweep"]["oom_jobs"] == 0
    assert "| rows | long / short |" in (tmp_path / "long_rows.md").read_text()


def test_the_user_is_told_auto_turned_it_on(tmp_path):
    from plora.spec.loading import load_spec
    from plora.sweep import memory_notes, prepare

    spec = load_spec(_space(tmp_path, 8192, "auto"))
    prep = prepare(spec, hardware=Hardware(True, 1, 24 * GIB, local=False))
    assert any("activation checkpointing on" in n for n in memory_notes(spec, prep))
