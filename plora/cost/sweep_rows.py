"""A sweep's rows as its jobs will see them, priced from its data: their tokens, their layout
and the eval one adapter gets.

What `plora.cost.model` prices a row at is a number; this module measures it on the sweep's
own rows (tokenized with the model's tokenizer), and resolves the sweep-wide row settings
(``training.row_layout``, ``training.length_buckets``) from them. Pricing only: a row that
cannot be read here is reported by validation and by the job, never here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from plora.cost.job import EvalLoad
from plora.data.row_layout import priced_row_tokens
from plora.results.metrics import generated_metrics
from plora.spec.defaults import eval_batch_rows

if TYPE_CHECKING:
    from plora.spec.schema import SweepSpec


#: training rows tokenized to price a sweep's steps (a sample of larger sets)
ROWS_SAMPLED = 2000


def _tokenizer(spec: "SweepSpec"):
    from plora.data.dataset import TextTokenizer
    from plora.models.folders import read_model_info

    info = read_model_info(spec.model.resolved_path(), spec.model.family)
    return TextTokenizer(info.path, info.eos_token_id, info.pad_token_id)


def _train_rows(spec: "SweepSpec") -> int | None:
    """How many training rows the sweep has (tokenizing none of them); None where unknown."""
    from plora.data.dataset import load_split
    from plora.data.check import data_config

    try:
        return len(load_split(data_config(spec), "train"))
    except Exception:  # noqa: BLE001 - pricing only: validation reports bad data
        return None


def train_row_lengths(spec: "SweepSpec") -> list[int] | None:
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


def sweep_row_layout(spec: "SweepSpec", *, graphed: bool, lengths: list[int] | None = None,
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


def sweep_length_buckets(spec: "SweepSpec", steps: Mapping[str, int], *, graphed: bool,
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


def train_row_tokens(spec: "SweepSpec", *, graphed: bool = False, length_buckets: int | str | None = None,
                     lengths: list[int] | None = None, row_layout: str | None = None,
                     batch_sizes: Sequence[int] | None = None) -> float | None:
    """What a sweep's training row costs a step, in tokens (`plora.data.row_layout.priced_row_tokens`):
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


def widest_train_row(spec: "SweepSpec", *, graphed: bool = False, lengths: list[int] | None = None,
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


def eval_load_for(spec: "SweepSpec", gpu: bool | None = None) -> EvalLoad | None:
    """The eval one adapter of a sweep gets: its eval rows (at most ``max_eval_samples``), their
    mean tokens and prompt tokens under the model's tokenizer, the tokens generated per row
    (``eval.max_new_tokens`` when a metric decodes answers), and the rows one eval forward
    takes on the sweep's device (``gpu``; None: as `plora.hardware.sweep_on_gpu` says). None
    without eval rows.

    Where the rows cannot be tokenized here, each counts as ``max_seq_len`` tokens."""
    from plora.data.dataset import load_split
    from plora.data.check import data_config, mean_row_sizes

    data = data_config(spec)
    cap = int(spec.data.max_eval_samples)
    examples = load_split(data, "eval")
    if not examples:
        return None
    seq = int(spec.model.max_seq_len)
    try:  # the rows a job scores: those left after tokenizing (as `prepare_data`), at most ``cap``
        from plora.data.dataset import tokenize_split

        samples = tokenize_split(examples, _tokenizer(spec), seq, eval=True, on_bad_rows="drop")[0][:cap]
        if not samples:
            return None
        count = len(samples)
        row, prompt = mean_row_sizes(samples)
    except Exception:  # noqa: BLE001 - pricing only: the job itself reports bad data
        count, row, prompt = min(len(examples), cap), float(seq), float(seq)
    return eval_load_of(spec, count, row, prompt, gpu)


def eval_load_of(spec: "SweepSpec", samples: int, row_tokens: float, prompt_tokens: float,
                 gpu: bool | None = None) -> EvalLoad:
    """`eval_load_for` of eval rows already counted and measured (``samples`` rows of
    ``row_tokens``, ``prompt_tokens`` of them prompt, on average)."""
    metrics = [str(m) for m in spec.eval.metrics]
    new = int(spec.eval.max_new_tokens) if generated_metrics(metrics) else 0
    scored = spec.scored_epochs
    if gpu is None:
        from plora.hardware import sweep_on_gpu

        gpu = sweep_on_gpu(spec)
    return EvalLoad(samples=int(samples), row_tokens=float(row_tokens), prompt_tokens=float(prompt_tokens),
                    max_new_tokens=new, batch_rows=eval_batch_rows(spec.eval.batch_rows, "cuda" if gpu else "cpu"),
                    evals=int(scored) if isinstance(scored, int) else 1,
                    beside_training=bool(gpu) and scores_beside_training(spec))


def scores_beside_training(spec: "SweepSpec") -> bool:
    """Whether a one-GPU job of this sweep scores leaving adapters beside its training: its
    steps replay CUDA graphs, the side lane is on (``PLORA_OVERLAP``) and no
    ``training.micro_batch_size`` is set (`plora.train.packed_lora`, `_leaves_on_lane`)."""
    from plora.job.step_settings import graphs_wanted
    from plora.settings import settings

    return (settings().overlap and getattr(spec.training, "micro_batch_size", None) is None
            and graphs_wanted(spec.training.cuda_graphs, "cuda", tp=False,
                              activation_checkpointing=spec.training.checkpointing))
