"""LoRA target names per model family, under the Hugging Face (and PEFT) module names.

Kept free of torch so that validating a space file stays cheap: `plora.spec.schema` reads this
table to expand ``all-linear`` and to refuse a layer the model does not have.
"""

from __future__ import annotations

_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: family -> the linear layers of one decoder block that LoRA can adapt (``all-linear``)
FAMILY_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    # Phi-3's projections are fused; PEFT adapts the fused modules, with one A and one B each.
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}

#: every target name some family has, in a stable order
ALL_TARGET_NAMES: tuple[str, ...] = tuple(dict.fromkeys(n for names in FAMILY_TARGETS.values() for n in names))


def family_targets(family: str) -> tuple[str, ...]:
    """The ``all-linear`` layers of `family`; KeyError names the family if unknown."""
    try:
        return FAMILY_TARGETS[family]
    except KeyError:
        raise KeyError(f"unknown model family {family!r}; known: {', '.join(FAMILY_TARGETS)}") from None
