"""Qwen2/Qwen2.5 (torchtune's builder) and Qwen3 (composed from torchtune's modules).

Both keep Hugging Face's RoPE layout (torchtune's `Qwen2RotaryPositionalEmbeddings`), so no
weight is permuted. Qwen3 adds an RMSNorm over each head of q and k, before RoPE.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from plora.models.families.base import (
    LLAMA_LAYER_KEYS,
    check_activation,
    check_builder_head_dim,
    check_plain_rope,
    map_keys,
    rope_settings,
    sliding_window,
    top_keys,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plora.models.info import ModelInfo


def read_qwen2(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    check_activation(cfg, where, "hidden_act", ("silu",))
    check_builder_head_dim(cfg, where, "qwen2")
    check_plain_rope(rope_settings(cfg, where), where, "qwen2")
    return {"sliding_window": sliding_window(cfg)}


def read_qwen3(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    check_activation(cfg, where, "hidden_act", ("silu",))
    check_plain_rope(rope_settings(cfg, where), where, "qwen3")
    return {"sliding_window": sliding_window(cfg), "attention_bias": bool(cfg.get("attention_bias", False))}


def build_qwen2(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from torchtune.models.qwen2._component_builders import qwen2

    return qwen2(
        vocab_size=info.vocab_size,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        embed_dim=info.embed_dim,
        intermediate_dim=info.intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=info.norm_eps,
        rope_base=info.rope_base,
        tie_word_embeddings=info.tie_word_embeddings,
    )


def build_qwen3(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from torch import nn
    from plora.models.families.modules import HFOrderAttention  # torchtune: imported where a model is built
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import FeedForward, RMSNorm, TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer

    dim, hd, eps = info.embed_dim, info.head_dim, info.norm_eps
    q_out, kv_out = info.num_heads * hd, info.num_kv_heads * hd
    bias = bool(info.options.get("attention_bias"))
    rope = Qwen2RotaryPositionalEmbeddings(dim=hd, max_seq_len=max_seq_len, base=info.rope_base)
    layers = nn.ModuleList()
    for _ in range(info.num_layers):
        attn = HFOrderAttention(
            embed_dim=dim,
            num_heads=info.num_heads,
            num_kv_heads=info.num_kv_heads,
            head_dim=hd,
            q_proj=nn.Linear(dim, q_out, bias=bias),
            k_proj=nn.Linear(dim, kv_out, bias=bias),
            v_proj=nn.Linear(dim, kv_out, bias=bias),
            output_proj=nn.Linear(q_out, dim, bias=bias),
            pos_embeddings=rope,
            q_norm=RMSNorm(hd, eps=eps),
            k_norm=RMSNorm(hd, eps=eps),
            max_seq_len=max_seq_len,
        )
        mlp = FeedForward(
            gate_proj=nn.Linear(dim, info.intermediate_dim, bias=False),
            down_proj=nn.Linear(info.intermediate_dim, dim, bias=False),
            up_proj=nn.Linear(dim, info.intermediate_dim, bias=False),
        )
        layers.append(TransformerSelfAttentionLayer(attn=attn, mlp=mlp, sa_norm=RMSNorm(dim, eps=eps), mlp_norm=RMSNorm(dim, eps=eps)))
    emb = nn.Embedding(info.vocab_size, dim)
    output = TiedLinear(emb) if info.tie_word_embeddings else nn.Linear(dim, info.vocab_size, bias=False)
    return TransformerDecoder(
        tok_embeddings=emb, layers=layers, max_seq_len=max_seq_len, num_heads=info.num_heads,
        head_dim=hd, norm=RMSNorm(dim, eps=eps), output=output,
    )


_QWEN3_LAYER_KEYS = {
    **LLAMA_LAYER_KEYS,
    "self_attn.o_proj.bias": "attn.output_proj.bias",
    "self_attn.q_norm.weight": "attn.q_norm.scale",
    "self_attn.k_norm.weight": "attn.k_norm.scale",
}


def hf_to_tune_qwen2(state: dict[str, torch.Tensor], info: "ModelInfo") -> dict[str, torch.Tensor]:
    return map_keys(state, top_keys(info.tie_word_embeddings), LLAMA_LAYER_KEYS, info)


def hf_to_tune_qwen3(state: dict[str, torch.Tensor], info: "ModelInfo") -> dict[str, torch.Tensor]:
    return map_keys(state, top_keys(info.tie_word_embeddings), _QWEN3_LAYER_KEYS, info)
