"""Data checked before anything runs: every row read, shaped and tokenized as a job will.

A sweep's data is read here by the same code its jobs use (`plora.data.dataset.prepare_data`), with
the model's own tokenizer and chat template, so a bad file, line or cell, an answer cut
away by ``max_seq_len`` or an eval set with no rows is one line naming it, at validation,
before a run directory exists: never a job that crashes, retries and leaves one behind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plora.job.config import JobData, JobEval

if TYPE_CHECKING:
    from plora.data.dataset import Sample
    from plora.spec.schema import SweepSpec

__all__ = ["DataReport", "check_data", "data_config", "eval_config"]


def data_config(spec: "SweepSpec") -> JobData:
    """The ``data`` section a job reads (paths as text; the eval-row limit goes to `eval_config`)."""
    return JobData(**spec.data.model_dump(mode="json", exclude={"max_eval_samples"}))


def eval_config(spec: "SweepSpec") -> JobEval:
    """The ``eval`` section a job reads: metrics as the space file names them, where a job
    imports user metrics from, and the label choices."""
    from plora.results.metrics import metric_paths

    return JobEval(
        metrics=list(spec.eval.metrics),
        max_new_tokens=spec.eval.max_new_tokens,
        max_eval_samples=spec.data.max_eval_samples,
        every_steps=spec.eval.every_steps,
        objective=spec.eval.objective,
        greater_is_better=not spec.eval.minimize,
        intermediate_samples=spec.eval.intermediate_samples,
        each_epoch=spec.scored_epochs > 1,
        choices=list(spec.eval.choices) if spec.eval.choices is not None else None,
        choices_column=spec.eval.choices_column,
        python_path=metric_paths(spec.eval.metrics),
        batch_rows=spec.eval.batch_rows,
    )


@dataclass
class DataReport:
    """What the check found: usable rows per split, and notes for the user (rows cut by
    ``max_seq_len``, rows dropped)."""

    num_train: int
    num_eval: int
    notes: list[str] = field(default_factory=list)
    #: the scored eval rows' mean tokens, and mean prompt tokens (those without a label)
    eval_row_tokens: float = 0.0
    eval_prompt_tokens: float = 0.0


def check_data(spec: "SweepSpec") -> DataReport:
    """Read and tokenize the sweep's train and eval rows; raises `plora.data.dataset.DataError`
    (one line: file, line or row, column) or `plora.models.loading.ModelError`."""
    from plora.data.dataset import DataError, TextTokenizer, prepare_data
    from plora.models.folders import read_model_info

    info = read_model_info(spec.model.resolved_path(), spec.model.family)
    tok = TextTokenizer(info.path, info.eos_token_id, info.pad_token_id)
    max_len = spec.model.max_seq_len
    data = prepare_data(data_config(spec), eval_config(spec), tok, max_len)
    if spec.data.eval is not None and not data.eval:
        raise DataError(f"data.eval: {spec.data.eval} has no usable rows")
    row, prompt = mean_row_sizes(data.eval)
    return DataReport(len(data.train), len(data.eval), data.notes(max_len), eval_row_tokens=row,
                      eval_prompt_tokens=prompt)


def mean_row_sizes(samples: Sequence["Sample"]) -> tuple[float, float]:
    """Rows' mean tokens, and mean prompt tokens (those without a label); 0, 0 for none."""
    if not samples:
        return 0.0, 0.0
    n = len(samples)
    return (sum(len(x.tokens) for x in samples) / n,
            sum(sum(1 for t in x.labels if t < 0) for x in samples) / n)
