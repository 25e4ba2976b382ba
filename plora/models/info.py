"""What the rest of plora knows about a base model, read from its config.json: `ModelInfo`.

Kept apart from the loading (`plora.models.loading`) and below the families
(`plora.models.families`), which both read it: a family reads a config into a `ModelInfo`'s
options, the loader builds the decoder from it. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: config.json ``model_type`` -> (our family name, torchtune's checkpointer model type, or
#: "" where torchtune 0.6.1 has none). The weights are converted by the family itself
#: (`plora.models.families.table`); the second name is for tools that speak torchtune's terms.
FAMILIES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LLAMA3"),
    "mistral": ("mistral", "MISTRAL"),
    "qwen2": ("qwen2", "QWEN2"),
    "qwen3": ("qwen3", ""),
    "gemma2": ("gemma2", "GEMMA2"),
    "phi3": ("phi3", "PHI3_MINI"),
}


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of plora needs to know about a base model, read from config.json.

    `options` holds the family's own settings (RoPE scaling, soft-capping, the sliding
    window...), as its reader in `plora.models.families` returned them.
    """

    path: Path
    family: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    embed_dim: int
    head_dim: int
    intermediate_dim: int
    max_position_embeddings: int
    norm_eps: float
    rope_base: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def checkpointer_type(self) -> str:
        return FAMILIES[self.family][1]
