"""Tiny random models of every family, written by `transformers` (used by test_families)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            bos_token_id=1, eos_token_id=2, pad_token_id=0)

#: case name -> (transformers config class, model class, extra config keys)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama-tied-llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=500000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, query_pre_attn_scalar=24,
                                                          sliding_window=128, attn_logit_softcapping=5.0,
                                                          final_logit_softcapping=3.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0, eos_token_id=2)),
    # Phi-4-mini-like: LongRoPE (short factors) on half of each head, tied embeddings
    "phi3-longrope-partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, eos_token_id=2, tie_word_embeddings=True, max_position_embeddings=256,
        original_max_position_embeddings=64,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "short_factor": [1.0, 1.3, 2.1, 3.7], "long_factor": [2.0, 3.0, 5.0, 9.0]})),
}


def make_model(name: str, out: Path, *, seed: int = 0, v4_spelling: bool = False) -> Path:
    """Write case `name` with `save_pretrained` (+ a char tokenizer.json).

    `v4_spelling` rewrites config.json's ``rope_parameters`` as transformers 4.x wrote it
    (``rope_theta`` and ``rope_scaling`` at the top level).
    """
    import torch
    import transformers

    from plora.data.dataset import char_tokenizer

    cfg_cls, model_cls, extra = CASES[name]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # norms away from 1 (or 0 for Gemma), so a wrong mapping shows
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out)
    char_tokenizer("abcdefghijklmnopqrstuvwxyz0123456789+-=>< ").save(str(out / "tokenizer.json"))
    if v4_spelling:
        path = out / "config.json"
        c = json.loads(path.read_text())
        rope = dict(c.pop("rope_parameters"))
        c["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            c["rope_scaling"] = rope
        path.write_text(json.dumps(c, indent=2))
    return out


def hf_model(name: str, folder: Path):
    import transformers

    return getattr(transformers, CASES[name][1]).from_pretrained(folder).eval()
