"""A `plora.train.step_graph.GraphBackend` without a GPU, for driving `StepGraph`'s books
(and a whole job's) on a CPU.

An eager step runs the body. A capture records the body it was given and the buffers; a
replay runs that recorded body on those buffers, so a replayed step reads what a real
graph would read from the device: the held buffers (batch, optimizer table, segment
metadata) filled for this step, and the pack's tensors where they are. What it cannot
show is a host number that a real capture would bake in: those are kept out of the
graphs by construction (`plora.train.step_graph`'s module docstring) and checked on a GPU.
Memory is numbers the test sets: the room beside the held graphs, and what a step takes
per batch token.
"""

from __future__ import annotations

from typing import Any


class FakeGraph:
    def __init__(self, body, buffers):
        self.body, self.buffers = body, buffers

    def replay(self) -> None:
        self.body(self.buffers)


class FakeGraphs:
    """Counts what `StepGraph` asked of the device (``eager_keys``, ``captured``: the keys
    of each eager step and capture, in order; ``released``)."""

    def __init__(self, room: int = 1 << 40, bytes_per_token: int = 100, fail_capture: bool = False):
        self.free = room
        self.per_token = bytes_per_token
        self.fail_capture = fail_capture
        self.eager_keys: list[tuple] = []
        self.captured: list[tuple] = []
        self.released = 0
        self.grew = 0
        self.beside: list[tuple] = []  # keys captured beside the job's thread (ahead)

    def eager(self, body, buffers, *, measure: bool = False) -> int:
        body(buffers)
        self.eager_keys.append(buffers.key)
        return self.per_token * int(buffers.tokens.numel()) if measure else 0

    def capture(self, body, buffers, pool: Any, *, beside: bool = False) -> tuple[FakeGraph, Any]:
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captured.append(buffers.key)
        if beside:
            self.beside.append(buffers.key)
        self.grew = self.per_token * int(buffers.tokens.numel())
        return FakeGraph(body, buffers), pool if pool is not None else object()

    def stream(self) -> None:
        return None

    def captured_bytes(self) -> int:
        return self.grew

    def room(self) -> int:
        return self.free

    def release(self) -> None:
        self.released += 1


def install(monkeypatch, made: list) -> None:
    """Jobs built from here on replay their steps from `FakeGraphs` (their `StepGraph`s go
    to ``made``, in order), with the scales read from the segment metadata as the Triton
    kernels read them (on a CPU the torch path reads its host numbers, which
    `LoRAMeta.set_scale` writes too)."""
    from plora.train import packed_lora
    from plora.train.step_graph import StepGraph

    def step_graph(device, **kw):
        sg = StepGraph(device, backend=FakeGraphs(), **kw)
        made.append(sg)
        return sg

    monkeypatch.setattr(packed_lora, "graphs_wanted", lambda *a, **k: True)
    monkeypatch.setattr(packed_lora, "scales_on_device", lambda device: True)
    monkeypatch.setattr(packed_lora, "StepGraph", step_graph)
