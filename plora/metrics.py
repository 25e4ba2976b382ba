"""Eval metrics by name: the built-in ones and a user's ``module:function``.

A metric is named in the space file (``eval.metrics``) and lands in results as
``eval_<name>``: ``loss``, ``exact_match`` (the greedy answer equals the reference),
``choice_accuracy`` (the label choice with the highest log-likelihood is the reference: no
generation) and user metrics, called with the generated predictions and the references and
returning a float (named after the function: ``mymetrics:f1`` gives ``eval_f1``). A user
metric is imported when the space file is validated, so a typo fails there, not in a job.
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = [
    "BUILTIN_METRICS",
    "MetricError",
    "check_metric",
    "choice_accuracy",
    "exact_match",
    "generated_metrics",
    "load_metric",
    "metric_name",
    "metric_paths",
    "score_predictions",
]

BUILTIN_METRICS: tuple[str, ...] = ("loss", "exact_match", "choice_accuracy")


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
    """The metrics that need generated answers: exact match and user metrics."""
    return [n for n in names if n == "exact_match" or is_user_metric(n)]


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


def score_predictions(names: Sequence[str], predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """``eval_<name>`` of every generated metric. A user metric that raises or returns no
    number scores NaN, with a line on stderr: a metric never costs the training."""
    out: dict[str, float] = {}
    for name in names:
        if name == "exact_match":
            out["eval_exact_match"] = exact_match(predictions, references)
            continue
        try:
            value = float(load_metric(name)(list(predictions), list(references)))
        except Exception as e:  # noqa: BLE001 - the user's code
            print(f"metric {name}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            value = math.nan
        out[f"eval_{metric_name(name)}"] = value
    return out
