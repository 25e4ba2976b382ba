"""RMSNorm on torch's fused kernel.

torchtune's `RMSNorm` normalizes ``x.float()`` with its scale, which a bfloat16 model holds
in bfloat16. ``F.rms_norm`` refuses its fused kernel for an input and a weight of different
dtypes ("Mismatch dtype between input and weight ... Cannot dispatch to fused
implementation") and runs its composite instead: about 6 kernels forward and 14 backward,
each a pass over a float32 copy of the activations, at each of a decoder's 2·layers + 1
norms. With the scale held in float32 (frozen, a few kilobytes), CUDA runs
``_fused_rms_norm`` and its backward: one kernel each way beside the casts.

The function is the same, ``x·rsqrt(mean(x²) + eps)·scale`` in float32 then cast: a
bfloat16 scale read as float32 is the same number, and the composite promotes it exactly
so. On a GPU the fused kernel computes it its own way (its own reduction for the mean, its
own rsqrt, its own formula for the backward): float32 roundings differ, before the cast to
the model's dtype, so a GPU job's numbers with and without the lean step are close, not
equal. The CPU has no fused kernel: there the composite runs either way, and the numbers
are equal bit for bit (`tests/test_lean_step.py`).

Gemma's `GemmaRMSNorm` (Gemma2) writes the composite out by hand, ``x·rsqrt(mean(x²) + eps)``
then ``·(1 + scale)``, four of them per layer: `GemmaFusedRMSNorm` computes it as
``F.rms_norm(x.float(), weight=1 + scale)`` with ``1 + scale`` made once in float32, which is
the same sequence of operations where the composite runs and the fused kernel on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GemmaFusedRMSNorm(nn.Module):
    """`GemmaRMSNorm` (frozen) as one ``F.rms_norm`` call with the weight ``1 + scale`` in
    float32, made once (not a buffer: a cast of the model would round it); its ``scale`` stays
    the parameter it was (same name, same values)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.eps = float(norm.eps)
        self.scale = norm.scale
        self._weight: torch.Tensor | None = None  # 1 + scale in float32, and what it was made from
        self._made_from: tuple | None = None
        self.weight()  # now, not in a step's first forward: that may be a CUDA graph's capture

    def weight(self) -> torch.Tensor:
        """``1 + scale`` in float32, made again where the scale changed (loaded, moved, cast)."""
        scale = self.scale
        now = (scale._version, scale.device, scale.dtype, scale.data_ptr())
        if self._weight is None or self._made_from != now:
            self._weight, self._made_from = 1.0 + scale.detach().float(), now
        return self._weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight=self.weight(), eps=self.eps).type_as(x)


def fused_rms_norms(model: nn.Module) -> int:
    """Every frozen RMSNorm of ``model`` put on torch's fused kernel: torchtune's given a
    float32 scale (its parameter converted in place), Gemma's replaced by a
    `GemmaFusedRMSNorm`; how many."""
    from torchtune.models.gemma.rms_norm import GemmaRMSNorm
    from torchtune.modules import RMSNorm

    converted = 0
    gemma: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in model.modules():
        for name, module in parent.named_children():
            scale = getattr(module, "scale", None)
            if not isinstance(scale, torch.Tensor) or scale.requires_grad:
                continue  # not a norm, or a trained one (none in a LoRA job): left as it is
            if type(module) is RMSNorm and module.scale.dtype != torch.float32:
                module.scale.data = module.scale.data.float()
                converted += 1
            elif type(module) is GemmaRMSNorm:
                gemma.append((parent, name, module))
    for parent, name, module in gemma:
        setattr(parent, name, GemmaFusedRMSNorm(module))
    return converted + len(gemma)
