"""Epochs as fidelity and pruning on the objective: an adapter is scored at each epoch end,
its best epoch's weights are what it keeps (through a mid-job resume and a divergence too),
the results list every epoch; intermediate evals score the objective on a fixed slice of
the eval rows, and the prune watcher reports it in the study's direction."""

from __future__ import annotations

import json
import math
import signal
import time
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import inject_fault, tiny_space_file
from plora.train import hooks
from plora.planner.plan import Job, Plan
from plora.train.epochs import better_epoch, epoch_ends
from plora.spec.loading import load_spec
from plora.job.from_spec import job_config
from plora.sweep import prepare, run_prepared, write_run_files

ONE = [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 8}]
TWO = ONE + [{"rank": 4, "alpha": 8, "learning_rate": 3e-3, "batch_size": 12}]


def scripted_metric(tmp_path: Path, scores: list[float]) -> tuple[str, Path]:
    """A user metric next to the space file that returns ``scores`` in turn, counted across
    processes in a log file (one line per call): which epoch is best is then known."""
    name = f"scripted_{abs(hash(str(tmp_path))) % 10**8}"
    log = tmp_path / "metric_calls.txt"
    (tmp_path / f"{name}.py").write_text(
        "from pathlib import Path\n"
        f"LOG = Path({str(log)!r})\n"
        f"SCORES = {scores!r}\n"
        "def score(predictions, references):\n"
        "    n = len(LOG.read_text().splitlines()) if LOG.exists() else 0\n"
        "    with open(LOG, 'a') as f:\n"
        "        f.write('call\\n')\n"
        "    return SCORES[n % len(SCORES)]\n")
    return f"{name}:score", log


def prepared(tmp_path: Path, *, configs=ONE, eval_section=None, training=None, num_eval: int = 4):
    path = tiny_space_file(
        tmp_path, name="ep", num_eval=num_eval, space={"strategy": "list", "configs": configs},
        training={"scheduler": "constant", "checkpoint_every_steps": 1000, "checkpoint_every_minutes": None,
                  **(training or {"epochs": 3})},
        eval=eval_section or {"max_new_tokens": 2, "metrics": ["loss", "exact_match"]})
    prep = prepare(load_spec(path))
    prep.plan = Plan([Job("job-000", [c.id for c in prep.configs])], grouping="one job for the test")
    write_run_files(prep)
    return prep


def job_dict(prep, out: Path | None = None) -> dict:
    cfg = job_config(prep.spec, Job("job-000", [c.id for c in prep.configs]), prep.configs, prep.steps,
                     prep.run_dir, eval_base=False).to_dict()
    if out is not None:
        cfg.update(output_dir=str(out), job_dir=str(out / "jobs" / "job-000"))
    return cfg


def run_in_process(cfg: dict, snapshots: Path | None = None):
    """The job in this process; with ``snapshots``, every adapter's PEFT files at each of
    its epoch ends (``<snapshots>/<id>/e<epoch>``), as its own save would write them."""
    from plora.train.packed.peft_format import save_peft_adapter
    from plora.train.packed_lora import PackedLoRARecipe

    def snap(recipe, step):
        for r in recipe.runs:
            if r.active and r.step in recipe.epochs.ends(r):
                state = recipe.bank.host_states([r.index])[0]
                save_peft_adapter(snapshots / r.id / f"e{recipe.epochs.ends(r).index(r.step) + 1}", state, recipe.info,
                                  rank=r.cfg.rank, alpha=r.cfg.alpha, targets=recipe.targets, dropout=r.cfg.dropout or 0.0,
                                  rslora=bool(r.cfg.rslora))

    recipe = PackedLoRARecipe(cfg)
    if snapshots is None:
        return recipe.run()
    with hooks.installed("after_step", snap):
        return recipe.run()


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(folder) / "adapter_model.safetensors")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)


# ------------------------------------------------------------------ pieces
def test_epoch_ends_are_the_steps_an_epoch_budget_gives():
    assert epoch_ends(24, 8, 9) == [3, 6, 9]
    assert epoch_ends(24, 5, 15) == [5, 10, 15]
    assert epoch_ends(10, 4, math.ceil(2.5 * 10 / 4)) == [3, 5, 7]  # a partial last epoch ends with the budget
    assert epoch_ends(24, 8, 3) == [3]


def test_the_best_epoch_follows_the_objectives_direction_then_the_loss():
    a = {"eval_exact_match": 0.5, "eval_loss": 2.0}
    assert better_epoch(a, None, "eval_exact_match", minimize=False)
    assert better_epoch({"eval_exact_match": 0.6, "eval_loss": 9.0}, a, "eval_exact_match", minimize=False)
    assert not better_epoch({"eval_exact_match": 0.6, "eval_loss": 9.0}, a, "eval_exact_match", minimize=True)
    assert better_epoch({"eval_exact_match": 0.5, "eval_loss": 1.0}, a, "eval_exact_match", minimize=False)
    assert not better_epoch(dict(a), a, "eval_exact_match", minimize=False)  # a full tie keeps the earlier
    assert not better_epoch({"eval_exact_match": float("nan")}, a, "eval_exact_match", minimize=False)


@pytest.mark.parametrize("section, field", [
    ({"intermediate_samples": 0}, "eval.intermediate_samples"),
    ({"intermediate_samples": 2.5}, "eval.intermediate_samples"),
])
def test_bad_eval_settings_are_one_line_exit_2(tmp_path, section, field):
    from plora.cli import app

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"name": "bad", "eval": section, "output": {"dir": str(tmp_path / "runs")}}))
    result = CliRunner().invoke(app, ["sweep", str(path)])
    assert result.exit_code == 2
    text = result.output.strip()
    assert len(text.splitlines()) == 1 and text.startswith("error: " + field), text
    assert not (tmp_path / "runs").exists()


def test_per_epoch_scoring_is_on_for_more_than_one_epoch_only(tmp_path):
    from plora.data.check import eval_config
    from plora.spec.loading import parse_spec

    assert eval_config(parse_spec({"name": "x", "training": {"epochs": 3}})).each_epoch
    assert eval_config(parse_spec({"name": "x", "training": {"epochs": 1.5}})).each_epoch
    assert not eval_config(parse_spec({"name": "x"})).each_epoch
    assert not eval_config(parse_spec({"name": "x", "training": {"steps": 500}})).each_epoch
    spec = parse_spec({"name": "x", "training": {"epochs": 2.5}})
    assert spec.scored_epochs == 3
    # epochs searched per adapter: scored at the ends of the most any adapter trains
    spaced = parse_spec({"name": "x", "space": {"epochs": [1, 3]}})
    assert spaced.scored_epochs == 3 and eval_config(spaced).each_epoch
    listed = parse_spec({"name": "x", "space": {"strategy": "list", "configs": [
        {"rank": 8, "alpha": 16, "learning_rate": 1e-3, "batch_size": 4, "epochs": 2}]}})
    assert listed.scored_epochs == 2


def test_epoch_end_evals_are_priced():
    from plora.cost.job import EvalLoad, JobOverheads

    terms = JobOverheads(eval_call_s=1.0, eval_tok_s=0.01, save_s=0.5)
    once = EvalLoad(8, 32.0, 26.0, 4)
    thrice = EvalLoad(8, 32.0, 26.0, 4, evals=3)
    assert terms.exit_time(2, thrice) == pytest.approx(3 * terms.eval_time(2, once) + 2 * 0.5)
    assert EvalLoad.from_dict(once.to_dict() | {"evals": 3}) == thrice
    assert EvalLoad.from_dict({"samples": 8, "row_tokens": 32.0}).evals == 1  # a cost model saved before


# ------------------------------------------------------------------ epochs in a sweep
def test_a_three_epoch_sweep_lists_every_epoch_and_keeps_the_best(tmp_path):
    """Two adapters, three epochs each (at different steps: batch 8 and 12 of 24 rows): each
    is scored three times, results.parquet lists each epoch's scores and the epoch kept,
    and the adapter's scores are that epoch's."""
    from plora import views
    from plora.results.plots import results_table
    from plora.results.run_data import load_run

    prep = prepared(tmp_path, configs=TWO)
    frame = run_prepared(prep, slots=["cpu:0"])
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]
    for col in ["epoch"] + [f"{s}_epoch{e}" for e in (1, 2, 3) for s in ("eval_exact_match", "eval_loss")]:
        assert col in frame.columns and frame[col].notna().all(), col
    on_disk = pd.read_parquet(prep.run_dir / "results.parquet")
    assert list(on_disk.columns) == list(frame.columns)
    for _, row in frame.iterrows():
        m = json.loads((prep.run_dir / "adapters" / row.adapter_id / "metrics.json").read_text())
        assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3]
        steps = prep.steps[row.adapter_id]
        assert [e["step"] for e in m["epochs"]] == [steps // 3, 2 * steps // 3, steps]
        kept = m["epochs"][m["epoch"] - 1]
        assert m["eval_exact_match"] == kept["eval_exact_match"] and m["eval_loss"] == kept["eval_loss"]
        assert row.eval_loss == pytest.approx(kept["eval_loss"]) and row.epoch == m["epoch"]
        best = max(m["epochs"], key=lambda e: (e["eval_exact_match"], -e["eval_loss"], -e["epoch"]))
        assert m["epoch"] == best["epoch"]
    study = optuna.load_study(study_name="ep", storage=f"sqlite:///{prep.run_dir / 'study.sqlite'}")
    kept = {t.user_attrs["adapter_id"]: t.user_attrs["epoch"] for t in study.trials}
    assert kept == dict(zip(frame.adapter_id, frame.epoch))
    text = _render(views.results_table(frame, prep.spec, {}))
    assert "epoch" in text and "exact match by epoch" in text
    assert "epoch" in results_table(load_run(prep.run_dir)).columns


def test_the_kept_weights_are_the_best_epochs_not_the_last(tmp_path):
    """A user objective that scores epoch 2 best: the adapter's PEFT folder holds its
    weights at the end of epoch 2 (as saved then), not those of epoch 3."""
    metric, log = scripted_metric(tmp_path, [0.2, 0.9, 0.5])
    prep = prepared(tmp_path, eval_section={"max_new_tokens": 2, "metrics": ["loss", metric], "objective": "score"})
    run_in_process(job_dict(prep), snapshots=tmp_path / "snap")
    a = prep.configs[0].id
    m = json.loads((prep.run_dir / "adapters" / a / "metrics.json").read_text())
    assert [e["eval_score"] for e in m["epochs"]] == [0.2, 0.9, 0.5] and m["epoch"] == 2
    assert m["eval_score"] == 0.9 and m["eval_loss"] == m["epochs"][1]["eval_loss"] and m["status"] == "done"
    got = weights(prep.run_dir / "adapters" / a)
    assert same(got, weights(tmp_path / "snap" / a / "e2"))
    assert not same(got, weights(tmp_path / "snap" / a / "e3"))
    assert len(log.read_text().splitlines()) == 3


def test_a_diverged_adapter_keeps_its_best_finished_epoch(tmp_path):
    """Its weights turn NaN in epoch 2: it is `diverged`, and keeps epoch 1's weights and scores."""
    prep = prepared(tmp_path)
    a = prep.configs[0].id

    def poison(recipe, step):
        if step == 4:
            with torch.no_grad():
                recipe.bank.weights.fill_(float("nan"))

    with hooks.installed("after_step", poison):
        run_in_process(job_dict(prep), snapshots=tmp_path / "snap")
    m = json.loads((prep.run_dir / "adapters" / a / "metrics.json").read_text())
    assert m["status"] == "diverged" and "kept epoch 1" in m["reason"]
    assert m["epoch"] == 1 and len(m["epochs"]) == 1 and m["eval_loss"] == m["epochs"][0]["eval_loss"]
    assert m["checkpoint_path"] and same(weights(prep.run_dir / "adapters" / a), weights(tmp_path / "snap" / a / "e1"))


def test_a_job_killed_after_epoch_1_resumes_with_its_score_and_weights(tmp_path, monkeypatch):
    """Killed in epoch 2 (the only checkpoint is the one taken at epoch 1's end); the next
    attempt goes on from there, does not score epoch 1 again, and, epoch 1 being the best,
    saves epoch 1's weights: those of an uninterrupted run's epoch 1."""
    from plora.engine.local import launch

    metric, log = scripted_metric(tmp_path, [0.9, 0.1, 0.2])
    prep = prepared(tmp_path, eval_section={"max_new_tokens": 2, "metrics": ["loss", metric], "objective": "score"})
    a = prep.configs[0].id
    job_dir = prep.run_dir / "jobs" / "job-000"
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "job.yaml").write_text(yaml.safe_dump(job_dict(prep)))
    inject_fault(monkeypatch, "kill@job-000@4@1")  # after job step 5; epoch 1 ended at step 3
    for attempt, code in ((1, -signal.SIGKILL), (2, 0)):
        proc = launch("job-000", job_dir, "cpu:0", extra_env={"PLORA_ATTEMPT": str(attempt)})
        assert proc.proc.wait(timeout=300) == code, (job_dir / "log.txt").read_text()[-3000:]
        proc.log.close()
        if attempt == 1:
            state = torch.load(job_dir / "checkpoint" / "state.rank0.pt", weights_only=True)
            saved = state["adapters"][a]
            assert state["job_step"] == 3 and saved["best_epoch"] == 1 and len(saved["epochs"]) == 1
            assert saved["best_weights"].shape == saved["weights"].shape
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["resumed_from"] == {a: 3}
    m = json.loads((prep.run_dir / "adapters" / a / "metrics.json").read_text())
    assert m["attempt"] == 2 and [e["eval_score"] for e in m["epochs"]] == [0.9, 0.1, 0.2] and m["epoch"] == 1
    assert len(log.read_text().splitlines()) == 3  # epoch 1 was scored once

    log.unlink()
    ref = tmp_path / "ref"
    run_in_process(job_dict(prep, ref), snapshots=tmp_path / "snap")
    r = json.loads((ref / "adapters" / a / "metrics.json").read_text())
    assert r["epochs"][0]["eval_loss"] == pytest.approx(m["epochs"][0]["eval_loss"], rel=1e-5)
    got = weights(prep.run_dir / "adapters" / a)
    assert same(got, weights(tmp_path / "snap" / a / "e1")) and same(got, weights(ref / "adapters" / a))


# ------------------------------------------------------------------ pruning on the objective
def test_intermediate_evals_score_the_objective_on_a_fixed_slice(tmp_path, monkeypatch):
    """Every step: the loss on the eval set, and exact match on 3 of its 8 rows, the same
    rows at every eval and for every adapter, the adapters due together in one packed eval."""
    import plora.results.evaluate as evaluate

    seen: list[tuple[tuple[str, ...], tuple[tuple[int, ...], ...]]] = []
    packed: list[int] = []
    real = evaluate.evaluate_adapters

    def spy(pm, adapters, samples, examples, tok, *, metrics, **kw):
        seen.append((tuple(metrics), tuple(tuple(s.tokens) for s in samples)))
        packed.append(len(adapters))
        return real(pm, adapters, samples, examples, tok, metrics=metrics, **kw)

    monkeypatch.setattr("plora.train.evaluator.evaluate_adapters", spy)
    prep = prepared(tmp_path, configs=TWO, num_eval=8, training={"epochs": 1},
                    eval_section={"max_new_tokens": 2, "metrics": ["loss", "exact_match"], "every_steps": 1,
                                  "intermediate_samples": 3})
    run_in_process(job_dict(prep))
    recs = [json.loads(x) for x in (prep.run_dir / "jobs" / "job-000" / "evals.jsonl").read_text().splitlines()]
    assert recs and {r["adapter"] for r in recs} == {c.id for c in prep.configs}
    for r in recs:
        assert r["objective"] == "exact_match" and r["objective_samples"] == 3
        assert 0.0 <= r["eval_exact_match"] <= 1.0 and math.isfinite(r["eval_loss"])
    slices = {rows for metrics, rows in seen if metrics == ("exact_match",)}
    assert len(slices) == 1 and len(next(iter(slices))) == 3  # one slice, every time
    assert all(len(rows) == 8 for metrics, rows in seen if metrics == ("loss",))
    assert packed[0] == 2  # both adapters at the first step, in one pass


def test_the_slice_is_clipped_to_the_eval_set(tmp_path):
    prep = prepared(tmp_path, training={"steps": 2}, num_eval=4,
                    eval_section={"max_new_tokens": 2, "metrics": ["loss", "exact_match"], "every_steps": 1,
                                  "intermediate_samples": 100})
    run_in_process(job_dict(prep))
    recs = [json.loads(x) for x in (prep.run_dir / "jobs" / "job-000" / "evals.jsonl").read_text().splitlines()]
    assert recs and all(r["objective_samples"] == 4 for r in recs)


def test_a_loss_objective_reports_the_loss(tmp_path):
    prep = prepared(tmp_path, training={"steps": 2},
                    eval_section={"metrics": ["loss", "exact_match"], "objective": "loss", "every_steps": 1})
    run_in_process(job_dict(prep))
    recs = [json.loads(x) for x in (prep.run_dir / "jobs" / "job-000" / "evals.jsonl").read_text().splitlines()]
    assert recs and all(r["objective"] == "loss" and "objective_samples" not in r and "eval_exact_match" not in r
                        for r in recs)


def _watch(tmp_path: Path, direction: str, sign: float, records: list[dict]) -> dict[int, float]:
    from plora.tuning.prune import _PruneWatcher

    job_dir = tmp_path / "job"
    job_dir.mkdir(parents=True)
    (job_dir / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    study = optuna.create_study(direction=direction)
    trial = study.ask()
    _PruneWatcher({"a": [trial]}, sign, can_prune=False).poll(job_dir, prune=False)
    return study.trials[0].intermediate_values


def test_the_watcher_reports_the_objective_in_the_studys_direction(tmp_path):
    recs = [{"adapter": "a", "adapter_step": 2, "eval_loss": 2.5, "objective": "exact_match",
             "eval_exact_match": 0.25, "objective_samples": 32},
            {"adapter": "a", "adapter_step": 4, "eval_loss": 2.0, "objective": "exact_match",
             "eval_exact_match": 0.5, "objective_samples": 32},
            {"adapter": "a", "adapter_step": 6, "eval_loss": 1.5}]  # an earlier version's: the loss, signed
    assert _watch(tmp_path / "max", "maximize", -1.0, recs) == {2: 0.25, 4: 0.5, 6: -1.5}
    loss = [{"adapter": "a", "adapter_step": 2, "eval_loss": 2.5, "objective": "loss"}]
    assert _watch(tmp_path / "min", "minimize", 1.0, loss) == {2: 2.5}


def test_a_median_pruner_stops_the_worse_objective(tmp_path):
    """Two trials, the same loss curve, different exact match: the pruner (maximizing)
    stops the one whose objective is lower, which the loss alone could not tell apart."""
    from plora.tuning.prune import _PruneWatcher

    study = optuna.create_study(direction="maximize",
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0))
    good = study.ask()
    for step in (1, 2):
        good.report(0.8, step)
    study.tell(good, 0.8)
    bad = study.ask()
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    (job_dir / "evals.jsonl").write_text(json.dumps({"adapter": "b", "adapter_step": 1, "eval_loss": 1.0,
                                                     "objective": "exact_match", "eval_exact_match": 0.1}) + "\n")
    stopped = _PruneWatcher({"b": [bad]}, -1.0, can_prune=True).poll(job_dir, prune=True)
    assert stopped == ["b"]
    assert json.loads((job_dir / "control.json").read_text())["prune"] == ["b"]


def _render(table) -> str:
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(table)
    return console.export_text()


def test_resuming_a_run_directory_of_other_intermediate_samples(tmp_path):
    """How many rows intermediate evals score changes no result: a run directory resumes."""
    from plora.engine.preflight import check_resumable
    from plora.spec.loading import parse_spec

    prep = prepared(tmp_path, training={"steps": 1}, eval_section={"metrics": ["loss"]})
    run_prepared(prep, slots=["cpu:0"])
    other = load_spec(tmp_path / "space.yaml")
    other.eval.intermediate_samples = 8
    check_resumable(prep.run_dir, other, [c.id for c in prep.configs])
    before = yaml.safe_load((prep.run_dir / "spec.yaml").read_text())
    before["eval"].pop("intermediate_samples")  # a run directory of an earlier version
    (prep.run_dir / "spec.yaml").write_text(yaml.safe_dump(before))
    check_resumable(prep.run_dir, load_spec(tmp_path / "space.yaml"), [c.id for c in prep.configs])
    assert parse_spec({"name": "x"}).eval.intermediate_samples == 32


def test_an_accumulating_adapter_is_scored_once_at_each_epoch_end(tmp_path):
    """With a micro-batch smaller than the batch, an adapter's optimizer step spans several
    packed steps: its epoch ends are scored once each, at the optimizer step that ends them."""
    prep = prepared(tmp_path, configs=TWO, training={"epochs": 2, "micro_batch_size": 4})
    frame = run_prepared(prep, slots=["cpu:0"])
    assert set(frame.status) == {"done"}, frame[["adapter_id", "status", "reason"]]
    for _, row in frame.iterrows():
        m = json.loads((prep.run_dir / "adapters" / row.adapter_id / "metrics.json").read_text())
        steps = prep.steps[row.adapter_id]
        assert [(e["epoch"], e["step"]) for e in m["epochs"]] == [(1, steps // 2), (2, steps)]
