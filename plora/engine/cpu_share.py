"""Each job process's share of the host's CPU: the cores of its GPUs, and as many threads.

torch's intra-op (OpenMP) pool and the tokenizers' pool default to every core, in each
process. Alone on a host that costs nothing; four jobs on a 4-GPU host of 64 cores start
64 threads each, their many small host operations spin on 256 threads over 64 cores (a
load average of 85), and each job's Python thread, which feeds its GPU, waits for a core:
the jobs ran 2-3x slower than alone. So each of the host's GPUs gets a block of its
physical cores (with their hyperthread siblings); a job process is bound to the blocks of
its GPUs and runs as many threads as one block has physical cores. On a one-GPU host the
block is the whole machine and nothing changes.

The share is worked out where the job's environment is (`plora.engine.job_env`), so that a
process started ahead of its job (`plora.engine.spare`) has the same. ``PLORA_CPU_SHARE=0``
leaves threads and binding to the libraries' defaults; a thread count the user set
(``OMP_NUM_THREADS``) is kept.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from plora.settings import CPU_SHARE, CPUS, settings

#: set to 0 to leave each job's threads and cores to the libraries' defaults
ENV_SWITCH = CPU_SHARE
#: the cores a job process is bound to (``0-7,32-39``), read by `bind_to_share` as it starts
CPUS_VAR = CPUS
#: the thread pools a job sizes: torch's intra-op (OpenMP), MKL's, the tokenizers' (Rayon)
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
SYS_CPU = Path("/sys/devices/system/cpu")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class CpuShare:
    """The cores a job process may run on, and the threads each of its pools gets."""

    cpus: tuple[int, ...]
    threads: int

    def env(self) -> dict[str, str]:
        return {**{v: str(self.threads) for v in THREAD_VARS}, CPUS_VAR: format_cpus(self.cpus)}


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    return settings(environ).cpu_share


def format_cpus(cpus: Iterable[int]) -> str:
    """``0-3,8,10-11``: the kernel's own list format (as in /sys and ``taskset -c``)."""
    out = []
    for _, run in itertools.groupby(enumerate(sorted(set(cpus))), lambda ic: ic[1] - ic[0]):
        run_cpus = [c for _, c in run]
        out.append(f"{run_cpus[0]}-{run_cpus[-1]}" if len(run_cpus) > 1 else str(run_cpus[0]))
    return ",".join(out)


def parse_cpus(text: str) -> tuple[int, ...]:
    """The inverse of `format_cpus`; a malformed list is a ValueError."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        first, last = int(lo), int(hi or lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def physical_cores(cpus: Iterable[int], sys_cpu: Path = SYS_CPU) -> list[tuple[int, ...]]:
    """The logical CPUs ``cpus`` grouped into physical cores (hyperthread siblings together),
    by package then core id, so that consecutive cores share a socket. Where the topology
    cannot be read, each logical CPU is a core of its own."""
    groups: dict[tuple[int, int], list[int]] = {}
    for c in sorted(set(cpus)):
        topo = sys_cpu / f"cpu{c}" / "topology"
        try:
            key = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            key = (-1, c)
        groups.setdefault(key, []).append(c)
    return [tuple(groups[k]) for k in sorted(groups)]


def host_gpu_count(torch_fallback: bool = True) -> int:
    """The GPUs of this host, whatever this process sees of them (``CUDA_VISIBLE_DEVICES``
    narrows what a sweep uses, not who else runs beside it); 0 where none is found. The
    driver's list first; without one, torch's count unless ``torch_fallback`` is off."""
    try:
        return sum(1 for _ in NVIDIA_GPUS.iterdir())
    except OSError:
        pass
    if not torch_fallback:
        return 0
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no CUDA: no GPUs to share the cores among
        return 0


def share_for(gpu_ids: Sequence[int], host_gpus: int, cores: Sequence[tuple[int, ...]]) -> CpuShare | None:
    """The share of a job on the host's GPUs ``gpu_ids`` (of ``host_gpus``), given the
    physical ``cores`` this process may use; None where there is nothing to divide (one GPU)."""
    if host_gpus <= 1 or not gpu_ids or not cores:
        return None
    per_gpu = len(cores) // host_gpus
    if per_gpu < 1:  # fewer cores than GPUs: one thread each, anywhere
        return CpuShare(tuple(c for core in cores for c in core), 1)
    cpus = sorted({c for g in gpu_ids for core in cores[(g % host_gpus) * per_gpu:(g % host_gpus + 1) * per_gpu]
                   for c in core})
    return CpuShare(tuple(cpus), per_gpu)


def job_share(device_ids: Sequence[str], environ: Mapping[str, str] | None = None) -> CpuShare | None:
    """The share of a job on the devices ``device_ids`` (what its ``CUDA_VISIBLE_DEVICES``
    lists), or None where it is off or there is nothing to divide."""
    if not enabled(environ) or not hasattr(os, "sched_getaffinity"):
        return None
    try:
        ids = [int(d) for d in device_ids]
    except ValueError:  # GPU UUIDs: the host's numbering is not known, so no block either
        return None
    return share_for(ids, host_gpu_count(), physical_cores(os.sched_getaffinity(0)))


def bind_to_share(environ: Mapping[str, str]) -> None:
    """Bind the calling process to the cores its environment names (`CPUS_VAR`), before it
    starts any thread: every thread it starts, and every process, inherits them. Run in the
    child between fork and exec; a list the kernel refuses leaves the process unbound."""
    text = settings(environ).cpus
    if not text or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, parse_cpus(text))
    except (OSError, ValueError):
        pass
