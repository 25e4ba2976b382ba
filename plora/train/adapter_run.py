"""One adapter's progress inside its job (`AdapterRun`), and its learning-rate schedule.

What the recipe's components share about an adapter: its config, its own data stream, its
step and status, its losses, its place in the pack (``index``), its effective batch when it
accumulates (`plora.data.accumulation`) and its epochs (`plora.train.epochs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from plora.data.accumulation import split_batch
from plora.data.balanced_stream import BalancedStream
from plora.data.dataset import AdapterStream
from plora.job.config import JobAdapter

#: what an adapter that left the pack has as its status
FINAL_STATUSES = ("done", "diverged", "pruned")


def lr_factor(step: int, total: int, warmup: int, scheduler: str) -> float:
    """Multiplier of an adapter's base LR at its own step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    if scheduler == "constant":
        return 1.0
    if scheduler == "linear":
        return max(0.0, 1.0 - progress)
    if scheduler == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    raise ValueError(f"unknown scheduler {scheduler!r}")


@dataclass
class AdapterRun:
    """One adapter's progress inside the job. ``index``: its slot in the pack (None once
    the slot was given back); ``joined_at``: the job step it joined at (None: in the job
    from its start)."""

    index: int | None
    cfg: JobAdapter
    stream: AdapterStream | BalancedStream
    step: int = 0
    status: str = "running"  # running | done | diverged | pruned
    losses: list[float] = field(default_factory=list)
    reason: str = ""
    finished_at: float | None = None
    joined_at: int | None = None
    #: the largest batch its stream draws from here on (tokens, labels), for a balanced step's shape
    floor: tuple[int, int] | None = None
    #: seconds it trained in earlier attempts of its job (from its checkpoint): its wall
    #: time counts them, so that a resumed adapter's time is not only the last attempt's
    earlier_s: float = 0.0
    #: the adapter steps its epochs end at, the last with its budget (`plora.train.epochs`);
    #: None until the job has worked them out
    epoch_ends: list[int] | None = None
    #: each finished epoch's scores (`epoch_record`), with ``eval.each_epoch``
    epochs: list[dict[str, Any]] = field(default_factory=list)
    #: the best finished epoch so far (its number), and its weights as a flat host copy
    best_epoch: int | None = None
    best_weights: torch.Tensor | None = None
    #: packed steps one optimizer step spans (`plora.data.accumulation`; 1: its batch in one pass)
    parts: int = 1
    #: the part of its effective batch the next packed step trains (0: a new batch is drawn)
    micro: int = 0
    #: the current effective batch, in parts; its label tokens (every part's loss is over
    #: them); the loss of its parts so far; the stream's position before it was drawn (what
    #: a checkpoint saves: an adapter mid-batch resumes from the start of that batch, its
    #: weights and moments being those of its last optimizer step)
    cycle: list[list[int]] = field(default_factory=list)
    cycle_labels: int = 0
    partial: float = 0.0
    cycle_stream: dict[str, Any] | None = None
    #: rows it put in the last packed step
    last_rows: int = 0

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def total_steps(self) -> int:
        return self.cfg.steps

    @property
    def warmup(self) -> int:
        return self.cfg.warmup_steps

    @property
    def scheduler(self) -> str:
        return self.cfg.scheduler or "constant"

    @property
    def active(self) -> bool:
        return self.status == "running"

    @property
    def at_boundary(self) -> bool:
        """Whether its next packed step starts a new effective batch (and its last, if any,
        ended with an optimizer step)."""
        return self.micro == 0

    @property
    def packed_steps_taken(self) -> int:
        return self.step * self.parts + self.micro

    def next_rows(self, label_counts: list[int]) -> list[int]:
        """The rows of its next packed step: its whole batch in one pass, or the next part
        of the effective batch it draws whole (one pass's rows, in one pass's order)."""
        b = self.cfg.batch_size
        if self.parts == 1:
            return self.stream.next(b)
        if self.micro == 0:
            self.cycle_stream = self.stream.state_dict()
            rows = self.stream.next(b)
            self.cycle = split_batch(rows, self.parts)
            self.cycle_labels = sum(label_counts[i] for i in rows)
            self.partial = 0.0
        return self.cycle[self.micro]

    def stream_state(self) -> dict[str, Any]:
        """Where a checkpoint resumes its data from: the start of its current effective batch."""
        return self.cycle_stream if self.cycle_stream is not None else self.stream.state_dict()
