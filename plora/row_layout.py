"""How a job lays out a packed step's rows, and what a row then costs: one decision that the
recipe makes and the cost model prices, kept where both read it (and nothing else)."""

from __future__ import annotations

#: the right-padded batch width of a CUDA-graph step is a multiple of this (and never shrinks
#: while a composition's graph is held: `plora.recipes.step_graph.padded_width`)
WIDTH_MULTIPLE = 64


def rows_flattened(layout: str, *, graphed: bool) -> bool:
    """Whether a job's rows go flattened without padding, or right-padded to one width.

    ``training.row_layout`` "auto" flattens except in CUDA-graph steps: a flat pack's
    per-adapter segment sizes change from step to step, and a graph needs fixed ones (on an
    H100, a 16-adapter pack of rows 16-400 tokens long recaptured until its sizes settled:
    427 ms a step against 57 ms padded)."""
    return layout == "flat" or (layout != "padded" and not graphed)


def priced_row_tokens(layout: str, *, graphed: bool, mean_tokens: float, max_tokens: int, max_seq_len: int) -> float:
    """What one training row costs a step, in tokens: its real tokens when rows are
    flattened; right-padded, the width a job's graph settles on (the longest row, rounded up
    to `WIDTH_MULTIPLE`, at most ``max_seq_len``), since every row is padded to it."""
    if rows_flattened(layout, graphed=graphed):
        return float(mean_tokens)
    width = -(-int(max_tokens) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    return float(max(int(max_tokens), min(int(max_seq_len), width)))
