"""The environment a job process runs with: the sweep's, with its GPUs, its share of the
host's cores (`plora.engine.cpu_share`) and the allocator set.

Shared by the launcher (`plora.engine.local`) and the processes started ahead of their jobs
(`plora.engine.spare`), which must start with the environment their job will have.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from plora.engine.cpu_share import job_share
from plora.job.step_settings import JOB_ALLOCATOR


def visible_gpu_ids(gpus: Sequence[int], visible: str | None) -> list[str]:
    """The device ids to hand a job for the sweep's GPU indices ``gpus``.

    The pool numbers the GPUs this process sees 0..n-1; where the sweep itself runs under
    ``CUDA_VISIBLE_DEVICES`` (say ``2,3``), index 0 is the first entry of that list, not
    the machine's GPU 0.
    """
    ids = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not ids:
        return [str(g) for g in gpus]
    if any(g >= len(ids) for g in gpus):
        raise ValueError(f"GPU index {max(gpus)} is not among CUDA_VISIBLE_DEVICES={visible}")
    return [ids[g] for g in gpus]


def job_env(gpus: Sequence[int] = (), extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a job on ``gpus`` (none: a CPU job) gets it."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra_env or {})
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpu_ids(gpus, os.environ.get("CUDA_VISIBLE_DEVICES")))
        # Packs of many adapters allocate many differently sized activations: without
        # expandable segments the allocator reserves up to ~30% more than its peak.
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", JOB_ALLOCATOR)
        # its GPUs' share of the host's cores, so that jobs side by side do not starve each other
        share = job_share(env["CUDA_VISIBLE_DEVICES"].split(","), env)
        for key, value in (share.env() if share else {}).items():
            env.setdefault(key, value)
    else:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
