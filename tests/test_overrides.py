"""``key=value`` overrides of the space file on the command line (`plora.spec.overrides`): applied
before validation, validated like the file, shown in the run's spec.yaml."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from plora.cli import app
from plora.spec.overrides import OverrideError, apply_overrides
from plora.planner.plan import Plan
from test_cli import small_space

runner = CliRunner()


def test_values_are_read_as_yaml_and_applied_in_order():
    data = {"name": "t", "model": None, "training": {"epochs": 1}}
    out = apply_overrides(data, ["training.epochs=2", "space.rank=[8,16]", "model.path=builtin:tiny-llama",
                                 "planner.streaming=true", "training.warmup_ratio=0.1", "training.epochs=3",
                                 "eval.objective="])
    assert out == {"name": "t", "model": {"path": "builtin:tiny-llama"}, "space": {"rank": [8, 16]},
                   "training": {"epochs": 3, "warmup_ratio": 0.1}, "planner": {"streaming": True},
                   "eval": {"objective": None}}
    assert data == {"name": "t", "model": None, "training": {"epochs": 1}}  # the loaded file is left as it was
    with pytest.raises(OverrideError, match="is not key=value"):
        apply_overrides(data, ["training.epochs"])
    with pytest.raises(OverrideError, match="is a value, not a section"):
        apply_overrides(data, ["training.epochs.low=1"])


@pytest.mark.parametrize("command", ["sweep", "plan", "profile", "tune"])
@pytest.mark.parametrize(
    "override, error",
    [
        ("training.epoch=2", "error: training.epoch: unknown field (did you mean 'epochs'?)"),
        ("space.rank=[0]", "error: space.rank: must be positive integers, got [0]"),
        ("training.epochs=-1", "error: training.epochs: input should be greater than 0, got -1"),
        ("space.rank=[8,16", "error: space.rank: invalid YAML value '[8,16'"),
        ("training.epochs.low=1", "error: training.epochs.low: training.epochs is a value, not a section"),
        ("lora.dropout.rate=1", "error: lora.dropout: input should be a valid number"),
        ("training.epochs", "error: override: 'training.epochs' is not key=value"),
        ("spaec.rank=[4]", "error: spaec: unknown field (did you mean 'space'?)"),
    ],
)
def test_a_bad_override_is_one_line_exit_2_nothing_written(tmp_path, command, override, error):
    result = runner.invoke(app, [command, str(small_space(tmp_path)), override], terminal_width=200)
    assert result.exit_code == 2, result.output
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith(error), text
    assert "Traceback" not in text
    assert not (tmp_path / "runs").exists()


def test_plan_follows_the_overrides(tmp_path):
    space = small_space(tmp_path)
    result = runner.invoke(app, ["plan", str(space), "name=other", "planner.max_adapters_per_job=1",
                                 "training.steps=3", "training.epochs=null"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "runs" / "t").exists()
    plan = Plan.load(tmp_path / "runs" / "other" / "plan.json")
    assert len(plan.jobs) == 3 and all(len(j.adapters) == 1 for j in plan.jobs)
    assert yaml.safe_load(space.read_text())["planner"]["max_adapters_per_job"] == 2  # the file is not changed


def test_a_sweep_run_directory_shows_the_overridden_values(swept_run):
    from conftest import SWEPT_OVERRIDES

    assert "training.steps=6" in SWEPT_OVERRIDES
    resolved = yaml.safe_load((swept_run.run / "spec.yaml").read_text())
    assert resolved["training"]["steps"] == 6 and resolved["training"]["epochs"] is None
    assert resolved["eval"]["every_steps"] == 3 and resolved["planner"]["max_adapters_per_job"] == 2
    assert yaml.safe_load(swept_run.space.read_text())["training"] == {"epochs": 1}
    import pandas as pd

    assert set(pd.read_parquet(swept_run.run / "results.parquet").steps) == {6}
