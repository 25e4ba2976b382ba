"""The job config: one typed model built by the sweep, written as job.yaml, read by the job;
and the hooks through which tests look into (or break) a job."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import yaml
from omegaconf import OmegaConf
from pydantic import ValidationError

from conftest import job_config
from plora.train import hooks
from plora.job.config import JobConfig


def _sweep_job(tmp_path, **training):
    from plora.spec.adapter import AdapterConfig
    from plora.spec.loading import parse_spec
    from plora.planner.plan import Job
    from plora.job.from_spec import job_config as sweep_job_config

    spec = parse_spec({"name": "j", "hardware": {"device": "cpu"}, "training": {"steps": 30, **training}})
    adapters = [AdapterConfig.make(4, 8.0, 1e-3, 2, 0), AdapterConfig.make(8, 16.0, 3e-3, 4, 1)]
    job = Job("job-000", [a.id for a in adapters])
    return spec, sweep_job_config(spec, job, adapters, {a.id: 30 for a in adapters}, tmp_path, eval_base=True)


def test_the_sweeps_job_config_round_trips_through_job_yaml(tmp_path):
    spec, cfg = _sweep_job(tmp_path, warmup_ratio=0.1, scheduler="cosine")
    path = cfg.write(tmp_path / "job.yaml")
    again = JobConfig.load(path)
    assert again == cfg
    assert JobConfig.parse(OmegaConf.load(path)) == cfg  # what `tune run` hands the recipe
    raw = yaml.safe_load(path.read_text())
    # every setting is written out, so job.yaml says what the job does without its defaults
    assert raw["training"]["checkpoint_every_steps"] == spec.training.checkpoint_every_steps
    assert [a["warmup_steps"] for a in raw["adapters"]] == [spec.training.warmup_for(30)] * 2 == [3, 3]
    assert raw["job_dir"] == str(tmp_path / "jobs" / "job-000") and raw["eval_base"] is True
    assert "warmup_ratio" not in raw["training"]  # computed once, by the sweep


@pytest.mark.parametrize("path, key", [((), "learning_rte"), (("training",), "grad_clipp"),
                                       (("adapters", 0), "sed"), (("eval",), "metric")])
def test_a_typo_in_a_job_file_is_an_error(tiny_model, reverse_data, tmp_path, path, key):
    cfg = job_config(tiny_model, reverse_data, tmp_path, [dict(id="a", rank=2, alpha=4.0, learning_rate=1e-3,
                                                                batch_size=2, seed=0, steps=3)])
    JobConfig.parse(cfg)
    where = cfg
    for p in path:
        where = where[p]
    where[key] = 1
    with pytest.raises(ValidationError, match=key):
        JobConfig.parse(cfg)


def test_job_dir_defaults_under_the_run_directory(tiny_model, reverse_data, tmp_path):
    cfg = JobConfig.parse(job_config(tiny_model, reverse_data, tmp_path, [dict(
        id="a", rank=2, alpha=4.0, learning_rate=1e-3, batch_size=2, seed=0, steps=3)]))
    assert cfg.job_dir == tmp_path / "jobs" / "job-test"


def test_a_job_whose_config_does_not_validate_fails_as_unfixable(tmp_path):
    """The engine fails such a job's adapters at once (exit 4 and error.json) instead of
    retrying what would fail the same way."""
    from plora.job.outputs import ERROR_FILE as UNFIXABLE_FILE, EXIT_UNFIXABLE
    from plora.train.packed_lora import recipe_main

    _, cfg = _sweep_job(tmp_path)
    raw = cfg.to_dict()
    raw["training"]["schedular"] = "linear"
    with pytest.raises(SystemExit) as exit_:
        recipe_main(OmegaConf.create(raw))
    assert exit_.value.code == EXIT_UNFIXABLE
    message = json.loads((cfg.job_dir / UNFIXABLE_FILE).read_text())["error"]
    assert "training.schedular" in message


def test_hooks_fire_only_while_installed():
    seen = []
    hooks.fire("after_step", recipe=None, step=0)
    with hooks.installed("after_step", lambda recipe, step: seen.append(step)):
        hooks.fire("after_step", recipe=None, step=1)
    hooks.fire("after_step", recipe=None, step=2)
    assert seen == [1]


def test_hooks_named_in_the_environment_are_loaded_once(tmp_path, monkeypatch):
    module = tmp_path / "my_hooks.py"
    module.write_text(textwrap.dedent("""
        from plora.train import hooks
        SEEN = []
        hooks.register("probe_event", lambda **kw: SEEN.append(kw))
    """))
    monkeypatch.setenv(hooks.ENV, str(module))
    calls = []
    try:
        hooks.load_env_hooks()
        hooks.load_env_hooks()  # a second call installs nothing twice
        with hooks.installed("probe_event", lambda **kw: calls.append(kw)):
            hooks.fire("probe_event", step=3)
        assert calls == [{"step": 3}]
        assert len(hooks._hooks["probe_event"]) == 1
    finally:
        hooks._hooks.pop("probe_event", None)
        hooks._loaded.discard(str(module))
        sys.modules.pop("_plora_hooks_my_hooks", None)
