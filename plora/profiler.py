"""Profiler: fit the cost model of packed jobs from a few real iterations.

The planner trusts `CostModel.memory` and `CostModel.step_time` for every job it forms: a
pack predicted to fit that runs out of memory wastes the sweep, and a wrong step time
gives a wrong schedule. So the coefficients come from measurements on the sweep's own
hardware and model: short *probe* jobs (two warm-up steps, then by default ten timed
steps, as PLoRA does with the first ten iterations of real runs) that vary total rows,
Σ rank·rows, adapter count and, where it can be measured, the TP degree.

Choices, and why:

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
* **Probe sizes** come from two small calibration probes: their memory gives the bytes per
  row, and the largest probes are sized to about 70% of the usable memory, so the fit
  covers the range the planner will use without running near the limit.
* **Fit.** Step time: non-negative least squares on ``[1, Σ bs·seq, Σ r·bs·seq, K,
  buckets]``, or the maximum of that (the GPU) and ``[1, K, buckets]`` (the host issuing
  the step's kernels) when two pieces predict left-out probes clearly better
  (`fit_step_time`); memory: the Appendix-B structure of `CostModel` (base; per adapter a constant, its
  parameters, gradients and AdamW state ∝ rank, activations ∝ bs·seq and ∝ r·bs·seq), all
  coefficients non-negative, calibrated on the measured peaks. Both minimize *relative*
  error, because the planner compares small and large jobs alike. Small packs are
  launch-bound (flat in tokens: on an H200, 150-180 ms per step on the 0.5B shape from 256
  to 4,000 tokens), which one linear form cannot follow next to GPU-bound large packs
  (20-30% errors); the host piece does. Packs whose reserved memory nears the device's are slowed by the
  allocator freeing and retrying; the memory model and the load factor keep the planner's
  packs out of the second regime.
* **TP degree.** One GPU measures d = 1 only. Degrees d > 1 are derived from the d = 1 fit
  with `CostModel.analytic`'s TP scaling (sharded compute and memory divided by d, plus
  its communication terms) and marked ``extrapolated`` in the model's ``meta``.
* **Job terms.** Probes run in-process and cannot see what a job of a sweep pays besides
  its steps: process start, model load, the first step's one-time costs, a graph capture
  whenever the pack changes, the packed eval and the saves of adapters leaving. One short
  real job (`plora.jobprobe`, run as the engine runs jobs, with adapters leaving in groups
  of different sizes) reports its phases, and `plora.jobcost.fit_overheads` fits them; the
  raw phases are kept in the profile (``job_runs``) and the phases of a finished sweep's
  jobs are fitted in with them (`remember_job_phases`).
* **Cache.** A profile is stored under ``$PLORA_CACHE_DIR`` (default
  ``~/.cache/plora/profiles``), keyed by (model shape, LoRA targets and dropout, sequence
  length, dtype, device name, kernel backend, measured TP degree); a second sweep on the
  same model and hardware reuses it without probing.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import random
import re
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from plora.costmodel import (AdapterLoad, CostModel, MemoryCoeffs, ModelShape, TimeCoeffs, num_buckets,
                             resolve_lora_targets)
from plora.heap import frozen_heap
from plora.jobconfig import JobAdapter, JobConfig, JobData, JobEval, JobLora, JobModel, JobTraining, SyntheticRows
from plora.jobcost import fit_overheads
from plora.jobprobe import run_job_probe

__all__ = [
    "DEFAULT_ITERS",
    "DEFAULT_WARMUP",
    "Measurement",
    "Probe",
    "Profile",
    "ProfileError",
    "cache_dir",
    "cache_path",
    "calibration_probes",
    "fit_cost_model",
    "fit_probes",
    "holdout_probes",
    "limit_probes",
    "fill_probes",
    "load_profile",
    "prediction_errors",
    "profile_key",
    "profile_model",
    "profile_sweep",
    "remember_job_overhead",
    "remember_job_phases",
    "run_probe",
    "shape_from_model",
    "summarize_errors",
]

DEFAULT_WARMUP = 2
DEFAULT_ITERS = 10
#: on a GPU, probes time at least this many seconds of steps (up to MAX_ITERS_FACTOR x iters)
DEFAULT_MIN_TIMED_S = 3.0
MAX_ITERS_FACTOR = 3
#: fewest timed steps a probe gets when `max_probe_s` shortens it
MIN_ITERS = 3
#: ranks that probes and validation packs draw from
RANKS = (8, 16, 32, 64, 128)
#: the largest probes are sized to this share of the usable memory (load factor x total),
#: by the bytes per row of the two calibration probes: a rough estimate (on the 7B shape, a
#: pack of 16 mixed ranks came out 14% over it), so it stays well short of the limit
PROBE_MEMORY_SHARE = 0.7
#: "fill" probes, sized by the first fit's memory model (within 1-2% on the GPU) to this
#: share of the usable memory, then part of the final fit. The planner fills GPUs to the
#: load factor; a step-time fit that stops at 0.7 extrapolates the GPU piece from packs
#: that are partly launch-bound (H200, 0.5B shape: packs at the limit under-predicted by up
#: to 26%; refitted with one such pack among the probes, 15%).
FILL_SHARE = 0.97
#: more warm-up steps for the first probe of a process
FIRST_PROBE_EXTRA_WARMUP = 3
#: rows of the largest probe when memory cannot say (CPU)
CPU_MAX_ROWS = 8
#: `profile_sweep` on a CPU: shorter probes (the CPU path is for the demo, not for planning a cluster)
CPU_DEFAULTS = {"max_probe_s": 0.5, "holdout": 3}
PROFILE_KIND = "plora.profile/v1"
CACHE_ENV = "PLORA_CACHE_DIR"
TIME_FEATURES = ("c0", "c_tok", "c_rtok", "c_ad", "c_bkt")
MEMORY_FEATURES = ("base", "adapter", "rank", "tok", "rank_tok")

Log = Callable[[str], None]


class ProfileError(RuntimeError):
    """Profiling cannot produce a model (too few probes ran, the base model does not fit)."""


# --------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class Probe:
    """One packed job to measure: adapter k has rank ``ranks[k]`` and ``batch_sizes[k]`` rows."""

    name: str
    ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    role: str = "fit"  # fit | holdout | limit

    def __post_init__(self) -> None:
        if not self.ranks or len(self.ranks) != len(self.batch_sizes):
            raise ValueError(f"probe {self.name}: one batch size per rank, at least one adapter")
        if min(self.ranks) < 1 or min(self.batch_sizes) < 1:
            raise ValueError(f"probe {self.name}: ranks and batch sizes must be positive")

    @property
    def adapters(self) -> int:
        return len(self.ranks)

    @property
    def rows(self) -> int:
        return sum(self.batch_sizes)

    @property
    def rank_sum(self) -> int:
        return sum(self.ranks)

    def tokens(self, seq_len: int) -> int:
        return self.rows * seq_len

    def rank_tokens(self, seq_len: int) -> int:
        return sum(r * b for r, b in zip(self.ranks, self.batch_sizes)) * seq_len

    def loads(self) -> list[AdapterLoad]:
        return [AdapterLoad(f"{self.name}-{k}", r, b, 1) for k, (r, b) in enumerate(zip(self.ranks, self.batch_sizes))]

    def label(self) -> str:
        """``K=4 r=8,32,64,128 bs=2,2,2,2``, runs of equal values folded (``r=16x8``)."""
        return f"K={self.adapters} r={_fold(self.ranks)} bs={_fold(self.batch_sizes)}"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ranks": list(self.ranks), "batch_sizes": list(self.batch_sizes), "role": self.role}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Probe":
        return cls(str(d["name"]), tuple(int(r) for r in d["ranks"]), tuple(int(b) for b in d["batch_sizes"]),
                   str(d.get("role", "fit")))


def _fold(values: Sequence[int]) -> str:
    if len(set(values)) == 1 and len(values) > 1:
        return f"{values[0]}x{len(values)}"
    return ",".join(str(v) for v in values)


def calibration_probes() -> list[Probe]:
    """Two small probes that size the others (and are part of the fit)."""
    return [Probe("cal-1", (16,), (1,)), Probe("cal-2", (16, 64), (2, 2))]


def fit_probes(rows: int, kmax: int = 16) -> list[Probe]:
    """Probes whose total rows, Σ rank·rows, Σ rank and adapter count vary independently.

    ``rows`` is the total of the largest probes; adapter counts are capped by it as well,
    since a pack never holds more adapters than rows.
    """
    R = max(1, int(rows))
    k_many = max(2, min(int(kmax), max(R, 2)))
    k_mid = max(2, min(8, k_many))

    def bs(total: float, k: int) -> int:
        return max(1, round(total / k))

    mixed = (8, 32, 64, 128)
    probes = [
        Probe("rows-r8", (8,), (R,)),
        Probe("rows-r128", (128,), (bs(R / 2, 1),)),
        Probe(f"k{k_mid}-r8", (8,) * k_mid, (bs(R, k_mid),) * k_mid),
        Probe("k2-r128", (128, 128), (bs(R / 2, 2),) * 2),
        Probe(f"k{k_many}-r16", (16,) * k_many, (1,) * k_many),
        Probe("k4-mixed", mixed, (bs(R, 4),) * 4),
        Probe(f"k{k_mid}-small", tuple((8, 16, 32, 64)[i % 4] for i in range(k_mid)), (1,) * k_mid),
        # between the launch-bound small packs and the GPU-bound large ones: where the two
        # step-time pieces meet (`fit_step_time`)
        Probe("rows-r64-q", (64,), (bs(R / 4, 1),)),
        Probe(f"k{k_many}-mixed", tuple((8, 16, 32, 64, 128)[i % 5] for i in range(k_many)), (bs(R, k_many),) * k_many),
        Probe("k4-mixed-h", mixed, (bs(R / 2, 4),) * 4),
        Probe(f"k{k_mid}-r32-h", (32,) * k_mid, (bs(R / 2, k_mid),) * k_mid),
        # small packs of several buckets: the host piece's per-adapter and per-bucket costs
        Probe("k4-mixed-small", mixed, (1,) * 4),
        Probe("k2-spread", (8, 128), (1, 1)),
    ]
    seen: set[tuple] = set()  # few rows make some of them the same pack: run it once
    unique = []
    for p in probes:
        if (p.ranks, p.batch_sizes) not in seen:
            seen.add((p.ranks, p.batch_sizes))
            unique.append(p)
    return unique


def holdout_probes(rows: int, kmax: int = 16, n: int = 4, seed: int = 0) -> list[Probe]:
    """Validation packs, none of them a fit probe: one small single-adapter job, then
    seeded random mixes of ranks and batch sizes over the probes' range of rows."""
    R = max(1, int(rows))
    rng = random.Random(seed)
    out = [Probe("ho-1", (32,), (max(1, R // 4),), role="holdout")]
    k_hi = max(2, min(int(kmax), max(R, 2)))
    for i in range(2, n + 1):
        k = rng.randint(2, k_hi)
        target = rng.uniform(0.3, 1.0) * R
        ranks = tuple(rng.choice(RANKS) for _ in range(k))
        sizes = tuple(max(1, round(target / k * rng.choice((0.5, 1.0, 1.5)))) for _ in range(k))
        out.append(Probe(f"ho-{i}", ranks, sizes, role="holdout"))
    return out[:n]


def limit_probes(cm: CostModel, load_factor: float, kmax: int = 16, d: int = 1) -> list[Probe]:
    """Packs that the model predicts *just* fit: the fullest a planner would form.

    Adapters of mixed ranks start at one row each; rows are then added one adapter at a
    time while ``cm.fits`` still holds, so the prediction ends within one row of
    ``load_factor x gpu_memory``. Running them shows whether a predicted fit really fits.
    """
    shapes = (("limit-mixed", (8, 16, 32, 64, 128, 16, 32, 64)[: max(1, min(8, kmax))]), ("limit-r128", (128, 64)))
    return [p for name, ranks in shapes if (p := _filled(cm, name, ranks, load_factor, d, "limit")) is not None]


def fill_probes(cm: CostModel, load_factor: float, kmax: int = 16, d: int = 1,
                max_rows: int | None = None) -> list[Probe]:
    """Fit probes that fill `FILL_SHARE` of the usable memory by ``cm``'s prediction: the
    large packs the planner forms, measured rather than extrapolated to. Their ranks differ
    from the `limit_probes`, which stay validation packs. ``max_rows`` caps them (CPU)."""
    shapes = (("fill-r32", (32,)), ("fill-k4", (16, 32, 64, 128)[: max(1, min(4, kmax))]))
    return [p for name, ranks in shapes
            if (p := _filled(cm, name, ranks, load_factor * FILL_SHARE, d, "fit", max_rows)) is not None]


def _filled(cm: CostModel, name: str, ranks: Sequence[int], load_factor: float, d: int, role: str,
            max_rows: int | None = None) -> Probe | None:
    """The pack of these ranks (as many as fit at one row each) with the most rows that
    ``cm`` predicts fit at ``load_factor``: uniform batch sizes, then one more row for as
    many adapters as still fit (at most ``max_rows`` in all)."""
    ranks = tuple(ranks)
    k = len(ranks)
    while k > 0 and not _fits(cm, ranks[:k], (1,) * k, load_factor, d):
        k -= 1
    if k == 0:
        return None
    ranks = ranks[:k]
    total = 1 << 20 if max_rows is None else max(k, int(max_rows))

    def ok(sizes) -> bool:
        return sum(sizes) <= total and _fits(cm, ranks, tuple(sizes), load_factor, d)

    lo, hi = 1, 2
    while ok((hi,) * k):
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # largest uniform batch that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok((mid,) * k) else (lo, mid)
    sizes = [lo] * k
    for i in range(k):  # then one more row for as many adapters as still fit
        trial = sizes.copy()
        trial[i] += 1
        if not ok(trial):
            break
        sizes = trial
    return Probe(name, ranks, tuple(sizes), role=role)


def _fits(cm: CostModel, ranks, sizes, load_factor: float, d: int) -> bool:
    return cm.fits(Probe("x", tuple(ranks), tuple(sizes)).loads(), d, load_factor)


# ----------------------------------------------------------------------- measurement


@dataclass
class Measurement:
    """Step times and peak memory of one probe job."""

    probe: Probe
    seq_len: int
    step_times: list[float] = field(default_factory=list)
    #: the job's peak memory: CUDA reserved peak + context (GPU), resident set peak (CPU)
    peak_bytes: float = 0.0
    allocated_peak: float | None = None
    reserved_peak: float | None = None
    context_bytes: float = 0.0
    build_s: float = 0.0
    oom: bool = False
    error: str = ""

    @property
    def step_time(self) -> float:
        """Interquartile mean of the timed steps: robust to a few slow or fast steps like the
        median, steadier than it on the noisy launch-bound steps of small packs."""
        if not self.step_times:
            return float("nan")
        ts = sorted(self.step_times)
        cut = len(ts) // 4
        return statistics.fmean(ts[cut: len(ts) - cut])

    @property
    def allocated_bytes(self) -> float | None:
        """Allocated (not reserved) peak plus context: the footprint without fragmentation."""
        return None if self.allocated_peak is None else self.allocated_peak + self.context_bytes

    @property
    def ok(self) -> bool:
        return not self.oom and not self.error and bool(self.step_times) and self.peak_bytes > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "probe": self.probe.to_dict(),
            "seq_len": self.seq_len,
            "step_time": None if not self.step_times else self.step_time,
            "step_times": self.step_times,
            "peak_bytes": self.peak_bytes,
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "context_bytes": self.context_bytes,
            "build_s": self.build_s,
            "oom": self.oom,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Measurement":
        return cls(
            probe=Probe.from_dict(d["probe"]),
            seq_len=int(d["seq_len"]),
            step_times=[float(t) for t in d.get("step_times", [])],
            peak_bytes=float(d.get("peak_bytes", 0.0)),
            allocated_peak=d.get("allocated_peak"),
            reserved_peak=d.get("reserved_peak"),
            context_bytes=float(d.get("context_bytes", 0.0)),
            build_s=float(d.get("build_s", 0.0)),
            oom=bool(d.get("oom", False)),
            error=str(d.get("error", "")),
        )


def probe_job_config(model_dir: str | Path, probe: Probe, *, seq_len: int, dtype: str, device: str,
                     targets: Sequence[str], family: str = "auto", dropout: float = 0.0,
                     output_dir: str | Path = ".", num_threads: int | None = None,
                     activation_checkpointing: bool = False, cuda_graphs: Any = "auto") -> JobConfig:
    """The recipe config of a probe: a random-init model, fixed-length synthetic rows."""
    return JobConfig(
        job_id=f"probe-{probe.name}",
        output_dir=Path(output_dir),
        device=device,
        num_threads=num_threads,
        seed=0,
        model=JobModel(path=str(model_dir), family=family, max_seq_len=int(seq_len), dtype=dtype, random_init=True),
        data=JobData(synthetic=SyntheticRows(seq_len=int(seq_len), num_samples=max(16, max(probe.batch_sizes)))),
        lora=JobLora(targets=list(targets), dropout=float(dropout)),
        adapters=[
            JobAdapter(id=f"{probe.name}-{k}", rank=r, alpha=2.0 * r, learning_rate=1e-4, batch_size=b, seed=k,
                       steps=10**9)
            for k, (r, b) in enumerate(zip(probe.ranks, probe.batch_sizes))
        ],
        training=JobTraining(scheduler="constant", grad_clip=1.0, weight_decay=0.0,
                             activation_checkpointing=bool(activation_checkpointing), cuda_graphs=cuda_graphs),
        eval=JobEval(metrics=[]),
    )


def run_probe(
    model_dir: str | Path,
    probe: Probe,
    *,
    seq_len: int,
    dtype: str = "bfloat16",
    device: str = "cuda",
    targets: Sequence[str] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    family: str = "auto",
    dropout: float = 0.0,
    warmup: int = DEFAULT_WARMUP,
    iters: int = DEFAULT_ITERS,
    max_probe_s: float | None = None,
    min_timed_s: float | None = None,
    num_threads: int | None = None,
    activation_checkpointing: bool = False,
    cuda_graphs: Any = "auto",
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

    from plora.recipes.packed_lora import PackedLoRARecipe

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    _release(cuda)
    m = Measurement(probe, int(seq_len))
    poller = None if cuda else _RssPoller()
    with tempfile.TemporaryDirectory(prefix="plora-probe-") as tmp:
        cfg = probe_job_config(model_dir, probe, seq_len=seq_len, dtype=dtype, device=device, targets=targets,
                               family=family, dropout=dropout, output_dir=tmp, num_threads=num_threads,
                               activation_checkpointing=activation_checkpointing, cuda_graphs=cuda_graphs)
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
                free, whole = torch.cuda.mem_get_info(dev)
                m.context_bytes = float(max(0, (whole - free) - torch.cuda.memory_reserved(dev)))
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


# ----------------------------------------------------------------------------- fit


def _time_row(p: Probe, seq: int) -> list[float]:
    return [1.0, float(p.tokens(seq)), float(p.rank_tokens(seq)), float(p.adapters), float(num_buckets(p.ranks))]


#: host-piece forms tried, as columns of `_time_row`: the host issues the same kernels
#: whatever the tokens, so it has a constant, maybe a cost per adapter and per rank bucket
HOST_FORMS = ((0, 3, 4), (0, 3), (0,))
#: the fewest fit probes for which a two-piece step time is tried
MIN_PROBES_TWO_PIECES = 6
#: a two-piece fit must predict left-out probes this much better than one piece to be kept
TWO_PIECE_GAIN = 0.7
#: every host/GPU split is tried up to this many probes (2^n fits), beyond only splits by tokens
EXHAUSTIVE_SPLITS_MAX = 10


def fit_step_time(X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Step-time coefficients (the `_time_row` columns): a GPU piece, and a host piece (None
    when one linear form predicts as well).

    The step is ``max(gpu, host)`` (see `plora.costmodel`). Which probes are host-bound is
    unknown, so for each host form (`HOST_FORMS`) the fit searches the splits (all of them
    for up to `EXHAUSTIVE_SPLITS_MAX` probes, else the splits by tokens), refines each by
    reassigning probes to the piece that predicts more, and keeps the split whose maximum
    fits best. Two pieces have up to 8 coefficients for a dozen probes, enough to fit
    noise: the form is chosen by leave-one-out error (each probe predicted by the pieces
    refitted without it), not by the fit's own error.
    """
    n = len(y)

    def rel2(pred: np.ndarray) -> float:
        return float(np.sum((pred / y - 1.0) ** 2))

    def loo_one() -> float:
        err = 0.0
        for i in range(n):
            keep = np.arange(n) != i
            err += (X[i] @ _nnls_relative(X[keep], y[keep]) / y[i] - 1.0) ** 2
        return err

    one = _nnls_relative(X, y)
    if n < MIN_PROBES_TWO_PIECES:
        return one, None
    best_loo, best = loo_one(), (one, None)

    for cols in HOST_FORMS:
        H = X[:, cols]

        def fit_split(gpu: np.ndarray):
            g = h = None
            for _ in range(10):
                if gpu.sum() < 2 or (~gpu).sum() < 1:
                    return None
                g = _nnls_relative(X[gpu], y[gpu])
                h = _nnls_relative(H[~gpu], y[~gpu])
                new = X @ g >= H @ h
                if (new == gpu).all():
                    break
                gpu = new
            return rel2(np.maximum(X @ g, H @ h)), g, h, gpu

        if n <= EXHAUSTIVE_SPLITS_MAX:
            splits = (np.array([(m >> i) & 1 for i in range(n)], dtype=bool) for m in range(1, (1 << n) - 1))
        else:
            order = np.argsort(X[:, 1], kind="stable")  # by tokens
            splits = (np.isin(np.arange(n), order[k:]) for k in range(1, n))
        found = None
        for split in splits:
            got = fit_split(split)
            if got is not None and (found is None or got[0] < found[0]):
                found = got
        if found is None:
            continue
        _, g, h, gpu = found
        loo = 0.0  # the split fixed, each probe predicted by both pieces refitted without it
        for i in range(n):
            keep = np.arange(n) != i
            gk, hk = gpu & keep, ~gpu & keep
            if gk.sum() < 1 or hk.sum() < 1:
                loo = np.inf
                break
            pred = max(X[i] @ _nnls_relative(X[gk], y[gk]), H[i] @ _nnls_relative(H[hk], y[hk]))
            loo += (pred / y[i] - 1.0) ** 2
        if loo < TWO_PIECE_GAIN * best_loo:
            host = np.zeros(X.shape[1])
            host[list(cols)] = h
            best_loo, best = loo, (g, host)
    return best


def _memory_row(p: Probe, seq: int) -> list[float]:
    return [1.0, float(p.adapters), float(p.rank_sum), float(p.tokens(seq)), float(p.rank_tokens(seq))]


def _nnls_relative(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative errors: min Σ ((Xc - y) / y)² with c >= 0."""
    from scipy.optimize import nnls

    w = 1.0 / np.maximum(np.abs(y), 1e-30)
    A = X * w[:, None]
    scale = np.linalg.norm(A, axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale, y * w)
    return coef / scale


def fit_cost_model(
    measurements: Sequence[Measurement],
    shape: ModelShape,
    seq_len: int,
    gpu_memory_bytes: float,
    *,
    targets: str | Iterable[str] | None = None,
    tp_degrees: Iterable[int] = (1,),
    name: str | None = None,
    meta: dict[str, Any] | None = None,
) -> CostModel:
    """A `CostModel` fitted on measured probes (d = 1), extended to ``tp_degrees``.

    Only probes that ran (no OOM) count. Time: ``t = c0 + c_tok·Σbs·seq + c_rtok·Σr·bs·seq
    + c_ad·K + c_bkt·buckets``, or the larger of that and a host piece ``h0 + h_ad·K +
    h_bkt·buckets`` where that predicts left-out probes clearly better (`fit_step_time`); memory: ``base + Σ_k (adapter + rank·r_k + tok·bs_k·seq + rank_tok·r_k·bs_k·seq)``;
    every coefficient non-negative, relative errors minimized.
    """
    good = [m for m in measurements if m.ok]
    if len(good) < len(MEMORY_FEATURES):
        failed = [m.error for m in measurements if m.error and not m.oom]
        why = f" (first failure: {failed[0]})" if failed else ""
        raise ProfileError(f"need at least {len(MEMORY_FEATURES)} probes that ran to fit the cost model, "
                           f"got {len(good)}{why}")
    seqs = {m.seq_len for m in good}
    if seqs != {int(seq_len)}:
        raise ProfileError(f"probes were measured at sequence lengths {sorted(seqs)}, not {seq_len}")
    seq = int(seq_len)
    Xt = np.array([_time_row(m.probe, seq) for m in good])
    yt = np.array([m.step_time for m in good])
    Xm = np.array([_memory_row(m.probe, seq) for m in good])
    ym = np.array([m.peak_bytes for m in good])
    ct, host = fit_step_time(Xt, yt)
    cm_ = _nnls_relative(Xm, ym)
    t1 = TimeCoeffs(*(float(v) for v in ct))
    m1 = MemoryCoeffs(*(float(v) for v in cm_))
    names = resolve_lora_targets(targets)
    degrees = sorted(set(int(d) for d in tp_degrees) | {1})
    time_c, mem_c = _extend_tp(t1, m1, shape, seq, gpu_memory_bytes, names, degrees)
    # every TP rank issues the same launches: the host piece is the same at every degree
    host_c = {d: TimeCoeffs(*(float(v) for v in host)) for d in degrees} if host is not None else {}
    pred_t = Xt @ ct if host is None else np.maximum(Xt @ ct, Xt @ host)
    fit_t = pred_t / yt - 1.0
    fit_m = Xm @ cm_ / ym - 1.0
    info = {
        "source": "profile",
        "shape": shape.to_dict(),
        "targets": list(names),
        "measured_degrees": [1],
        "extrapolated_degrees": [d for d in degrees if d != 1],
        "tp_extrapolation": "CostModel.analytic TP scaling of the d=1 fit (activation_checkpointing=False)",
        "probes_used": len(good),
        "fit_max_abs_err": {"time": float(np.max(np.abs(fit_t))), "memory": float(np.max(np.abs(fit_m)))},
        "memory_measure": "cuda reserved peak + context" if any(m.reserved_peak for m in good) else "process rss",
        **(meta or {}),
    }
    info["step_time_pieces"] = 1 if host is None else 2
    return CostModel(float(gpu_memory_bytes), seq, time_c, mem_c, name=name or f"{shape.name}@{seq}", meta=info,
                     host_time=host_c)


def _extend_tp(t1: TimeCoeffs, m1: MemoryCoeffs, shape: ModelShape, seq: int, gpu_memory_bytes: float,
               targets: Sequence[str], degrees: Sequence[int]) -> tuple[dict[int, TimeCoeffs], dict[int, MemoryCoeffs]]:
    """Coefficients at d > 1 from the measured d = 1 ones and the analytic model's ratios.

    Compute that is sharded (base GEMMs, LoRA products, sharded activations and logits,
    sharded LoRA parameters, the weights) scales as the analytic model says; the measured
    fixed overheads (step constant, per-adapter cost, runtime memory) are kept; the
    analytic all-reduce time per token and latency are added.
    """
    time_c, mem_c = {1: t1}, {1: m1}
    extra = [d for d in degrees if d != 1]
    if not extra:
        return time_c, mem_c
    an = CostModel.analytic(shape, seq, gpu_memory_bytes, targets, activation_checkpointing=False,
                            tp_degrees=[1, *extra])
    a1t, a1m = an.time[1], an.memory_coeffs[1]
    weights = float(shape.n_params * shape.dtype_bytes)

    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else 1.0

    for d in extra:
        at, am = an.time[d], an.memory_coeffs[d]
        comm_tok = max(0.0, at.c_tok - a1t.c_tok / d)
        time_c[d] = TimeCoeffs(
            c0=max(0.25 * t1.c0, t1.c0 + (at.c0 - a1t.c0)),
            c_tok=t1.c_tok / d + comm_tok,
            c_rtok=t1.c_rtok * ratio(at.c_rtok, a1t.c_rtok),
            c_ad=t1.c_ad,
            c_bkt=t1.c_bkt,
        )
        mem_c[d] = MemoryCoeffs(
            base=max(0.0, m1.base - weights) + weights / d,
            adapter=m1.adapter,
            rank=m1.rank * ratio(am.rank, a1m.rank),
            tok=m1.tok * ratio(am.tok, a1m.tok),
            rank_tok=m1.rank_tok,
        )
    return time_c, mem_c


# ------------------------------------------------------------------------ validation


def prediction_errors(cm: CostModel, measurements: Sequence[Measurement], load_factor: float = 0.9,
                      d: int = 1) -> list[dict[str, Any]]:
    """Per measured pack: predicted vs measured step time and peak memory, and whether
    the model said it fits (at ``load_factor``) and whether it ran out of memory."""
    rows = []
    for m in measurements:
        loads = m.probe.loads()
        pt, pm = cm.step_time(loads, d), cm.memory(loads, d)
        rows.append({
            "probe": m.probe.name,
            "role": m.probe.role,
            "label": m.probe.label(),
            "tokens": m.probe.tokens(m.seq_len),
            "measured_s": m.step_time if m.ok else None,
            "predicted_s": pt,
            "time_err": (pt / m.step_time - 1.0) if m.ok else None,
            "measured_bytes": m.peak_bytes if m.ok else None,
            "allocated_bytes": m.allocated_bytes if m.ok else None,
            "predicted_bytes": pm,
            "memory_err": (pm / m.peak_bytes - 1.0) if m.ok else None,
            "predicted_share": pm / cm.gpu_memory_bytes,
            "fits": cm.fits(loads, d, load_factor),
            "oom": m.oom,
        })
    return rows


def summarize_errors(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Max and mean absolute relative errors, and predicted fits that ran out of memory."""
    te = [abs(r["time_err"]) for r in rows if r["time_err"] is not None]
    me = [abs(r["memory_err"]) for r in rows if r["memory_err"] is not None]
    return {
        "packs": len(rows),
        "time_max_abs_err": max(te) if te else None,
        "time_mean_abs_err": sum(te) / len(te) if te else None,
        "memory_max_abs_err": max(me) if me else None,
        "memory_mean_abs_err": sum(me) / len(me) if me else None,
        "predicted_fit_oom": sum(1 for r in rows if r["fits"] and r["oom"]),
        "oom": sum(1 for r in rows if r["oom"]),
    }


# --------------------------------------------------------------------------- profile


@dataclass
class Profile:
    """A fitted cost model with the measurements behind it: what profile.json holds."""

    cost_model: CostModel
    measurements: list[Measurement]  # the probes the model is fitted on
    holdout: list[Measurement]  # validation packs, not used in the fit
    key: dict[str, Any]
    load_factor: float = 0.9
    timings: dict[str, float] = field(default_factory=dict)
    reused: bool = False
    cache_path: str | None = None
    #: raw phases of real job runs (the job probe's, then finished sweeps'): the job terms' data
    job_runs: list[dict[str, Any]] = field(default_factory=list)

    def errors(self) -> list[dict[str, Any]]:
        return prediction_errors(self.cost_model, self.holdout, self.load_factor)

    def fit_errors(self) -> list[dict[str, Any]]:
        return prediction_errors(self.cost_model, self.measurements, self.load_factor)

    def summary(self) -> dict[str, Any]:
        return summarize_errors(self.errors())

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": PROFILE_KIND,
            "key": self.key,
            "cost_model": self.cost_model.to_dict(),
            "load_factor": self.load_factor,
            "timings": self.timings,
            "reused": self.reused,
            "cache_path": self.cache_path,
            "summary": self.summary(),
            "errors": self.errors(),
            "measurements": [m.to_dict() for m in self.measurements],
            "holdout": [m.to_dict() for m in self.holdout],
            **({"job_runs": self.job_runs} if self.job_runs else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        if d.get("kind") != PROFILE_KIND:
            raise ProfileError(f"not a plora profile (kind {d.get('kind')!r}, expected {PROFILE_KIND!r})")
        return cls(
            cost_model=CostModel.from_dict(d["cost_model"]),
            measurements=[Measurement.from_dict(m) for m in d.get("measurements", [])],
            holdout=[Measurement.from_dict(m) for m in d.get("holdout", [])],
            key=dict(d.get("key", {})),
            load_factor=float(d.get("load_factor", 0.9)),
            timings={k: float(v) for k, v in d.get("timings", {}).items()},
            reused=bool(d.get("reused", False)),
            cache_path=d.get("cache_path"),
            job_runs=list(d.get("job_runs", [])),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ProfileError(f"{path}: cannot read the profile ({e})") from e


def load_profile(path: str | Path) -> Profile:
    return Profile.load(path)


def _match_job_allocator(say: Log) -> None:
    """Probe with the CUDA allocator settings jobs run with (`plora.engine.local.JOB_ALLOCATOR`):
    expandable segments reserve up to ~30% less for the same pack, so peaks measured
    without them would not be a job's. Left alone where ``PYTORCH_CUDA_ALLOC_CONF`` is set
    (a job's environment already has it; so does a user's explicit choice)."""
    from plora.engine.local import JOB_ALLOCATOR

    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ:
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = JOB_ALLOCATOR  # jobs and processes started from here
    try:
        import torch

        torch.cuda.memory._set_allocator_settings(JOB_ALLOCATOR)
    except Exception as e:  # noqa: BLE001 - probing still works, its peaks are then conservative
        say(f"  could not set the CUDA allocator to {JOB_ALLOCATOR} ({e}); peaks may be overestimated")


def _device_info(device: str) -> tuple[str, str, float | None]:
    """(resolved device, device name, total memory in bytes or None on CPU)."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ProfileError("hardware.device is cuda but no CUDA device is visible")
        dev = torch.device(device)
        props = torch.cuda.get_device_properties(dev)
        return device, torch.cuda.get_device_name(dev), float(props.total_memory)
    return "cpu", "cpu", None


def _backend(device: str, activation_checkpointing: bool = False, cuda_graphs: Any = "auto") -> str:
    """How a job's steps run on ``device``: the kernels, and "+graph" when they are replayed
    from CUDA graphs (a profile measured one way does not predict the other)."""
    if not device.startswith("cuda"):
        return "torch"
    import torch

    from plora.recipes.step_graph import graphs_wanted

    kernels = "torch" if os.environ.get("PLORA_KERNELS", "auto").lower() == "torch" else "triton"
    graphed = graphs_wanted(cuda_graphs, torch.device(device), tp=False,
                            activation_checkpointing=activation_checkpointing)
    return kernels + ("+graph" if graphed else "")


def profile_model(
    model_dir: str | Path,
    shape: ModelShape,
    *,
    seq_len: int,
    dtype: str = "bfloat16",
    device: str = "auto",
    targets: str | Iterable[str] | None = None,
    family: str = "auto",
    dropout: float = 0.0,
    gpu_memory_bytes: float | None = None,
    tp_degrees: Iterable[int] = (1,),
    load_factor: float = 0.9,
    kmax: int = 16,
    max_rows: int | None = None,
    warmup: int = DEFAULT_WARMUP,
    iters: int = DEFAULT_ITERS,
    max_probe_s: float | None = None,
    holdout: int = 6,
    limit: bool | None = None,
    fill: bool | None = None,
    num_threads: int | None = None,
    deadline: float | None = None,
    min_checks: int = 0,
    log: Log | None = None,
    on_measurement: Callable[[Measurement], None] | None = None,
    activation_checkpointing: bool = False,
    cuda_graphs: Any = "auto",
    job_probe: bool = False,
    random_init: bool = True,
) -> Profile:
    """Probe a model on this machine, fit its cost model, validate it on held-out packs.

    ``limit`` adds the near-limit packs of `limit_probes` to the validation, ``fill`` the
    memory-filling packs of `fill_probes` to the fit (both by default on a GPU).
    ``deadline`` (a ``time.time()`` value) skips validation packs that would start after
    it, once ``min_checks`` of them have run; the fit probes always run. ``job_probe`` also
    runs one short real job (`plora.jobprobe`) and fits the job terms from its phases.
    """
    say = log or (lambda _msg: None)
    device, device_name, total = _device_info(device)
    cuda = device.startswith("cuda")
    if gpu_memory_bytes is None:
        if total is None:
            raise ProfileError("gpu_memory_bytes is needed on CPU")
        gpu_memory_bytes = total
    names = list(resolve_lora_targets(targets))
    if limit is None:
        limit = cuda
    if fill is None:
        fill = cuda
    if max_rows is None and not cuda:
        max_rows = CPU_MAX_ROWS
    key = profile_key(shape, seq_len=seq_len, dtype=dtype, device_name=device_name,
                      backend=_backend(device, activation_checkpointing, cuda_graphs), targets=names, dropout=dropout,
                      activation_checkpointing=activation_checkpointing)

    from scipy.optimize import nnls  # noqa: F401 - loaded now, not between probes (it moves the CPU baseline)

    first = [True]

    def measure(p: Probe) -> Measurement:
        # The process' first steps pay one-time costs (lazy loading, kernel compilation,
        # allocator growth) beyond a normal warm-up: the first probe warms up longer.
        extra = FIRST_PROBE_EXTRA_WARMUP if first[0] else 0
        first[0] = False
        try:
            m = run_probe(model_dir, p, seq_len=seq_len, dtype=dtype, device=device, targets=names, family=family,
                          dropout=dropout, warmup=warmup + extra, iters=iters, max_probe_s=max_probe_s,
                          num_threads=num_threads, activation_checkpointing=activation_checkpointing,
                          cuda_graphs=cuda_graphs)
        except Exception as e:  # noqa: BLE001 - one failed probe is reported, the others still count
            m = Measurement(p, int(seq_len), error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        if m.error and not m.oom:
            say(f"  {p.role:7} {p.name:14} {p.label():40} failed: {m.error}")
        elif m.oom:
            say(f"  {p.role:7} {p.name:14} {p.label():40} out of memory")
        else:
            say(f"  {p.role:7} {p.name:14} {p.label():40} {m.step_time * 1e3:9.2f} ms  "
                f"{m.peak_bytes / 2**30:7.2f} GiB  ({len(m.step_times)} steps, build {m.build_s:.1f} s)")
        if on_measurement is not None:
            on_measurement(m)
        return m

    if cuda:
        _match_job_allocator(say)
    t_start = time.time()
    say(f"profiling {shape.name} at seq {seq_len}, {dtype}, on {device_name} ({key['backend']} kernels)")
    fit_set = [measure(p) for p in calibration_probes()]
    rows = _probe_rows(fit_set, gpu_memory_bytes * load_factor, seq_len, max_rows)
    say(f"  largest probes: {rows} rows of {seq_len} tokens")
    fit_set += [measure(p) for p in fit_probes(rows, kmax)]
    meta = {"device": device_name, "backend": key["backend"], "dtype": dtype, "seq_len": int(seq_len),
            "warmup": warmup, "iters": iters, "probe_rows": rows,
            **({"cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")} if cuda else {})}
    cm = fit_cost_model(fit_set, shape, seq_len, gpu_memory_bytes, targets=names, tp_degrees=tp_degrees, meta=meta)
    if fill:  # the largest packs, placed by the memory model just fitted; then fit again
        fit_set += [measure(p) for p in fill_probes(cm, load_factor, kmax, max_rows=max_rows)]
        cm = fit_cost_model(fit_set, shape, seq_len, gpu_memory_bytes, targets=names, tp_degrees=tp_degrees,
                            meta=meta)
    job_runs: list[dict[str, Any]] = []
    if job_probe:
        t_job = time.time()
        run = run_job_probe(model_dir, seq_len=seq_len, dtype=dtype, device=device, targets=names, family=family,
                            dropout=dropout, random_init=random_init,
                            activation_checkpointing=activation_checkpointing, cuda_graphs=cuda_graphs)
        if run is None:
            say("  job probe did not finish: job start, load, eval and save are not in the model")
        else:
            job_runs.append(run)
            cm = cm.with_overheads(fit_overheads(job_runs))
            o = cm.overheads
            say(f"  job probe: start {o.start_s:.1f} s, load {o.load_s:.1f} s, set-up {o.setup_s:.1f} s, "
                f"first step +{o.warm_s:.2f} s, capture {o.capture_s:.2f} s, save {o.save_s:.2f} s/adapter "
                f"({time.time() - t_job:.0f} s)")
    profiling_s = time.time() - t_start
    cm.meta["profiling_s"] = profiling_s

    t_val = time.time()
    checks = holdout_probes(rows, kmax, n=holdout)
    if limit:  # interleaved, so that a deadline leaves some of each kind
        for i, p in enumerate(limit_probes(cm, load_factor, kmax)):
            checks.insert(min(len(checks), 2 + 3 * i), p)
    held: list[Measurement] = []
    for p in checks:
        if deadline is not None and time.time() > deadline and len(held) >= min_checks:
            say(f"  skipped {p.name}: out of time")
            continue
        held.append(measure(p))
    prof = Profile(cm, fit_set, held, key, load_factor,
                   timings={"profiling_s": profiling_s, "validation_s": time.time() - t_val}, job_runs=job_runs)
    prof.cost_model.meta["holdout"] = prof.summary()
    return prof


def _probe_rows(cal: Sequence[Measurement], usable_bytes: float, seq_len: int, max_rows: int | None) -> int:
    """Rows of the largest probes: about `PROBE_MEMORY_SHARE` of the usable memory, by the
    bytes per row the two calibration probes show (capped by ``max_rows``)."""
    a, b = cal[0], cal[1]
    rows = max_rows
    if a.ok and b.ok and a.reserved_peak is not None:  # GPU: the allocator's numbers
        if a.peak_bytes > usable_bytes:
            raise ProfileError(f"the base model alone needs {a.peak_bytes / 2**30:.1f} GiB, more than "
                               f"{usable_bytes / 2**30:.1f} GiB usable")
        per_row = max((b.peak_bytes - a.peak_bytes) / max(1, b.probe.rows - a.probe.rows), 1.0)
        fit_rows = int((PROBE_MEMORY_SHARE * usable_bytes - a.peak_bytes) // per_row) + 1
        rows = fit_rows if rows is None else min(rows, fit_rows)
    return max(1, int(rows if rows is not None else CPU_MAX_ROWS))


# ----------------------------------------------------------------------------- cache


def cache_dir() -> Path:
    """Where profiles are cached: ``$PLORA_CACHE_DIR`` or ``~/.cache/plora/profiles``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "plora" / "profiles"


def profile_key(shape: ModelShape, *, seq_len: int, dtype: str, device_name: str, backend: str,
                targets: Iterable[str], dropout: float = 0.0, tp: int = 1,
                activation_checkpointing: bool = False) -> dict[str, Any]:
    """What a profile depends on. The model enters by its architecture (not its name or
    weights: a random-init shape costs what the trained model costs) and its LoRA setup."""
    arch = {k: v for k, v in shape.to_dict().items() if k != "name"}
    setup = {"arch": arch, "targets": list(targets), "dropout": float(dropout)}
    if activation_checkpointing:  # absent otherwise: keys of earlier profiles stay valid
        setup["activation_checkpointing"] = True
    model = hashlib.sha1(json.dumps(setup, sort_keys=True).encode()).hexdigest()[:12]
    return {"model": model, "model_name": shape.name, "seq_len": int(seq_len), "dtype": dtype,
            "device": device_name, "backend": backend, "tp": int(tp)}


def cache_path(key: dict[str, Any]) -> Path:
    ident = {k: key[k] for k in ("model", "seq_len", "dtype", "device", "backend", "tp")}
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:10]
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(key["device"])).strip("-").lower() or "device"
    return cache_dir() / f"{key['model']}-seq{key['seq_len']}-{key['dtype']}-{device}-tp{key['tp']}-{digest}.json"


# ------------------------------------------------------------------------- the sweep


def shape_from_model(path: str | Path, family: str = "auto", dtype: str = "bfloat16") -> ModelShape:
    """The `ModelShape` of a Hugging Face model folder (parameters counted from config.json)."""
    from plora.models import read_model_info

    info = read_model_info(path, family)
    h, inter, L, V = info.embed_dim, info.intermediate_dim, info.num_layers, info.vocab_size
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv if info.family == "qwen2" else 0)
    per_layer = attn + 3 * h * inter + 2 * h
    n_params = V * h + L * per_layer + h + (0 if info.tie_word_embeddings else V * h)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return ModelShape(info.path.name, n_params, h, inter, L, info.num_heads, info.num_kv_heads, info.head_dim, V,
                      dtype_bytes, info.tie_word_embeddings)


def _sweep_cache_path(spec, shape: ModelShape, device: str, device_name: str) -> Path:
    key = profile_key(shape, seq_len=spec.model.max_seq_len, dtype=spec.model.dtype, device_name=device_name,
                      backend=_backend(device, bool(spec.training.activation_checkpointing), spec.training.cuda_graphs),
                      targets=list(spec.lora.resolved_targets()),
                      dropout=spec.lora.dropout, activation_checkpointing=bool(spec.training.activation_checkpointing))
    return cache_path(key)


def sweep_cache_path(spec) -> Path:
    """Where the profile of a sweep's model on this machine is cached (`profile_sweep`)."""
    shape = shape_from_model(spec.model.resolved_path(), spec.model.family, spec.model.dtype)
    device, device_name, _ = _device_info(spec.hardware.device)
    return _sweep_cache_path(spec, shape, device, device_name)


def remember_job_overhead(spec, overhead_s: float, jobs: int) -> Path | None:
    """Keep the per-job overhead a finished sweep measured in the cached profile of its model
    on this machine, so that the next sweep's first plan counts it.

    Probes run in-process and cannot see what every job pays besides its steps (process
    start, model load, evaluation and checkpoints: about 20 s a job for the 0.5B shape on an
    H200, where one packed job's steps took 22 s). The engine measures it from finished
    jobs (`plora.engine.runner.Drift`); re-plans use it at once, and this carries it over.
    Returns the profile written, or None when there is no cached profile to update.
    """
    path = sweep_cache_path(spec)
    if not path.is_file():
        return None
    try:
        prof = Profile.load(path)
    except ProfileError:
        return None
    cm = prof.cost_model
    cm.job_overhead_s = float(overhead_s)
    cm.meta["job_overhead"] = {"measured_s": float(overhead_s), "jobs": int(jobs), "at": time.time()}
    return prof.save(path)


def remember_job_phases(spec, runs: Sequence[dict[str, Any]]) -> Path | None:
    """Fit the job terms of the cached profile of a sweep's model on this machine again, with
    the phases of the sweep's finished jobs added to those it has (``runs``: summary.json
    ``phases``, with ``exited_at`` where the engine saw the process end). Returns the
    profile written, or None when there is no cached profile or no phases."""
    runs = [r for r in runs if r]
    path = sweep_cache_path(spec)
    if not runs or not path.is_file():
        return None
    try:
        prof = Profile.load(path)
    except ProfileError:
        return None
    prof.job_runs = (prof.job_runs + list(runs))[-64:]
    prof.cost_model = prof.cost_model.with_overheads(fit_overheads(prof.job_runs))
    return prof.save(path)


def profile_sweep(spec, run_dir: str | Path | None, *, force: bool = False, log: Log | None = None,
                  cached_only: bool = False, **options) -> CostModel | None:
    """The cost model of a sweep's model on this machine: from the cache when there is one
    (no probing), else measured; written to ``<run_dir>/profile.json`` (when a run_dir is
    given). With ``cached_only`` it never probes and returns None on a cache miss.

    ``options`` go to `profile_model` (iters, warmup, kmax, max_rows, ...).
    """
    say = log or (lambda _msg: None)
    model_dir = spec.model.resolved_path()
    dtype = spec.model.dtype
    shape = shape_from_model(model_dir, spec.model.family, dtype)
    device, device_name, total = _device_info(spec.hardware.device)
    gpu_memory = total if total is not None else spec.hardware.gpu_memory_gb * 2**30
    targets = list(spec.lora.resolved_targets())
    degrees = shape.tp_degrees(max_tp=spec.hardware.gpus)
    seq = spec.model.max_seq_len
    ac = bool(spec.training.activation_checkpointing)
    path = _sweep_cache_path(spec, shape, device, device_name)
    load_factor = spec.planner.memory_load_factor
    prof = None
    if path.is_file() and not force:
        try:
            prof = Profile.load(path)
        except ProfileError as e:
            say(f"ignoring the cached profile: {e}")
    if prof is not None:
        say(f"reusing the cached profile {path}")
        cm = prof.cost_model
        if set(cm.degrees) != set(degrees) or cm.gpu_memory_bytes != gpu_memory:
            keep = {k: v for k, v in cm.meta.items() if k in ("device", "backend", "dtype", "seq_len", "warmup",
                                                              "iters", "probe_rows", "profiling_s", "holdout")}
            overhead, terms = cm.job_overhead_s, cm.overheads
            prof.cost_model = fit_cost_model(prof.measurements, shape, seq, gpu_memory, targets=targets,
                                             tp_degrees=degrees, meta=keep)
            prof.cost_model.job_overhead_s = overhead  # learned from sweeps (remember_job_overhead)
            if terms is not None:
                prof.cost_model = prof.cost_model.with_overheads(terms)
        prof.reused, prof.load_factor = True, load_factor
    elif cached_only:
        return None
    else:
        threads = 1 if device == "cpu" else None
        if threads:
            import torch

            torch.set_num_threads(1)  # tiny matmuls on several threads are far slower on a small CPU
            for k, v in CPU_DEFAULTS.items():
                options.setdefault(k, v)
        options.setdefault("job_probe", True)
        options.setdefault("random_init", bool(spec.model.random_init))
        prof = profile_model(model_dir, shape, seq_len=seq, dtype=dtype, device=device, targets=targets,
                             family=spec.model.family, dropout=spec.lora.dropout, gpu_memory_bytes=gpu_memory,
                             tp_degrees=degrees, load_factor=load_factor, num_threads=threads, log=say,
                             activation_checkpointing=ac, cuda_graphs=spec.training.cuda_graphs, **options)
        prof.cache_path = str(path)
        prof.save(path)
    prof.cache_path = str(path)
    if run_dir is not None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        prof.save(Path(run_dir) / "profile.json")
    return prof.cost_model
