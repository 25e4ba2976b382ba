"""A job's base model in fewer kernels, computing the same function (``PLORA_LEAN_STEP``).

A packed step replayed from a CUDA graph costs about 2.5 µs per kernel whatever its rows, so
the model's glue between the packed linears is worth fewer kernels: RoPE in one autograd node
per call (`plora.train.packed.rope`) and torchtune's RMSNorms on torch's fused kernel
(`plora.train.packed.norms`). Applied where a job's model is loaded (`plora.train.preload`),
so that a spare's warm-up runs the kernels its job's steps will.
"""

from __future__ import annotations

from torch import nn

from plora.settings import settings
from plora.train.packed.norms import fused_rms_norms
from plora.train.packed.rope import install_packed_rope


def make_lean(model: nn.Module, lean: bool | None = None) -> tuple[int, int]:
    """The attentions given a `PackedRope` and the norms put on the fused kernel, where
    ``lean`` (None: unless ``PLORA_LEAN_STEP=0``); idempotent."""
    if not (settings().lean_step if lean is None else lean):
        return 0, 0
    return install_packed_rope(model), fused_rms_norms(model)
