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
from typer.testing import CliRunner

from conftest import job_config, tiny_space, write_space
from plora.data.dataset import IGNORE_INDEX
from plora.results.evaluate import evaluate_adapters
from plora.results.metrics import (
    MetricError,
    check_metric,
    choice_accuracy,
    exact_match,
    metric_name,
    metric_paths,
    score_predictions,
)
from plora.train.packed_lora import PackedLoRARecipe

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
    with pytest.raises(MetricError, match="unknown metric 'meteor'"):
        check_metric("meteor")
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
    space = tiny_space(
        tmp_path, name="labels", max_seq_len=32, lora=None,
        data={"train": str(label_data["train"]), "eval": str(label_data["eval"]), "max_eval_samples": 8},
        space={"strategy": "list", "configs": [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4},
                                               {"rank": 4, "alpha": 8, "learning_rate": 1e-3, "batch_size": 4}]},
        training={"steps": 3},
        eval={"metrics": ["loss", "choice_accuracy", "plora_test_metrics_mod:first_letter"], "choices": LABELS,
              "objective": "choice_accuracy", "max_new_tokens": 4})
    path = write_space(label_data["dir"] / "space.yaml", space)
    result = CliRunner().invoke(__import__("plora.cli", fromlist=["app"]).app, ["sweep", str(path)],
                                terminal_width=200)
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "runs" / "labels" / "results.parquet")
    assert set(frame.status) == {"done"}
    assert frame.eval_choice_accuracy.between(0, 1).all() and frame.eval_first_letter.between(0, 1).all()
    assert frame.eval_exact_match.isna().all()  # not measured
    assert "best configurations by choice_accuracy" in result.output and "accuracy" in result.output


# ------------------------------------------------------------------ ROUGE-L, BLEU, perplexity

ANSWERS = ["the cat sat on the mat", "a quick brown fox", "It wasn't surprising.", ""]
REFERENCES = ["the cat is on the mat", "the quick brown fox jumps", "It was not unexpected.", "nothing"]


def test_rouge_l_and_bleu_are_the_packages_own_scores():
    from rouge_score.rouge_scorer import RougeScorer
    from sacrebleu.metrics import BLEU

    from plora.results.metrics import bleu, rouge_l

    # ROUGE-L F1 by hand: a common subsequence of 5 words of 6 and 6; 3 of 4 and 5; 1 ("it")
    # of 4 and 4 (rouge-score reads letters and digits: "wasn't" is "wasn t"); nothing
    by_hand = [5 / 6, 2 * (3 / 4) * (3 / 5) / (3 / 4 + 3 / 5), 1 / 4, 0.0]
    scorer = RougeScorer(["rougeL"])
    assert [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(ANSWERS, REFERENCES)] == pytest.approx(by_hand)
    assert rouge_l(ANSWERS, REFERENCES) == pytest.approx(sum(by_hand) / 4)
    assert bleu(ANSWERS, REFERENCES) == pytest.approx(BLEU().corpus_score(ANSWERS, [REFERENCES]).score)
    assert bleu(REFERENCES, REFERENCES) == pytest.approx(100.0) and bleu(["x y z w"] * 2, ["a b c d"] * 2) == 0.0
    out = score_predictions(["exact_match", "rouge_l", "bleu"], ANSWERS, REFERENCES)
    assert out == {"eval_exact_match": 0.0, "eval_rouge_l": pytest.approx(sum(by_hand) / 4),
                   "eval_bleu": pytest.approx(bleu(ANSWERS, REFERENCES))}


def test_perplexity_and_the_direction_of_each_metric():
    from plora.results.metrics import lower_is_better, minimize, perplexity
    from plora.spec.loading import parse_spec

    assert perplexity(0.0) == 1.0 and perplexity(math.log(7.5)) == pytest.approx(7.5)
    assert perplexity(1e6) == math.inf and math.isnan(perplexity(math.nan))
    assert [lower_is_better(m) for m in ("loss", "perplexity", "exact_match", "rouge_l", "bleu", "m:f")] == \
        [True, True, False, False, False, False]
    assert minimize("perplexity") and not minimize("bleu") and minimize("bleu", False) and not minimize("loss", True)

    def spec(**ev):
        return parse_spec({"name": "t", "eval": {"metrics": ["loss", "perplexity", "rouge_l", "bleu"], **ev}})

    assert spec(objective="perplexity").eval.minimize and not spec(objective="rouge_l").eval.minimize
    assert not spec(objective="perplexity", greater_is_better=True).eval.minimize
    assert spec().eval.objective == "loss"  # no exact match measured: the first metric


@pytest.mark.parametrize("metric, module, package", [("rouge_l", "rouge_score", "rouge-score"),
                                                     ("bleu", "sacrebleu", "sacrebleu")])
def test_a_missing_metric_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, metric, module, package):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    write_space(tmp_path / "space.yaml", tiny_space(tmp_path, eval={"metrics": ["loss", metric]}))
    result = CliRunner().invoke(__import__("plora.cli", fromlist=["app"]).app, ["sweep", str(tmp_path / "space.yaml")])
    assert result.exit_code == 2
    assert result.output.strip() == f'error: eval.metrics[1]: {metric} needs the {package} package: pip install "plora[metrics]"'
    assert not (tmp_path / "runs").exists()


def test_a_sweep_measures_and_ranks_by_them(swept_run):
    """The swept run measures loss, exact match, perplexity, ROUGE-L and BLEU and ranks by
    perplexity, lower first."""
    frame = pd.read_parquet(swept_run.run / "results.parquet")
    assert {"eval_perplexity", "eval_rouge_l", "eval_bleu"} <= set(frame.columns)
    assert frame.eval_perplexity.tolist() == pytest.approx([math.exp(x) for x in frame.eval_loss])
    assert frame.eval_rouge_l.between(0, 1).all() and frame.eval_bleu.between(0, 100).all()
    for a in frame.adapter_id:
        m = json.loads((swept_run.run / "adapters" / a / "metrics.json").read_text())
        assert {"eval_loss", "eval_exact_match", "eval_perplexity", "eval_rouge_l", "eval_bleu"} <= set(m)
    base = json.loads((swept_run.run / "base_metrics.json").read_text())
    assert base["eval_perplexity"] == pytest.approx(math.exp(base["eval_loss"])) and "eval_bleu" in base
    assert "best configurations by perplexity" in swept_run.output
    best = frame.sort_values("eval_perplexity").adapter_id.tolist()
    lines = [line for line in swept_run.output.splitlines() if any(a in line for a in best)]
    assert [next(a for a in best if a in line) for line in lines[-2:]] == best
