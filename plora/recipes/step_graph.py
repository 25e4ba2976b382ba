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

A graph is made for one *composition* (the active adapters and their row counts) and one
batch shape (`plora.packed.step_batch`: each adapter's segment and label part padded to a
held size when rows are flattened, which only grows; or the padded width, one of a few when
rows come in length buckets). The first step of a shape runs eagerly (on the stream the
graph is captured on: it also builds the kernels' schedules, which the graph then reads),
the second captures the graph and replays it, the following ones replay it. The graphs of
one composition share one memory pool, since only one step runs at a time; a new
composition (an adapter left) drops them and gives their memory back first, and so does a
new shape whose eager step would not fit beside them, so a job never holds two steps'
activations at once.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plora.row_layout import WIDTH_MULTIPLE, padded_width

__all__ = ["WIDTH_MULTIPLE", "StepBuffers", "StepGraph", "padded_width", "step_inputs"]


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

    #: graphs held for one composition (one per batch shape: padded rows drawn from length
    #: buckets come in a few widths); past it the oldest is dropped
    MAX_GRAPHS = 16

    def __init__(self, device: torch.device, log: Callable[[str], None] | None = None):
        self.device = device
        self.enabled = True
        self._log = log or (lambda msg: print(msg, file=sys.stderr))
        self._stream: torch.cuda.Stream | None = None
        self._composition: tuple | None = None
        # batch shape -> [buffers, graph or None (run eagerly once, captured the next time)]
        self._held: dict[tuple, list] = {}
        self._pool: Any = None  # the memory pool the composition's graphs share
        self._step_bytes = 0  # the most memory one eager step of this composition took
        self.captures = 0
        self.replays = 0

    def held_shapes(self, adapters: Sequence[int], rows: Sequence[int]) -> list[tuple]:
        """The batch shapes (`StepBatch.shape`) of the graphs held for these adapters and
        rows, oldest first: a new batch that fits one reuses its graph."""
        if self._composition != (tuple(adapters), tuple(rows)):
            return []
        return [key[2] for key in self._held]

    def drop(self) -> None:
        """Forget the current composition and give its graphs' memory back."""
        if not self._held and self._pool is None:
            return
        self._held.clear()
        self._pool = None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def run(
        self,
        key: tuple,
        make: Callable[[], StepBuffers],
        inputs: tuple[dict[str, torch.Tensor], torch.Tensor],
        body: Callable[[StepBuffers], None],
    ) -> StepBuffers:
        """One step of composition ``key`` = (adapters, rows, batch shape). ``make()``
        allocates its buffers (and sets the pack state the body reads) the first time a
        shape comes; ``inputs`` = (`step_inputs`, planned).

        The graphs of one composition's shapes share one memory pool: a step's activations
        live only within it, so the pool holds what the largest of them needs, once."""
        if key[:2] != self._composition:
            self.drop()
            self._step_bytes = 0
            self._composition = key[:2]
        entry = self._held.get(key)
        if entry is None:
            if self._held and not self._room_for_an_eager_step():
                self.drop()  # the held graphs' pool and an eager step would not fit side by side
            while len(self._held) >= self.MAX_GRAPHS:
                self._held.pop(next(iter(self._held)))
            buffers = make()
            self._held[key] = [buffers, None]
            self._eager_on_side_stream(body, buffers, measure=True)
            return buffers
        buffers, graph = entry
        buffers.fill(*inputs)
        if graph is None and self.enabled:
            graph = entry[1] = self._capture(body, buffers)
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self._eager_on_side_stream(body, buffers)
        return buffers

    def _room_for_an_eager_step(self) -> bool:
        free, _total = torch.cuda.mem_get_info(self.device)
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return free + max(0, cached) > 1.1 * self._step_bytes

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _eager_on_side_stream(self, body: Callable[[StepBuffers], None], buffers: StepBuffers, *,
                              measure: bool = False) -> None:
        # The warm-up runs on the capture stream (per-stream state such as cuBLAS
        # workspaces is then made before the capture, as CUDA graphs require).
        stream, main = self._side_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            body(buffers)
        main.wait_stream(stream)
        if measure:  # what the step freed stays cached: about what one step of this shape takes
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            self._step_bytes = max(self._step_bytes, cached)

    def _capture(self, body: Callable[[StepBuffers], None], buffers: StepBuffers) -> torch.cuda.CUDAGraph | None:
        stream = self._side_stream()
        torch.cuda.synchronize(self.device)
        if self._pool is None:
            torch.cuda.empty_cache()  # the eager steps' cached blocks: not held beside the graphs' pool
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream, pool=self._pool):
                body(buffers)
        except Exception as e:  # noqa: BLE001 - a capture failure costs speed, not the job
            self.enabled = False
            self._held.clear()
            self._pool = None
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            self._log(f"CUDA graph capture failed ({type(e).__name__}: {e}); this job's steps run eagerly")
            return None
        if self._pool is None:
            self._pool = graph.pool()
        self.captures += 1
        return graph
