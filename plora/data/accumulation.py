"""Gradient accumulation per adapter: how an adapter's effective batch is cut into the
micro-batches of the packed steps it spans.

An adapter's ``batch_size`` is its effective batch: the rows of one optimizer step. With
``training.micro_batch_size`` m, an adapter of batch B > m draws its B rows at once (the
same rows, in the same order, as one pass would) and trains them over ceil(B / m) packed
steps, in near-equal parts (larger first; none over m): B need not be a multiple of m. Its
optimizer, learning-rate schedule, clipping and divergence check act once, after its last
part; each part's loss is divided by the label tokens of the whole effective batch, so the
summed gradient is one pass's within float rounding. An adapter of B <= m, and every
adapter without a micro-batch size, trains its batch in one packed step, as before.

The planner and the cost model see such an adapter as what the packed steps hold: its
largest part's rows per step, for its optimizer steps × parts packed steps
(`plora.cost.model.packed_load`).
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def accumulation_steps(batch_size: int, micro_batch_size: int | None) -> int:
    """Packed steps one optimizer step of an adapter of effective batch ``batch_size`` spans."""
    if micro_batch_size is None or batch_size <= micro_batch_size:
        return 1
    return -(-int(batch_size) // int(micro_batch_size))


def micro_rows(batch_size: int, micro_batch_size: int | None) -> int:
    """The most rows the adapter puts in one packed step (its largest part)."""
    return -(-int(batch_size) // accumulation_steps(batch_size, micro_batch_size))


def split_batch(rows: Sequence[T], parts: int) -> list[list[T]]:
    """``rows`` in ``parts`` consecutive near-equal pieces, the larger first."""
    base, extra = divmod(len(rows), parts)
    out, start = [], 0
    for j in range(parts):
        n = base + (j < extra)
        out.append(list(rows[start : start + n]))
        start += n
    return out


def steps_for(num_train: int, batch_size: int, epochs: float = 1.0) -> int:
    """Optimizer steps of an adapter that sees ``epochs`` passes over ``num_train`` samples:
    ``ceil(epochs * num_train / batch_size)``, computed exactly (0.3 epochs of 10 samples at
    batch size 3 is 1 step, not the 2 that float rounding would give)."""
    from fractions import Fraction

    if num_train < 1:
        raise ValueError(f"num_train must be >= 1, got {num_train}")
    return max(1, math.ceil(Fraction(repr(float(epochs))) * num_train / batch_size))
