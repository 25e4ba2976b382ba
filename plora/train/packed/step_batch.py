"""The tensors of one packed step (or eval forward), flattened or padded, and their shapes.

`build_step_batch` turns adapter-contiguous rows into what the model and the loss read:
flattened rows (`plora.train.packed.rows.flatten_rows`, when the model's attention can be
confined to rows) or right-padded rows (`plora.data.dataset.collate`), each with the label parts
the chunked head reads (`plora.train.packed.head_loss`). With ``fixed`` shapes (a CUDA graph)
sizes come from the held ones and only grow (`plora.train.packed.rows.held_sizes`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from plora.data.dataset import IGNORE_INDEX, Sample, collate
from plora.train.packed.rows import SIZE_MULTIPLE, LabelParts, cu_seqlens, flatten_rows, held_sizes, padded_label_parts
from plora.data.balanced_stream import BALANCED_MULTIPLE
from plora.data.row_layout import padded_width


@dataclass
class StepBatch:
    """One batch on the host. ``shape``: what a CUDA graph of it is keyed on (equal shapes,
    equal tensor sizes and LoRA segments); ``segment_tokens``: each active adapter's LoRA
    segment (tokens); ``row_lengths``: rows of the flattened sequence (None when padded)."""

    flat: bool
    tokens: torch.Tensor  # [1, T] flattened, or [B, W] padded
    labels: LabelParts
    segment_tokens: list[int]
    real_tokens: int
    positions: torch.Tensor | None = None  # [1, T], flattened only
    row_lengths: list[int] | None = None
    max_len: int = 0
    shape: tuple = field(default_factory=tuple)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def cu_seqlens(self) -> torch.Tensor:
        return cu_seqlens(self.row_lengths or [])

    def last_positions(self) -> list[int]:
        """The flat position of each real row's last token (rows in order)."""
        if self.flat:
            out, end = [], 0
            for n in self.row_lengths or []:
                end += n
                out.append(end - 1)
            return out
        raise ValueError("padded batches: use the row lengths")


def row_labels(sample: Sample) -> int:
    """A row's number of next-token labels."""
    return sum(1 for t in sample.labels[1:] if t != IGNORE_INDEX)


def label_counts(samples: Sequence[Sample], rows_per_adapter: Sequence[int]) -> list[int]:
    """Each adapter's number of next-token labels in its rows."""
    out, i = [], 0
    for n in rows_per_adapter:
        out.append(sum(row_labels(s) for s in samples[i : i + n]))
        i += n
    return out


def build_step_batch(
    samples: Sequence[Sample],
    rows_per_adapter: Sequence[int],
    pad_id: int,
    *,
    flat: bool,
    fixed: bool = False,
    held: Sequence[tuple] | tuple | None = (),
    max_width: int | None = None,
    floors: tuple[Sequence[int], Sequence[int]] | None = None,
) -> StepBatch:
    """Rows of each adapter (adapter-contiguous) as a flattened or padded batch.

    ``fixed``: shapes for a CUDA graph. ``held``: the shapes of the graphs held for the same
    adapters and rows (`StepGraph.held_shapes`; one shape is taken too). Flattened rows grow
    the newest held shape only when the rows do not fit it; padded rows take the narrowest
    held width they fit, else a new width of their own (length-bucketed rows come in a few
    widths, each with its graph). ``max_width``: the padded layout's width cap (the model's
    context). ``floors``: flattened fixed shapes at least this large per adapter (tokens,
    labels), e.g. the largest batch each adapter's balanced stream will draw
    (`plora.data.balanced_stream`): one shape then holds every step, at a finer size multiple.
    """
    layout = "flat" if flat else "padded"
    shapes = [held] if held and isinstance(held[0], str) else list(held or ())
    shapes = [sh for sh in shapes if sh and sh[0] == layout]
    counts = label_counts(samples, rows_per_adapter) if fixed else None
    if flat:
        newest = shapes[-1] if shapes else None
        multiple = BALANCED_MULTIPLE if floors is not None else SIZE_MULTIPLE
        if fixed and floors is not None:
            counts = [max(c, int(f)) for c, f in zip(counts, floors[1])]
        labels_sizes = held_sizes(counts, newest[2] if newest else None, multiple=multiple) if fixed else None
        seg_sizes = None
        if fixed:
            real: list[int] = []
            i = 0
            for n in rows_per_adapter:
                real.append(sum(len(s.tokens) for s in samples[i : i + n]))
                i += n
            if floors is not None:
                real = [max(r, int(f)) for r, f in zip(real, floors[0])]
            seg_sizes = held_sizes(real, newest[1] if newest else None, extra=1, multiple=multiple)
        rows = flatten_rows(samples, rows_per_adapter, pad_id, segment_sizes=seg_sizes, label_sizes=labels_sizes)
        max_len = rows.max_row
        if fixed:  # a graph replays with other rows: a bound that holds for any of them
            # (a real row fits the context; a padding row, its segment)
            max_len = max(max_len, int(max_width or 0), max(seg_sizes or [0]))
        return StepBatch(True, rows.tokens, rows.labels, rows.segment_tokens, rows.real_tokens, rows.positions,
                         rows.row_lengths, max_len,
                         ("flat", tuple(seg_sizes or ()), tuple(labels_sizes or ())) if fixed else ())
    width = None
    labels_sizes = None
    if fixed:
        longest = max(len(s.tokens) for s in samples)
        fitting = [sh for sh in shapes if int(sh[1]) >= longest and len(sh[2]) == len(counts)
                   and all(c <= h for c, h in zip(counts, sh[2]))]
        if fitting:
            width, labels = min(((int(sh[1]), sh[2]) for sh in fitting), key=lambda wl: wl[0])
            labels_sizes = list(labels)
        else:
            width = padded_width(longest, max(longest, int(max_width or longest)))
            widest = [max(col) for col in zip(*(sh[2] for sh in shapes))] if shapes and all(
                len(sh[2]) == len(counts) for sh in shapes) else None
            labels_sizes = held_sizes(counts, widest)
    tokens, labels = collate(samples, pad_id, width=width)
    seq = tokens.shape[1]
    parts = padded_label_parts(labels, rows_per_adapter, labels_sizes)
    return StepBatch(False, tokens, parts, [n * seq for n in rows_per_adapter],
                     sum(len(s.tokens) for s in samples), max_len=seq,
                     shape=("padded", seq, tuple(labels_sizes or ())) if fixed else ())
