"""Run packed jobs as local processes: `tune run <plora recipe> --config <job.yaml>`.

Each job is its own process so that one crash, out-of-memory or hang never takes the sweep
down with it. On CPU a job is a single-threaded process and the machine's cores are the
slots: tiny matmuls on several OpenMP threads are many times slower than on one, and two
one-thread jobs side by side keep both cores busy.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from plora.bytecode_cache import PREAMBLE
from plora.job.outputs import read_progress
from plora.engine import spare
from plora.engine.job_env import job_env, visible_gpu_ids  # noqa: F401 - visible_gpu_ids: where callers look
from plora.engine.spare import child_setup

#: relative path that `tune run` turns into the module `plora.train.packed_lora`
RECIPE = "plora/train/packed_lora.py"
#: torchtune's `tune` command with plora imported first, so that torchao's import (which
#: torchtune's makes) finds its version notice already silenced (`plora.torchao_notice`), and
#: the bytecode of torchtune's imports is kept where Python may not write it (`plora.bytecode_cache`)
TUNE = ("import runpy, plora; " + PREAMBLE
        + "runpy.run_module('torchtune._cli.tune', run_name='__main__', alter_sys=True)")


@dataclass
class JobProcess:
    """A launched job and where it writes."""

    job_id: str
    job_dir: Path
    slot: str
    proc: subprocess.Popen
    started: float
    log: object = None
    returncode: int | None = None
    ended: float | None = None

    @property
    def lost(self) -> bool:
        """Whether the job was lost with its machine (a Ray node that died), not crashed."""
        return bool(getattr(self.proc, "lost", False))

    def signal(self, sig: int) -> None:
        """Signal the job: its process group here, or through its backend's handle."""
        if self.proc.pid is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        else:
            self.proc.send_signal(sig)

    def progress(self) -> dict:
        return read_progress(self.job_dir)


def tune_command(job_yaml: Path, nproc: int = 1) -> list[str]:
    cmd = [sys.executable, "-c", TUNE, "run"]
    if nproc > 1:
        cmd += ["--nproc_per_node", str(nproc)]
    return cmd + [RECIPE, "--config", str(job_yaml)]


def launch(
    job_id: str,
    job_dir: Path,
    slot: str,
    *,
    gpus: Sequence[int] = (),
    nproc: int = 1,
    extra_env: dict[str, str] | None = None,
) -> JobProcess:
    """Start one job in its own session (its process group is its pid), logging to log.txt.

    The job dies with the sweep process (Linux parent-death signal), so a sweep killed with
    SIGKILL leaves no orphan training on behind it; resume also kills stale groups.
    """
    env = job_env(gpus, extra_env)
    log = open(job_dir / "log.txt", "a")
    log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {job_id} attempt {env.get('PLORA_ATTEMPT', '1')} on {slot}\n")
    log.flush()
    launched = time.time()  # a hand-over may wait for a spare still importing: that counts
    proc = spare.take(job_dir / "job.yaml", job_dir, job_dir / "log.txt", env, launched) if nproc == 1 else None
    if proc is None:  # no spare started ahead (or not one this job can use): the ordinary way
        proc = subprocess.Popen(
            tune_command(job_dir / "job.yaml", nproc),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(job_dir),
            start_new_session=True,
            preexec_fn=child_setup(env),
        )
    return JobProcess(job_id, job_dir, slot, proc, launched, log)


def default_slots(device: str) -> list[str]:
    """GPU ids when CUDA is wanted and visible; one slot per CPU core otherwise."""
    if device in ("auto", "cuda"):
        try:
            import torch

            n = torch.cuda.device_count()
        except Exception:  # noqa: BLE001 - a broken CUDA install means no GPUs
            n = 0
        if n:
            return [f"cuda:{i}" for i in range(n)]
        if device == "cuda":
            raise RuntimeError("hardware.device is cuda but no CUDA device is visible")
    return [f"cpu:{i}" for i in range(max(1, os.cpu_count() or 1))]
