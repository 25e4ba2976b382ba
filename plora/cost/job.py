"""A job's time outside its steady training steps: fitted terms and the sweep's eval load.

On a GPU a packed job of a 0.5B model spends about as long starting, loading, capturing
graphs, evaluating and saving as it spends in its steps; a plan that prices only the steps
predicts half the makespan. These terms are measured from the phases a job records
(`plora.job.phases.PhaseClock`, summary.json ``phases``), fitted here, cached with the
profile (`plora.cost.profiling`), and used by `plora.cost.model.CostModel.job_time`:

    job = fixed + Σ_phases steps·step_time + capture·(phases - 1) + Σ_groups (eval(G) + save·|G|)

``fixed`` is the process start, model load, set-up, the first step's one-time costs and the
process exit; each change of the pack (an adapter leaving) costs a capture; adapters that
leave together are evaluated packed and saved then, inside the job:

    eval(G) = call + tok·rows·L + gen_fwd·m·⌈rows/batch⌉ + gen_tok·rows·m·(P + m/2),  rows = |G|·n

(once per epoch end where each epoch is scored: `EvalLoad.evals`) with n eval samples of
L tokens (P of them prompt), m new tokens generated per row (0 when
no metric generates). Every coefficient is non-negative and fitted on relative error, like
the step time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

from plora.results.metrics import generated_metrics
from plora.data.row_layout import priced_row_tokens

__all__ = ["EvalLoad", "JobOverheads", "eval_features", "fit_overheads"]

#: rows an eval forward takes at once (`plora.results.evaluate.evaluate_adapters`' default batch_rows)
EVAL_BATCH_ROWS = 256


@dataclass(frozen=True)
class EvalLoad:
    """What evaluating one adapter costs a sweep: its eval rows, their size, generation."""

    samples: int
    row_tokens: float
    prompt_tokens: float = 0.0
    max_new_tokens: int = 0  # 0: no metric generates
    batch_rows: int = EVAL_BATCH_ROWS
    #: bytes an eval batch may use beyond the job's weights and adapter state (None: unbounded,
    #: the batch is `batch_rows` rows whatever they need)
    budget_bytes: float | None = None
    #: evals each adapter gets on these rows: one at each epoch end with per-epoch scoring
    #: (`plora.train.epochs`), else 1 (its final eval). Adapters that leave together end
    #: their epochs together too (same batch size, same steps), so each eval is of the same group
    evals: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalLoad":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def eval_features(adapters: int, samples: int, row_tokens: float, prompt_tokens: float, max_new_tokens: int,
                  batch_rows: int = EVAL_BATCH_ROWS) -> list[float]:
    """The eval-time features of one packed eval (see the module docstring)."""
    rows = adapters * samples
    if rows <= 0:
        return [0.0, 0.0, 0.0, 0.0]
    m = max(0, int(max_new_tokens))
    return [1.0, float(rows * row_tokens), float(m * math.ceil(rows / max(1, batch_rows))),
            float(rows * m * (prompt_tokens + m / 2.0))]


@dataclass(frozen=True)
class JobOverheads:
    """Seconds a job spends outside its steady steps (see the module docstring)."""

    start_s: float = 0.0  # process creation to the recipe (interpreter, imports, CLI)
    load_s: float = 0.0  # the base model built and loaded
    setup_s: float = 0.0  # LoRA injection, data, optimizer
    warm_s: float = 0.0  # the first step over a steady one (kernel compilation, first capture)
    tail_s: float = 0.0  # after the summary is written until the process has exited
    capture_s: float = 0.0  # each later pack composition's first step over a steady one
    eval_call_s: float = 0.0
    eval_tok_s: float = 0.0
    eval_gen_fwd_s: float = 0.0
    eval_gen_tok_s: float = 0.0
    save_s: float = 0.0  # per adapter saved (PEFT files, metrics)
    jobs: int = 0  # job runs behind the fit

    @property
    def fixed_s(self) -> float:
        """Paid once by every job, whatever its adapters."""
        return self.start_s + self.load_s + self.setup_s + self.warm_s + self.tail_s

    def eval_time(self, adapters: int, load: EvalLoad | None) -> float:
        if load is None or adapters <= 0 or load.samples <= 0:
            return 0.0
        x = eval_features(adapters, load.samples, load.row_tokens, load.prompt_tokens, load.max_new_tokens,
                          load.batch_rows)
        c = (self.eval_call_s, self.eval_tok_s, self.eval_gen_fwd_s, self.eval_gen_tok_s)
        return float(sum(a * b for a, b in zip(x, c)))

    def exit_time(self, adapters: int, load: EvalLoad | None) -> float:
        """Seconds ``adapters`` adapters leaving the pack together add: their packed evals (one
        per epoch end with per-epoch scoring, `EvalLoad.evals`), saves."""
        if adapters <= 0:
            return 0.0
        evals = max(1, load.evals) if load is not None else 1
        return self.eval_time(adapters, load) * evals + self.save_s * adapters

    def scaled(self, factor: float) -> "JobOverheads":
        return JobOverheads(**{f.name: (getattr(self, f.name) * factor if f.name != "jobs" else self.jobs)
                               for f in fields(self)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "JobOverheads":
        known = {f.name for f in fields(cls)}
        return cls(**{k: (int(v) if k == "jobs" else float(v)) for k, v in d.items() if k in known})


def _steady(phase: dict[str, Any]) -> float | None:
    n = int(phase.get("steps", 0))
    return float(phase["rest_s"]) / (n - 1) if n >= 2 else None


def fit_overheads(runs: Sequence[dict[str, Any]], batch_rows: int = EVAL_BATCH_ROWS) -> JobOverheads:
    """The job terms from finished jobs' phases.

    ``runs``: one dict per job run, the ``phases`` of its summary.json, optionally with
    ``exited_at`` (when whoever started the process saw it end: gives the tail). Medians
    for the per-job terms (one slow start does not move them), a non-negative least-squares
    fit on relative error for the eval; the save time per adapter is the total over all saves.
    """
    runs = [r for r in runs if r]
    if not runs:
        raise ValueError("no job phases to fit")

    def median(values) -> float:
        values = [float(v) for v in values if v is not None]
        return statistics.median(values) if values else 0.0

    warm, capture = [], []
    for r in runs:
        phases = r.get("phases", [])
        for i, p in enumerate(phases):
            if i > 0 and p.get("reused"):  # replayed a held graph: no capture to measure
                continue
            steady = _steady(p)
            if steady is None and i + 1 < len(phases):  # a one-step phase: the next one's rate
                steady = _steady(phases[i + 1])
            if steady is None:
                continue
            (warm if i == 0 else capture).append(max(0.0, float(p["first_s"]) - steady))
    tails = [max(0.0, float(r["exited_at"]) - float(r["finished_at"])) for r in runs
             if r.get("exited_at") is not None and r.get("finished_at") is not None]
    saved = sum(int(s["adapters"]) for r in runs for s in r.get("saves", []))
    save_s = sum(float(s["seconds"]) for r in runs for s in r.get("saves", [])) / saved if saved else 0.0

    X, y = [], []
    for r in runs:
        for e in r.get("evals", []):
            if float(e.get("seconds", 0)) <= 0 or int(e.get("samples", 0)) <= 0:
                continue
            X.append(eval_features(int(e["adapters"]), int(e["samples"]), float(r.get("eval_row_tokens", 0.0)),
                                   float(r.get("eval_prompt_tokens", 0.0)), int(e.get("max_new_tokens", 0)),
                                   batch_rows))
            y.append(float(e["seconds"]))
    coef = _fit_eval(X, y)
    return JobOverheads(
        start_s=median(r.get("start_s") for r in runs),
        load_s=median(r.get("load_s") for r in runs),
        setup_s=median(r.get("setup_s") for r in runs),
        warm_s=median(warm),
        tail_s=median(tails),
        capture_s=median(capture),
        eval_call_s=coef[0], eval_tok_s=coef[1], eval_gen_fwd_s=coef[2], eval_gen_tok_s=coef[3],
        save_s=save_s,
        jobs=len(runs),
    )


def _fit_eval(X: list[list[float]], y: list[float]) -> list[float]:
    if not y:
        return [0.0] * 4
    import numpy as np
    from scipy.optimize import nnls

    A, b = np.asarray(X, dtype=float), np.asarray(y, dtype=float)
    used = np.abs(A).sum(axis=0) > 0  # a feature no event had (no generation) stays 0
    w = 1.0 / b
    Aw = A[:, used] * w[:, None]
    scale = np.linalg.norm(Aw, axis=0)
    scale[scale == 0] = 1.0
    c, _ = nnls(Aw / scale, b * w)
    out = np.zeros(A.shape[1])
    out[used] = c / scale
    return [float(v) for v in out]


#: training rows tokenized to price a sweep's steps (a sample of larger sets)
ROWS_SAMPLED = 2000


def _tokenizer(spec: Any):
    from plora.data.dataset import TextTokenizer
    from plora.models.loading import read_model_info

    info = read_model_info(spec.model.resolved_path(), spec.model.family)
    return TextTokenizer(info.path, info.eos_token_id, info.pad_token_id)


def _train_rows(spec: Any) -> int | None:
    """How many training rows the sweep has (tokenizing none of them); None where unknown."""
    from plora.data.dataset import load_split
    from plora.data.check import data_config

    try:
        return len(load_split(data_config(spec), "train"))
    except Exception:  # noqa: BLE001 - pricing only: validation reports bad data
        return None


def train_row_lengths(spec: Any) -> list[int] | None:
    """The tokens of a sweep's training rows as jobs see them (at most ``max_seq_len``
    each; the first `ROWS_SAMPLED` rows). None where they cannot be tokenized here."""
    try:
        from plora.data.dataset import load_split, tokenize_examples
        from plora.data.check import data_config

        examples = load_split(data_config(spec), "train")[:ROWS_SAMPLED]
        samples = tokenize_examples(examples, _tokenizer(spec), int(spec.model.max_seq_len))
        return [len(s.tokens) for s in samples] or None
    except Exception:  # noqa: BLE001 - pricing only: validation and the job report bad data
        return None


def sweep_row_layout(spec: Any, *, graphed: bool, lengths: list[int] | None = None,
                     batch_sizes: Sequence[int] = (2,)) -> str:
    """``training.row_layout`` resolved once for a whole sweep: "auto" becomes "balanced"
    where its jobs replay graphed steps, its rows vary so much in length that padding them
    (in their best length buckets) would cost `BALANCE_WHEN_PADDED_OVER` times their real
    tokens, and balanced batches of its adapters' ``batch_sizes`` cost less (at batch size 1
    nothing balances); the rows then come in batches of nearly equal tokens, flattened
    (`plora.data.balanced_stream`). Every job of the sweep gets the same layout, so an adapter's
    row order never depends on its pack-mates."""
    from plora.data.balanced_stream import balanced_rows_cost
    from plora.data.row_layout import AUTO_LENGTH_BUCKETS, BALANCE_WHEN_PADDED_OVER, bucketed_row_tokens

    setting = spec.training.row_layout
    if setting != "auto" or not graphed or not lengths:
        return setting
    mean = sum(lengths) / len(lengths)
    padded = bucketed_row_tokens(list(lengths), AUTO_LENGTH_BUCKETS, int(spec.model.max_seq_len))
    if mean <= 0 or padded / mean < BALANCE_WHEN_PADDED_OVER:
        return setting
    return "balanced" if balanced_rows_cost(list(lengths), batch_sizes) < padded else setting


def sweep_length_buckets(spec: Any, steps: Mapping[str, int], *, graphed: bool,
                         lengths: list[int] | None = None, row_layout: str | None = None) -> int | str:
    """``training.length_buckets`` resolved once for a whole sweep: "auto" becomes the count
    that costs its graphed, padded jobs least (`plora.data.row_layout.auto_length_buckets`) for
    its rows (``lengths``, else `train_row_lengths`) and step budgets. Every job of the sweep
    gets the same count, so an adapter's row order depends on the sweep's data and budgets,
    never on its pack-mates."""
    from plora.data.row_layout import auto_length_buckets, rows_flattened

    setting = spec.training.length_buckets
    layout = row_layout or spec.training.row_layout
    if setting != "auto" or not graphed or rows_flattened(layout, graphed=graphed) or not steps:
        return setting
    lengths = lengths if lengths is not None else train_row_lengths(spec)
    if not lengths:
        return setting
    budgets = list(steps.values())
    return auto_length_buckets(lengths, int(spec.model.max_seq_len), steps=max(budgets), compositions=len(set(budgets)))


def train_row_tokens(spec: Any, *, graphed: bool = False, length_buckets: int | str | None = None,
                     lengths: list[int] | None = None, row_layout: str | None = None,
                     batch_sizes: Sequence[int] | None = None) -> float | None:
    """What a sweep's training row costs a step, in tokens (`plora.job.step_settings.priced_row_tokens`):
    the mean real tokens of its rows (``lengths``, else `train_row_lengths`) where jobs flatten
    them, the width they are padded to where jobs pad them (``graphed``: steps replayed from
    CUDA graphs), in ``length_buckets`` (default: the spec's). None where they cannot be
    tokenized here."""
    lengths = lengths if lengths is not None else train_row_lengths(spec)
    if not lengths:
        return None
    buckets = spec.training.length_buckets if length_buckets is None else length_buckets
    layout = row_layout or spec.training.row_layout
    if layout == "balanced" and graphed:  # a segment sized for every batch (`plora.data.balanced_stream`)
        from plora.data.balanced_stream import balanced_rows_cost

        sizes = batch_sizes if batch_sizes is not None else [c.batch_size for c in spec.expand()]
        return balanced_rows_cost(list(lengths), sizes)
    return priced_row_tokens(layout, graphed=graphed, lengths=lengths, max_seq_len=int(spec.model.max_seq_len),
                             length_buckets=buckets)


def widest_train_row(spec: Any, *, graphed: bool = False, lengths: list[int] | None = None,
                     row_layout: str | None = None) -> float | None:
    """The most tokens a training row of the sweep takes in a step
    (`plora.data.row_layout.widest_row_tokens`): what its memory counts a row at. None where the
    rows cannot be tokenized here (then ``max_seq_len``)."""
    from plora.data.row_layout import widest_row_tokens

    lengths = lengths if lengths is not None else train_row_lengths(spec)
    if not lengths:
        return None
    if len(lengths) >= ROWS_SAMPLED:
        rows = _train_rows(spec)
        if rows is None or rows > len(lengths):
            return None  # a sample's longest row is not the set's: memory counts max_seq_len
    return widest_row_tokens(row_layout or spec.training.row_layout, graphed=graphed, lengths=lengths,
                             max_seq_len=int(spec.model.max_seq_len))


def eval_load_for(spec: Any) -> EvalLoad | None:
    """The eval one adapter of a sweep gets: its eval rows (at most ``max_eval_samples``), their
    mean tokens and prompt tokens under the model's tokenizer, and the tokens generated per
    row (``eval.max_new_tokens`` when a metric decodes answers). None without eval rows.

    Where the rows cannot be tokenized here, each counts as ``max_seq_len`` tokens."""
    from plora.data.dataset import load_split
    from plora.data.check import data_config

    data = data_config(spec)
    cap = getattr(spec.data, "max_eval_samples", None) or getattr(spec.eval, "max_samples", None) or 256
    examples = load_split(data, "eval")[: int(cap)]
    if not examples:
        return None
    seq = int(spec.model.max_seq_len)
    metrics = [str(m) for m in spec.eval.metrics]
    generates = bool(generated_metrics(metrics))
    new = int(spec.eval.max_new_tokens) if generates else 0
    try:
        from plora.data.dataset import tokenize_examples

        samples = tokenize_examples(examples, _tokenizer(spec), seq)
        row = sum(len(s.tokens) for s in samples) / len(samples)
        prompt = sum(sum(1 for x in s.labels if x < 0) for s in samples) / len(samples)
    except Exception:  # noqa: BLE001 - pricing only: the job itself reports bad data
        row, prompt = float(seq), float(seq)
    scored = getattr(spec, "scored_epochs", 1)
    return EvalLoad(samples=len(examples), row_tokens=float(row), prompt_tokens=float(prompt), max_new_tokens=new,
                    evals=int(scored) if isinstance(scored, int) else 1)


def measured_makespan(run_dir: Any) -> float | None:
    """Seconds from a run's first job start to its last job end, from its journal: the
    makespan a plan predicts (the sweep's own set-up and result collection are outside it)."""
    from pathlib import Path

    from plora.engine.journal import Journal

    path = Path(run_dir) / "journal.sqlite"
    if not path.is_file():
        return None
    journal = Journal(path)
    try:
        jobs = [j for j in journal.jobs() if j.started is not None and j.ended is not None]
    finally:
        journal.close()
    if not jobs:
        return None
    return max(j.ended for j in jobs) - min(j.started for j in jobs)
