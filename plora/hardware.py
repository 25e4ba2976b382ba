"""What a sweep runs on: this machine's GPUs (or CPU cores), or a Ray cluster's, as the
planner, the cost model and the engine see it (`Hardware`)."""

from __future__ import annotations

from dataclasses import dataclass


from plora.spec.schema import SweepSpec


@dataclass(frozen=True)
class Hardware:
    """What a sweep is planned for: GPUs (how many, how much memory each) or CPU slots."""

    gpu: bool
    slots: int
    gpu_memory_bytes: float | None = None
    local: bool = True  # this machine's (profiles can be measured and looked up here)
    max_tp: int | None = None  # GPUs of one node on a cluster: no job spans nodes

    def describe(self) -> str:
        if self.gpu:
            return f"{self.slots} GPU{'s' if self.slots > 1 else ''} of {self.gpu_memory_bytes / 2**30:.0f} GiB"
        return f"{self.slots} CPU slot{'s' if self.slots > 1 else ''}"

    def slot_names(self) -> list[str]:
        return [f"cuda:{i}" for i in range(self.slots)] if self.gpu else [f"cpu:{i}" for i in range(self.slots)]


def hardware_for(spec: SweepSpec, *, here: bool = True) -> Hardware:
    """This machine's GPUs (at most `hardware.gpus`) or its cores; with `here=False` and no
    GPU visible, the space file's `hardware` itself (planning a GPU sweep from elsewhere)."""
    import os

    if spec.hardware.backend == "ray":
        return cluster_hardware(spec)
    cpu = Hardware(False, max(1, os.cpu_count() or 1))
    if spec.hardware.device == "cpu":
        return cpu
    from plora.gpu_facts import visible_gpus

    gpus = visible_gpus()  # (no torch import: `plora.gpu_facts`)
    if gpus:
        n = max(1, min(spec.hardware.gpus, len(gpus)))
        return Hardware(True, n, float(gpus[0].total_memory))
    if not here:
        return Hardware(True, spec.hardware.gpus, spec.hardware.gpu_memory_gb * 2**30, local=False)
    if spec.hardware.device == "cuda":
        raise ValueError("hardware.device: cuda, but no CUDA device is visible on this machine")
    return cpu


def cluster_hardware(spec: SweepSpec) -> Hardware:
    """A Ray cluster as the space file describes it: ``nodes × gpus_per_node`` GPUs of
    ``gpu_memory_gb`` (CPU slots with ``device: cpu``), no job wider than one node. Its GPUs
    are not this machine's: profiles are not measured here."""
    hw = spec.hardware
    slots = hw.nodes * hw.per_node
    if hw.device == "cpu":
        return Hardware(False, slots, max_tp=1)
    return Hardware(True, slots, hw.gpu_memory_gb * 2**30, local=False, max_tp=hw.per_node)


def sweep_on_gpu(spec: SweepSpec, hw: Hardware | None = None) -> bool:
    """Whether the sweep's jobs run on GPUs (what ``planner.streaming: auto`` turns on for):
    its hardware's, where the sweep has decided it, else as the space file says (``auto``:
    where CUDA is here)."""
    if hw is not None:
        return hw.gpu
    if spec.hardware.device in ("cpu", "cuda"):
        return spec.hardware.device == "cuda"
    from plora.gpu_facts import visible_gpus

    return bool(visible_gpus())
