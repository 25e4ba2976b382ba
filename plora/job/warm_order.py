"""What a sweep and its kernel-warming process (`plora.kernels.warm_cache`) say to each other:
one `WarmOrder` line in, one `WarmAnswer` line out. Kept apart from the kernels so that the
sweep writes its order without importing torch (`plora.engine.kernel_warmer`)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict

__all__ = ["READY", "WarmAnswer", "WarmOrder", "WarmPack", "answered"]

#: what the child prints once its imports are done
READY = "ready"


class WarmPack(BaseModel):
    """One packed step as the sweep expects it: each adapter's tokens in a step and rank;
    ``backward``: a training step (forward and backward), else an eval's forward."""

    model_config = ConfigDict(extra="forbid")

    tokens: list[int]
    ranks: list[int]
    backward: bool = True


class WarmOrder(BaseModel):
    """The one line the child reads: what to compile, and where."""

    model_config = ConfigDict(extra="forbid")

    device: str = "cuda"
    dtype: str  #: the adapters' dtype ("bfloat16", "float16", "float32")
    shapes: list[tuple[int, int]]  #: (in, out) of each targeted linear
    packs: list[WarmPack]
    accumulate_dx: bool = True  #: False where LoRA dropout feeds the adapters another input
    optimizer: bool = True  #: the training steps' norms and AdamW (`plora.kernels.segments`) too
    #: the model's vocabulary: its loss's kernel (`plora.kernels.cross_entropy`) too (None: not)
    vocab: int | None = None


class WarmAnswer(BaseModel):
    """The one line the child prints when done."""

    model_config = ConfigDict(extra="forbid")

    kernels: int = 0
    seconds: float = 0.0
    finished_at: float = 0.0  #: epoch seconds (where a sweep's wait went: the log beside its caches)
    error: str | None = None


def answered(log: str | Path, offset: int = 0) -> WarmAnswer | None:
    """The `WarmAnswer` the kernel-warming process wrote to ``log`` past byte ``offset`` (its
    log is appended to by every sweep's process: ``offset`` is its size when this sweep's
    started), or None while it has not answered (or the log cannot be read)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, int(offset)))
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    for line in tail.splitlines():
        if line.startswith("{"):
            try:
                return WarmAnswer.model_validate_json(line)
            except ValueError:
                continue
    return None
