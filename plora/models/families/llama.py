"""Llama (Llama 2, 3, 3.1, 3.2, 3.3, SmolLM2) and Mistral, through torchtune's builders.

torchtune's RoPE pairs dimensions (2i, 2i+1) where Hugging Face pairs (i, i + d/2), so q/k
rows are permuted on load, as torchtune's own checkpointer does (`rope_permuted`).
``rope_scaling`` of type ``llama3`` becomes torchtune's `Llama3ScaledRoPE`; tied embeddings
become its `TiedLinear`, as in `llama3_2`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from plora.models.families.base import (
    LLAMA_LAYER_KEYS,
    ModelError,
    check_activation,
    check_builder_head_dim,
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

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _read_common(cfg: Mapping[str, Any], where: str, family: str, rope_types: tuple[str, ...]) -> dict[str, Any]:
    check_activation(cfg, where, "hidden_act", ("silu",))
    refuse_if(bool(cfg.get("attention_bias")), where, "attention_bias", f"is not supported for {family} (no bias in torchtune's builder)")
    refuse_if(bool(cfg.get("mlp_bias")), where, "mlp_bias", f"is not supported for {family}")
    check_builder_head_dim(cfg, where, family)
    rope = rope_settings(cfg, where)
    check_plain_rope(rope, where, family, rope_types)
    scaling = None
    if rope["type"] == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in rope["params"]]
        if missing:
            raise ModelError(f"{where}: llama3 RoPE scaling lacks {', '.join(missing)}")
        scaling = {k: float(rope["params"][k]) for k in _LLAMA3_KEYS}
    return {"rope_scaling": scaling, "sliding_window": sliding_window(cfg)}


def read_llama(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    return _read_common(cfg, where, "llama", ("llama3",))


def read_mistral(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    return _read_common(cfg, where, "mistral", ())


def _common(info: "ModelInfo", max_seq_len: int) -> dict[str, Any]:
    return dict(
        vocab_size=info.vocab_size,
        num_layers=info.num_layers,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        embed_dim=info.embed_dim,
        intermediate_dim=info.intermediate_dim,
        max_seq_len=max_seq_len,
        norm_eps=info.norm_eps,
    )


def build_llama(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from plora.models.families.modules import tie_output  # torchtune: imported where a model is built
    from torchtune.models.llama3._component_builders import llama3
    from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE

    model = llama3(rope_base=info.rope_base, **_common(info, max_seq_len))
    scaling = info.options.get("rope_scaling")
    if scaling:
        rope = Llama3ScaledRoPE(
            dim=info.head_dim,
            max_seq_len=max_seq_len,
            base=info.rope_base,
            scale_factor=scaling["factor"],
            low_freq_factor=scaling["low_freq_factor"],
            high_freq_factor=scaling["high_freq_factor"],
            old_context_len=int(scaling["original_max_position_embeddings"]),
        )
        for layer in model.layers:
            layer.attn.pos_embeddings = rope  # one module shared by every layer, as the builder does
    if info.tie_word_embeddings:
        tie_output(model)
    return model


def build_mistral(info: "ModelInfo", max_seq_len: int) -> nn.Module:
    from plora.models.families.modules import tie_output  # torchtune: imported where a model is built
    from torchtune.models.mistral._component_builders import mistral

    model = mistral(rope_base=info.rope_base, **_common(info, max_seq_len))
    if info.tie_word_embeddings:
        tie_output(model)
    return model


def _permute(t: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """Hugging Face's half-split RoPE rows -> torchtune's interleaved ones (torchtune's own map)."""
    rest = t.shape[1:]
    return t.reshape(n_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(n_heads * head_dim, *rest)


def hf_to_tune_permuted(state: dict[str, torch.Tensor], info: "ModelInfo") -> dict[str, torch.Tensor]:
    out = map_keys(state, top_keys(info.tie_word_embeddings), LLAMA_LAYER_KEYS, info)
    for key in list(out):
        if ".attn.q_proj." in key:
            out[key] = _permute(out[key], info.num_heads, info.head_dim)
        elif ".attn.k_proj." in key:
            out[key] = _permute(out[key], info.num_kv_heads, info.head_dim)
    return out
