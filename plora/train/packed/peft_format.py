"""Adapters in the Hugging Face PEFT format, and merged-weight export.

torchtune permutes the rows of q/k projections of Llama-family checkpoints on load (its
RoPE pairs dimensions differently from Hugging Face's); LoRA B of q/k must be permuted back
on save, or the adapter would be silently wrong in `transformers`. The other families keep
Hugging Face's layout (`Family.rope_permuted`), so nothing is permuted there. Phi-3's fused
`qkv_proj` / `gate_up_proj` are adapted whole, so their A and B are PEFT's as they are.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from plora.models.families.table import get_family
from plora.models.info import ModelInfo

#: torchtune module path pieces -> Hugging Face ones
_TUNE_TO_HF = {
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.output_proj": "self_attn.o_proj",
    "mlp.w1": "mlp.gate_proj",
    "mlp.w2": "mlp.down_proj",
    "mlp.w3": "mlp.up_proj",
    "attn.qkv_proj": "self_attn.qkv_proj",
    "mlp.gate_up_proj": "mlp.gate_up_proj",
}


def _rope_rows_to_hf(t: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    rank = t.shape[-1]
    return t.reshape(n_heads, head_dim // 2, 2, rank).transpose(1, 2).reshape(n_heads * head_dim, rank)


def hf_module_name(tune_name: str) -> str:
    """`layers.3.attn.q_proj` -> `model.layers.3.self_attn.q_proj`."""
    prefix, idx, rest = tune_name.split(".", 2)
    return f"model.{prefix}.{idx}.{_TUNE_TO_HF[rest]}"


def to_peft_state_dict(tune_state: Mapping[str, torch.Tensor], info: ModelInfo) -> dict[str, torch.Tensor]:
    """torchtune LoRA names (`<module>.lora_a.weight`) -> PEFT's keys, with q/k rows fixed."""
    out: dict[str, torch.Tensor] = {}
    permuted = get_family(info.family).rope_permuted
    for key, value in tune_state.items():
        module, which, _ = key.rsplit(".", 2)
        value = value.detach().to("cpu").contiguous()
        if which == "lora_b" and permuted:
            if module.endswith("attn.q_proj"):
                value = _rope_rows_to_hf(value, info.num_heads, info.head_dim)
            elif module.endswith("attn.k_proj"):
                value = _rope_rows_to_hf(value, info.num_kv_heads, info.head_dim)
        peft_which = "lora_A" if which == "lora_a" else "lora_B"
        out[f"base_model.model.{hf_module_name(module)}.{peft_which}.weight"] = value.contiguous()
    return out


def save_peft_adapter(
    out_dir: str | Path,
    tune_state: Mapping[str, torch.Tensor],
    info: ModelInfo,
    *,
    rank: int,
    alpha: float,
    targets: list[str],
    dropout: float,
    rslora: bool = False,
    base_quantize: str | None = None,
) -> Path:
    """Write `adapter_model.safetensors` + `adapter_config.json`, loadable by PeftModel
    (``rslora``: its scale is alpha/sqrt(r), PEFT's ``use_rslora``); trained on a quantized
    base (``base_quantize``), a note of it beside them (`plora.quantize.export`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_peft_state_dict(tune_state, info)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(info.path),
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "use_rslora": bool(rslora),
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    if base_quantize:
        from plora.quantize.export import write_base_note

        write_base_note(out, base_quantize)
    return out


#: weight files of a model folder: the merged folder gets its own safetensors, and never the
#: base's unmerged weights in another format beside them
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def merge_adapter(model_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a Hugging Face model folder whose weights have the adapter merged in (W + s·B·A)."""
    import shutil

    from plora.models.gguf import ensure_weights

    model_dir, adapter_dir, out = Path(model_dir), Path(adapter_dir), Path(out_dir)
    ensure_weights(model_dir)  # a GGUF file's folder converted head first
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = float(cfg["lora_alpha"]) / (math.sqrt(int(cfg["r"])) if cfg.get("use_rslora") else int(cfg["r"]))
    lora = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():  # config, tokenizer, generation config, the shards' index
        if f.is_file() and f.suffix not in WEIGHT_SUFFIXES:
            shutil.copy2(f, out / f.name)
    merged_keys = 0
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights = load_file(str(shard))
        for key in list(weights):
            module = key.removesuffix(".weight")
            a = lora.get(f"base_model.model.{module}.lora_A.weight")
            b = lora.get(f"base_model.model.{module}.lora_B.weight")
            if a is None or b is None:
                continue
            w = weights[key]
            weights[key] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
            merged_keys += 1
        save_file(weights, str(out / shard.name), metadata={"format": "pt"})
    if merged_keys * 2 != len(lora):
        raise ValueError(f"merged {merged_keys} modules but the adapter has {len(lora) // 2}")
    return out
