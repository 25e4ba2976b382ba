"""Self-attention over flattened rows without the copies torchtune makes for its kernel.

torchtune's `MultiHeadAttention` (and plora's `HFOrderAttention`) turn q, k and v to
``[b, heads, s, d]`` and expand k and v to every query head before they call attention:
for grouped-query models (Qwen2.5-0.5B: 14 query heads over 2 key-value heads) that is a
full-size copy of k and of v, and the flash varlen kernel then needs ``[T, heads, d]`` again,
two more copies; backward copies each gradient back and sums the expanded ones. On an H200
one layer's attention of a 12,600-token step took 1.11 ms that way, forward and backward,
and 0.65 ms as this module runs it (`scripts/probe_varlen_attention.py`): the projections'
outputs viewed as ``[T, heads, d]``, RoPE and the q/k norms in the module's own order, and
one flash varlen call with the key-value heads as they are (the kernel groups query heads
itself, query head ``h`` reading key-value head ``h // (heads / kv_heads)``, as the expand
lays them out).

`install_row_forward` gives every attention of a model a `RowsForward` in front of its own
forward: while flattened rows are set for the flash kernel (`RowAttention.direct`) it runs
the above, and in every other case (padded rows, generation with a decode cache, the CPU's
per-row path, dropout on attention) the module's own forward, unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from plora.train.packed.flash_varlen import flash_varlen

__all__ = ["RowsForward", "install_row_forward", "project_qkv"]


def project_qkv(attn: nn.Module, x: torch.Tensor, input_pos: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """q, k and v of self-attention over ``x`` as ``[b, s, heads, d]``, computed as the
    module's own forward computes them (RoPE and q/k norms in its order), before any
    transpose or expand: plora's `HFOrderAttention` says so itself (`project`), torchtune's
    `MultiHeadAttention` as its forward does."""
    if hasattr(attn, "project"):
        return attn.project(x, x, input_pos)
    b, s, _ = x.shape
    hd = attn.head_dim
    q, k, v = (proj(x).reshape(b, s, -1, hd) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    if attn.pos_embeddings is not None:
        q = attn.pos_embeddings(q, input_pos=input_pos)
        k = attn.pos_embeddings(k, input_pos=input_pos)
    # torchtune's norms come after RoPE (over head_dim: any layout)
    if attn.q_norm is not None:
        q = attn.q_norm(q)
    if attn.k_norm is not None:
        k = attn.k_norm(k)
    return q, k, v


class RowsForward:
    """Stands in for an attention module's ``forward`` (module docstring)."""

    def __init__(self, attn: nn.Module, state, original: Callable):
        self.attn = attn
        self.state = state  # the model's `RowAttention`
        self.original = original

    def applies(self, x: torch.Tensor, y: torch.Tensor | None, mask) -> bool:
        attn = self.attn
        return (y is x and mask is None and self.state.direct(x)
                and not (attn.training and float(getattr(attn, "attn_dropout", 0.0) or 0.0) > 0)
                and (getattr(attn, "kv_cache", None) is None or not getattr(attn, "cache_enabled", False)))

    def __call__(self, x: torch.Tensor, y: torch.Tensor | None = None, *, mask=None,
                 input_pos: torch.Tensor | None = None) -> torch.Tensor:
        if not self.applies(x, y, mask):
            return self.original(x, y, mask=mask, input_pos=input_pos)
        b, s, _ = x.shape
        q, k, v = project_qkv(self.attn, x, input_pos)
        state = self.state
        out = flash_varlen()(q[0].contiguous(), k[0].contiguous(), v[0].contiguous(), state.cu_seqlens,
                             state.max_len)
        return self.attn.output_proj(out.reshape(b, s, -1))


def install_row_forward(attns: list[nn.Module], state) -> int:
    """A `RowsForward` in front of each of ``attns`` (idempotent); how many have one now."""
    for attn in attns:
        if not isinstance(attn.__dict__.get("forward"), RowsForward):
            attn.forward = RowsForward(attn, state, attn.forward)
    return len(attns)
