"""An adapter's rows in batches of nearly equal tokens, so that rows of varied length cost a
replayed step what fixed-length rows cost.

A CUDA-graph step has fixed shapes. Rows of varied length, right-padded, pay for the longest
row of their step (length buckets bring that to about 1.2x the real tokens on rows of
66-440 tokens, `plora.data.row_layout.bucketed_row_tokens`); flattened, each adapter's segment
needs a fixed size, and the sum of a random batch's lengths varies so much from step to step
that a size that holds every step wastes as much (a bs-4 batch's sum reaches 1.5x its mean).

A `BalancedStream` draws the adapter's rows in the plain shuffled order (`AdapterStream`),
``GROUP_STEPS`` batches' worth at a time (a group ends with its epoch), and deals each group into batches whose token
counts are nearly equal (longest rows first, each into the batch with fewest tokens so far
that still has room), in a seeded order. Every row is still seen once an epoch (up to a
group's worth across an epoch's end), each batch still holds ``batch_size`` rows, and the
order depends only on the adapter's own seed, batch size and data: packed still equals
alone. A step's segment is then sized once for all of an adapter's steps
(`max_batch_tokens`), about 1.05x its mean on those rows.
"""

from __future__ import annotations

import heapq

from collections.abc import Sequence
from typing import Any

import numpy as np

from plora.data.accumulation import split_batch
from plora.data.dataset import AdapterStream, DataError

__all__ = ["BALANCED_MULTIPLE", "GROUP_STEPS", "BalancedStream", "balanced_batches", "balanced_row_tokens",
           "balanced_rows_cost"]

#: batches dealt together, and at least `GROUP_ROWS` rows: more balance more evenly (a segment
#: size nearer the mean), fewer keep more of the shuffle's randomness in which rows share a
#: batch. Within 5% of the mean for batch sizes 2-8 on rows of 66-440 tokens.
GROUP_STEPS = 64
GROUP_ROWS = 256
#: a balanced segment's size is a multiple of this (`plora.train.packed.rows.held_sizes`)
BALANCED_MULTIPLE = 8


def balanced_batches(rows: Sequence[int], lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """``rows`` dealt into batches of ``batch_size`` rows (the last may be short) of nearly
    equal total length: longest first, each into the emptiest batch with room (ties: the
    first)."""
    n = len(rows)
    if n == 0:
        return []
    k = -(-n // batch_size)
    room = [batch_size] * k
    if n % batch_size:
        room[-1] = n % batch_size
    batches: list[list[int]] = [[] for _ in range(k)]
    # the batches with room, emptiest first (ties: the first): a heap of (total, batch), where a
    # scan of every batch per row took a sweep's planning 0.8 s for its four epochs' pricing
    open_ = [(0, b) for b in range(k)]
    for i in sorted(rows, key=lambda r: (-int(lengths[r]), r)):
        total, j = heapq.heappop(open_)
        batches[j].append(int(i))
        if len(batches[j]) < room[j]:
            heapq.heappush(open_, (total + int(lengths[i]), j))
    return batches


class BalancedStream:
    """An adapter's rows in batches of ``batch_size`` with nearly equal tokens (see the module
    docstring); `next` takes a batch at a time."""

    def __init__(self, num_samples: int, seed: int, *, lengths: Sequence[int], batch_size: int,
                 group_steps: int = GROUP_STEPS):
        if num_samples <= 0:
            raise DataError("the training set is empty")
        self.num_samples = num_samples
        self.seed = int(seed)
        self.lengths = [int(n) for n in list(lengths)[:num_samples]]
        self.batch_size = max(1, int(batch_size))
        self.group_steps = max(1, int(group_steps), -(-GROUP_ROWS // self.batch_size))
        self._rows = AdapterStream(num_samples, seed)  # the plain shuffled order the groups come from
        self._group_start: dict[str, Any] = self._rows.state_dict()
        self._groups = 0  # groups dealt so far
        self._queue: list[list[int]] = []
        self._taken = 0  # batches of the current group taken

    @property
    def buckets(self) -> int:
        return 1

    def _deal(self) -> None:
        self._group_start = self._rows.state_dict()
        # a group ends with its epoch (only the rows that do not fill a batch go on into the
        # next, as the plain shuffle's batches do): each epoch still sees every row once
        left = self._rows.rows_left_in_epoch()
        if left < self.batch_size:  # the epoch has no batch left: this group is the next epoch's
            left += self.num_samples  # (a lone batch dealt here would be as unbalanced as a random one)
        take = min(self.batch_size * self.group_steps, left - left % self.batch_size) or self.batch_size
        rows = self._rows.next(take)
        batches = balanced_batches(rows, self.lengths, self.batch_size)
        order = np.random.default_rng([self.seed, 104729, self._groups]).permutation(len(batches))
        self._queue = [batches[int(i)] for i in order]
        self._groups += 1
        self._taken = 0

    def next(self, count: int) -> list[int]:
        if count != self.batch_size:
            raise ValueError(f"a balanced stream of batch size {self.batch_size} was asked for {count} rows")
        if not self._queue:
            self._deal()
        self._taken += 1
        return self._queue.pop(0)

    def max_batch_tokens(self, steps: int, weights: Sequence[int] | None = None) -> int:
        """The most tokens (or of ``weights`` per row: labels, say) any of the next ``steps``
        batches holds; the stream itself does not move."""
        return self.max_batch_sums(steps, [self.lengths if weights is None else weights])[0]

    def max_batch_sums(self, steps: int, weights: Sequence[Sequence[int]], parts: int = 1) -> list[int]:
        """For each of ``weights`` (a number per row), the most any of the next ``steps``
        batches holds, dealt once for all of them; with ``parts`` > 1, the most any part of
        them holds (the micro-batches of an adapter that accumulates: `plora.data.accumulation`)."""
        per_row = [[int(w) for w in ws] for ws in weights]
        probe = BalancedStream(self.num_samples, self.seed, lengths=self.lengths, batch_size=self.batch_size)
        probe.group_steps = self.group_steps
        probe.load_state_dict(self.state_dict())
        most = [0] * len(per_row)
        for _ in range(max(0, int(steps))):
            for batch in split_batch(probe.next(self.batch_size), parts):
                for j, ws in enumerate(per_row):
                    most[j] = max(most[j], sum(ws[i] for i in batch))
        return most

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is: its current group's start and the batches taken from it."""
        return {"balanced": self.group_steps, "groups": self._groups, "taken": self._taken,
                "group_start": dict(self._group_start)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state.get("balanced", 0)) != self.group_steps:
            raise DataError("the checkpoint's data position was saved with another row order")
        groups, taken = int(state["groups"]), int(state["taken"])
        self._rows.load_state_dict(state["group_start"])
        self._queue, self._taken = [], 0
        if groups == 0:
            self._groups, self._group_start = 0, self._rows.state_dict()
            return
        self._groups = groups - 1
        self._deal()
        for _ in range(taken):
            self._queue.pop(0)
        self._taken = taken


def balanced_rows_cost(lengths: list[int], batch_sizes: Sequence[int]) -> float:
    """What a row of a sweep whose adapters have these ``batch_sizes`` costs a graphed step in
    balanced batches, on average over its rows (`balanced_row_tokens` at each batch size)."""
    sizes = [max(1, int(b)) for b in batch_sizes] or [2]
    price = {b: balanced_row_tokens(lengths, b) for b in set(sizes)}
    return sum(b * price[b] for b in sizes) / sum(sizes)


def balanced_row_tokens(lengths: list[int], batch_size: int = 2, steps: int = 1024) -> float:
    """What a row costs a graphed step in balanced batches: the segment size that holds
    ``steps`` batches of ``batch_size`` (one per adapter, `plora.data.balanced_stream`), per row.
    At batch size 1 nothing balances: the segment holds the longest row."""
    if not lengths:
        return 0.0
    stream = BalancedStream(len(lengths), 0, lengths=lengths, batch_size=batch_size)
    most = stream.max_batch_tokens(min(steps, max(1, 4 * len(lengths) // batch_size)))
    size = -(-(most + 1) // BALANCED_MULTIPLE) * BALANCED_MULTIPLE
    return size / batch_size
