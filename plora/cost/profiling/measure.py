"""A probe's job run in this process, its steps timed and its peak memory read.

The one part of the profiler that imports the recipe (`PackedLoRARecipe`, inside
`run_probe`): a probe must be a real packed job, built and stepped as a job is, for its
times and peaks to be a job's. Everything else in `plora.cost.profiling` works on the
`Measurement` it returns.

* **A fresh recipe per probe.** Each probe builds its own `PackedLoRARecipe` with exactly
  its adapters, like a real job. One shared recipe with the union of the probes' adapters
  would save the model build, but its memory would hold every other probe's LoRA weights
  and whatever AdamW state earlier probes left, which then has to be subtracted; a fresh
  build needs no correction and costs seconds even for a 7B shape (the weights are
  random-initialized on the device, `model.random_init`). Validation packs are run the
  same way, so their errors are those of real jobs.
* **What "peak memory" is.** On a GPU: the job's device footprint, the CUDA caching
  allocator's *reserved* peak plus what the process holds outside the allocator (CUDA
  context, loaded kernels, read from the driver). Reserved, not allocated: the allocator
  keeps freed blocks in segments it cannot always reuse, and on the GPU that decides an
  out-of-memory error. Measured on Qwen2.5 shapes (H200), reserved exceeds allocated by
  about 10% (7B) to 29% (0.5B, whose 152k-entry logits come in huge blocks); a pack
  predicted at 88% of the device by its allocated peak ran out of memory. Blocks cached
  while the model was built are emptied before the peak counters are reset (a random-init
  build stages the weights in fp32 on the device; where the bf16 copies land in those
  segments, emptying cannot release them, which inflated the 7B reserved peaks by a few
  GiB: building in the target dtype directly would avoid it). The allocated peak is
  recorded too. On CPU: the process's resident set, sampled during the steps (noisy; the
  CPU path exists so that `plora profile` works on the demo).
"""

from __future__ import annotations

import gc
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from plora.models.families.targets import DEFAULT_TARGETS
from plora.train.heap import frozen_heap
from plora.job.config import JobConfig
from plora.job.synthetic import synthetic_job_config
from plora.job.phases import outside_allocator
from plora.cost.profiling.probes import Measurement, Probe
from plora.job.step_settings import JOB_ALLOCATOR

DEFAULT_WARMUP = 2
DEFAULT_ITERS = 10
#: on a GPU, probes time at least this many seconds of steps (up to MAX_ITERS_FACTOR x iters)
DEFAULT_MIN_TIMED_S = 3.0
MAX_ITERS_FACTOR = 3
#: fewest timed steps a probe gets when `max_probe_s` shortens it
MIN_ITERS = 3

Log = Callable[[str], None]


def probe_job_config(model_dir: str | Path, probe: Probe, *, seq_len: int, dtype: str, device: str,
                     targets: Sequence[str], family: str = "auto", dropout: float = 0.0,
                     output_dir: str | Path = ".", num_threads: int | None = None,
                     activation_checkpointing: bool = False, cuda_graphs: Any = "auto",
                     quantize: str | None = None) -> JobConfig:
    """The recipe config of a probe: a random-init model (its block linears held as
    ``quantize`` says), fixed-length synthetic rows."""
    return synthetic_job_config(f"probe-{probe.name}", model_dir, list(zip(probe.ranks, probe.batch_sizes)),
                                seq_len=seq_len, dtype=dtype, device=device, targets=targets, family=family,
                                dropout=dropout, output_dir=output_dir, num_threads=num_threads,
                                adapter_ids=[f"{probe.name}-{k}" for k in range(probe.adapters)],
                                activation_checkpointing=activation_checkpointing, cuda_graphs=cuda_graphs,
                                quantize=quantize)


def run_probe(
    model_dir: str | Path,
    probe: Probe,
    *,
    seq_len: int,
    dtype: str = "bfloat16",
    device: str = "cuda",
    targets: Sequence[str] = DEFAULT_TARGETS,
    family: str = "auto",
    dropout: float = 0.0,
    warmup: int = DEFAULT_WARMUP,
    iters: int = DEFAULT_ITERS,
    max_probe_s: float | None = None,
    min_timed_s: float | None = None,
    num_threads: int | None = None,
    activation_checkpointing: bool = False,
    cuda_graphs: Any = "auto",
    quantize: str | None = None,
) -> Measurement:
    """Build a fresh packed job of ``probe``'s adapters, run warm-up and timed steps.

    ``max_probe_s`` caps the timed part: after warm-up, the number of timed steps is cut
    to what fits in that many seconds (at least `MIN_ITERS`). ``min_timed_s`` (default:
    `DEFAULT_MIN_TIMED_S` on a GPU, none on CPU) raises it, up to `MAX_ITERS_FACTOR` x
    ``iters``, until that many seconds are timed. Running out of memory is a result
    (``oom=True``), not an error; any other failure propagates.
    """
    if min_timed_s is None:
        min_timed_s = DEFAULT_MIN_TIMED_S if str(device).startswith("cuda") else 0.0
    import torch

    from plora.train.packed_lora import PackedLoRARecipe

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    _release(cuda)
    m = Measurement(probe, int(seq_len))
    poller = None if cuda else _RssPoller()
    with tempfile.TemporaryDirectory(prefix="plora-probe-") as tmp:
        cfg = probe_job_config(model_dir, probe, seq_len=seq_len, dtype=dtype, device=device, targets=targets,
                               family=family, dropout=dropout, output_dir=tmp, num_threads=num_threads,
                               activation_checkpointing=activation_checkpointing, cuda_graphs=cuda_graphs,
                               quantize=quantize)
        recipe = None
        try:
            t0 = time.perf_counter()
            recipe = PackedLoRARecipe(cfg)
            recipe.setup()
            if cuda:  # blocks cached while building (fp32 staging of the weights) are not the job's
                torch.cuda.synchronize(dev)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            else:
                poller.start()
            m.build_s = time.perf_counter() - t0
            active = list(recipe.runs)
            total, i = warmup + iters, 0
            with frozen_heap():  # as in a job's loop (`PackedLoRARecipe.run`)
                while i < total:
                    if cuda:
                        torch.cuda.synchronize(dev)
                    t = time.perf_counter()
                    recipe.train_step(active, i)
                    if cuda:
                        torch.cuda.synchronize(dev)
                    dt = time.perf_counter() - t
                    if i >= warmup:
                        m.step_times.append(dt)
                    if i == max(warmup - 1, 0) and dt > 0:
                        # short, launch-bound steps are the noisiest: time at least min_timed_s of them
                        total = warmup + max(iters, min(MAX_ITERS_FACTOR * iters, math.ceil(min_timed_s / dt)))
                        if max_probe_s:
                            total = warmup + max(MIN_ITERS, min(total - warmup, int(max_probe_s / dt)))
                    i += 1
            if cuda:
                m.allocated_peak = float(torch.cuda.max_memory_allocated(dev))
                m.reserved_peak = float(torch.cuda.max_memory_reserved(dev))
                m.context_bytes = outside_allocator(dev)
                m.peak_bytes = m.reserved_peak + m.context_bytes
            else:
                m.peak_bytes = float(poller.stop())
        except Exception as e:  # noqa: BLE001 - sorted below: OOM is a result
            if not _is_oom(e):
                raise
            m.oom, m.error = True, "out of memory"
            m.step_times = []
        finally:
            if poller is not None:
                poller.stop()
            if recipe is not None:
                recipe.cleanup()
            del recipe
    _release(cuda)
    return m


def _is_oom(e: BaseException) -> bool:
    import torch

    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _release(cuda: bool) -> None:
    """Free what the last probe left, so the next one starts from the same state."""
    gc.collect()
    if cuda:
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    else:  # glibc keeps freed heap; hand it back so the next probe's resident set is its own
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


class _RssPoller:
    """The peak resident set of this process while running, sampled every 2 ms."""

    def __init__(self, every_s: float = 0.002):
        self.every_s = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _rss() -> int:
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except ImportError:  # pragma: no cover - psutil is nearly always there
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            self._stop.wait(self.every_s)

    def start(self) -> None:
        self.peak = self._rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.peak = max(self.peak, self._rss())
        return self.peak


def _match_job_allocator(say: Log) -> None:
    """Probe with the CUDA allocator settings jobs run with (`plora.job.step_settings.JOB_ALLOCATOR`):
    expandable segments reserve up to ~30% less for the same pack, so peaks measured
    without them would not be a job's. Left alone where ``PYTORCH_CUDA_ALLOC_CONF`` is set
    (a job's environment already has it; so does a user's explicit choice)."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = JOB_ALLOCATOR  # jobs and processes started from here
    try:
        import torch

        torch.cuda.memory._set_allocator_settings(JOB_ALLOCATOR)
    except Exception as e:  # noqa: BLE001 - probing still works, its peaks are then conservative
        say(f"  could not set the CUDA allocator to {JOB_ALLOCATOR} ({e}); peaks may be overestimated")
