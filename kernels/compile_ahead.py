"""Compile a step's Triton kernels ahead of its first launch, many at once, on threads.

A step's first launch of each kernel variant compiles it, one after another, while the GPU
waits: on first use of a machine (Triton's cache empty) a 16-adapter pack of four rank
buckets compiled 32 variants in its first step, 10.9-13.3 s on an H100 against 1.5 s warm
(`scripts/bench_first_sweep.py`). Which variants a step needs is decided on the host from
its segments alone (`triton_ops`: tiles per rank bucket and launch size, dy mode, atomics),
so the ops are run once with their launches *collected* instead of run
(`triton_ops.collecting`), and every variant not yet compiled is compiled, and loaded, on a
pool of threads (Triton's compiler spends its time in MLIR, LLVM, ptxas and the C compiler
of its launchers, outside the GIL). The real launches then find each kernel ready, in
Triton's own cache. A variant this misses
(an argument the dry run did not foresee) still compiles at its launch, as before.

Where nothing would compile (CPU tensors, Triton's interpreter, ``PLORA_COMPILE_THREADS=0``)
it does nothing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from plora.settings import settings

from .meta import LoRAMeta

__all__ = ["COMPILED", "CompileStats", "compile_ahead", "compile_threads", "compiles_here", "launches_of",
           "scratch_bytes"]

#: most threads one process compiles on
MAX_THREADS = 32


@dataclass
class CompileStats:
    """What this process compiled ahead: variants, seconds spent waiting for them, failures."""

    kernels: int = 0
    seconds: float = 0.0
    failed: int = 0
    calls: int = 0
    #: the variants that took long (compiled here rather than read from Triton's cache, or kept
    #: waiting by the threads beside): kernel, its constants, seconds; what a process compiling
    #: ahead of this one likely missed
    slow: list = field(default_factory=list)

    def to_dict(self) -> dict[str, float | int | list]:
        return {"kernels": self.kernels, "seconds": round(self.seconds, 3), "failed": self.failed,
                "calls": self.calls, "slow": self.slow[:SLOW_KEPT]}


#: a variant that took this long was compiled, not loaded from Triton's cache
SLOW_S = 0.1
#: at most this many slow variants kept
SLOW_KEPT = 64


#: this process's totals (a job's summary.json keeps them)
COMPILED = CompileStats()
_SEEN: set[tuple] = set()  # variants compiled (or tried) ahead in this process
_LOCK = threading.Lock()


def compile_threads() -> int:
    """Threads to compile on: ``PLORA_COMPILE_THREADS``, else one per core this process may
    use, at most `MAX_THREADS`."""
    want = settings().compile_threads
    if want is not None:
        return want
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(MAX_THREADS, cores))


def compiles_here(device: torch.device | str) -> bool:
    """Whether launches on ``device`` would compile Triton kernels: the Triton backend on a
    CUDA device (not ``PLORA_KERNELS=torch``, not Triton's interpreter)."""
    if torch.device(device).type != "cuda" or settings().kernels == "torch":
        return False
    from . import triton_ops

    return not triton_ops._interpreting()


def _arg_key(a) -> tuple:
    """What Triton specializes an argument on: a tensor's dtype and 16-byte alignment, an
    integer's being 1 or a multiple of 16, anything else its value."""
    if isinstance(a, torch.Tensor):
        return ("t", a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool) or not isinstance(a, int):
        return ("v", a)
    return ("i", a == 1, a % 16 == 0)


def _variant(call: tuple) -> tuple:
    kernel, _grid, args, kwargs = call
    return (id(kernel), tuple(_arg_key(a) for a in args), tuple(sorted(kwargs.items())))


def _scratch_views(backward: bool) -> int:
    """Views of one token × width buffer a dry run holds: x and y, and for a backward dx."""
    return 3 if backward else 2


def _scratch_part(num_tokens: int, shapes: Iterable[tuple[int, int]]) -> int:
    """Elements of one view: the tokens × the widest layer, each view starting 64 elements on
    (as aligned as a tensor of its own)."""
    width = max((max(d_in, d_out) for d_in, d_out in shapes), default=1)
    return -(-max(num_tokens, 1) * width // 64) * 64


def scratch_bytes(num_tokens: int, shapes: Iterable[tuple[int, int]], dtype: torch.dtype, *, backward: bool) -> int:
    """Bytes the one buffer of a dry run over ``num_tokens`` holds (`launches_of`)."""
    return _scratch_views(backward) * _scratch_part(num_tokens, list(shapes)) * dtype.itemsize


def launches_of(meta: LoRAMeta, shapes: Iterable[tuple[int, int]], dtype: torch.dtype,
                device: torch.device, *, backward: bool, accumulate_dx: bool = True,
                also: Callable[[], None] | None = None) -> list[tuple]:
    """The launches the packed LoRA forward (and backward) of layers of ``shapes`` (in, out)
    would make over ``meta``'s segments, and those of ``also()`` (a step's optimizer),
    collected, not run (the torch ops between them, allocations and casts, do run).

    Every shape's activations (x, y, dx) are views of one scratch buffer, at its start (so
    aligned as a fresh tensor is): what the kernels are specialized on is their dtype,
    strides and alignment, never their values, so the dry run holds one token × width
    buffer, not three per shape."""
    from . import triton_ops

    shapes = sorted(set(shapes))
    n, r = max(meta.num_tokens, 1), max(meta.total_rank, 1)
    part = _scratch_part(n, shapes)
    scratch = torch.empty(_scratch_views(backward) * part, dtype=dtype, device=device)

    def view(d: int, at: int) -> torch.Tensor:
        return scratch[at * part: at * part + n * d].view(n, d)

    with triton_ops.collecting() as calls:
        for d_in, d_out in shapes:
            x, y = view(d_in, 0), view(d_out, 1)
            a = torch.empty((r, d_in), dtype=dtype, device=device)
            b = torch.empty((r, d_out), dtype=dtype, device=device)
            s = triton_ops.lora_forward(x, a, b, meta, y)
            if backward:
                dx = view(d_in, 2) if accumulate_dx else None
                triton_ops.lora_backward(y, x, s, a, b, meta, dx, need_dx=True)
        if also is not None:
            also()
    return calls


def _warm(call: tuple, device: int) -> None:
    """Compile one variant, then load it (the module onto the GPU, and the launcher Triton
    builds with the C compiler for each new signature): a launch would otherwise do that
    part, one kernel after another, at its first call."""
    kernel, grid, args, kwargs = call
    t0 = time.perf_counter()
    torch.cuda.set_device(device)  # the launch's device: Triton compiles and loads for the current one
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    load = getattr(compiled, "_init_handles", None)
    if callable(load):
        load()
    seconds = time.perf_counter() - t0
    if seconds >= SLOW_S and len(COMPILED.slow) < SLOW_KEPT:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        consts = ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if isinstance(v, (int, bool, str)))
        COMPILED.slow.append([name, consts, round(seconds, 3)])


def compile_ahead(meta: LoRAMeta | None, shapes: Iterable[tuple[int, int]], dtype: torch.dtype,
                  device: torch.device | str, *, backward: bool, accumulate_dx: bool = True,
                  threads: int | None = None, also: Callable[[], None] | None = None) -> int:
    """Compile, on ``threads`` threads, every kernel variant a step over ``meta`` would launch
    for layers of ``shapes`` (and ``also()``, `launches_of`) and that this process has not
    compiled yet; return how many. Returns once all are compiled.

    Nothing here may stop a step: a dry run that fails is counted and left alone, and a
    variant that fails to compile is left to its launch, which raises the error where it
    belongs. Each variant is tried once per process. Only for the Triton backend on CUDA
    (`plora.kernels.backend_for`); tensor-parallel layers are left to their launches by the
    caller (`PackedModel.compile_kernels_ahead`)."""
    device = torch.device(device)
    threads = compile_threads() if threads is None else threads
    if meta is None or meta.num_tokens == 0 or threads <= 0 or not compiles_here(device):
        return 0
    t0 = time.perf_counter()
    fresh = {}
    with _LOCK:
        try:
            calls = launches_of(meta, shapes, dtype, device, backward=backward, accumulate_dx=accumulate_dx,
                                also=also)
        except Exception:  # noqa: BLE001 - the step itself meets whatever broke here
            COMPILED.failed += 1
            return 0
        for call in calls:
            key = _variant(call)
            if key not in _SEEN and key not in fresh:
                fresh[key] = call
        _SEEN.update(fresh)
    COMPILED.calls += 1
    if not fresh:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    for kernel in {id(c[0]): c[0] for c in fresh.values()}.values():
        try:  # each kernel's cache for this device made here, not raced for by the threads
            kernel.device_caches[index]
        except Exception:  # noqa: BLE001 - a thread then makes it, as before
            pass
    failed = 0
    with ThreadPoolExecutor(min(threads, len(fresh)), thread_name_prefix="plora-compile") as pool:
        for future in [pool.submit(_warm, call, index) for call in fresh.values()]:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - its launch compiles it again and raises there
                failed += 1
    COMPILED.kernels += len(fresh) - failed
    COMPILED.failed += failed
    COMPILED.seconds += time.perf_counter() - t0
    return len(fresh) - failed
