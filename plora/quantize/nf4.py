"""Hold a loaded base model's block linears in NF4 (torchao's `NF4Tensor`), as torchtune's
QLoRA builders do (`torchtune.modules.low_precision.FrozenNF4Linear`, `LoRALinear(...,
quantize_base=True)`): every linear of every decoder block, targeted by LoRA or not; the
embeddings, norms, LM head and the adapters stay in the model's dtype.

A quantized weight stays a parameter of its `nn.Linear` (frozen), an `NF4Tensor` of the
original shape and dtype. Products with it dequantize it for that product only:
`nn.Linear.forward` reaches torchao's ``linear_nf4`` through ``F.linear``, and the packed
layer's autograd function dequantizes it in forward and again in backward
(`plora.kernels.function`), so no dense copy of the base outlives one product.

Blocks: torchao's defaults, 64 weights per absmax and 256 absmaxes per scale, where a weight
allows; a weight whose absmaxes do not fill whole scaler blocks (the tiny test models, a
tensor-parallel shard of a small layer) takes the largest power of two that does. A weight
whose size is not a multiple of 64 stays dense (none in the supported families).

Call it after tensor-parallel sharding (`plora.train.packed.tp`): each rank then quantizes its own
shards, and no NF4 tensor is ever sliced (torchao's NF4 supports no slicing).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from plora.quantize.cost import NF4_BLOCK, NF4_SCALER_BLOCK, check_quantize

__all__ = ["QuantizedBase", "is_nf4", "quantize_base", "to_nf4_weight", "dense_weight"]


def is_nf4(t) -> bool:
    """Whether ``t`` is a torchao NF4 tensor (a parameter holding one included)."""
    from torchao.dtypes.nf4tensor import NF4Tensor

    return isinstance(t, NF4Tensor)


def dense_weight(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a plain tensor: an NF4 tensor dequantized (to ``dtype``, default its own)."""
    if is_nf4(t):
        return t.get_original_weight().to(dtype or t.dtype)
    return t if dtype is None else t.to(dtype)


def scaler_block_for(numel: int) -> int | None:
    """The scaler block an NF4 weight of ``numel`` elements takes: torchao's 256, or the
    largest power of two below it that divides its block count; None: it cannot be NF4."""
    if numel <= 0 or numel % NF4_BLOCK:
        return None
    blocks = numel // NF4_BLOCK
    s = NF4_SCALER_BLOCK
    while blocks % s:
        s //= 2
    return s


def to_nf4_weight(w: torch.Tensor) -> torch.Tensor | None:
    """torchao's NF4 of a 2-D weight (None where it cannot be)."""
    from torchao.dtypes.nf4tensor import to_nf4

    s = scaler_block_for(w.numel())
    if s is None:
        return None
    return to_nf4(w.detach().contiguous(), block_size=NF4_BLOCK, scaler_block_size=s)


@dataclass
class QuantizedBase:
    """What `quantize_base` did: the linears it quantized and those it left dense."""

    method: str
    quantized: list[str] = field(default_factory=list)
    dense: list[str] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0


def _nf4_bytes(t) -> int:
    return sum(x.numel() * x.element_size() for x in (t.quantized_data, t.quantized_scalers,
                                                      t.quantization_factor, t.scaler_mean, t.nf4))


def _linears(model: nn.Module):
    """(name, module holding the weight) of every linear of every decoder block: the base of
    a packed layer, a plain `nn.Linear`, or a tensor-parallel shard of one."""
    from plora.train.packed.layer import PackedLoRALinear

    for i, block in enumerate(model.layers):
        for sub_name in ("attn", "mlp"):
            sub = getattr(block, sub_name, None)
            if sub is None:
                continue
            for name, module in sub.named_children():
                base = module.base if isinstance(module, PackedLoRALinear) else module
                w = getattr(base, "weight", None)
                if isinstance(base, nn.Linear) or (type(base).__name__ == "ShardedLinear" and w is not None):
                    yield f"layers.{i}.{sub_name}.{name}", base


@torch.no_grad()
def quantize_base(model: nn.Module, method: str = "nf4") -> QuantizedBase:
    """Quantize the block linears of a torchtune decoder (packed layers in it or not) in place."""
    method = check_quantize(method)
    if method is None:
        return QuantizedBase("none")
    out = QuantizedBase(method)
    for name, linear in _linears(model):
        w = linear.weight
        if is_nf4(w):
            out.quantized.append(name)
            continue
        q = to_nf4_weight(w)
        if q is None:
            out.dense.append(name)
            continue
        out.bytes_before += w.numel() * w.element_size()
        out.bytes_after += _nf4_bytes(q)
        linear.weight = nn.Parameter(q, requires_grad=False)
        del w
        out.quantized.append(name)
    return out
