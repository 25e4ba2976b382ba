"""`plora tune` on a resource that compares across configurations, with a GPU-time budget:
rungs at the same fractions of every adapter's budget whatever its batch size, a pruned
adapter's slot taken at the step it leaves, a budget that stops asking trials (and lets
the running ones finish or prunes them), and the (GPU-seconds, best so far) history."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from typer.testing import CliRunner

from plora.cli import app
from plora.spec.loading import parse_spec
from plora.tuning import loop as tloop
from plora.tuning import samplers as tsamp
from plora.tuning.base import TuneError
from plora.tuning.budget import HISTORY_FILE, SUMMARY_FILE, Budget, GpuClock, parse_gpu_budget
from plora.tuning.fidelity import UNITS, PatientRungs, Rungs
from test_optuna import demo_model  # noqa: F401 - the shared fixture
from test_optuna import space as optuna_space

runner = CliRunner()

BS2_BS4 = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 2},
           {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 4}]


def space(tmp_path: Path, model: str, **over) -> dict:
    """`test_optuna`'s space, scored by the loss alone (no generation: faster tunes)."""
    return optuna_space(tmp_path, model, **{"eval": {"metrics": ["loss"], "objective": "loss"}, **over})


class Never(optuna.pruners.BasePruner):
    """A pruner that records every report and stops nothing."""

    def prune(self, study, trial) -> bool:
        return False


# --------------------------------------------------------------------------- rungs


def test_rungs_sit_at_the_same_fractions_for_every_batch_size():
    rungs = Rungs(111, 3)
    assert rungs.units == [111, 333, 999]
    for total in (9, 18, 27, 32, 64, 100, 1000, 3000):
        steps = rungs.eval_steps(total)
        assert steps == sorted(set(steps)) and all(0 < s < total for s in steps)
        for s, u in zip(steps, [u for u in rungs.units if -(-u * total // UNITS) < total]):
            assert s / total >= u / UNITS and (s - 1) / total < u / UNITS  # the first step past the rung
            assert rungs.resource(s, total) == u
    # batch 2 and batch 4 over the same rows: twice the steps, the same rungs reported
    assert [rungs.resource(s, 64) for s in rungs.eval_steps(64)] == [rungs.resource(s, 32) for s in rungs.eval_steps(32)]
    assert rungs.resource(64, 64) == UNITS and rungs.resource(5, 64) == 5 * UNITS // 64


def test_pruner_settings_come_from_the_space_file(tmp_path, demo_model):
    spec = parse_spec(space(tmp_path, demo_model, optuna={"pruner": {"min_fraction": 0.1, "reduction_factor": 2}}))
    rungs = Rungs.of(spec)
    assert rungs.units == [100, 200, 400, 800] and rungs.min_peers == 2
    sha = tsamp.make_pruner("successive-halving", rungs)
    assert isinstance(sha, PatientRungs)
    assert sha.wrapped._min_resource == 100 and sha.wrapped._reduction_factor == 2
    hb = tsamp.make_pruner("hyperband", rungs).wrapped
    assert hb._min_resource == 100 and hb._max_resource == UNITS  # known up front, never "auto"
    assert isinstance(tsamp.make_pruner("median", rungs), optuna.pruners.MedianPruner)
    for bad in ({"min_fraction": 0}, {"min_fraction": 1.5}, {"reduction_factor": 1}):
        with pytest.raises(ValueError, match="optuna.pruner"):
            parse_spec(space(tmp_path, demo_model, optuna={"pruner": bad}))


def test_a_rung_waits_for_its_peers_before_it_prunes():
    study = optuna.create_study(direction="minimize", pruner=PatientRungs(
        optuna.pruners.SuccessiveHalvingPruner(min_resource=111, reduction_factor=3), 3))
    verdicts = []
    for value in (1.0, 2.0, 3.0, 4.0):  # each worse than the ones before
        t = study.ask()
        t.report(value, 111)
        verdicts.append(t.should_prune())
    # plain successive halving prunes the second trial on one comparison; here the third is the first judged
    assert verdicts == [False, False, True, True]


def test_intermediate_reports_land_at_the_same_fractions_for_batch_2_and_4(tmp_path, demo_model):
    """Two adapters of the same budget (one epoch of 64 rows), batch size 2 (32 steps) and 4
    (16 steps): each job scores them at the first step past each rung of its own budget, and
    their trials report at the same resources."""
    data = space(tmp_path, demo_model, space={"strategy": "list", "configs": BS2_BS4},
                 training={"epochs": 1})
    spec = parse_spec(data)
    study = tloop.run_tune(spec, pruner=Never(), batch=2)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2
    by_bs = {t.params["batch_size"]: t for t in trials}
    assert by_bs[2].user_attrs["steps"] == 32 and by_bs[4].user_attrs["steps"] == 16
    assert sorted(by_bs[2].intermediate_values) == sorted(by_bs[4].intermediate_values) == [111, 333]
    run = spec.run_dir()
    evals = [json.loads(x) for jd in (run / "jobs").iterdir() for x in (jd / "evals.jsonl").read_text().splitlines()]
    steps = {bs: sorted(e["adapter_step"] for e in evals if e["adapter"] == by_bs[bs].user_attrs["adapter_id"])
             for bs in (2, 4)}
    assert steps == {2: [4, 11], 4: [2, 6]}  # ceil(0.111 · 32), ceil(0.333 · 32); ceil(0.111 · 16), ...
    for e in evals:
        total = 32 if e["adapter"] == by_bs[2].user_attrs["adapter_id"] else 16
        assert e["budget_fraction"] == pytest.approx(e["adapter_step"] / total)
    listed = [a for jd in (run / "jobs").iterdir() for a in yaml.safe_load((jd / "job.yaml").read_text())["adapters"]]
    assert {a["batch_size"]: a["eval_steps"] for a in listed} == {2: [4, 11], 4: [2, 6]}


class PruneFirstAtARung(optuna.pruners.BasePruner):
    """Prunes trial 0 at the first rung it reports."""

    def prune(self, study, trial) -> bool:
        return trial.number == 0 and trial.last_step is not None


def test_async_a_trial_pruned_at_a_rung_leaves_its_slot_to_the_next_at_that_step(tmp_path, demo_model):
    """No eval.every_steps: the adapters are scored only at their rungs. Trial 0 is pruned at
    its first rung and trial 2 joins the job at the step boundary where trial 0 leaves."""
    from plora.job.control import read_joins

    budget = 240
    configs = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
               {"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 4},
               {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4}]
    spec = parse_spec(space(tmp_path, demo_model, space={"strategy": "list", "configs": configs},
                            training={"steps": budget}))
    study = tloop.run_tune(spec, pruner=PruneFirstAtARung(), batch=2, slots=["cpu:0"], asynchronous=True)
    first, second, third = study.get_trials()
    assert first.state == TrialState.PRUNED and list(first.intermediate_values) == [111]
    rung_step = Rungs.of(spec).eval_steps(budget)[0]
    assert rung_step <= first.user_attrs["steps"] < budget
    for t in (second, third):
        assert t.state == TrialState.COMPLETE and sorted(t.intermediate_values) == [111, 333]
    job_dir = spec.run_dir() / "jobs" / first.user_attrs["job_id"]
    [join] = read_joins(job_dir)
    assert join.adapter.id == third.user_attrs["adapter_id"]
    rows = [json.loads(x) for x in (job_dir / "metrics.jsonl").read_text().splitlines()]
    pruned_last = max(r["step"] for r in rows if r.get("adapter") == first.user_attrs["adapter_id"])
    joined_first = min(r["step"] for r in rows if r.get("adapter") == join.adapter.id)
    assert join.job_step == joined_first and joined_first <= pruned_last + 2


# --------------------------------------------------------------------------- budget


def test_budget_values():
    assert parse_gpu_budget("1800") == 1800 and parse_gpu_budget("90s") == 90
    assert parse_gpu_budget("30m") == 1800 and parse_gpu_budget("1.5h") == 5400 and parse_gpu_budget(2.5) == 2.5
    for bad in ("0", "-5", "nan", "inf", "abc", "30 parsecs", ""):
        with pytest.raises(TuneError, match="budget"):
            parse_gpu_budget(bad)
    with pytest.raises(TuneError, match="on-budget"):
        Budget(10, "later")


def test_gpu_seconds_count_each_jobs_gpus_over_its_life():
    class P:
        def __init__(self, job, slot, start, end):
            self.job_id, self.slot, self.started, self.ended = job, slot, start, end

    clock = GpuClock()
    clock.observe([P("a", "cuda:0", 0.0, 10.0), P("b", "cuda:1,cuda:2", 5.0, 9.0)])
    clock.observe([P("a", "cuda:0", 0.0, 10.0)])  # seen again: counted once
    assert clock.spent(now=100.0) == 10 + 2 * 4
    clock.observe([P("c", "cpu:0", 90.0, None)])  # still running
    assert clock.spent(now=100.0) == 18 + 10


def _history(run: Path) -> list[dict]:
    with open(run / HISTORY_FILE, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_spent_budget_asks_no_more_trials_and_lets_running_ones_finish(tmp_path, demo_model, asynchronous):
    spec = parse_spec(space(tmp_path, demo_model))
    study = tloop.run_tune(spec, sampler="random", trials=6, batch=2, slots=["cpu:0"], asynchronous=asynchronous,
                           budget=Budget(0.01, "finish"))
    trials = study.get_trials()
    assert len(trials) == 2  # the trials asked before the budget was spent
    ran = [t for t in trials if t.state == TrialState.COMPLETE]
    assert ran and all(t.user_attrs["steps"] == 8 for t in ran)  # running trials finished
    for t in trials:  # a loop's job that had not started yet does not start
        assert t in ran or (t.state == TrialState.PRUNED and "budget" in t.user_attrs["reason"])
    run = spec.run_dir()
    summary = json.loads((run / SUMMARY_FILE).read_text())
    assert summary["budget_gpu_seconds"] == 0.01 and summary["budget_spent"] is True
    assert summary["spent_gpu_seconds"] > 0.01 and summary["on_budget"] == "finish" and summary["trials"] == 2
    rows = _history(run)
    assert [int(r["trial"]) for r in sorted(rows, key=lambda r: int(r["trial"]))] == [0, 1]
    gpu = [float(r["gpu_seconds"]) for r in rows]
    assert gpu == sorted(gpu) and gpu[-1] <= summary["spent_gpu_seconds"] + 1e-6
    best = min(t.value for t in ran)
    assert float(rows[-1]["best"]) == pytest.approx(best)
    assert rows[0]["strategy"] == ("random async" if asynchronous else "random loop")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_stop_prunes_the_running_trials_once_the_budget_is_spent(tmp_path, demo_model, asynchronous):
    spec = parse_spec(space(tmp_path, demo_model, training={"steps": 2000}))
    study = tloop.run_tune(spec, sampler="random", trials=6, batch=2, slots=["cpu:0"], asynchronous=asynchronous,
                           budget=Budget(0.01, "stop"))
    trials = study.get_trials()
    assert len(trials) == 2 and all(t.state == TrialState.PRUNED for t in trials)
    assert all((t.user_attrs["steps"] or 0) < 2000 for t in trials)
    summary = json.loads((spec.run_dir() / SUMMARY_FILE).read_text())
    assert summary["budget_spent"] is True and summary["on_budget"] == "stop"


def test_async_stop_asks_no_trial_that_could_not_train_to_its_end_within_the_budget(tmp_path, demo_model):
    """``--async`` under ``on_budget: stop``: once a new trial would need more than the
    budget left for its pack to train through (the cost model made very slow here), it is
    told pruned untrained and no trial follows it, even in the run's first fill; the run's
    first trial always starts and trains to its end, within the budget, rather than every
    trial being pruned at the budget's last second."""
    from plora.cost.sweep_model import sweep_cost_model

    spec = parse_spec(space(tmp_path, demo_model))
    slow = sweep_cost_model(spec, spec.run_dir()).scaled(1e6)
    study = tloop.run_tune(spec, sampler="random", trials=6, batch=2, slots=["cpu:0"], asynchronous=True,
                           budget=Budget(3600, "stop"), cost_model=slow)
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.PRUNED]
    assert trials[0].user_attrs["steps"] == 8  # the first trained through
    assert "could not train it to its end" in trials[1].user_attrs["reason"]
    summary = json.loads((spec.run_dir() / SUMMARY_FILE).read_text())
    assert summary["budget_spent"] is False and summary["best"] == pytest.approx(trials[0].value)


def test_async_stop_fills_as_many_slots_as_the_budget_lets_end(tmp_path, demo_model):
    """With a cost model that times the demo's jobs as they are, the same budget lets the
    whole first fill start and every trial train through (the check refuses only what could
    not end)."""
    spec = parse_spec(space(tmp_path, demo_model))
    study = tloop.run_tune(spec, sampler="random", trials=4, batch=2, slots=["cpu:0"], asynchronous=True,
                           budget=Budget(3600, "stop"))
    trials = study.get_trials()
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials)


def test_the_loop_under_stop_starts_no_batch_that_could_not_end_within_the_budget(tmp_path, demo_model):
    """The loop's first batch starts; a later one that its plan (scaled by the earlier
    batches' measured pace) says could not end within the budget left does not: its trials
    are told pruned untrained, and the budget is not spent on jobs it would prune."""
    from plora.cost.sweep_model import sweep_cost_model

    spec = parse_spec(space(tmp_path, demo_model))
    slow = sweep_cost_model(spec, spec.run_dir()).scaled(1e6)
    study = tloop.run_tune(spec, sampler="random", trials=4, batch=2, slots=["cpu:0"],
                           budget=Budget(3600, "stop"), cost_model=slow)
    trials = sorted(study.get_trials(), key=lambda t: t.number)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 2 + [TrialState.PRUNED] * 2
    assert all("could not train it to its end" in t.user_attrs["reason"] for t in trials[2:])
    summary = json.loads((spec.run_dir() / SUMMARY_FILE).read_text())
    assert summary["budget_spent"] is False and summary["trials"] == 4
    assert {p.name[:3] for p in (spec.run_dir() / "jobs").iterdir()} == {"b01"}  # no job of batch 2


def test_batch_fits_the_budget_left():
    assert tloop.batch_fits(Budget(100, "stop"), 50, 1.0)
    assert not tloop.batch_fits(Budget(100, "stop"), 50, 2.5)
    assert tloop.batch_fits(Budget(100, "finish"), 500, 1.0)  # finish lets a started batch end
    assert tloop.batch_fits(Budget(None, "stop"), 500, 1.0)


def test_a_jobs_pace_counts_its_steps_and_stalls_but_not_its_start():
    from plora.cost.model import AdapterLoad
    from plora.tuning.pace import MIN_MEASURED_S, PACE_RANGE, JobPaces, Pace

    class Model:  # 0.1 s a step whatever the pack
        def step_time(self, pack, tp):
            return 0.1

    pack = [AdapterLoad("a", 8, 2, 100), AdapterLoad("b", 8, 4, 50)]
    paces = JobPaces(Model())
    paces.observe("j", {}, pack, 0.0)
    paces.observe("j", {"a": 0, "b": 0}, pack, 5.0)  # loading: no step yet
    assert not paces.stepped("j") and paces.factor("j") == 1.0
    paces.observe("j", {"a": 10, "b": 10}, pack, 6.0)  # its first steps: the start, not measured
    assert paces.stepped("j") and paces.factor("j") == 1.0
    paces.observe("j", {"a": 20, "b": 20}, pack, 8.0)  # 10 steps in 2 s: twice the model's time
    assert paces.factor("j") == pytest.approx(2.0)
    paces.observe("j", {"a": 20, "b": 20}, pack, 9.0)  # a stall (an eval at a rung) counts too
    assert paces.factor("j") == pytest.approx(3.0)
    assert Pace(MIN_MEASURED_S / 2, 0.01).factor == 1.0  # too little measured
    assert Pace(100.0, 1.0).factor == PACE_RANGE[1] and Pace(1.0, 100.0).factor == PACE_RANGE[0]


def test_the_loop_starts_no_queued_job_once_the_budget_is_spent(tmp_path, demo_model):
    """Two jobs of one batch on one slot: the budget is spent while the first trains, so the
    second never starts; its trials are told pruned ("the budget was spent")."""
    spec = parse_spec(space(tmp_path, demo_model, planner={"max_adapters_per_job": 1}))
    study = tloop.run_tune(spec, sampler="random", trials=2, batch=2, slots=["cpu:0"], budget=Budget(0.01, "finish"))
    states = sorted(t.state.name for t in study.get_trials())
    assert states == ["COMPLETE", "PRUNED"]
    [never] = [t for t in study.get_trials() if t.state == TrialState.PRUNED]
    assert "budget" in never.user_attrs["reason"]


def test_cli_budget(tmp_path, demo_model):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space(tmp_path, demo_model)))
    for args in (["--budget-gpu-seconds", "abc"], ["--budget-gpu-seconds", "0"], ["--budget-gpu-seconds", "-3"],
                 ["--on-budget", "later"]):
        bad = runner.invoke(app, ["tune", str(path), *args])
        assert bad.exit_code == 2, (args, bad.output)
        lines = bad.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and "budget" in lines[0]
    bad = runner.invoke(app, ["tune", str(path), "optuna.budget_gpu_seconds=-1"])
    assert bad.exit_code == 2 and "optuna.budget_gpu_seconds" in bad.output
    ok = runner.invoke(app, ["tune", str(path), "--sampler", "random", "--trials", "4", "--batch", "2",
                             "--budget-gpu-seconds", "0.01s"], terminal_width=200)
    assert ok.exit_code == 0, ok.output
    assert "of a 0.01 GPU-s budget" in ok.output and "budget spent: running trials finished" in ok.output
    assert len(_history(tmp_path / "runs" / "tune")) == 2


class Spy(optuna.samplers.RandomSampler):
    """A random sampler that counts the trials it proposed."""

    def __init__(self) -> None:
        super().__init__(seed=0)
        self.trials: set[int] = set()

    def sample_independent(self, study, trial, name, dist):
        self.trials.add(trial.number)
        return super().sample_independent(study, trial, name, dist)


def test_the_model_proposes_only_once_its_start_up_trials_are_told():
    """TPE with the constant liar counts running trials toward its start-up: an asynchronous
    tune asks through `Startup`, which explores until that many trials are told."""
    space = {"x": optuna.distributions.FloatDistribution(0, 1)}
    study = optuna.create_study(sampler=tsamp.make_sampler("tpe", parse_spec({"name": "s"}), n_startup_trials=2))
    startup = tsamp.Startup(Spy(), 2)
    running = [startup.ask(study, space) for _ in range(3)]  # none told: all three explore
    assert startup.sampler.trials == {0, 1, 2}
    study.tell(running[0], 0.5)
    startup.ask(study, space)  # one told: still exploring
    assert 3 in startup.sampler.trials
    study.tell(running[1], 0.2)
    startup.ask(study, space)  # two told: the model's turn
    assert 4 not in startup.sampler.trials and isinstance(study.sampler, optuna.samplers.TPESampler)


def test_async_hyperband_on_the_budget_fraction_runs_end_to_end(tmp_path, demo_model):
    path = tmp_path / "space.yaml"
    path.write_text(yaml.safe_dump(space(tmp_path, demo_model, training={"epochs": 1})))
    result = runner.invoke(app, ["tune", str(path), "--sampler", "tpe", "--trials", "4", "--batch", "2",
                                 "--pruner", "hyperband", "--async"], terminal_width=200)
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "tune"
    study = optuna.load_study(study_name="tune", storage=f"sqlite:///{run / 'study.sqlite'}")
    assert len(study.trials) == 4
    for t in study.trials:  # every report at a rung or the share of the budget, never at a raw step
        assert set(t.intermediate_values) <= {111, 333}
    assert json.loads((run / SUMMARY_FILE).read_text())["strategy"] == "tpe + hyperband async"
