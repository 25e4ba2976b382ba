"""How a job lays out a packed step's rows, and what a row then costs: one decision that the
recipe makes and the cost model prices, kept where both read it (and nothing else)."""

from __future__ import annotations

#: the right-padded batch width of a CUDA-graph step is a multiple of this (`padded_width`)
WIDTH_MULTIPLE = 64


def padded_width(width: int, max_width: int) -> int:
    """The batch width in graph mode: rounded up to `WIDTH_MULTIPLE`, at most ``max_width``
    (never narrower than the batch), so that a composition's batches come in a few widths,
    each replayed from its own graph (`plora.train.step_graph.StepGraph`)."""
    return max(width, min(max_width, -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE))


#: fixed (CUDA-graph) segment and label-part sizes are multiples of this
SIZE_MULTIPLE = 64


def round_up(n: int, multiple: int = SIZE_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``: a graphed step's sizes come in few
    values, so a composition settles on few captures (and the sweep, which orders the first
    job's kernels from these sizes, needs no torch for it)."""
    return -(-n // multiple) * multiple


def rows_flattened(layout: str, *, graphed: bool) -> bool:
    """Whether a job's rows go flattened without padding, or right-padded to one width.

    ``training.row_layout`` "auto" flattens except in CUDA-graph steps: a flat pack's
    per-adapter segment sizes change from step to step, and a graph needs fixed ones (on an
    H100, a 16-adapter pack of rows 16-400 tokens long recaptured until its sizes settled:
    427 ms a step against 57 ms padded). "balanced" flattens everywhere: each adapter draws
    its rows in batches of nearly equal tokens (`plora.data.balanced_stream`), so one segment size
    holds all of its steps."""
    return layout in ("flat", "balanced") or (layout != "padded" and not graphed)


#: a graphed sweep whose rows, padded in their best length buckets, would cost at least this
#: many times their real tokens draws balanced batches instead (`sweep_row_layout`)
BALANCE_WHEN_PADDED_OVER = 1.08


def widest_row_tokens(layout: str, *, graphed: bool, lengths: list[int], max_seq_len: int) -> float:
    """The most tokens one row of these ``lengths`` takes in a step: the longest row (padded
    as padded steps pad it). What a sweep's memory counts every row at: any step may draw
    its longest rows together."""
    if not lengths:
        return float(max_seq_len)
    longest = min(max(lengths), int(max_seq_len))
    if rows_flattened(layout, graphed=graphed):
        return float(longest)
    return float(padded_width(longest, int(max_seq_len)))


def priced_row_tokens(layout: str, *, graphed: bool, lengths: list[int], max_seq_len: int,
                      length_buckets: int | str = "auto") -> float:
    """What one training row of these ``lengths`` costs a step, in tokens: its real tokens
    where rows are flattened (in balanced batches of a graphed step, a segment sized for
    every batch costs a little more: `plora.data.balanced_stream.balanced_row_tokens`, which its
    callers ask); right-padded, the width its step pads to: the longest row of
    its length bucket (`bucketed_row_tokens`; one bucket: of all rows), rounded up to
    `WIDTH_MULTIPLE`, at most ``max_seq_len``."""
    if not lengths:
        return 0.0
    flattened = rows_flattened(layout, graphed=graphed)
    if flattened:
        return sum(lengths) / len(lengths)
    buckets = length_buckets_for(length_buckets, flattened=False, graphed=graphed)
    return bucketed_row_tokens(list(lengths), buckets, max_seq_len)


#: ``training.length_buckets: auto``: where rows are padded, every adapter's rows are drawn
#: from this many length buckets in turn (`plora.data.dataset.AdapterStream`), so that the rows of one
#: step, whatever adapter they belong to, have about the same length
AUTO_LENGTH_BUCKETS = 8


def length_buckets_for(setting: int | str, *, flattened: bool, graphed: bool) -> int:
    """How many length buckets an adapter's rows are drawn from (1: a plain shuffle).

    "auto" buckets only the padded rows of CUDA-graph steps, the one place where a step
    pays for its longest row (flattened rows cost their real tokens whatever their lengths;
    padded eager steps are launch-bound), so everywhere else the order stays the plain
    shuffle. A sweep resolves "auto" to a number once (`auto_length_buckets`) and writes
    it into every job; "auto" left to a job means `AUTO_LENGTH_BUCKETS`."""
    if setting == "auto":
        return AUTO_LENGTH_BUCKETS if graphed and not flattened else 1
    return max(1, int(setting))


#: a batch shape new to a pack composition costs it about this many replayed steps of that
#: shape: its first step runs eagerly and its second is captured, both host-bound (H100,
#: 0.5B shape, 16 adapters: about 0.25 s eager and 0.3 s to capture, against 0.145 s replayed)
SHAPE_COST_STEPS = 4.0


def auto_length_buckets(lengths: list[int], max_seq_len: int, *, steps: int, compositions: int = 1) -> int:
    """The bucket count (1 to `AUTO_LENGTH_BUCKETS`) that costs a graphed job least.

    More buckets pad less (each step pads to the longest row of one bucket), but each
    bucket is one more batch shape, captured once in every pack composition a job goes
    through (`SHAPE_COST_STEPS`). Over ``steps`` steps and ``compositions`` compositions the
    cost is (steps + SHAPE_COST_STEPS x buckets x compositions) x the padded row width. On
    an H100, 16 adapters of rows 70-440 tokens over 256 steps and two compositions took
    37 s of steps with 8 buckets where fixed-length rows took 26 s."""
    if not lengths or steps <= 0:
        return AUTO_LENGTH_BUCKETS
    best, best_cost = 1, float("inf")
    for b in range(1, AUTO_LENGTH_BUCKETS + 1):
        cost = (steps + SHAPE_COST_STEPS * b * max(1, compositions)) * bucketed_row_tokens(lengths, b, max_seq_len)
        if cost < best_cost - 1e-9:
            best, best_cost = b, cost
    return best


def bucket_bounds(lengths: list[int] | tuple[int, ...], buckets: int) -> list[list[int]]:
    """Row indices in ``buckets`` length buckets of (as near as possible) equal size, shortest first."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    n, b = len(order), max(1, min(int(buckets), len(order) or 1))
    return [order[k * n // b:(k + 1) * n // b] for k in range(b)]


def bucketed_row_tokens(lengths: list[int], buckets: int, max_seq_len: int) -> float:
    """What a padded row costs, in tokens, when rows come in length buckets: the mean over
    the buckets of the width each pads to (its longest row, rounded up to `WIDTH_MULTIPLE`)."""
    groups = [g for g in bucket_bounds(lengths, buckets) if g]
    if not groups:
        return 0.0
    widths = [padded_width(max(lengths[i] for i in g), int(max_seq_len)) for g in groups]
    return sum(w * len(g) for w, g in zip(widths, groups)) / sum(len(g) for g in groups)
