"""Decoder pieces that torchtune 0.6.1 lacks, composed from its modules.

- `HFOrderAttention`: torchtune's `MultiHeadAttention` with a fused qkv projection
  (Phi-3) and/or q/k RMSNorm applied before RoPE, as Qwen3 does (torchtune's own
  q_norm/k_norm run after RoPE, which is not the same function). It ends in
  `self._attention_call(...)` like its parent, so whatever replaces that call replaces it here.
- `FusedGateUpMLP`: Phi-3's MLP, gate and up in one linear.
- `SoftCappedOutput`: the LM head followed by Gemma2's final logit soft-capping, so that
  logits stay ``model.output(model.norm(h))``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchtune.modules import MultiHeadAttention, TiedLinear


class HFOrderAttention(MultiHeadAttention):
    """Self-attention in Hugging Face's order: project, (q/k norm), RoPE, attend.

    With `qkv_proj`, q, k and v are the three consecutive slices of one projection's
    output (q_proj/k_proj/v_proj are then None).
    """

    def __init__(self, *, qkv_proj: nn.Module | None = None, **kwargs: Any) -> None:
        q_norm, k_norm = kwargs.pop("q_norm", None), kwargs.pop("k_norm", None)
        if qkv_proj is not None:
            kwargs.update(q_proj=None, k_proj=None, v_proj=None)
        super().__init__(**kwargs)
        self.qkv_proj = qkv_proj
        # set after init: the parent's q_norm/k_norm slots, used here before RoPE
        self.q_norm, self.k_norm = q_norm, k_norm

    def project(self, x: torch.Tensor, y: torch.Tensor, input_pos=None) -> tuple[torch.Tensor, ...]:
        """q, k and v as ``[b, s, heads, head_dim]``: projected, (q/k-normed,) rotated, in
        Hugging Face's order (`plora.train.packed.row_forward` attends them as they are)."""
        b, s, _ = x.shape
        hd = self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
            nq = qkv.shape[-1] - 2 * self.num_kv_heads * hd
            q, k, v = qkv.split([nq, self.num_kv_heads * hd, self.num_kv_heads * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(y), self.v_proj(y)
        q = q.reshape(b, s, -1, hd)
        k = k.reshape(b, s, -1, hd)
        v = v.reshape(b, s, -1, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
            k = self.pos_embeddings(k, input_pos=input_pos)
        return q, k, v

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None, *, mask=None, input_pos=None) -> torch.Tensor:
        if y is None:
            raise ValueError(f"{type(self).__name__} is self-attention only (no KV cache): pass y = x")
        b, s, _ = x.shape
        hd = self.head_dim
        q, k, v = self.project(x, y, input_pos)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        n_h, n_kv = q.shape[1], k.shape[1]
        if n_h != n_kv:
            shape = (b, n_kv, n_h // n_kv, s, hd)
            k = k.unsqueeze(2).expand(shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(shape).flatten(1, 2)
        out = self._attention_call(
            q, k, v,
            mask=mask,
            dropout_p=self.attn_dropout if self.training else 0.0,
            is_causal=mask is None and self.is_causal,
        )
        return self.output_proj(out.transpose(1, 2).contiguous().view(b, s, -1))


class FusedGateUpMLP(nn.Module):
    """``w2(act(gate) * up)`` with ``[gate; up] = gate_up_proj(x)`` (Phi-3's layout)."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, activation: nn.Module) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.w2 = down_proj  # torchtune's FeedForward name, so "mlp.w2" is down_proj everywhere
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.w2(self.activation(gate) * up)


class SoftCappedOutput(nn.Module):
    """LM head, then ``cap · tanh(logits / cap)`` (Gemma2's final logit soft-capping)."""

    def __init__(self, proj: nn.Module | TiedLinear, cap: float) -> None:
        super().__init__()
        self.proj = proj  # a TiedLinear is not a module: the embedding is not registered twice
        self.cap = float(cap)

    @property
    def weight(self) -> torch.Tensor:
        return self.proj.tied_module.weight if isinstance(self.proj, TiedLinear) else self.proj.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.proj(h)
        return torch.tanh(logits / self.cap) * self.cap

    def extra_repr(self) -> str:
        return f"cap={self.cap:g}, tied={isinstance(self.proj, TiedLinear)}"


def tie_output(model: nn.Module) -> None:
    """Make the LM head the token embedding (torchtune's `TiedLinear`, as llama3_2 does)."""
    del model.output
    model.output = TiedLinear(model.tok_embeddings)


class PartialRotaryEmbedding(nn.Module):
    """Hugging Face's rotate-half RoPE on the first `rotary_dim` features of each head.

    Covers what Phi-3.5 and Phi-4-mini add to plain RoPE: a partial rotary factor (the
    rest of each head passes through), LongRoPE's per-frequency divisors (`ext_factors`,
    the short factors: plora refuses sequences long enough for the long ones) and its
    cos/sin scale (`scale`, the attention factor). Tables are built in float32, as in
    transformers, and cast to the input's dtype.
    """

    def __init__(self, rotary_dim: int, max_seq_len: int, base: float,
                 ext_factors: list[float] | None = None, scale: float = 1.0) -> None:
        super().__init__()
        if rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
        self.rotary_dim, self.max_seq_len, self.base = rotary_dim, max_seq_len, float(base)
        self.ext_factors = list(ext_factors) if ext_factors is not None else None
        self.scale = float(scale)
        self.rope_init()

    def rope_init(self) -> None:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim
        ext = torch.tensor(self.ext_factors, dtype=torch.float32) if self.ext_factors is not None else 1.0
        inv_freq = 1.0 / (ext * self.base**exponents)
        freqs = torch.arange(self.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * self.scale, persistent=False)
        self.register_buffer("sin", emb.sin() * self.scale, persistent=False)

    def forward(self, x: torch.Tensor, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        """x: [b, s, n_heads, head_dim]; `input_pos` [b, s] (or None for 0..s-1)."""
        s, r = x.shape[1], self.rotary_dim
        cos = self.cos[:s] if input_pos is None else self.cos[input_pos]
        sin = self.sin[:s] if input_pos is None else self.sin[input_pos]
        cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
        x_rot, x_pass = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat([-x_rot[..., half:], x_rot[..., :half]], dim=-1)
        return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)

    def extra_repr(self) -> str:
        return f"rotary_dim={self.rotary_dim}, base={self.base:g}, longrope={self.ext_factors is not None}, scale={self.scale:g}"
