"""A packed training step replayed from a CUDA graph.

A packed step launches thousands of small kernels (every adapted layer runs a few Triton
launches per rank bucket, forward and backward), and on a GPU the host cannot issue them as
fast as the GPU runs them: traced on an H200, a 0.5B-shape step of 16 adapters took 247 ms
of which the GPU was busy 64 ms. A pack's shapes do not change from one step to the next
until an adapter leaves it, so the whole step (forward, per-adapter losses, backward,
norms, clipping, AdamW) is captured once and replayed: the host then issues one launch per
step, and step time is what the GPU needs, the same in every process.

What a step must decide per adapter (diverged loss, non-finite gradient, clipping) is
decided on the device inside the step (`PackedLoRARecipe._device_step`); the host reads
one small tensor back after the replay and keeps the books.

A graph is made for one *composition*: the active adapters, their row counts and the
batch's shape (`plora.packed.step_batch`: each adapter's segment and label part padded to a
held size when rows are flattened, or the padded width; sizes only grow). The first step of a composition runs eagerly (on the stream
the graph is captured on: it also builds the kernels' schedules, which the graph then
reads), the second captures the graph and replays it, the following ones replay it. A new
composition (an adapter left, a batch wider than the graph's) drops the graph first and gives
its memory back, so a job never holds two steps' activations at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plora.row_layout import WIDTH_MULTIPLE

__all__ = ["WIDTH_MULTIPLE", "StepBuffers", "StepGraph", "padded_width", "step_inputs"]


def padded_width(width: int, max_width: int, held: int | None = None) -> int:
    """The batch width in graph mode: rounded up to `WIDTH_MULTIPLE`, at most ``max_width``;
    or ``held``, the width of the graph held for the same adapters and rows, when the batch
    fits in it. A composition's width then only grows, so batches of real data (each padded
    to its longest row) settle on one graph after a few captures instead of alternating."""
    padded = max(width, min(max_width, -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE))
    return held if held is not None and held >= padded else padded


def step_inputs(batch) -> dict[str, torch.Tensor]:
    """The host tensors of a `plora.packed.step_batch.StepBatch` that a step reads: tokens,
    the label parts, and for flattened rows their positions and boundaries."""
    out = {"tokens": batch.tokens, "label_index": batch.labels.index, "label_targets": batch.labels.targets}
    if batch.flat:
        out["positions"] = batch.positions
        out["cu_seqlens"] = batch.cu_seqlens()
    return out


@dataclass
class StepBuffers:
    """The device tensors one composition's step reads and writes, allocated once.

    ``inputs``: the batch (`step_inputs`: tokens, label positions and targets, and for
    flattened rows their positions and boundaries); ``planned``: the optimizer table as if
    every active adapter stepped (`PackedAdamW.planned_hyperparams`); ``active``: the active
    adapters' indices (int64, ascending); ``out``: what the step reports, (5, K) float32 —
    each adapter's loss, gradient norm, weight norm after the update, whether its loss was
    kept (finite, under ``divergence_loss``) and whether it stepped (NaN loss and 0, 0 for
    an adapter not in the batch). ``meta``: the segment metadata the captured kernels read,
    kept alive with the graph.
    """

    key: tuple
    inputs: dict[str, torch.Tensor]
    planned: torch.Tensor
    active: torch.Tensor
    out: torch.Tensor
    meta: Any = None

    @property
    def tokens(self) -> torch.Tensor:
        return self.inputs["tokens"]

    @classmethod
    def allocate(cls, key: tuple, inputs: dict[str, torch.Tensor], planned: torch.Tensor,
                 active: Sequence[int], num_adapters: int, device: torch.device) -> "StepBuffers":
        return cls(
            key=key,
            inputs={name: t.to(device) for name, t in inputs.items()},
            planned=planned.to(device),
            active=torch.tensor(list(active), dtype=torch.int64).to(device),
            out=torch.zeros(5, num_adapters, dtype=torch.float32, device=device),
        )

    def fill(self, inputs: dict[str, torch.Tensor], planned: torch.Tensor) -> None:
        """This step's batch and optimizer table, into the same memory (the graph reads it)."""
        for name, t in inputs.items():
            self.inputs[name].copy_(t, non_blocking=True)
        self.planned.copy_(planned, non_blocking=True)


class StepGraph:
    """Runs a step body eagerly or from a CUDA graph of its composition (module docstring).

    ``body(buffers)`` must do all its work on the device from ``buffers`` and host numbers
    fixed by the composition: no host syncs, no host-side effects (it runs once to record).
    """

    def __init__(self, device: torch.device, log: Callable[[str], None] | None = None):
        self.device = device
        self.enabled = True
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self._stream: torch.cuda.Stream | None = None
        self._buffers: StepBuffers | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        self.replays = 0

    def held_shape(self, adapters: Sequence[int], rows: Sequence[int]) -> tuple | None:
        """The batch shape (`StepBatch.shape`) of the graph held for these adapters and
        rows, if any: a new batch that fits it reuses the graph."""
        b = self._buffers
        if b is None or b.key[:2] != (tuple(adapters), tuple(rows)):
            return None
        return b.key[2]

    def drop(self) -> None:
        """Forget the current composition and give its graph's memory back."""
        if self._buffers is None and self._graph is None:
            return
        self._graph = None
        self._buffers = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def run(
        self,
        key: tuple,
        make: Callable[[], StepBuffers],
        inputs: tuple[dict[str, torch.Tensor], torch.Tensor],
        body: Callable[[StepBuffers], None],
    ) -> StepBuffers:
        """One step of composition ``key``. ``make()`` allocates its buffers (and sets the
        pack state the body reads) the first time; ``inputs`` = (`step_inputs`, planned)."""
        if self._buffers is None or self._buffers.key != key:
            self.drop()
            buffers = make()
            self._buffers = buffers
            self._eager_on_side_stream(body, buffers)
            return buffers
        buffers = self._buffers
        buffers.fill(*inputs)
        if self._graph is None and self.enabled:
            self._capture(body, buffers)
        if self._graph is not None:
            self._graph.replay()
            self.replays += 1
        else:
            self._eager_on_side_stream(body, buffers)
        return buffers

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _eager_on_side_stream(self, body: Callable[[StepBuffers], None], buffers: StepBuffers) -> None:
        # The warm-up runs on the capture stream (per-stream state such as cuBLAS
        # workspaces is then made before the capture, as CUDA graphs require).
        stream, main = self._side_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            body(buffers)
        main.wait_stream(stream)

    def _capture(self, body: Callable[[StepBuffers], None], buffers: StepBuffers) -> None:
        stream = self._side_stream()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager step's cached blocks: not held beside the graph's pool
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream):
                body(buffers)
        except Exception as e:  # noqa: BLE001 - a capture failure costs speed, not the job
            self.enabled = False
            self._graph = self._buffers = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._log(f"CUDA graph capture failed ({type(e).__name__}: {e}); this job's steps run eagerly")
            return
        self._graph = graph
        self.captures += 1
