"""Eval metrics by name: the built-in ones and a user's ``module:function``.

A metric is named in the space file (``eval.metrics``) and lands in results as
``eval_<name>``: ``loss``, ``perplexity`` (exp of the eval loss), ``exact_match`` (the
greedy answer equals the reference), ``rouge_l`` and ``bleu`` (the greedy answers against
the references, by the maintained ``rouge-score`` and ``sacrebleu`` packages: the
``plora[metrics]`` extra), ``choice_accuracy`` (the label choice with the highest
log-likelihood is the reference: no generation) and user metrics, called with the generated
predictions and the references and returning a float (named after the function:
``mymetrics:f1`` gives ``eval_f1``). A user metric is imported, and a metric's package
looked for, when the space file is validated, so a typo or a missing package fails there,
not in a job.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "BUILTIN_METRICS",
    "LOWER_IS_BETTER",
    "MetricError",
    "bleu",
    "check_metric",
    "choice_accuracy",
    "exact_match",
    "generated_metrics",
    "load_metric",
    "lower_is_better",
    "metric_name",
    "metric_paths",
    "minimize",
    "needs_eval_loss",
    "perplexity",
    "rouge_l",
    "score_predictions",
]

BUILTIN_METRICS: tuple[str, ...] = ("loss", "perplexity", "exact_match", "rouge_l", "bleu", "choice_accuracy")
#: metrics where lower is better (every other one, a user's too, is higher-is-better by default)
LOWER_IS_BETTER: tuple[str, ...] = ("loss", "perplexity")
#: metrics scored from the greedy answers by a built-in function
_GENERATED: tuple[str, ...] = ("exact_match", "rouge_l", "bleu")
#: metrics computed by a package of the ``plora[metrics]`` extra: (import name, PyPI name)
_PACKAGES: dict[str, tuple[str, str]] = {"rouge_l": ("rouge_score", "rouge-score"), "bleu": ("sacrebleu", "sacrebleu")}
METRICS_EXTRA = "plora[metrics]"


class MetricError(ValueError):
    """A metric that cannot be used; the message is one line."""


def is_user_metric(name: str) -> bool:
    return ":" in name


def metric_name(name: str) -> str:
    """The name a metric has in results (``eval_<name>``)."""
    if is_user_metric(name):
        return name.split(":", 1)[1].replace(".", "_")
    return name


def generated_metrics(names: Sequence[str]) -> list[str]:
    """The metrics that need generated answers: exact match, ROUGE-L, BLEU and user metrics."""
    return [n for n in names if n in _GENERATED or is_user_metric(n)]


def needs_eval_loss(names: Sequence[str]) -> bool:
    """Whether these metrics need the eval loss (perplexity is its exponential)."""
    return any(n in LOWER_IS_BETTER for n in names)


def lower_is_better(name: str) -> bool:
    """A metric's own direction (`LOWER_IS_BETTER`), by its results name."""
    return metric_name(name) in LOWER_IS_BETTER


def minimize(objective: str, greater_is_better: bool | None = None) -> bool:
    """Whether a lower ``objective`` ranks first: ``eval.greater_is_better`` when the space
    file sets it, else the metric's own direction. The one rule every ranking follows (the
    results table, the Optuna study, the report, ``plora export --best``)."""
    if greater_is_better is not None:
        return not greater_is_better
    return lower_is_better(objective)


def _resolve(name: str) -> Callable:
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise MetricError(f"{name!r}: a user metric is written module:function")
    importlib.invalidate_caches()  # a module written after this process looked at its folder
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        raise MetricError(f"{name!r}: cannot import {module_name!r} ({e})") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise MetricError(f"{name!r}: importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise MetricError(f"{name!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise MetricError(f"{name!r}: {attr!r} is not callable")
    return obj


def check_metric(name: str, base_dir: Path | None = None) -> None:
    """A built-in metric, or a user metric that imports and is callable. A module next to
    the space file (``base_dir``) is found too: that folder joins the import path."""
    if not is_user_metric(name):
        if name not in BUILTIN_METRICS:
            raise MetricError(f"unknown metric {name!r}; expected one of {', '.join(BUILTIN_METRICS)} "
                              "or a user metric module:function")
        if name in _PACKAGES:
            module, package = _PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise MetricError(f"{name} needs the {package} package: pip install \"{METRICS_EXTRA}\"")
        return
    if base_dir is not None and str(base_dir) not in sys.path:
        try:
            _resolve(name)
            return
        except MetricError:
            sys.path.append(str(base_dir))
    _resolve(name)


def load_metric(name: str) -> Callable:
    """The user metric's function."""
    return _resolve(name)


def metric_paths(names: Sequence[str]) -> list[str]:
    """Folders a job process adds to its import path to import these user metrics (it runs
    in its own folder, where the space file's folder is not on the path)."""
    out: list[str] = []
    for name in names:
        if not is_user_metric(name):
            continue
        module_name = name.split(":", 1)[0]
        module = sys.modules.get(module_name) or importlib.import_module(module_name)
        origin = getattr(module, "__file__", None)
        if not origin:
            continue
        root = Path(origin).resolve().parent
        depth = module_name.count(".") + (1 if Path(origin).name == "__init__.py" else 0)
        for _ in range(depth):
            root = root.parent
        if str(root) not in out:
            out.append(str(root))
    return out


def use_metric_paths(paths: Sequence[str]) -> None:
    """Put `metric_paths`' folders on this process's import path (a job's start)."""
    for p in paths:
        if p not in sys.path:
            sys.path.append(p)


def exact_match(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Share of answers equal to their reference (surrounding whitespace ignored)."""
    hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references))
    return hits / max(1, len(references))


def choice_accuracy(scores: Sequence[Sequence[float]], gold: Sequence[int]) -> float:
    """Share of rows whose highest-scoring choice (log-likelihood) is the right one."""
    hits = sum(max(range(len(s)), key=lambda j: s[j]) == g for s, g in zip(scores, gold))
    return hits / max(1, len(gold))


def rouge_l(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Mean ROUGE-L F1 of each answer against its reference, by ``rouge-score`` (its own
    tokenization: lowercased letters and digits, no stemming), in [0, 1]."""
    from rouge_score.rouge_scorer import RougeScorer

    scorer = RougeScorer(["rougeL"], use_stemmer=False)
    scores = [scorer.score(r, p)["rougeL"].fmeasure for p, r in zip(predictions, references)]
    return sum(scores) / max(1, len(references))


def bleu(predictions: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU of the answers against one reference each, by ``sacrebleu`` with its
    defaults (13a tokenization, exponential smoothing), on sacrebleu's 0-100 scale: the
    number papers report."""
    import sacrebleu

    return float(sacrebleu.corpus_bleu(list(predictions), [list(references)]).score)


def perplexity(eval_loss: float) -> float:
    """exp of the token-weighted mean eval loss (inf where that overflows)."""
    try:
        return math.exp(eval_loss)
    except OverflowError:
        return math.inf


_SCORERS: dict[str, Callable[[Sequence[str], Sequence[str]], float]] = {
    "exact_match": exact_match, "rouge_l": rouge_l, "bleu": bleu,
}


def score_predictions(names: Sequence[str], predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """``eval_<name>`` of every generated metric. A user metric that raises or returns no
    number scores NaN, with a line on stderr: a metric never costs the training."""
    out: dict[str, float] = {}
    for name in names:
        if name in _SCORERS:
            out[f"eval_{name}"] = _SCORERS[name](predictions, references)
            continue
        try:
            value = float(load_metric(name)(list(predictions), list(references)))
        except Exception as e:  # noqa: BLE001 - the user's code
            print(f"metric {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            value = math.nan
        out[f"eval_{metric_name(name)}"] = value
    return out
