"""Causal flash attention over rows laid end to end, called through ATen's own flash ops.

torch's ``torch.nn.attention.varlen.varlen_attn`` runs exactly these two ops
(``aten._flash_attention_forward`` and ``aten._flash_attention_backward``) behind a custom
op; but importing that module imports ``torch._dynamo`` (it marks an op as not for graphs),
4.3-6.3 s of a job process's interpreter on the GPU machines, which either delayed a job's
first step or shared the interpreter lock with its model load and set-up. This function
calls the ops with the arguments ``varlen_attn`` gives them for causal rows
(``window_size=(-1, 0)``; ``num_splits=1``, split-KV off, where this torch has it: a row's
result then does not depend on the other rows of its batch), so the results are the same,
and nothing imports dynamo. Where this torch's ops lack the window arguments, `flash_varlen`
is None and `plora.train.packed.varlen_attention` uses ``varlen_attn``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch

__all__ = ["flash_varlen"]

#: what both ops must take for a causal window
_WINDOW_ARGS = {"window_size_left", "window_size_right"}


class _CausalRows(torch.autograd.Function):
    """``[T, H, D]`` query, key and value of rows bounded by ``cu`` (int32, on the device)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int,
                splits: dict) -> torch.Tensor:
        out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, return_debug_mask=False, scale=None,
            window_size_left=-1, window_size_right=0, **splits)
        # no dropout: the state varlen_attn saves for the backward is a zero seed and offset
        rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)
        ctx.save_for_backward(q, k, v, cu, out, lse, rng_state)
        ctx.max_len = max_len
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, cu, out, lse, rng_state = ctx.saved_tensors
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out, q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, True, rng_state, unused,
            scale=None, window_size_left=-1, window_size_right=0)
        return dq, dk, dv, None, None, None


@lru_cache(maxsize=1)
def flash_varlen() -> Callable[..., torch.Tensor] | None:
    """``fn(q, k, v, cu_seqlens, max_len) -> out`` (``[T, H, D]``), or None where this torch's
    flash ops do not take the arguments it passes."""
    try:
        forward = {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments}
        backward = {a.name for a in torch.ops.aten._flash_attention_backward.default._schema.arguments}
    except (AttributeError, RuntimeError):
        return None
    if not (_WINDOW_ARGS <= forward and _WINDOW_ARGS <= backward):
        return None
    # split-KV off where this torch can say so (varlen_attn's num_splits=1); where it cannot,
    # varlen_attn leaves the choice to the kernel too
    splits = {"num_splits": 1} if "num_splits" in forward else {}

    def causal_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int) -> torch.Tensor:
        return _CausalRows.apply(q, k, v, cu, int(max_len), splits)

    return causal_rows
