"""The job's training rows: each adapter's own stream of them, and a packed step's batch.

`TrainRows` holds the job's tokenized training rows and how ``training.row_layout`` and
``training.length_buckets`` lay them out: it gives each adapter its own seeded stream (the
data order it would see trained alone, in balanced batches where the sweep chose them), and
lays the rows of a packed step out as a batch: flattened without padding where attention can
be confined to each row, padded otherwise (`plora.train.packed.step_batch`). Which shapes a
replayed step may take is the step graphs' to say (``held``); this module only lays out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plora.data.accumulation import accumulation_steps
from plora.data.balanced_stream import BalancedStream
from plora.data.dataset import IGNORE_INDEX, AdapterStream, Sample
from plora.data.row_layout import length_buckets_for, rows_flattened
from plora.job.config import JobAdapter, JobTraining
from plora.train.adapter_run import AdapterRun
from plora.train.packed.step_batch import StepBatch, build_step_batch, row_labels
from plora.train.step_graph import Composition


class TrainRows:
    """The job's training rows, streamed per adapter and laid out per packed step.

    ``row_attention``: the model's per-row attention (`install_row_attention`; None: rows are
    padded), ``graphed``: whether steps may be replayed from CUDA graphs."""

    def __init__(self, samples: list[Sample], training: JobTraining, *, pad_id: int, max_seq_len: int,
                 row_attention, device: torch.device, dtype: torch.dtype, graphed: bool,
                 micro_batch_size: int | None):
        self.samples = samples
        self.row_layout = training.row_layout
        self.pad_id = pad_id
        self.max_seq_len = max_seq_len
        self.row_attention = row_attention
        self.device, self.dtype = device, dtype
        self.micro_batch_size = micro_batch_size
        #: whether an adapter of the job accumulates its batch (sticky: a step's inputs then
        #: carry every slot's accumulation, `plora.train.packed_step`)
        self.accumulates = micro_batch_size is not None
        self.lengths = [len(s.tokens) for s in samples]
        self.label_counts = [row_labels(s) for s in samples]
        self.buckets = length_buckets_for(training.length_buckets, flattened=self.flat(graphed), graphed=graphed)

    def __len__(self) -> int:
        return len(self.samples)

    def stream(self, a: JobAdapter) -> AdapterStream | BalancedStream:
        """An adapter's own data order from its start (a joined adapter's too, from length
        bucket 0 whatever bucket the pack is on: `AdapterStream` says why); in balanced
        batches where the sweep's rows are laid out so (`plora.data.balanced_stream`)."""
        if self.row_layout == "balanced":
            return BalancedStream(len(self.samples), a.seed, lengths=self.lengths, batch_size=a.batch_size)
        return AdapterStream(len(self.samples), a.seed, lengths=self.lengths, buckets=self.buckets)

    def adapter_run(self, index: int, a: JobAdapter, joined_at: int | None) -> AdapterRun:
        """A new adapter in slot ``index``, with its own stream and its accumulation parts."""
        micro = a.micro_batch_size if a.micro_batch_size is not None else self.micro_batch_size
        self.accumulates = self.accumulates or micro is not None
        return AdapterRun(index, a, self.stream(a), joined_at=joined_at,
                          parts=accumulation_steps(a.batch_size, micro))

    def next_parts(self, active: Sequence[AdapterRun]) -> list[list[Sample]]:
        """Each active adapter's rows of the next packed step, drawn from its stream."""
        return [[self.samples[i] for i in r.next_rows(self.label_counts)] for r in active]

    def floors(self, active: Sequence[AdapterRun]) -> tuple[list[int], list[int]] | None:
        """For a replayed step of balanced rows, each adapter's largest batch to come (tokens,
        labels): the step's shape holds every one of its steps (one capture a composition)."""
        if self.row_layout != "balanced":
            return None
        tokens, labels = [], []
        for r in active:
            if r.floor is None:  # every stream is balanced here (`stream`)
                left = max(1, r.total_steps - r.step)
                tokens_most, labels_most = r.stream.max_batch_sums(left, [self.lengths, self.label_counts],
                                                                   parts=r.parts)
                r.floor = (tokens_most, labels_most)
            tokens.append(r.floor[0])
            labels.append(r.floor[1])
        return tokens, labels

    def flat(self, graphed: bool) -> bool:
        """Whether a step's rows are flattened without padding: attention can be confined to
        rows (and, for a CUDA graph, read its row boundaries from the device) and
        ``training.row_layout`` allows it ("auto": not in graph-replayed steps)."""
        return (self.row_attention is not None and rows_flattened(self.row_layout, graphed=graphed)
                and (not graphed or self.row_attention.graph_safe(self.device, self.dtype)))

    def step_batch(self, samples: list[Sample], rows: list[int], graphed: bool, held: Sequence = (),
                   floors: tuple[list[int], list[int]] | None = None) -> StepBatch:
        """A step's batch of ``samples`` (``rows`` per adapter): flattened or padded (`flat`);
        ``held``: the shapes a replayed step may take; ``floors``: a balanced step's sizes."""
        flat = self.flat(graphed)
        return build_step_batch(samples, rows, self.pad_id, flat=flat, fixed=graphed, held=held,
                                max_width=self.max_seq_len, floors=floors if flat else None)

    def covered_batch(self, parts: list[list[Sample]], own: Composition, cover: Composition,
                      held: Sequence) -> StepBatch | None:
        """This step's rows laid out as ``cover``'s: each active slot its own rows, then
        one-token padding rows up to its rows in ``cover`` (a vacant slot: only those), in a
        shape of ``held`` (those ``cover`` has a graph of); None when the rows fit none of
        them. Padding rows have no labels (a vacant slot's loss is 0, and its optimizer row
        says "leave alone"); every row is alone in its attention, a vacant slot's through its
        old adapter's weights."""
        mine = dict(zip(own.slots, parts))
        pad = Sample([self.pad_id], [IGNORE_INDEX])
        samples: list = []
        for k, n in zip(cover.slots, cover.rows):
            part = mine.get(k, [])
            samples.extend(part + [pad] * (n - len(part)))
        batch = build_step_batch(samples, list(cover.rows), self.pad_id, flat=self.flat(True), fixed=True,
                                 held=held, max_width=self.max_seq_len)
        return batch if batch.shape in held else None
