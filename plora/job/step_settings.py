"""How a job's steps run: the settings that the recipe and the profiler must agree on.

A probe measures what a job's steps cost only where it runs them as a job does: with the
CUDA allocator settings the engine starts jobs with, and with steps replayed from CUDA
graphs exactly where the recipe replays them. The recipe, the engine and the profiler
read those decisions here, so the profiler (below the planner) needs neither the recipe
nor the engine to know them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from plora.settings import CUDA_GRAPHS, settings
from plora.spec.sections import cuda_graphs_setting

if TYPE_CHECKING:
    import torch

#: the CUDA allocator settings every job runs with (and the profiler's probes, so that what
#: they measure is what jobs use)
JOB_ALLOCATOR = "expandable_segments:True"

#: ``training.cuda_graphs``: "auto" (on for one CUDA device without activation
#: checkpointing), "on" or "off"; the environment variable overrides the config.
CUDA_GRAPHS_ENV = CUDA_GRAPHS


def graphs_wanted(setting: Any, device: torch.device | str, *, tp: bool, activation_checkpointing: bool) -> bool:
    """Whether steps should be replayed from CUDA graphs on this job.

    "auto" turns them on for a CUDA device, off under tensor parallelism (collectives in a
    graph are not set up here) and activation checkpointing (recomputation saves and
    restores RNG state, which a capture does not allow).
    """
    try:
        env = settings().cuda_graphs
        value = cuda_graphs_setting(env if env is not None else setting if setting is not None else "auto")
    except ValueError as e:
        raise ValueError(f"cuda_graphs: {e}") from None
    kind = device.partition(":")[0] if isinstance(device, str) else device.type
    if value is False or kind != "cuda":
        return False
    if value == "auto" and (tp or activation_checkpointing):
        return False
    return True

