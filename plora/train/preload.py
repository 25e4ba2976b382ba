"""A job's base model, loaded by its process before the job was handed to it.

A job process started ahead (`plora.engine.spare`) imports the recipe while the sweep plans;
told which model the sweep trains (`plora.engine.spare.preload`), it also loads that model
then, so the job that takes it skips the load (for a model read from disk, seconds). Only
the first job of a sweep gets one: its GPU is idle; a spare beside a running job would hold
a second copy of the weights in that job's memory.

A held model is given to one job only, and only to a job that asks for exactly that model
(path, family, sequence length, dtype, device, random or read weights); any other request
loads its own and frees the held one. Loading is deterministic and draws no random numbers
(random-init weights come from their own generator), so a job that takes a held model
trains exactly as one that loads it. Either way the model is made lean as it loads
(`plora.train.packed.lean_step`: the same function in fewer kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelKey", "held_model", "hold", "load", "release"]


@dataclass(frozen=True)
class ModelKey:
    """What decides a loaded base model."""

    path: str
    family: str
    max_seq_len: int
    dtype: str
    device: str
    random_init: bool
    #: made lean as it loads (`PLORA_LEAN_STEP`, `plora.train.packed.lean_step`)
    lean: bool = True

    @classmethod
    def of(cls, path: str | Path, family: str, max_seq_len: int, dtype: str, device: Any,
           random_init: bool) -> "ModelKey":
        from plora.settings import settings

        return cls(str(path), str(family), int(max_seq_len), str(dtype), str(device), bool(random_init),
                   settings().lean_step)


#: the model loaded ahead and its key, until a job takes it
_held: tuple[ModelKey, Any, Any] | None = None


def _load(key: ModelKey) -> tuple[Any, Any]:
    from plora.models.loading import load_base_model
    from plora.train.packed.lean_step import make_lean

    model, info = load_base_model(key.path, family=key.family, max_seq_len=key.max_seq_len, dtype=key.dtype,
                                  device=key.device, random_init=key.random_init)
    make_lean(model, key.lean)  # before a spare's warm-up: it runs the kernels the job's steps will
    return model, info


def hold(key: ModelKey) -> None:
    """Load the model of ``key`` now and keep it for the job that will ask for it."""
    global _held
    _held = None
    _held = (key, *_load(key))


def held_model(key: ModelKey) -> Any | None:
    """The model held for ``key`` (still held: not given away), or None."""
    return _held[1] if _held is not None and _held[0] == key else None


def release() -> None:
    """Hold nothing: the next job loads its own model."""
    global _held
    _held = None


def load(key: ModelKey) -> tuple[Any, Any]:
    """The held model of ``key`` (given away: a job injects its adapters into it), else one
    loaded now; (model, `plora.models.info.ModelInfo`)."""
    global _held
    held, _held = _held, None
    if held is not None and held[0] == key:
        return held[1], held[2]
    del held  # another model's: its memory goes before this one loads
    return _load(key)
