"""The architecture numbers of a decoder-only transformer, as planning needs them.

`ModelShape` is read from a model folder (`plora.models.loading.shape_folder` writes one back)
or taken from a preset; the cost model prices a pack on it and the space file's validation
resolves ``model.shape`` to it. No torch here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from plora.models.families.targets import resolve_lora_targets

# Megatron-style TP: these shard their output features (column parallel) ...
_COLWISE = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
# ... and these their input features (row parallel).
_ROWWISE = frozenset({"o_proj", "down_proj"})


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers of a decoder-only transformer that the cost model needs."""

    name: str
    n_params: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int = 2
    tied_embeddings: bool = False
    #: the block linears held 4-bit ("nf4", `plora.quantize.cost`); None: in ``dtype_bytes``
    quantize: str | None = None

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear of one block."""
        h, i = self.hidden, self.intermediate
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def lora_params_per_rank(self, targets: str | Iterable[str] | None = None) -> int:
        """LoRA parameters per unit of rank: sum over targeted linears of (in + out), times layers."""
        dims = self.linear_dims()
        return self.n_layers * sum(sum(dims[t]) for t in resolve_lora_targets(targets))

    def lora_split_per_rank(self, targets: str | Iterable[str] | None = None) -> tuple[int, int]:
        """(replicated, sharded) LoRA parameters per rank under Megatron TP.

        A column-parallel linear keeps A (r x in) whole and shards B (out x r); a
        row-parallel one shards A and keeps B whole. Only the sharded part shrinks with d.
        """
        dims = self.linear_dims()
        rep = shard = 0
        for t in resolve_lora_targets(targets):
            i, o = dims[t]
            if t in _COLWISE:
                rep, shard = rep + i, shard + o
            else:
                rep, shard = rep + o, shard + i
        return rep * self.n_layers, shard * self.n_layers

    def tp_degrees(self, max_tp: int = 8) -> tuple[int, ...]:
        """Powers of two up to ``max_tp`` that split attention heads and KV heads evenly.

        Sharding attention by heads needs d | n_heads and d | n_kv_heads; a degree that
        splits a head would change the computation, so it is not offered. A quantized base
        runs at degree 1 only (`plora.quantize.cost.check_tp`).
        """
        if self.quantize:
            return (1,)
        out, d = [], 1
        while d <= max_tp:
            if self.n_heads % d == 0 and self.n_kv_heads % d == 0:
                out.append(d)
            d *= 2
        return tuple(out)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if out["quantize"] is None:  # absent when off: keys of earlier profiles stay valid
            del out["quantize"]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelShape":
        return cls(**d)

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """Shapes of common base models (numbers from their HF ``config.json``)."""
        key = name.lower()
        if key not in _PRESETS:
            raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(_PRESETS))}")
        return _PRESETS[key]

    @staticmethod
    def presets() -> tuple[str, ...]:
        return tuple(sorted(_PRESETS))


def _shape(name, n_params, hidden, inter, layers, heads, kv, head_dim, vocab, tied) -> ModelShape:
    return ModelShape(name, n_params, hidden, inter, layers, heads, kv, head_dim, vocab, 2, tied)


_PRESETS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _shape("qwen2.5-0.5b", 494_032_768, 896, 4864, 24, 14, 2, 64, 151936, True),
        _shape("qwen2.5-1.5b", 1_543_714_304, 1536, 8960, 28, 12, 2, 128, 151936, True),
        _shape("qwen2.5-3b", 3_085_938_688, 2048, 11008, 36, 16, 2, 128, 151936, True),
        _shape("qwen2.5-7b", 7_615_616_512, 3584, 18944, 28, 28, 4, 128, 152064, False),
        _shape("qwen2.5-14b", 14_770_033_664, 5120, 13824, 48, 40, 8, 128, 152064, False),
        _shape("qwen2.5-32b", 32_763_876_352, 5120, 27648, 64, 40, 8, 128, 152064, False),
        _shape("llama-3.2-1b", 1_235_814_400, 2048, 8192, 16, 32, 8, 64, 128256, True),
        _shape("llama-3.2-3b", 3_212_749_824, 3072, 8192, 28, 24, 8, 128, 128256, True),
        _shape("llama-3.1-8b", 8_030_261_248, 4096, 14336, 32, 32, 8, 128, 128256, False),
        _shape("mistral-7b-v0.3", 7_248_023_552, 4096, 14336, 32, 32, 8, 128, 32768, False),
    )
}
