"""LoRA target names per model family, under the Hugging Face (and PEFT) module names.

The one home of target names (``all-linear`` and what it means included). Kept free of torch so that validating a space file stays cheap: `plora.spec.schema` reads this
table to expand ``all-linear`` and to refuse a layer the model does not have.
"""

from __future__ import annotations

from collections.abc import Iterable

#: the keyword of a space file (and of PEFT) for "every linear layer of a block"
ALL_LINEAR = "all-linear"
#: the linear layers of a llama-style decoder block, Hugging Face names: what ``all-linear``
#: means for Llama, Mistral, Qwen and Gemma 2, and for the cost model of any family
LLAMA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: what a job adapts when nothing names its targets: the attention projections
DEFAULT_TARGETS: tuple[str, ...] = LLAMA_TARGETS[:4]
_LLAMA_LIKE = LLAMA_TARGETS

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


def resolve_lora_targets(targets: str | Iterable[str] | None) -> tuple[str, ...]:
    """Llama-style linear names of ``targets`` (what the cost model prices a target as);
    ``all-linear`` (alone or in a list) means `LLAMA_TARGETS`, None `DEFAULT_TARGETS`."""
    if targets is None:
        return DEFAULT_TARGETS
    if isinstance(targets, str):
        targets = [targets]
    out: list[str] = []
    for t in targets:
        names = LLAMA_TARGETS if t == ALL_LINEAR else (t,)
        for n in names:
            if n not in LLAMA_TARGETS:
                raise ValueError(f"unknown LoRA target {n!r}; expected one of {', '.join(LLAMA_TARGETS)} or {ALL_LINEAR}")
            if n not in out:
                out.append(n)
    return tuple(out)
