"""The packed LoRA linear as one autograd function, on the Triton or the torch backend.

    y = x Wᵀ + b + concat_k( s_k (x_k A_kᵀ) B_kᵀ )

The base product runs in torch (cuBLAS); the LoRA term is then accumulated *into* its
output, and in backward the LoRA part of dx is accumulated into dx = dy W, so the LoRA
path adds no out-of-place pass over tokens × hidden. W and b are frozen: they never get a
gradient. Which backend runs is decided per call (`backend_for`):

- CUDA tensors: Triton, unless ``PLORA_KERNELS=torch``;
- CPU tensors: the torch reference, unless ``PLORA_KERNELS=triton`` and Triton's
  interpreter is on (``TRITON_INTERPRET=1``), which is how the kernels are tested on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plora.settings import kernels_choice

from . import reference
from .meta import LoRAMeta

_BACKENDS = ("torch", "triton")


def _triton_interpreting() -> bool:
    from .triton_ops import _interpreting

    return _interpreting()


def backend_for(t: torch.Tensor, backend: str | None = None) -> str:
    """"torch" or "triton" for a tensor's device, from ``backend`` or ``PLORA_KERNELS``."""
    want = (backend or kernels_choice()).lower()
    if want not in ("auto", *_BACKENDS):
        raise ValueError(f"PLORA_KERNELS: expected auto, torch or triton, got {want!r}")
    if t.is_cuda:
        return "torch" if want == "torch" else "triton"
    if want == "triton" and _triton_interpreting():
        return "triton"
    return "torch"


def scales_on_device(device: torch.device | str) -> bool:
    """Whether the packed LoRA ops on ``device`` read the adapters' scales from
    `LoRAMeta.scales` on the device (Triton) rather than as host numbers (the torch path):
    only then does a captured CUDA graph follow `LoRAMeta.set_scale`."""
    return backend_for(torch.empty(0, device=device)) == "triton"


def _ops(name: str):
    if name == "triton":
        from . import triton_ops

        return triton_ops.lora_forward, triton_ops.lora_backward
    return reference.lora_forward_ref, reference.lora_backward_ref


def _dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # a frozen base held 4-bit (torchao's NF4Tensor, `plora.quantize`) is dequantized for
    # this one product; the LoRA side never sees it
    return weight.to(dtype) if hasattr(weight, "get_original_weight") else weight


class _PackedLoRA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, A, B, lora_x, meta: LoRAMeta, backend: str):
        if weight is not None:
            y = F.linear(x, _dense(weight, x.dtype), bias)
        else:
            y = torch.zeros(x.shape[0], B.shape[1], dtype=x.dtype, device=x.device)
        xl = x if lora_x is None else lora_x
        fwd, _ = _ops(backend)
        active = meta.num_tokens > 0 and meta.total_rank > 0
        S = fwd(xl, A, B, meta, y) if active else None
        ctx.meta, ctx.backend, ctx.active = meta, backend, active
        ctx.has_lora_x = lora_x is not None
        ctx.save_for_backward(xl, A, B, S, weight)
        return y

    @staticmethod
    def backward(ctx, dy):
        xl, A, B, S, weight = ctx.saved_tensors
        need_x, _, _, need_a, need_b, need_lx = ctx.needs_input_grad[:6]
        dy = dy.contiguous()
        dx = None
        if need_x:
            dx = dy @ _dense(weight, dy.dtype) if weight is not None else torch.zeros_like(xl)
        dA = dB = dlx = None
        if ctx.active and (need_a or need_b or need_x or need_lx):
            _, bwd = _ops(ctx.backend)
            if ctx.has_lora_x:
                dA, dB, dlx = bwd(dy, xl, S, A, B, ctx.meta, None, need_dx=need_lx)
            else:
                dA, dB, dx = bwd(dy, xl, S, A, B, ctx.meta, dx, need_dx=need_x)
        else:
            if need_a:
                dA = torch.zeros_like(A)
            if need_b:
                dB = torch.zeros_like(B)
            if need_lx:
                dlx = torch.zeros_like(xl)
        return (
            dx,
            None,
            None,
            dA if need_a else None,
            dB if need_b else None,
            dlx if need_lx else None,
            None,
            None,
        )


def _flat(t: torch.Tensor | None, width: int) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.reshape(-1, width)
    return t if t.stride(-1) == 1 else t.contiguous()


def packed_lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    A: torch.Tensor,
    B: torch.Tensor,
    meta: LoRAMeta,
    lora_x: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``x Wᵀ + b + concat_k(s_k (x_k A_kᵀ) B_kᵀ)``; gradients for x, A, B (and lora_x).

    x: (T, in) (leading dims are flattened and restored); weight: (out, in), frozen;
    bias: (out,) or None, frozen; A: (R, in) and B: (R, out) stack the adapters' A_k and
    B_kᵀ in adapter order; ``lora_x`` (same shape as x), when given, is the input of the
    LoRA path instead of x (the dropout-ed x). ``backend`` overrides ``PLORA_KERNELS``.
    """
    lead = x.shape[:-1]
    d_in = x.shape[-1]
    y = _PackedLoRA.apply(
        _flat(x, d_in), weight, bias, A, B, _flat(lora_x, d_in), meta, backend_for(x, backend)
    )
    return y.reshape(*lead, y.shape[-1])


def packed_lora_delta(
    x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, meta: LoRAMeta, *, backend: str | None = None
) -> torch.Tensor:
    """The LoRA term alone, ``concat_k(s_k (x_k A_kᵀ) B_kᵀ)`` (zero outside the segments)."""
    lead = x.shape[:-1]
    d_in = x.shape[-1]
    y = _PackedLoRA.apply(_flat(x, d_in), None, None, A, B, None, meta, backend_for(x, backend))
    return y.reshape(*lead, y.shape[-1])
