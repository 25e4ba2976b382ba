"""Where profiles are kept, what keys them, and what finished sweeps add to them.

* **Cache.** A profile is stored under ``$PLORA_CACHE_DIR`` (default
  ``~/.cache/plora/profiles``), keyed by (model shape, LoRA targets and dropout, sequence
  length, dtype, device name, kernel backend, measured TP degree); a second sweep on the
  same model and hardware reuses it without probing.
  The key's parts are read here: the model's shape from its config (`shape_from_model`),
  the device, and how a job's steps run on it (the kernels, CUDA graphs or not).
* **What sweeps add.** A finished sweep measures what every job pays besides its steps;
  `remember_job_overhead` and `remember_job_phases` keep it in the cached profile, so that
  the next sweep of the model on this machine plans with it.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

from plora.settings import settings
from plora.models.shape import ModelShape
from plora.cost.job import fit_overheads
from plora.cost.profiling.calibrate import Calibration
from plora.cost.profiling.errors import ProfileError
from plora.cost.profiling.record import Profile
from plora.job.step_settings import graphs_wanted

def cache_dir() -> Path:
    """Where profiles are cached: ``$PLORA_CACHE_DIR`` or ``~/.cache/plora/profiles`` (`plora.settings`)."""
    return settings().profile_dir


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


def shape_from_model(path: str | Path, family: str = "auto", dtype: str = "bfloat16",
                     quantize: str | None = None) -> ModelShape:
    """The `ModelShape` of a Hugging Face model folder (parameters counted from config.json),
    its block linears held as ``quantize`` says (``model.quantize``)."""
    from plora.models.folders import read_model_info

    info = read_model_info(path, family)
    h, inter, L, V = info.embed_dim, info.intermediate_dim, info.num_layers, info.vocab_size
    q, kv = info.num_heads * info.head_dim, info.num_kv_heads * info.head_dim
    attn = 2 * h * q + 2 * h * kv + (q + 2 * kv if info.family == "qwen2" else 0)
    per_layer = attn + 3 * h * inter + 2 * h
    n_params = V * h + L * per_layer + h + (0 if info.tie_word_embeddings else V * h)
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return ModelShape(info.path.name, n_params, h, inter, L, info.num_heads, info.num_kv_heads, info.head_dim, V,
                      dtype_bytes, info.tie_word_embeddings, quantize or None)


def _device_info(device: str) -> tuple[str, str, float | None]:
    """(resolved device, device name, total memory in bytes or None on CPU)."""
    from plora.gpu_facts import visible_gpus

    gpus = visible_gpus()  # (no torch import: `plora.gpu_facts`)
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    if device.startswith("cuda"):
        if not gpus:
            raise ProfileError("hardware.device is cuda but no CUDA device is visible")
        index = int(device.partition(":")[2] or 0)
        if index >= len(gpus):
            raise ProfileError(f"hardware.device is {device} but this machine sees {len(gpus)} CUDA device(s)")
        return device, gpus[index].name, float(gpus[index].total_memory)
    return "cpu", "cpu", None


def _backend(device: str, activation_checkpointing: bool = False, cuda_graphs: Any = "auto") -> str:
    """How a job's steps run on ``device``: the kernels, "+graph" when they are replayed from
    CUDA graphs, "+lean" with the lean step's RoPE and fused norms (`plora.train.packed.lean_step`):
    a profile measured one way does not predict the other."""
    if not device.startswith("cuda"):
        return "torch"
    kernels = "torch" if settings().kernels == "torch" else "triton"
    graphed = graphs_wanted(cuda_graphs, device, tp=False,
                            activation_checkpointing=activation_checkpointing)
    return kernels + ("+graph" if graphed else "") + ("+lean" if settings().lean_step else "")


def _sweep_cache_path(spec, shape: ModelShape, device: str, device_name: str) -> Path:
    key = profile_key(shape, seq_len=spec.model.max_seq_len, dtype=spec.model.dtype, device_name=device_name,
                      backend=_backend(device, spec.training.checkpointing, spec.training.cuda_graphs),
                      targets=list(spec.lora.resolved_targets()),
                      dropout=spec.lora.dropout, activation_checkpointing=spec.training.checkpointing)
    return cache_path(key)


def sweep_cache_path(spec) -> Path:
    """Where the profile of a sweep's model on this machine is cached (`profile_sweep`)."""
    shape = shape_from_model(spec.model.resolved_path(), spec.model.family, spec.model.dtype, spec.model.quantize)
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
    prof.cost_model = replace(prof.cost_model, job_overhead_s=float(overhead_s)).with_meta(
        job_overhead={"measured_s": float(overhead_s), "jobs": int(jobs), "at": time.time()})
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


def calibration_path(spec) -> Path:
    """Where the calibration of a sweep's model on this machine is kept: beside its profile's
    place in the cache, under the same key (`plora.cost.profiling.calibrate`)."""
    path = sweep_cache_path(spec)
    return path.with_name("calibration-" + path.name)


def load_calibration(spec) -> Calibration | None:
    """The cached calibration of a sweep's model on this machine, or None (none, or unreadable:
    a calibration is only ever a head start)."""
    try:
        path = calibration_path(spec)
        if not path.is_file():
            return None
        return Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, ProfileError):
        return None


def remember_calibration(spec, calibration: Calibration) -> Path | None:
    """Keep a sweep's calibration samples for the next sweep of its model here (written
    atomically); None where nothing was measured."""
    if calibration.empty:
        return None
    path = calibration_path(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(calibration.to_dict()) + "\n")
    tmp.replace(path)
    return path
