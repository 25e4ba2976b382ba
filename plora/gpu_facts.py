"""This machine's CUDA devices as torch lists them (how many, each one's name and memory),
read from the CUDA driver without importing torch.

A sweep plans from its GPUs' number, name and size. Importing torch for them took 3.7-5 s
of the sweep process on the GPU machines, before its plan; a thread that imported it
meanwhile only shared the interpreter lock with the planning. torch's own CUDA runtime reads
these facts from the driver (`cudaGetDeviceProperties`: `cuDeviceGetName`,
`cuDeviceTotalMem`), which applies ``CUDA_VISIBLE_DEVICES`` as it does for torch, so the
answers are the same. Where torch is already imported, or the driver cannot be loaded or
fails to start, torch answers.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass

__all__ = ["GpuFacts", "look_ahead", "visible_gpus"]

#: the driver's "no CUDA-capable device is detected" (``CUDA_VISIBLE_DEVICES`` empty, say)
_CUDA_ERROR_NO_DEVICE = 100


@dataclass(frozen=True)
class GpuFacts:
    """One visible CUDA device: torch's ``get_device_name`` and ``total_memory``."""

    name: str
    total_memory: int


def visible_gpus() -> tuple[GpuFacts, ...]:
    """The CUDA devices this process sees, in CUDA's order (none: no GPU, or no usable CUDA)."""
    if not _torch_imported():
        if not cuda_torch_build():
            return ()  # torch would not use them (a CPU wheel): nor does plora
        found = _from_driver()
        if found is not None:
            return found
    return _from_torch()


def cuda_torch_build() -> bool:
    """Whether the installed torch can use a GPU at all, from its version alone (a CPU wheel
    says ``+cpu``), without importing it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "+cpu" not in version("torch")
    except PackageNotFoundError:
        return False


def _torch_imported() -> bool:
    return "torch" in sys.modules


_DRIVER_LOCK = threading.Lock()
_driver_answer: list[tuple[GpuFacts, ...] | None] = []  # the answer, once there is one


def look_ahead() -> None:
    """Ask the driver now, on a thread of its own, for whoever asks next (`visible_gpus`).
    Starting the driver (``cuInit``) took 0.2-0.5 s of a sweep on an H200 machine, its main
    thread waiting, before its plan; it runs outside the interpreter's lock, beside the
    sweep's imports and its space's checks."""
    if _driver_answer or _torch_imported() or not cuda_torch_build():
        return
    threading.Thread(target=_from_driver, name="plora-gpu-facts", daemon=True).start()


def _from_driver() -> tuple[GpuFacts, ...] | None:
    """The driver's answer, asked once per process (a second caller waits for the first's);
    None where it cannot give one (no driver library, a failed call)."""
    with _DRIVER_LOCK:
        if not _driver_answer:
            _driver_answer.append(_ask_driver())
        return _driver_answer[0]


def _ask_driver() -> tuple[GpuFacts, ...] | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    try:
        status = cuda.cuInit(0)
        if status == _CUDA_ERROR_NO_DEVICE:
            return ()
        if status != 0:
            return None
        count = ctypes.c_int(0)
        if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
            return None
        found = []
        for ordinal in range(count.value):
            device = ctypes.c_int(0)
            name = ctypes.create_string_buffer(256)
            memory = ctypes.c_size_t(0)
            if (cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0
                    or cuda.cuDeviceGetName(name, len(name), device) != 0
                    or cuda.cuDeviceTotalMem_v2(ctypes.byref(memory), device) != 0):
                return None
            found.append(GpuFacts(name.value.decode(errors="replace"), int(memory.value)))
        return tuple(found)
    except (AttributeError, OSError):  # a driver library without these entry points
        return None


def _from_torch() -> tuple[GpuFacts, ...]:
    try:
        import torch

        if not torch.cuda.is_available():
            return ()
        return tuple(GpuFacts(torch.cuda.get_device_name(i), int(torch.cuda.get_device_properties(i).total_memory))
                     for i in range(torch.cuda.device_count()))
    except Exception:  # noqa: BLE001 - a broken CUDA install: no GPUs
        return ()
