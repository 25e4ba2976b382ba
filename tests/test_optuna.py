"""Optuna integration: the search space, a TPE-driven `plora tune` whose second batch is
proposed from the first's results, the study re-opened from its storage, and pruning that
stops one adapter of a pack without changing the others."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
import yaml
from optuna.distributions import (
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_space
from plora.cli import app
from plora.planner.plan import Plan
from plora.spec.adapter import AdapterConfig
from plora.spec.loading import parse_spec
from plora.spec.model import ASSETS_DIR
from plora.tuning import base as tbase
from plora.tuning import loop as tloop
from plora.tuning import samplers as tsamp
from plora.tuning import space as tspace
from plora.tuning import study as tstudy

runner = CliRunner()


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    """The shipped demo model; a random tiny Llama where the checkout has none."""
    if (ASSETS_DIR / "tiny-llama" / "config.json").is_file():
        return "builtin:tiny-llama"
    from conftest import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def space(tmp_path: Path, model: str, **over) -> dict:
    defaults = {
        "data": {"task": "builtin:shift", "num_train": 64, "num_eval": 16, "max_eval_samples": 16},
        "space": {"strategy": "random", "num_samples": 6, "seed": 0, "rank": [2, 4, 8],
                  "alpha": {"relative": [1, 2]}, "learning_rate": {"low": 1e-4, "high": 3e-2, "log": True},
                  "batch_size": [4, 8]},
        "training": {"steps": 8},
        "eval": {"metrics": ["loss", "exact_match"], "max_new_tokens": 8, "objective": "loss"},
        "planner": {"max_adapters_per_job": 4},
    }
    return tiny_space(tmp_path, name="tune", model_path=model, **{**defaults, **over})


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


# --------------------------------------------------------------------------- search space


def fake_model(tmp_path: Path) -> str:
    """Enough of a model folder for the space file to validate (nothing here loads it)."""
    d = tmp_path / "fake-model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return str(d)


def test_search_space_from_the_space_file(tmp_path):
    data = space(tmp_path, fake_model(tmp_path))
    data["space"] = {"strategy": "grid", "rank": [2, 4, 8], "alpha": {"relative": [1, 2]},
                     "learning_rate": {"low": 1e-4, "high": 3e-2, "log": True, "num": 2},
                     "batch_size": {"low": 4, "high": 16, "log": True, "num": 2}}
    spec = parse_spec(data)
    s = tspace.search_space(spec)
    assert s["rank"] == CategoricalDistribution([2, 4, 8])
    assert s["alpha_factor"] == CategoricalDistribution([1.0, 2.0])
    assert s["learning_rate"] == FloatDistribution(1e-4, 3e-2, log=True)
    assert s["batch_size"] == IntDistribution(4, 16, log=True)
    cfg = tspace.config_from_params(spec, {"rank": 4, "alpha_factor": 2.0, "learning_rate": 1e-3, "batch_size": 8})
    assert cfg == AdapterConfig.make(4, 8.0, 1e-3, 8, spec.space.seed)
    params, dists = tspace.params_of(spec, cfg)
    assert params == {"rank": 4, "alpha_factor": 2.0, "learning_rate": 1e-3, "batch_size": 8}
    assert tspace.config_from_params(spec, params) == cfg and set(dists) == set(params)
    # the grid sampler walks the grid points of the space
    assert tspace.grid_values(spec)["learning_rate"] == [1e-4, 3e-2]
    assert tspace.grid_values(spec)["batch_size"] == [4, 16]


def test_list_space_is_categorical_and_absolute_alpha(tmp_path, demo_model):
    data = space(tmp_path, demo_model, space={"strategy": "list", "configs": [
        {"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 8}]})
    spec = parse_spec(data)
    s = tspace.search_space(spec)
    assert s["alpha"] == CategoricalDistribution([4.0, 16.0]) and "alpha_factor" not in s
    study = optuna.create_study(direction="minimize")
    assert tspace.enqueue_configs(study, spec, [c.model_dump() for c in spec.space.configs]) == 2
    assert tspace.enqueue_configs(study, spec, [spec.space.configs[0].model_dump()]) == 0  # already queued
    with pytest.raises(tbase.TuneError, match="outside the search space"):
        tspace.enqueue_configs(study, spec, [{"rank": 3, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4}])


def test_adapter_status_to_trial_state(tmp_path):
    spec = parse_spec(space(tmp_path, fake_model(tmp_path)))  # objective: loss
    row = {"status": "done", "eval_loss": 1.5, "eval_exact_match": 0.5}
    assert tstudy._state_and_value(row, spec) == (TrialState.COMPLETE, 1.5)
    assert tstudy._state_and_value({**row, "status": "diverged"}, spec) == (TrialState.FAIL, None)
    assert tstudy._state_and_value({**row, "status": "failed"}, spec) == (TrialState.FAIL, None)
    assert tstudy._state_and_value({**row, "status": "pruned"}, spec) == (TrialState.PRUNED, None)
    assert tstudy._state_and_value({"status": "done", "eval_loss": float("nan")}, spec)[0] == TrialState.FAIL
    assert tstudy.intermediate_sign(spec) == 1.0
    assert tstudy.intermediate_sign(parse_spec({**space(tmp_path, fake_model(tmp_path)),
                                            "eval": {"objective": "exact_match"}})) == -1.0


def test_bad_requests_are_one_line_errors(tmp_path, demo_model):
    path = write(tmp_path, space(tmp_path, demo_model))
    bad = runner.invoke(app, ["tune", str(path), "--sampler", "nope"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines()[-1].startswith("error: unknown sampler 'nope'")
    # pruning needs no eval.every_steps: adapters are scored at the pruner's rungs
    tloop.check_tune_request(parse_spec(yaml.safe_load(path.read_text())), sampler="tpe", trials=2, batch=None,
                             pruner="median")
    with pytest.raises(tbase.TuneError, match="unknown pruner"):
        tsamp.make_pruner("sometimes")


# --------------------------------------------------------------------------- TPE, batches, storage


def _replay_batch2(spec, batch1: list, values: list, k: int) -> list[dict]:
    """Ask batch 1 again from a fresh sampler of the same seed, tell it `values`, and return
    the params the sampler proposes next: what `plora tune` would have trained in batch 2."""
    study = optuna.create_study(direction="minimize", sampler=tsamp.make_sampler("tpe", spec, n_startup_trials=k))
    dist = tspace.search_space(spec)
    asked = [study.ask(dist) for _ in range(k)]
    assert [t.params for t in asked] == [t.params for t in batch1]  # the same seeded first batch
    for t, v in zip(asked, values):
        study.tell(t, v)
    return [study.ask(dist).params for _ in range(k)]


def test_tpe_tune_second_batch_depends_on_first(tmp_path, demo_model):
    path = write(tmp_path, space(tmp_path, demo_model))
    result = runner.invoke(app, ["tune", str(path), "--sampler", "tpe", "--trials", "6", "--batch", "3"],
                           terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "batch 1:" in result.output and "batch 2:" in result.output
    run = tmp_path / "runs" / "tune"

    # the study re-opens from its storage with every trial and its record
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{run / 'study.sqlite'}")
    trials = study.get_trials()
    assert len(trials) == 6 and all(t.state == TrialState.COMPLETE for t in trials)
    assert [t.user_attrs["batch"] for t in trials] == [1, 1, 1, 2, 2, 2]
    spec = parse_spec(yaml.safe_load(path.read_text()))
    frame = pd.read_parquet(run / "results.parquet").set_index("adapter_id")
    for t in trials:
        a = t.user_attrs
        assert a["adapter_id"] == tspace.config_from_params(spec, t.params).id
        assert a["job_id"].startswith(f"b0{a['batch']}-job-") and a["tp"] == 1 and a["status"] == "done"
        assert (Path(a["checkpoint_path"]) / "adapter_model.safetensors").is_file()
        assert t.value == pytest.approx(frame.loc[a["adapter_id"], "eval_loss"])
    assert len(frame) == len({t.user_attrs["adapter_id"] for t in trials})
    plan = Plan.load(run / "plan.json")  # every batch's jobs, each batch with its own predictions
    assert {plan.batch_of()[j.id] for j in plan.jobs} == {1, 2} and {b["batch"] for b in plan.batches} == {1, 2}
    assert all(b["makespan"] > 0 for b in plan.batches) and len(plan.adapters) == len(frame)
    assert all(plan.job_of()[a] == frame.loc[a, "job_id"] for a in frame.index)
    for job_dir in (run / "jobs").iterdir():  # batches: no job lingers, none is sent joins
        assert yaml.safe_load((job_dir / "job.yaml").read_text())["streaming"]["linger_s"] == 0
        assert not (job_dir / "control.json").exists() and not (job_dir / "joins.jsonl").exists()

    # batch 2 came from the model fitted on batch 1: replaying batch 1 with its real values
    # proposes exactly batch 2, and with the values reversed proposes something else
    batch1, batch2 = trials[:3], trials[3:]
    real = [t.value for t in batch1]
    assert _replay_batch2(spec, batch1, real, 3) == [t.params for t in batch2]
    flipped = [sorted(real)[::-1][sorted(real).index(v)] for v in real]
    assert _replay_batch2(spec, batch1, flipped, 3) != [t.params for t in batch2]

    # re-running continues the study; a config already trained is told its result, not retrained
    jobs_before = sorted(p.name for p in (run / "jobs").iterdir())
    best = study.best_trial
    study.enqueue_trial(best.params)  # as if the sampler proposed it again
    again = tloop.run_tune(spec, trials=1, batch=1)
    assert len(again.trials) == 7
    last = again.trials[-1]
    assert last.params == best.params and last.value == best.value and last.user_attrs["batch"] == 3
    assert sorted(p.name for p in (run / "jobs").iterdir()) == jobs_before


# --------------------------------------------------------------------------- pruning


class PruneOne(optuna.pruners.BasePruner):
    """Prunes the trial of one learning rate as soon as it has reported an intermediate value."""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = learning_rate
        self.calls = 0

    def prune(self, study, trial) -> bool:
        self.calls += 1
        return trial.params.get("learning_rate") == self.learning_rate and trial.last_step is not None


#: three adapters of one batch size, for the pruning tests (the pruners pick one by its lr)
PRUNE_CONFIGS = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
                 {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 4},
                 {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]


def test_pruned_adapter_stops_early_and_the_others_are_unchanged(tmp_path, demo_model):
    from plora.train.packed_lora import PackedLoRARecipe

    # The pruner's verdict reaches the job through the engine's poll (every 0.25 s); the
    # budget leaves it seconds to land, however fast this machine trains.
    budget, every = 480, 40
    data = space(tmp_path, demo_model, space={"strategy": "list", "configs": PRUNE_CONFIGS},
                 training={"steps": budget}, eval={"metrics": ["loss"], "objective": "loss", "every_steps": every})
    spec = parse_spec(data)
    pruner = PruneOne(3e-3)
    study = tloop.run_tune(spec, pruner=pruner, batch=3)
    run = spec.run_dir()

    by_lr = {t.params["learning_rate"]: t for t in study.trials}
    pruned = by_lr[3e-3]
    assert pruned.state == TrialState.PRUNED and pruned.user_attrs["status"] == "pruned"
    assert every <= pruned.user_attrs["steps"] < budget
    assert pruned.intermediate_values  # what the pruner decided on
    for lr in (1e-2, 1e-3):
        t = by_lr[lr]
        assert t.state == TrialState.COMPLETE and t.user_attrs["steps"] == budget
        assert len(t.intermediate_values) == _scored(spec, budget, every)
    job = pruned.user_attrs["job_id"]
    assert json.loads((run / "jobs" / job / "control.json").read_text())["prune"] == [
        pruned.user_attrs["adapter_id"]]

    # the same jobs without pruning, in-process: every other adapter comes out the same
    ref = tmp_path / "reference"
    for job_dir in sorted((run / "jobs").glob("b01-*")):
        cfg = yaml.safe_load((job_dir / "job.yaml").read_text())
        cfg.update(output_dir=str(ref), job_dir=str(ref / "jobs" / job_dir.name), eval_base=False)
        PackedLoRARecipe(cfg).run()
    for lr in (1e-2, 1e-3):
        a = by_lr[lr].user_attrs["adapter_id"]
        got = load_file(run / "adapters" / a / "adapter_model.safetensors")
        want = load_file(ref / "adapters" / a / "adapter_model.safetensors")
        assert got.keys() == want.keys()
        for k in got:
            torch.testing.assert_close(got[k], want[k], atol=2e-6, rtol=0)


def _scored(spec, budget: int, every: int) -> int:
    """Evals of an adapter of ``budget`` steps: every ``every`` steps and at the pruner's rungs."""
    from plora.tuning.fidelity import Rungs

    return len(set(range(every, budget, every)) | set(Rungs.of(spec).eval_steps(budget)))


# --------------------------------------------------------------------------- asynchronous tuning


def _rows(job_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (job_dir / "metrics.jsonl").read_text().splitlines()]


def test_async_tune_records_every_trial_once(tmp_path, demo_model):
    """--async: 5 trials, 2 at a time, each told as soon as its adapter finishes and the next
    one sent into the job it left; study, results, journal and plan hold each trial once."""
    from plora.engine.journal import Journal
    from plora.job.control import read_joins

    path = write(tmp_path, space(tmp_path, demo_model))
    result = runner.invoke(app, ["tune", str(path), "--sampler", "random", "--trials", "5", "--batch", "2",
                                 "--async"], terminal_width=200)
    assert result.exit_code == 0, result.output
    told = [line for line in result.output.splitlines() if line.startswith("trial ") and ": complete, " in line]
    assert len(told) == 5 and "asynchronous run: 5 trials" in result.output  # a line per trial as it is told
    run = tmp_path / "runs" / "tune"
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{run / 'study.sqlite'}")
    trials = study.get_trials()
    assert len(trials) == 5 and all(t.state == TrialState.COMPLETE for t in trials)
    spec = parse_spec(yaml.safe_load(path.read_text()))
    frame = pd.read_parquet(run / "results.parquet").set_index("adapter_id")
    ids = [t.user_attrs["adapter_id"] for t in trials]
    assert len(set(ids)) == 5 and sorted(frame.index) == sorted(ids)
    plan = Plan.load(run / "plan.json")
    journal = Journal(run / "journal.sqlite")
    try:
        status = {r["id"]: r for r in journal.adapters()}
    finally:
        journal.close()
    jobs = sorted({t.user_attrs["job_id"] for t in trials})
    assert len(jobs) <= 2 and all(j.startswith("b01-job-") for j in jobs)  # one long-lived job per slot
    for t in trials:
        a = t.user_attrs
        assert a["adapter_id"] == tspace.config_from_params(spec, t.params).id and a["batch"] == 1
        assert a["status"] == "done" and a["steps"] == 8 and a["tp"] == 1
        assert t.value == pytest.approx(frame.loc[a["adapter_id"], "eval_loss"])
        assert status[a["adapter_id"]]["status"] == "done" and status[a["adapter_id"]]["job_id"] == a["job_id"]
        assert plan.job_of()[a["adapter_id"]] == a["job_id"]
    joined = [r.adapter.id for j in jobs for r in read_joins(run / "jobs" / j) if r.refused is None]
    assert len(joined) == 5 - sum(len(yaml.safe_load((run / "jobs" / j / "job.yaml").read_text())["adapters"])
                                  for j in jobs)
    assert sorted(joined) == sorted(set(joined)) and len(joined) >= 3
    assert [b["batch"] for b in plan.batches] == [1] and plan.batches[0]["trials"] == [t.number for t in trials]
    for j in jobs:  # closed once every trial was asked, long before their linger ran out
        assert json.loads((run / "jobs" / j / "control.json").read_text())["close"] is True


class PruneFirst(optuna.pruners.BasePruner):
    """Prunes trial 0 as soon as it has reported an intermediate value."""

    def prune(self, study, trial) -> bool:
        return trial.number == 0 and trial.last_step is not None


def test_async_tune_fills_a_pruned_slot_at_once(tmp_path, demo_model):
    """Two trials train in one job; trial 0 is pruned and trial 2 takes its slot at the very
    step boundary where trial 0 leaves (the prune and the join are one control.json write)."""
    from plora.job.control import read_joins

    budget, every = 240, 20
    data = space(tmp_path, demo_model, space={"strategy": "list", "configs": PRUNE_CONFIGS},
                 training={"steps": budget}, eval={"metrics": ["loss"], "objective": "loss", "every_steps": every})
    spec = parse_spec(data)
    told = []
    study = tloop.run_tune(spec, pruner=PruneFirst(), batch=2, slots=["cpu:0"], asynchronous=True,
                           on_trial=told.append)
    run = spec.run_dir()
    trials = study.get_trials()
    assert len(trials) == 3 and sorted(t.number for t in told) == [0, 1, 2]
    first, second, third = trials
    assert first.state == TrialState.PRUNED and first.user_attrs["status"] == "pruned"
    assert every <= first.user_attrs["steps"] < budget and first.intermediate_values
    for t in (second, third):
        assert t.state == TrialState.COMPLETE and t.user_attrs["steps"] == budget
        assert len(t.intermediate_values) == _scored(spec, budget, every)
    assert told[0].number == 0  # told before the others finished
    job = first.user_attrs["job_id"]
    assert {t.user_attrs["job_id"] for t in trials} == {job}
    job_dir = run / "jobs" / job
    control = json.loads((job_dir / "control.json").read_text())
    assert control["prune"] == [first.user_attrs["adapter_id"]]
    [join] = read_joins(job_dir)
    assert join.adapter.id == third.user_attrs["adapter_id"] and join.refused is None
    rows = _rows(job_dir)
    pruned_last = max(r["step"] for r in rows if r["adapter"] == first.user_attrs["adapter_id"])
    joined_first = min(r["step"] for r in rows if r["adapter"] == join.adapter.id)
    assert join.job_step == joined_first and joined_first <= pruned_last + 2


def test_async_tune_joins_a_trial_only_where_the_cost_model_says_it_fits(tmp_path, demo_model):
    """--async with 2 trials in flight in one job, but a cost model whose GPU holds one
    adapter: the second trial waits for the first to leave instead of joining beside it,
    no step ever trains two adapters, and every trial is told once."""
    from conftest import cost_model_holding
    from plora.job.control import read_joins

    spec = parse_spec(space(tmp_path, demo_model))
    told = []
    study = tloop.run_tune(spec, sampler="random", trials=3, batch=2, slots=["cpu:0"], asynchronous=True,
                           on_trial=told.append, cost_model=cost_model_holding(1))
    trials = study.get_trials()
    assert len(trials) == 3 and all(t.state == TrialState.COMPLETE for t in trials)
    assert sorted(t.number for t in told) == [0, 1, 2]
    [job] = {t.user_attrs["job_id"] for t in trials}
    job_dir = spec.run_dir() / "jobs" / job
    assert len(yaml.safe_load((job_dir / "job.yaml").read_text())["adapters"]) == 1  # the second trial waited
    rows = _rows(job_dir)
    at_step: dict[int, set] = {}
    for r in rows:
        at_step.setdefault(r["step"], set()).add(r["adapter"])
    assert max(len(a) for a in at_step.values()) == 1
    joins = [r for r in read_joins(job_dir) if r.refused is None]
    assert [r.adapter.id for r in joins] == [t.user_attrs["adapter_id"] for t in trials[1:]]
    for r in joins:  # each joined once the adapter before it had left
        assert r.job_step == 1 + max(row["step"] for row in rows if row["adapter"] != r.adapter.id
                                     and row["step"] < r.job_step)
    frame = pd.read_parquet(spec.run_dir() / "results.parquet")
    assert sorted(frame.adapter_id) == sorted(t.user_attrs["adapter_id"] for t in trials)
