"""The base model's eval scores are remembered across jobs (`plora.train.base_scores`): a
second job with the same model, rows and eval writes the same base_metrics.json without
scoring again; anything that could change the scores scores again."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from conftest import job_config
from plora.train.packed_lora import PackedLoRARecipe

ADAPTERS = [{"id": "a0", "rank": 4, "alpha": 8.0, "learning_rate": 1e-3, "batch_size": 2, "seed": 1, "steps": 2}]


def _job(model: Path, data: dict, out: Path, **eval_over) -> dict:
    cfg = job_config(model, data, out, ADAPTERS, eval_base=True)
    cfg["eval"] = {**cfg["eval"], **eval_over}
    summary = PackedLoRARecipe(cfg).run()
    return {"remembered": summary["phases"]["base_scores_remembered"],
            "scores": json.loads((out / "base_metrics.json").read_text())}


def test_a_second_job_on_the_same_model_rows_and_eval_reuses_the_base_scores(tiny_model, reverse_data, tmp_path):
    first = _job(tiny_model, reverse_data, tmp_path / "one")
    again = _job(tiny_model, reverse_data, tmp_path / "two")
    assert not first["remembered"] and again["remembered"]
    assert again["scores"] == first["scores"] and "eval_loss" in first["scores"]


def test_other_rows_another_eval_or_changed_weights_score_the_base_again(tiny_model, reverse_data, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    assert not _job(model, reverse_data, tmp_path / "a")["remembered"]
    assert not _job(model, reverse_data, tmp_path / "b", max_eval_samples=4)["remembered"]  # other rows
    assert not _job(model, reverse_data, tmp_path / "c", metrics=["loss", "exact_match"])["remembered"]
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # rewritten
    assert not _job(model, reverse_data, tmp_path / "d")["remembered"]
    assert _job(model, reverse_data, tmp_path / "e")["remembered"]


def test_a_user_metric_is_never_remembered_and_a_broken_entry_is_scored_again(tiny_model, reverse_data, tmp_path,
                                                                               monkeypatch):
    from plora.settings import settings

    first = _job(tiny_model, reverse_data, tmp_path / "one")
    for entry in (settings().cache_dir / "base-scores").glob("*.json"):
        entry.write_text("{not json")
    again = _job(tiny_model, reverse_data, tmp_path / "two")
    assert not again["remembered"] and again["scores"] == first["scores"]
    metrics = tmp_path / "metrics_dir"
    metrics.mkdir()
    (metrics / "my_metric_mod.py").write_text("def length(predictions, references):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(metrics))
    over = {"metrics": ["loss", "my_metric_mod:length"], "python_path": [str(metrics)]}
    assert not _job(tiny_model, reverse_data, tmp_path / "three", **over)["remembered"]
    assert not _job(tiny_model, reverse_data, tmp_path / "four", **over)["remembered"]


def test_no_key_for_a_users_metric_even_without_its_python_path(tmp_path):
    """A metric of the user's (``module:function``) is code the key cannot see change."""
    from plora.data.dataset import Sample
    from plora.job.config import JobEval, JobModel
    from plora.train.base_scores import key_of

    model = JobModel(path=str(tmp_path), max_seq_len=8)
    rows = [Sample(tokens=[1, 2], labels=[1, 2])]
    assert key_of(model, JobEval(metrics=["loss"]), rows, [], "cpu") is not None
    assert key_of(model, JobEval(metrics=["loss", "mine:score"]), rows, [], "cpu") is None
    assert key_of(model, JobEval(metrics=["loss"]), [], [], "cpu") is None
