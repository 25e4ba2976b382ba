"""Where a sweep's jobs run: local processes (the default) or tasks on a Ray cluster.

A backend gives the engine its slots and a launcher with the signature of
`plora.engine.local.launch`; everything else (queue, journal, retries, out-of-memory
splits, re-planning, the live view) is the one engine loop in `plora.engine.runner`.
Ray is imported only when the space file asks for it (`hardware.backend: ray`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from plora.engine.errors import BackendError  # noqa: F401 - where callers look for it


@dataclass
class Backend:
    """Slots for the engine's pool, a launcher for its jobs, and what to do at the end."""

    name: str
    slots: list[str]
    launcher: Callable[..., Any] | None = None  # None: `plora.engine.local.launch`
    close: Callable[[], None] = field(default=lambda: None)


def backend_for(spec: Any, run_dir: Path, slots: list[str]) -> Backend:
    """The backend `spec.hardware.backend` names. ``slots`` are the local backend's (the
    caller's or this machine's); a Ray cluster has ``nodes × gpus_per_node`` of its own."""
    hw = spec.hardware
    if hw.backend == "local":
        return Backend("local", slots)
    try:
        from plora.engine.ray_backend import RayBackend
    except ImportError:
        raise BackendError('hardware.backend is ray but Ray is not installed: pip install "plora[ray]"') from None

    ray = RayBackend(run_dir, address=hw.ray.address, device=hw.device, cpus_per_gpu=hw.ray.cpus_per_gpu)
    try:
        ray.check_storage()
    except BaseException:
        ray.close()
        raise
    return Backend("ray", ray.slots(hw.nodes, hw.per_node), ray.launch, ray.close)
