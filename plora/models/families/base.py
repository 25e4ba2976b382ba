"""What every model family provides, and the config.json reading they share.

A family turns a Hugging Face ``config.json`` into the options its builder needs, refusing
every setting plora does not implement by name (a silently ignored setting trains the
wrong model), builds the torchtune decoder, and converts Hugging Face weights into it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from plora.models.info import ModelInfo


class ModelError(ValueError):
    """A model folder that plora cannot build; the message names what is missing."""


@dataclass(frozen=True)
class Family:
    """One row of the family table (`plora.models.families.table.FAMILY_TABLE`).

    `read` checks the raw config and returns the family's options (kept in
    `ModelInfo.options`); `build` makes the empty decoder; `hf_to_tune` maps Hugging Face
    weight names (and layouts) to the decoder's. `rope_permuted` says that q/k rows are
    permuted on load (torchtune's interleaved RoPE), so LoRA B of q/k is permuted back on
    save. `tensor_parallel` says whether `plora.train.packed.tp` can shard the decoder.
    """

    name: str
    read: Callable[[Mapping[str, Any], str], dict[str, Any]]
    build: Callable[["ModelInfo", int], "nn.Module"]
    hf_to_tune: Callable[[dict[str, "torch.Tensor"], "ModelInfo"], dict[str, "torch.Tensor"]]
    targets: tuple[str, ...]
    rope_permuted: bool = False
    tensor_parallel: bool = False
    tie_default: bool = False
    model_types: tuple[str, ...] = field(default=())


# ---------------------------------------------------------------- config reading


def rope_settings(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    """RoPE base and scaling from either spelling of config.json.

    transformers 4.x writes ``rope_theta`` and ``rope_scaling`` ({"rope_type"|"type", ...});
    transformers 5.x writes one ``rope_parameters`` dict ({"rope_type", "rope_theta", ...}).
    Returns ``{"theta", "type", "params", "partial_rotary_factor"}`` with type None for
    plain RoPE.
    """
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ModelError(f"{where}: rope_parameters must be an object, got {params!r}")
    if params and all(isinstance(v, Mapping) for v in params.values()):
        raise ModelError(f"{where}: per-layer-type rope_parameters ({', '.join(params)}) are not supported")
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, Mapping):
        raise ModelError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    merged: dict[str, Any] = {**(scaling or {}), **(params or {})}
    theta = merged.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = merged.get("rope_type", merged.get("type"))
    if kind == "default":
        kind = None
    partial = merged.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    extra = {k: v for k, v in merged.items() if k not in ("rope_theta", "rope_type", "type", "partial_rotary_factor")}
    return {"theta": float(theta), "type": kind, "params": extra, "partial_rotary_factor": float(partial or 1.0)}


def refuse_if(cond: bool, where: str, setting: str, why: str = "is not supported by plora") -> None:
    if cond:
        raise ModelError(f"{where}: {setting} {why}")


def check_plain_rope(rope: Mapping[str, Any], where: str, family: str, allowed: tuple[str, ...] = ()) -> None:
    """Refuse a RoPE scaling type or partial rotary factor the family's builder lacks."""
    if rope["type"] is not None and rope["type"] not in allowed:
        ok = f" (supported for {family}: {', '.join(allowed)})" if allowed else ""
        raise ModelError(f"{where}: RoPE scaling type {rope['type']!r} is not supported for {family}{ok}")
    refuse_if(rope["partial_rotary_factor"] != 1.0, where,
              f"partial_rotary_factor {rope['partial_rotary_factor']:g}", "(rotating part of each head) is not supported")


def check_activation(cfg: Mapping[str, Any], where: str, key: str, expected: tuple[str, ...]) -> None:
    act = cfg.get(key)
    if act is not None and act not in expected:
        raise ModelError(f"{where}: {key} {act!r} is not supported (expected {' or '.join(map(repr, expected))})")


def sliding_window(cfg: Mapping[str, Any]) -> int | None:
    """The attention window some layers use, or None when every layer attends to all tokens."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return int(window) if "sliding_attention" in types else None
    if "use_sliding_window" in cfg and not cfg.get("use_sliding_window"):
        return None
    return int(window)


def check_seq_len(info: "ModelInfo", max_seq_len: int) -> None:
    """Refuse a sequence length at which a layer's sliding window would change results.

    Inside the window every layer attends to every earlier token, so plora's full causal
    attention is the model's own; beyond it, it would not be.
    """
    window = info.options.get("sliding_window")
    if window is not None and max_seq_len > window:
        raise ModelError(
            f"{info.path}: sliding-window attention (sliding_window {window}) is not supported: "
            f"max_seq_len {max_seq_len} exceeds the window; use max_seq_len <= {window}"
        )
    short = info.options.get("short_rope_max_len")
    if short is not None and max_seq_len > short:
        raise ModelError(
            f"{info.path}: longrope's long factors (used beyond original_max_position_embeddings {short}) "
            f"are not supported: max_seq_len {max_seq_len} exceeds it; use max_seq_len <= {short}"
        )


def head_dim_of(cfg: Mapping[str, Any]) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def check_builder_head_dim(cfg: Mapping[str, Any], where: str, family: str) -> None:
    """torchtune's builders derive the head size from hidden size and heads: a config with
    another ``head_dim`` (e.g. Mistral-Nemo) cannot be built through them."""
    dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    refuse_if(head_dim_of(cfg) * heads != dim, where, f"head_dim {head_dim_of(cfg)}",
              f"is not supported for {family}: torchtune's builder needs head_dim = hidden_size / "
              f"num_attention_heads ({dim // heads})")


# ---------------------------------------------------------------- weight names


def map_keys(
    state: dict[str, "torch.Tensor"],
    top: Mapping[str, str | None],
    layer: Mapping[str, str | None],
    info: "ModelInfo",
) -> dict[str, "torch.Tensor"]:
    """Rename Hugging Face weights: `top` maps whole names, `layer` maps what follows
    ``model.layers.<i>.``; a None target drops the tensor. Unknown names are refused."""
    out: dict[str, "torch.Tensor"] = {}
    where = f"{info.path}: unexpected weight {{!r}} for the {info.family} family"
    for key, value in state.items():
        if key in top:
            new = top[key]
        elif key.startswith("model.layers."):
            _, _, idx, rest = key.split(".", 3)
            if rest not in layer:
                raise ModelError(where.format(key))
            new = layer[rest] and f"layers.{idx}.{layer[rest]}"
        elif key.endswith("rotary_emb.inv_freq"):
            new = None
        else:
            raise ModelError(where.format(key))
        if new is not None:
            out[new] = value
    return out


#: Hugging Face -> torchtune names inside one llama-style decoder block
LLAMA_LAYER_KEYS: dict[str, str | None] = {
    "self_attn.q_proj.weight": "attn.q_proj.weight",
    "self_attn.k_proj.weight": "attn.k_proj.weight",
    "self_attn.v_proj.weight": "attn.v_proj.weight",
    "self_attn.q_proj.bias": "attn.q_proj.bias",
    "self_attn.k_proj.bias": "attn.k_proj.bias",
    "self_attn.v_proj.bias": "attn.v_proj.bias",
    "self_attn.o_proj.weight": "attn.output_proj.weight",
    "mlp.gate_proj.weight": "mlp.w1.weight",
    "mlp.down_proj.weight": "mlp.w2.weight",
    "mlp.up_proj.weight": "mlp.w3.weight",
    "input_layernorm.weight": "sa_norm.scale",
    "post_attention_layernorm.weight": "mlp_norm.scale",
    "self_attn.rotary_emb.inv_freq": None,
}


def top_keys(tied: bool, norm: str = "norm.scale", output: str = "output.weight") -> dict[str, str | None]:
    # A tied model's lm_head (when a checkpoint writes it) is the embedding: not loaded twice.
    return {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": norm,
        "lm_head.weight": None if tied else output,
    }
