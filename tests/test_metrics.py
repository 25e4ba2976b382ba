"""Eval metrics: choice accuracy (highest-likelihood label, no generation, packed) and user
metrics `module:function`, end to end in a tiny job and through the CLI."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import job_config
from plora.data import IGNORE_INDEX
from plora.evaluate import evaluate_adapters
from plora.metrics import (
    MetricError,
    check_metric,
    choice_accuracy,
    exact_match,
    metric_name,
    metric_paths,
    score_predictions,
)
from plora.recipes.packed_lora import PackedLoRARecipe

LABELS = ["yes", "no"]
ADAPTERS = [
    dict(id="a", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=1, steps=4),
    dict(id="b", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=3, seed=2, steps=3),
]
METRIC_MODULE = '''
def first_letter(predictions, references):
    """Share of answers whose first letter is right."""
    assert isinstance(predictions, list) and all(isinstance(p, str) for p in predictions)
    return sum(p[:1] == r[:1] for p, r in zip(predictions, references)) / len(references)


def broken(predictions, references):
    raise RuntimeError("boom")
'''


@pytest.fixture(scope="module")
def label_data(tmp_path_factory) -> dict[str, Path]:
    """Classification with label words: does a string start with 'a'?"""
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        s = "".join(rng.choice("abc") for _ in range(rng.randint(2, 4)))
        rows.append({"input": s + "=", "output": "yes" if s[0] == "a" else "no", "opts": LABELS})
    d = tmp_path_factory.mktemp("labels")
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:48]))
    (d / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[48:]))
    (d / "plora_test_metrics_mod.py").write_text(METRIC_MODULE)
    return {"train": d / "train.jsonl", "eval": d / "eval.jsonl", "dir": d}


def test_metric_names_and_scores():
    assert metric_name("loss") == "loss" and metric_name("pkg.mod:f1") == "f1" and metric_name("m:C.score") == "C_score"
    assert exact_match(["ab ", "x"], ["ab", "y"]) == 0.5
    assert choice_accuracy([[-1.0, -2.0], [-3.0, -0.5], [0.0, -1.0]], [0, 1, 1]) == pytest.approx(2 / 3)
    with pytest.raises(MetricError, match="unknown metric 'bleu'"):
        check_metric("bleu")
    with pytest.raises(MetricError, match="cannot import 'no_such_mod_xyz'"):
        check_metric("no_such_mod_xyz:f")
    with pytest.raises(MetricError, match="is not callable"):
        check_metric("json:__doc__")


def test_user_metric_next_to_the_space_file_and_its_path_for_jobs(label_data, capsys):
    check_metric("plora_test_metrics_mod:first_letter", label_data["dir"])
    assert metric_paths(["loss", "plora_test_metrics_mod:first_letter"]) == [str(label_data["dir"].resolve())]
    out = score_predictions(["exact_match", "plora_test_metrics_mod:first_letter", "plora_test_metrics_mod:broken"],
                            ["yes", "nah"], ["yes", "no"])
    assert out["eval_exact_match"] == 0.5 and out["eval_first_letter"] == 1.0 and math.isnan(out["eval_broken"])
    assert "metric plora_test_metrics_mod:broken: RuntimeError: boom" in capsys.readouterr().err


def _row_loglik(model, sample) -> float:
    """Log-likelihood of a row's labelled tokens, the plain way (one row, no packing)."""
    tokens = torch.tensor([sample.tokens])
    logp = torch.log_softmax(model(tokens)[0, :-1].float(), -1)
    return sum(float(logp[i - 1, t]) for i, t in enumerate(sample.labels) if t != IGNORE_INDEX)


def test_choice_accuracy_in_a_tiny_job(tiny_model, label_data, tmp_path):
    sys.path.append(str(label_data["dir"]))
    metrics = ["loss", "exact_match", "choice_accuracy", "plora_test_metrics_mod:first_letter"]
    cfg = job_config(tiny_model, label_data, tmp_path, ADAPTERS, eval_base=True)
    cfg["eval"] = {"metrics": metrics, "max_eval_samples": 12, "max_new_tokens": 4, "choices_column": "opts",
                   "python_path": [str(label_data["dir"])]}
    recipe = PackedLoRARecipe(cfg)
    summary = recipe.run()
    assert set(summary["adapters"].values()) == {"done"}
    keys = {"eval_loss", "eval_exact_match", "eval_choice_accuracy", "eval_first_letter"}
    for a in ADAPTERS:
        m = json.loads((tmp_path / "adapters" / a["id"] / "metrics.json").read_text())
        assert keys <= set(m) and all(0.0 <= m[k] <= 1.0 for k in keys - {"eval_loss"})
    base = json.loads((tmp_path / "base_metrics.json").read_text())
    assert keys <= set(base)

    # the base model's choice accuracy is the argmax of each choice's summed log-likelihood
    samples = recipe.eval_samples
    assert len(samples) == 12 and all(s.gold == LABELS.index(s.reference) for s in samples)
    model = recipe.pm.model
    model.eval()
    with torch.no_grad():
        scores = [[_row_loglik(model, c) for c in s.choices] for s in samples]
    expect = choice_accuracy(scores, [s.gold for s in samples])
    kw = dict(metrics=["choice_accuracy"], max_new_tokens=1, max_seq_len=64, device=torch.device("cpu"))
    [got] = evaluate_adapters(recipe.pm, [None], samples, recipe.eval_examples, recipe.tok, **kw)
    assert got["eval_choice_accuracy"] == pytest.approx(expect) == pytest.approx(base["eval_choice_accuracy"])

    # packed: each adapter scores as it does alone, with rows split across chunks too
    packed = evaluate_adapters(recipe.pm, [0, 1], samples, recipe.eval_examples, recipe.tok, batch_rows=10, **kw)
    alone = [evaluate_adapters(recipe.pm, [i], samples, recipe.eval_examples, recipe.tok, **kw)[0] for i in (0, 1)]
    assert packed == alone


@pytest.mark.slow  # a real sweep: about 50 s on a shared 2-core machine
def test_choice_accuracy_and_a_user_metric_through_the_cli(label_data, tmp_path):
    """A sweep ranked by choice accuracy, with a user metric from a module next to the space file."""
    space = {
        "name": "labels",
        "model": {"path": "builtin:tiny-llama", "max_seq_len": 32},
        "data": {"train": str(label_data["train"]), "eval": str(label_data["eval"]), "max_eval_samples": 8},
        "space": {"strategy": "list", "configs": [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
                                                   {"rank": 4, "alpha": 8, "learning_rate": 1e-3, "batch_size": 4}]},
        "training": {"steps": 3},
        "eval": {"metrics": ["loss", "choice_accuracy", "plora_test_metrics_mod:first_letter"], "choices": LABELS,
                 "objective": "choice_accuracy", "max_new_tokens": 4},
        "hardware": {"device": "cpu"},
        "output": {"dir": str(tmp_path / "runs")},
    }
    path = label_data["dir"] / "space.yaml"
    path.write_text(yaml.safe_dump(space))
    result = CliRunner().invoke(__import__("plora.cli", fromlist=["app"]).app, ["sweep", str(path)],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "runs" / "labels" / "results.parquet")
    assert set(frame.status) == {"done"}
    assert frame.eval_choice_accuracy.between(0, 1).all() and frame.eval_first_letter.between(0, 1).all()
    assert frame.eval_exact_match.isna().all()  # not measured
    assert "best configurations by choice_accuracy" in result.output and "accuracy" in result.output
