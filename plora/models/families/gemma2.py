"""Gemma2, composed from torchtune's gemma2 modules.

torchtune 0.6.1's `gemma2` builder is not used as is: it soft-caps the final hidden
state instead of the logits and swaps the pre/post feed-forward norms on load. Here the
same modules (`Gemma2Attention`, `GemmaRMSNorm`, `GemmaNormEmbeddings`, `gemma_mlp`) are
wired as Hugging Face's Gemma2: embeddings scaled by sqrt(hidden), sandwich norms around
attention and MLP, attention logits soft-capped and scaled by `query_pre_attn_scalar`,
and the final soft-capping inside ``.output`` (`SoftCappedOutput`). RoPE keeps Hugging
Face's layout (nothing permuted). `Gemma2Attention` computes attention itself (soft-capping
needs the scores), not through ``_attention_call``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from plora.models.families.base import (
    LLAMA_LAYER_KEYS,
    check_activation,
    check_plain_rope,
    map_keys,
    refuse_if,
    rope_settings,
    sliding_window,
    top_keys,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plora.models.info import ModelInfo

_GELU = ("gelu_pytorch_tanh", "gelu_tanh")

_LAYER_KEYS = {
    **{k: v for k, v in LLAMA_LAYER_KEYS.items() if "bias" not in k},
    "post_attention_layernorm.weight": "sa_scale.scale",
    "pre_feedforward_layernorm.weight": "mlp_norm.scale",
    "post_feedforward_layernorm.weight": "mlp_scale.scale",
}


def read_gemma2(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    check_activation(cfg, where, "hidden_activation", _GELU)
    if cfg.get("hidden_activation") is None:
        check_activation(cfg, where, "hidden_act", _GELU)
    refuse_if(bool(cfg.get("attention_bias")), where, "attention_bias", "is not supported for gemma2")
    refuse_if(bool(cfg.get("use_bidirectional_attention")), where, "use_bidirectional_attention", "is not supported")
    check_plain_rope(rope_settings(cfg, where), where, "gemma2")
    qpas = cfg.get("query_pre_attn_scalar")
    return {
        "sliding_window": sliding_window(cfg),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "query_pre_attn_scalar": float(qpas) if qpas is not None else None,
    }


def build_gemma2(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from torch import nn
    from plora.models.families.modules import SoftCappedOutput  # torchtune: imported where a model is built
    from torchtune.models.gemma._component_builders import gemma_mlp
    from torchtune.models.gemma.gemma_norm_embedding import GemmaNormEmbeddings
    from torchtune.models.gemma.rms_norm import GemmaRMSNorm
    from torchtune.models.gemma2._attention import Gemma2Attention
    from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
    from torchtune.modules import TiedLinear, TransformerDecoder, TransformerSelfAttentionLayer

    o = info.options
    dim, hd, eps = info.embed_dim, info.head_dim, info.norm_eps
    q_out, kv_out = info.num_heads * hd, info.num_kv_heads * hd
    rope = Qwen2RotaryPositionalEmbeddings(dim=hd, max_seq_len=max_seq_len, base=info.rope_base)
    layers = nn.ModuleList()
    for _ in range(info.num_layers):
        attn = Gemma2Attention(
            embed_dim=dim,
            num_heads=info.num_heads,
            num_kv_heads=info.num_kv_heads,
            head_dim=hd,
            q_proj=nn.Linear(dim, q_out, bias=False),
            k_proj=nn.Linear(dim, kv_out, bias=False),
            v_proj=nn.Linear(dim, kv_out, bias=False),
            output_proj=nn.Linear(q_out, dim, bias=False),
            pos_embeddings=rope,
            max_seq_len=max_seq_len,
            sliding_window_size=None,  # refused beyond the window (`check_seq_len`)
            softcapping=o.get("attn_logit_softcapping"),
            query_pre_attn_scalar=o.get("query_pre_attn_scalar"),
        )
        layers.append(TransformerSelfAttentionLayer(
            attn=attn,
            mlp=gemma_mlp(dim=dim, hidden_dim=info.intermediate_dim),
            sa_norm=GemmaRMSNorm(dim, eps=eps),  # input_layernorm
            sa_scale=GemmaRMSNorm(dim, eps=eps),  # post_attention_layernorm
            mlp_norm=GemmaRMSNorm(dim, eps=eps),  # pre_feedforward_layernorm
            mlp_scale=GemmaRMSNorm(dim, eps=eps),  # post_feedforward_layernorm
        ))
    emb = GemmaNormEmbeddings(info.vocab_size, dim)
    proj = TiedLinear(emb) if info.tie_word_embeddings else nn.Linear(dim, info.vocab_size, bias=False)
    cap = o.get("final_logit_softcapping")
    output = SoftCappedOutput(proj, cap) if cap else proj
    return TransformerDecoder(
        tok_embeddings=emb, layers=layers, max_seq_len=max_seq_len, num_heads=info.num_heads,
        head_dim=hd, norm=GemmaRMSNorm(dim, eps=eps), output=output,
    )


def hf_to_tune_gemma2(state: dict[str, torch.Tensor], info: "ModelInfo") -> dict[str, torch.Tensor]:
    head = "output.proj.weight" if info.options.get("final_logit_softcapping") else "output.weight"
    return map_keys(state, top_keys(info.tie_word_embeddings, output=head), _LAYER_KEYS, info)
