"""Phi-3 / Phi-3.5 / Phi-4-mini, composed from torchtune's modules with fused projections.

torchtune's own phi3 builder splits ``qkv_proj`` and ``gate_up_proj`` into separate
linears; PEFT adapts the fused modules (one A and one B of the fused output size each),
so plora keeps them fused and its adapters are PEFT's, name for name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import math

from plora.models.families.base import ModelError, check_activation, head_dim_of, map_keys, refuse_if, rope_settings, sliding_window, top_keys

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plora.models.info import ModelInfo

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
    rope = rope_settings(cfg, where)
    kind = rope["type"]
    if kind in ("su", "yarn"):  # transformers reads Phi-3's old names as longrope
        kind = "longrope"
    refuse_if(kind not in (None, "longrope"), where, f"RoPE scaling type {rope['type']!r}",
              "is not supported for phi3 (supported for phi3: longrope)")
    head_dim = head_dim_of(cfg)
    rotary_dim = int(head_dim * rope["partial_rotary_factor"])
    refuse_if(rotary_dim % 2 != 0 or rotary_dim <= 0, where,
              f"partial_rotary_factor {rope['partial_rotary_factor']:g}", f"gives an odd rotary dimension of {rotary_dim}")
    options: dict[str, Any] = {"sliding_window": sliding_window(cfg), "rotary_dim": rotary_dim}
    if kind == "longrope":
        params = rope["params"]
        short = params.get("short_factor")
        if not isinstance(short, list) or len(short) != rotary_dim // 2:
            raise ModelError(f"{where}: longrope short_factor must list {rotary_dim // 2} numbers")
        max_pos = int(cfg.get("max_position_embeddings", 4096))
        original = int(cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos)
        factor = params.get("factor") or max_pos / original
        attention = params.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        options.update(ext_factors=[float(v) for v in short], rope_scale=float(attention),
                       short_rope_max_len=original)
    return options


def build_phi3(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from torch import nn
    from plora.models.families.modules import FusedGateUpMLP, HFOrderAttention, PartialRotaryEmbedding  # torchtune: imported where a model is built
    from torchtune.modules import RMSNorm, TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer

    dim, hd, eps = info.embed_dim, info.head_dim, info.norm_eps
    q_out, kv_out = info.num_heads * hd, info.num_kv_heads * hd
    # Hugging Face's rotate-half RoPE, the layout Phi-3's weights are in (nothing permuted)
    o = info.options
    rope = PartialRotaryEmbedding(o.get("rotary_dim", hd), max_seq_len, info.rope_base,
                                  o.get("ext_factors"), o.get("rope_scale", 1.0))
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
    return map_keys(state, top_keys(info.tie_word_embeddings), _LAYER_KEYS, info)
