"""Pay what Triton charges once per process before a job needs its kernels.

A job's first step loads every kernel variant it launches from Triton's cache
(`compile_ahead`): 25 variants took 1.05 s of a warm 0.5B sweep's first step on an H200,
with the GPU idle. Part of that is not per variant but per process (Triton's backend and
driver utilities, the hash of Triton itself in every cache key, each kernel's source hash).
A spare job process (`plora.train.spare`) waits seconds for its job while the sweep plans:
it pays those costs there, by compiling (cached after a machine's first use), loading and
launching one tiny kernel and hashing every packed-LoRA kernel's source. What a step then
computes is unchanged: nothing of a real kernel is compiled or loaded here.
"""

from __future__ import annotations

import time

import torch

from .compile_ahead import compiles_here

__all__ = ["KERNEL_FILES", "prewarm"]

#: the files whose jitted kernels a job launches (`triton_ops.kernels_module`)
KERNEL_FILES = ("_triton_kernels.py", "_triton_segment_kernels.py", "_triton_dropout_kernels.py",
                "_triton_loss_kernels.py")


def prewarm(device: torch.device | str) -> dict[str, float]:
    """Seconds spent on each part; nothing (an empty dict) where nothing compiles
    (`compiles_here`: a CPU device, Triton's interpreter, the torch backend)."""
    device = torch.device(device)
    if not compiles_here(device):
        return {}
    from . import triton_ops

    out: dict[str, float] = {}
    t0 = time.perf_counter()
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        x = torch.zeros(1, dtype=torch.int32, device=device)
        triton_ops.kernels_module("_triton_prewarm_kernels.py").touch_kernel[(1,)](x)
        torch.cuda.synchronize(device)
    out["tiny_kernel_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    for file in KERNEL_FILES:
        module = triton_ops.kernels_module(file)
        for name in dir(module):
            fn = getattr(module, name)
            if hasattr(fn, "device_caches") and hasattr(fn, "cache_key"):
                fn.cache_key  # noqa: B018 - the source hash (its dependencies' too), computed once
                fn.device_caches[index]  # noqa: B018 - this device's cache, made once
    out["kernel_hashes_s"] = time.perf_counter() - t1
    return out
