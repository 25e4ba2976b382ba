"""Phi-3 / Phi-3.5 / Phi-4-mini, composed from torchtune's modules with fused projections.

torchtune's own phi3 builder splits ``qkv_proj`` and ``gate_up_proj`` into separate
linears; PEFT adapts the fused modules (one A and one B of the fused output size each),
so plora keeps them fused and its adapters are PEFT's, name for name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plora.families.base import check_activation, check_plain_rope, map_keys, refuse_if, rope_settings, sliding_window, top_keys
from plora.families.modules import FusedGateUpMLP, HFOrderAttention

if TYPE_CHECKING:
    from plora.models import ModelInfo

_LAYER_KEYS = {
    "self_attn.qkv_proj.weight": "attn.qkv_proj.weight",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_up_proj.weight": "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
}


def read_phi3(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    check_activation(cfg, where, "hidden_act", ("silu",))
    refuse_if(bool(cfg.get("attention_bias")), where, "attention_bias", "is not supported for phi3")
    check_plain_rope(rope_settings(cfg, where), where, "phi3")
    return {"sliding_window": sliding_window(cfg)}


def build_phi3(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import RMSNorm, TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer

    dim, hd, eps = info.embed_dim, info.head_dim, info.norm_eps
    q_out, kv_out = info.num_heads * hd, info.num_kv_heads * hd
    # Hugging Face's rotate-half RoPE, the layout Phi-3's weights are in (nothing permuted)
    rope = Qwen2RotaryPositionalEmbeddings(dim=hd, max_seq_len=max_seq_len, base=info.rope_base)
    layers = nn.ModuleList()
    for _ in range(info.num_layers):
        attn = HFOrderAttention(
            embed_dim=dim,
            num_heads=info.num_heads,
            num_kv_heads=info.num_kv_heads,
            head_dim=hd,
            qkv_proj=nn.Linear(dim, q_out + 2 * kv_out, bias=False),
            output_proj=nn.Linear(q_out, dim, bias=False),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
        )
        mlp = FusedGateUpMLP(
            nn.Linear(dim, 2 * info.intermediate_dim, bias=False),
            nn.Linear(info.intermediate_dim, dim, bias=False),
            nn.SiLU(),
        )
        layers.append(TransformerSelfAttentionLayer(attn=attn, mlp=mlp, sa_norm=RMSNorm(dim, eps=eps), mlp_norm=RMSNorm(dim, eps=eps)))
    emb = nn.Embedding(info.vocab_size, dim)
    output = TiedLinear(emb) if info.tie_word_embeddings else nn.Linear(dim, info.vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=emb, layers=layers, max_seq_len=max_seq_len, num_heads=info.num_heads,
        head_dim=hd, norm=RMSNorm(dim, eps=eps), output=output,
    )


def hf_to_tune_phi3(state: dict[str, torch.Tensor], info: "ModelInfo") -> dict[str, torch.Tensor]:
    return map_keys(state, top_keys(info.tie_word_embeddings), _LAYER_KEYS, str(info.path))
