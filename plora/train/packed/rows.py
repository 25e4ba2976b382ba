"""One packed step's rows as tensors: flattened without padding, or right-padded.

Flattened (`flatten_rows`), the rows of every adapter become one sequence ``[1, T]`` with
T their real tokens: each row keeps its own positions (restarting at 0, so RoPE sees what
it would see alone) and its own attention span (`plora.train.packed.varlen_attention`). A step
then costs what its real tokens cost, whatever the other adapters' row lengths.

Both layouts also give the *label parts*: for each adapter, the flat positions whose
next-token label is not ignored, and those labels. The LM head and the loss run on these
positions only (`plora.train.packed.head_loss`).

CUDA graphs need shapes that do not change from step to step, so with ``fixed`` sizes
each adapter's segment is padded to a held size by one padding row (its own attention
span, no labels), and each adapter's label part by ignored entries; sizes grow in
multiples of `SIZE_MULTIPLE` and never shrink, so a composition settles on few captures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from plora.data.dataset import IGNORE_INDEX, Sample
from plora.data.row_layout import SIZE_MULTIPLE, round_up

#: a flattened batch has at least this many tokens (a trailing padding row, in no adapter's
#: segment, fills it up). Below 16 rows, MKL's float32 GEMM takes other code paths whose
#: rounding differs from the one of larger calls, so a short batch (an adapter alone) would
#: round differently from the same rows inside a pack.
MIN_TOKENS = 16


def held_sizes(needed: Sequence[int], held: Sequence[int] | None, *, extra: int = 0,
               multiple: int = SIZE_MULTIPLE) -> list[int]:
    """Fixed sizes for these needs: each ``needed + extra`` rounded up to ``multiple``;
    the held sizes are kept when every need fits in them, so sizes only grow."""
    if held is not None and len(held) == len(needed) and all(n + extra <= h for n, h in zip(needed, held)):
        return list(held)
    grown = [round_up(n + extra, multiple) for n in needed]
    if held is not None and len(held) == len(needed):
        grown = [max(g, h) for g, h in zip(grown, held)]
    return grown


def cu_seqlens(row_lengths: Sequence[int]) -> torch.Tensor:
    """Row boundaries, int32 [rows + 1] (the varlen-attention layout)."""
    cu = [0]
    for n in row_lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32)


def next_token_targets(samples: Sequence[Sample]) -> list[list[int]]:
    """Each row's next-token label at each of its positions (ignored at the last one)."""
    return [list(s.labels[1:]) + [IGNORE_INDEX] for s in samples]


@dataclass
class LabelParts:
    """Per adapter, the flat positions that carry a label, and the labels: ``index[p]`` is a
    position of the flattened hidden states, ``targets[p]`` its next-token label (ignored in
    a fixed size's padding entries), adapter k owning ``sizes[k]`` consecutive entries."""

    index: torch.Tensor  # [N] int64
    targets: torch.Tensor  # [N] int64
    sizes: list[int]
    counts: list[int]  # real labels of each adapter (the rest of its part is padding)


def label_parts(
    flat_targets: Sequence[int] | torch.Tensor, segments: Sequence[tuple[int, int]], sizes: Sequence[int] | None = None
) -> LabelParts:
    """The labelled positions of each adapter's segment ``[start, end)`` of a flat target list;
    padded to ``sizes`` (ignored entries pointing at position 0) when given."""
    flat = torch.as_tensor(flat_targets, dtype=torch.long)
    labelled = flat != IGNORE_INDEX
    index: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    out_sizes, counts = [], []
    for k, (start, end) in enumerate(segments):
        pos = torch.nonzero(labelled[start:end]).flatten() + start
        n = int(pos.numel())
        size = n if sizes is None else int(sizes[k])
        if size < n:
            raise ValueError(f"label part {k}: size {size} is smaller than its {n} labels")
        index += [pos, torch.zeros(size - n, dtype=torch.long)]
        targets += [flat[pos], torch.full((size - n,), IGNORE_INDEX, dtype=torch.long)]
        counts.append(n)
        out_sizes.append(size)
    empty = torch.zeros(0, dtype=torch.long)
    return LabelParts(torch.cat(index) if index else empty, torch.cat(targets) if targets else empty,
                      out_sizes, counts)


@dataclass
class FlatRows:
    """Rows flattened into one sequence (module docstring)."""

    tokens: torch.Tensor  # [1, T]
    positions: torch.Tensor  # [1, T]
    row_lengths: list[int]  # every row's length, padding rows included (they sum to T)
    segment_tokens: list[int]  # tokens of each adapter's LoRA segment (its rows and its padding row)
    labels: LabelParts
    real_tokens: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def max_row(self) -> int:
        return max(self.row_lengths)

    def cu_seqlens(self) -> torch.Tensor:
        return cu_seqlens(self.row_lengths)


def flatten_rows(
    samples: Sequence[Sample],
    rows_per_adapter: Sequence[int],
    pad_id: int,
    *,
    segment_sizes: Sequence[int] | None = None,
    label_sizes: Sequence[int] | None = None,
    min_tokens: int = MIN_TOKENS,
) -> FlatRows:
    """Flatten adapter-contiguous rows (``rows_per_adapter[k]`` rows for adapter k).

    ``segment_sizes`` (fixed shapes): adapter k's segment is padded to that many tokens by
    one padding row, which must then be at least one token long. The whole sequence is
    padded to ``min_tokens`` by a trailing row in no adapter's segment.
    """
    if sum(rows_per_adapter) != len(samples):
        raise ValueError(f"{len(samples)} rows for row counts {list(rows_per_adapter)}")
    targets = next_token_targets(samples)
    tokens: list[int] = []
    positions: list[int] = []
    flat_targets: list[int] = []
    lengths: list[int] = []
    segment_tokens: list[int] = []
    segments: list[tuple[int, int]] = []
    i = 0
    for k, n in enumerate(rows_per_adapter):
        start = len(tokens)
        for s, t in zip(samples[i : i + n], targets[i : i + n]):
            tokens.extend(s.tokens)
            positions.extend(range(len(s.tokens)))
            flat_targets.extend(t)
            lengths.append(len(s.tokens))
        i += n
        real = len(tokens) - start
        if segment_sizes is not None:
            pad = int(segment_sizes[k]) - real
            if pad < 1:
                raise ValueError(f"segment {k}: size {segment_sizes[k]} leaves no padding row after {real} tokens")
            _pad_row(tokens, positions, flat_targets, lengths, pad, pad_id)
        segments.append((start, len(tokens)))
        segment_tokens.append(len(tokens) - start)
    real_tokens = sum(len(s.tokens) for s in samples)
    if len(tokens) < min_tokens:
        _pad_row(tokens, positions, flat_targets, lengths, min_tokens - len(tokens), pad_id)
    return FlatRows(
        tokens=torch.tensor([tokens], dtype=torch.long),
        positions=torch.tensor([positions], dtype=torch.long),
        row_lengths=lengths,
        segment_tokens=segment_tokens,
        labels=label_parts(flat_targets, segments, label_sizes),
        real_tokens=real_tokens,
    )


def _pad_row(tokens: list[int], positions: list[int], targets: list[int], lengths: list[int], n: int,
             pad_id: int) -> None:
    # Positions restart at 0 like any row's; a padding row longer than the model's context
    # would index past its RoPE table, so its positions wrap (it attends only to itself and
    # nothing reads it, so what it computes does not matter).
    tokens.extend([pad_id] * n)
    positions.extend(p % max(1, MIN_TOKENS) for p in range(n))
    targets.extend([IGNORE_INDEX] * n)
    lengths.append(n)


def padded_label_parts(labels: torch.Tensor, rows_per_adapter: Sequence[int],
                       sizes: Sequence[int] | None = None) -> LabelParts:
    """Label parts of a right-padded batch ``[B, W]`` whose hidden states are flattened to
    ``[B·W]``: the same head-and-loss path as flattened rows."""
    width = labels.shape[1]
    shifted = torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), IGNORE_INDEX, dtype=labels.dtype)], 1)
    flat = shifted.reshape(-1)
    segments, row = [], 0
    for n in rows_per_adapter:
        segments.append((row * width, (row + n) * width))
        row += n
    return label_parts(flat, segments, sizes)
