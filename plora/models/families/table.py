"""The model families plora builds, in one table.

A family maps to its config reader, its builder, its weight conversion, whether q/k rows
are permuted (which the PEFT export undoes) and its ``all-linear`` targets; the Hugging
Face <-> torchtune module names of the targets are in `plora.train.packed.inject` and
`plora.train.packed.peft_format`, shared by every family.
"""

from __future__ import annotations

from plora.models.families.base import Family, ModelError, check_seq_len
from plora.models.families.gemma2 import build_gemma2, hf_to_tune_gemma2, read_gemma2
from plora.models.families.llama import build_llama, build_mistral, hf_to_tune_permuted, read_llama, read_mistral
from plora.models.families.phi3 import build_phi3, hf_to_tune_phi3, read_phi3
from plora.models.families.qwen import build_qwen2, build_qwen3, hf_to_tune_qwen2, hf_to_tune_qwen3, read_qwen2, read_qwen3
from plora.models.families.targets import FAMILY_TARGETS

FAMILY_TABLE: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", read_llama, build_llama, hf_to_tune_permuted, FAMILY_TARGETS["llama"],
               rope_permuted=True, tensor_parallel=True, model_types=("llama",)),
        Family("mistral", read_mistral, build_mistral, hf_to_tune_permuted, FAMILY_TARGETS["mistral"],
               rope_permuted=True, tensor_parallel=True, model_types=("mistral",)),
        Family("qwen2", read_qwen2, build_qwen2, hf_to_tune_qwen2, FAMILY_TARGETS["qwen2"],
               tensor_parallel=True, model_types=("qwen2",)),
        Family("qwen3", read_qwen3, build_qwen3, hf_to_tune_qwen3, FAMILY_TARGETS["qwen3"], model_types=("qwen3",)),
        Family("gemma2", read_gemma2, build_gemma2, hf_to_tune_gemma2, FAMILY_TARGETS["gemma2"],
               tie_default=True, model_types=("gemma2",)),
        Family("phi3", read_phi3, build_phi3, hf_to_tune_phi3, FAMILY_TARGETS["phi3"], model_types=("phi3",)),
    )
}

#: config.json ``model_type`` -> family name
MODEL_TYPES: dict[str, str] = {t: f.name for f in FAMILY_TABLE.values() for t in f.model_types}


def get_family(name: str) -> Family:
    try:
        return FAMILY_TABLE[name]
    except KeyError:
        raise ModelError(f"unknown model family {name!r}; supported: {', '.join(FAMILY_TABLE)}") from None


def tensor_parallel_families() -> list[str]:
    return [f.name for f in FAMILY_TABLE.values() if f.tensor_parallel]


__all__ = ["FAMILY_TABLE", "MODEL_TYPES", "Family", "ModelError", "check_seq_len", "get_family", "tensor_parallel_families"]
