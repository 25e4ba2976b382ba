"""Mid-job checkpoints: a killed, preempted or interrupted job resumes where it was.

Every ``every_steps`` steps or ``every_minutes`` minutes (whichever comes first) a job
writes, for each adapter still training, what its next step depends on: its LoRA weights
and both AdamW moments (its pieces of the `LoRABank` and `PackedAdamW` buffers), its
optimizer step count (bias correction), its own step (schedule position), its data-stream
position, its losses so far and its status (an adapter that accumulates its gradient over
several packed steps is saved as at its last optimizer step, with the data position where
its current effective batch began: it resumes by training that batch again from its first
part, so no partial gradient is saved); its wall time so far, which a resumed adapter's
wall time goes on from; and, with per-epoch scoring, its finished epochs' scores and its
best epoch's weights (`plora.train.epochs`). Adapters are keyed by id, so a job that
resumes with a different pack (a retry without the adapters that finished, the halves of
an out-of-memory split) takes each adapter's state from wherever it was saved last.
Adapters that joined the running job are saved like the others (with the job step they
joined at); the relaunched job knows them from its joins.jsonl (`plora.job.control`) and
puts them back in its pack before it restores.

One file per tensor-parallel rank, ``jobs/<job-id>/checkpoint/state.rank<r>.pt``, written
atomically (temporary file, fsync, rename): a kill mid-write leaves the previous one.
A checkpoint is used only by a job of the same model, data, LoRA targets and training
settings (a fingerprint of those sections) and the same TP degree; anything else trains
from the start, as without checkpoints.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plora.job.outputs import EXIT_STOPPED
from plora.settings import settings
from plora.job.config import NEUTRAL_TRAINING  # left out of the fingerprint

if TYPE_CHECKING:
    from plora.job.config import JobConfig
    from plora.train.adapter_pack import AdapterPack
    from plora.train.adapter_run import AdapterRun
    from plora.train.packed.tp import TensorParallel

VERSION = 1


def checkpoint_dir(job_dir: Path) -> Path:
    return Path(job_dir) / "checkpoint"


def fingerprint(cfg: JobConfig) -> str:
    """What a checkpoint must agree with to be resumed from: the job config less the pack."""
    keep = cfg.model_dump(mode="json", include={"seed", "model", "data", "lora", "training"},
                          exclude={"training": set(NEUTRAL_TRAINING)})
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _adapter_key(run) -> dict[str, Any]:
    """An adapter's identity beyond its id: a checkpoint of another budget (or warm-up) is
    not its own. Its micro-batch is not part of it (a checkpoint holds an adapter at an
    optimizer-step boundary, the same whatever the parts), so a re-planned micro-batch resumes."""
    return run.cfg.model_dump(exclude={"id", "micro_batch_size"})


class JobCheckpointer:
    """Saves and restores the training state of a packed job's adapters (their slots of the
    `AdapterPack`, and their `AdapterRun` books).

    The recipe calls `restore(runs)` once before its first step, `maybe_save(step, runs)`
    after each step (once adapters that finished have left the pack) and `discard(runs)` at
    the end. In between, SIGTERM (how the engine stops jobs on Ctrl-C) is turned into a
    checkpoint at the end of the current step and an exit with `EXIT_STOPPED`: an
    interrupted sweep loses no steps.
    """

    def __init__(self, cfg: JobConfig, pack: AdapterPack, *, attempt: int, started_at: float,
                 tp: TensorParallel | None = None, device: torch.device | None = None):
        self.pack = pack
        self.job_id = cfg.job_id
        self.output_dir = Path(cfg.output_dir)
        self.attempt = attempt
        self.started_at = started_at  # the job's start: an adapter's wall time counts from it
        self.tp, self.device = tp, device
        every_steps, every_minutes = cfg.training.checkpoint_every_steps, cfg.training.checkpoint_every_minutes
        self.every_steps = int(every_steps) if every_steps else None
        self.every_s = float(every_minutes) * 60 if every_minutes else None
        self.rank, self.world = (tp.rank, tp.size) if tp is not None else (0, 1)
        self.dir = checkpoint_dir(cfg.job_dir)
        self.fingerprint = fingerprint(cfg)
        self.last_save = time.monotonic()
        self.saves = 0
        self.job_step = 0  # the job step the latest checkpoint restored from was taken at
        self.stop_requested = False
        self._previous_handler = None

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        """Whether to save after job step ``step`` (counted from 1). Under TP rank 0 decides
        for all (the clocks of the ranks differ): every rank must save at the same step."""
        if not self.enabled:
            return False
        go = bool(self.every_steps and step % self.every_steps == 0)
        go = go or bool(self.every_s is not None and time.monotonic() - self.last_save >= self.every_s)
        stop = self.stop_requested
        tp = self.tp
        if tp is not None and (self.every_s is not None or self._previous_handler is not None):
            flags = torch.tensor([int(go), int(stop)], dtype=torch.uint8, device=self.device)
            go, stop = (bool(x) for x in tp.broadcast_(flags).tolist())
            self.stop_requested = stop
        return go or stop

    def maybe_save(self, step: int, runs: list[AdapterRun], before: Callable[[], None] = lambda: None) -> bool:
        """Save when due (``before()`` first); after a SIGTERM, save and leave (SystemExit
        with `EXIT_STOPPED`)."""
        if not self.due(step):
            return False
        before()
        self.save(step, runs)
        if self.stop_requested:
            raise SystemExit(EXIT_STOPPED)
        return True

    def save(self, step: int, runs: list[AdapterRun]) -> Path | None:
        """Write every training adapter's state at job step ``step``; None when none trains."""
        live = [run for run in runs if run.active]
        self.last_save = time.monotonic()
        if not live:
            return None
        adapters = {}
        for run in live:
            adapters[run.id] = {
                "key": _adapter_key(run),
                **self.pack.adapter_state(run.index),  # weights, both moments, optimizer steps
                "step": int(run.step),
                "stream": run.stream_state(),  # an adapter mid-batch: where that batch began
                "losses": list(run.losses),
                "status": run.status,
                "joined_at": run.joined_at,
                "elapsed_s": run.earlier_s + time.time() - self.started_at,  # its wall time so far, every attempt
                # epochs as fidelity (`plora.train.epochs`): finished epochs' scores, the best one's weights
                "epochs": list(run.epochs),
                "best_epoch": run.best_epoch,
                "best_weights": run.best_weights,
            }
        state = {
            "version": VERSION,
            "job_id": self.job_id,
            "job_step": int(step),
            "attempt": self.attempt,
            "world": self.world,
            "fingerprint": self.fingerprint,
            "saved_at": time.time(),
            "adapters": adapters,
        }
        path = self.dir / f"state.rank{self.rank}.pt"
        atomic_torch_save(state, path)
        self.saves += 1
        return path

    def drop(self) -> None:
        """Delete this rank's checkpoint file (a job whose adapters have all left, waiting
        for joins, has nothing in it to resume)."""
        (self.dir / f"state.rank{self.rank}.pt").unlink(missing_ok=True)

    def discard(self, runs: list[AdapterRun]) -> None:
        """Drop this job's checkpoint once none of its adapters trains any more (every one
        has its result): it would only hold states nothing resumes from."""
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._previous_handler = None
        if not any(run.active for run in runs):
            self.drop()

    # --------------------------------------------------------------- restore
    def restore(self, runs: list[AdapterRun]) -> dict[str, int]:
        """Load each adapter's latest matching state into the pack; returns the adapter-steps
        resumed from, by adapter id (empty: the job starts from step 0)."""
        found = self._latest_states({run.id: run for run in runs if run.active})
        resumed: dict[str, int] = {}
        # only in a job the engine launched (it sets PLORA_ATTEMPT): a recipe run inside
        # another program must not change how that program takes SIGTERM
        if self.enabled and settings().launched_by_engine and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        for run in runs:
            saved = found.get(run.id)
            if saved is None or not run.active:
                continue
            if not self.pack.load_adapter_state(run.index, saved):
                continue  # another layout (other targets or shards): train it from the start
            run.step = int(saved["step"])
            run.stream.load_state_dict(saved["stream"])
            run.losses = [float(x) for x in saved["losses"]]
            run.earlier_s = float(saved.get("elapsed_s", 0.0))
            run.epochs = [dict(e) for e in saved.get("epochs", [])]
            run.best_epoch = saved.get("best_epoch")
            best = saved.get("best_weights")
            fits = isinstance(best, torch.Tensor) and best.numel() == saved["weights"].numel()
            run.best_weights = best if fits else None
            resumed[run.id] = run.step
            self.job_step = max(self.job_step, int(saved["job_step"]))
        self.last_save = time.monotonic()
        if self.tp is not None:  # every rank must go on from the same steps (each read its own file)
            steps = torch.tensor([resumed.get(run.id, -1) for run in runs], dtype=torch.int64, device=self.device)
            if not torch.equal(self.tp.broadcast_(steps.clone()), steps):
                raise RuntimeError(f"checkpoints of job {self.job_id} disagree between tensor-parallel ranks; "
                                   f"delete {self.dir} to start it over")
        return resumed

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def _latest_states(self, wanted: dict[str, Any]) -> dict[str, dict]:
        """For each wanted adapter, its state of the most steps among the run's checkpoints
        (this job's first: a split or retried job finds its parent's too)."""
        jobs = self.output_dir / "jobs"
        own = self.dir / f"state.rank{self.rank}.pt"
        paths = [own] + sorted(p for p in jobs.glob(f"*/checkpoint/state.rank{self.rank}.pt") if p != own)
        best: dict[str, dict] = {}
        for path in paths:
            state = _load(path)
            if (state is None or state.get("version") != VERSION or state.get("fingerprint") != self.fingerprint
                    or state.get("world") != self.world):
                continue
            for adapter_id, saved in state["adapters"].items():
                run = wanted.get(adapter_id)
                if run is None or saved.get("key") != _adapter_key(run) or saved.get("status") != "running":
                    continue
                if adapter_id not in best or saved["step"] > best[adapter_id]["step"]:
                    best[adapter_id] = {**saved, "job_step": state["job_step"]}
        return best


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save through a temporary file, fsynced, then renamed over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:  # the rename itself survives a power cut only once the folder is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _load(path: Path) -> dict | None:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - unreadable (another version, a torn disk): not resumable
        return None
