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
so. What differs on a GPU is the order in which the fused kernel sums ``x²`` (float32 ulps
of the mean, before the cast to the model's dtype). The CPU has no fused kernel: there the
composite runs either way, and the numbers are equal bit for bit (`tests/test_lean_step.py`).
"""

from __future__ import annotations

import torch
from torch import nn


def fused_rms_norms(model: nn.Module) -> int:
    """Every torchtune `RMSNorm` of ``model`` given a float32 scale (its frozen parameter
    converted in place, its ``requires_grad`` kept); how many were converted."""
    from torchtune.modules import RMSNorm

    converted = 0
    for module in model.modules():
        if type(module) is RMSNorm and module.scale.dtype != torch.float32:
            module.scale.data = module.scale.data.float()
            converted += 1
    return converted
