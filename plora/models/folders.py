"""A base model's folder: where it is (a shipped model, a GGUF file's converted folder, a
shape's config-only folder) and what its config.json says, without torch.

A sweep reads these while it plans, and it plans without torch: its import took 4 to 5 s
of a warm sweep's 10 s of planning on an H100 machine. Building the model and loading its
weights is `plora.models.loading`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plora.models.families.base import ModelError, rope_settings
from plora.models.families.table import get_family
from plora.models.info import FAMILIES, ModelInfo

__all__ = ["ASSETS", "ModelError", "ensure_weights", "read_model_info", "resolve_model_path", "shape_folder",
           "write_shape_folder"]

ASSETS = Path(__file__).resolve().parents[1] / "assets"


def resolve_model_path(path: str | Path, dtype: str = "float32", *, weights: bool = False) -> Path:
    """`builtin:<name>` names a model shipped in plora/assets; a `.gguf` file (or a built-in
    GGUF) its folder converted for the model's ``dtype`` (the weights only with ``weights``:
    whatever reads them converts them first, `plora.models.gguf.ensure_weights`); anything
    else is a folder."""
    text = str(path)
    from plora.models.gguf import GGUFError, gguf_folder  # a .gguf file or built-in GGUF: its converted folder

    try:
        converted = gguf_folder(text, dtype, weights=weights)
    except GGUFError as e:
        raise ModelError(str(e)) from None
    if converted is not None:
        return converted
    if text.startswith("builtin:"):
        folder = ASSETS / text.split(":", 1)[1]
        if not (folder / "config.json").is_file():
            known = sorted(p.name for p in ASSETS.iterdir() if (p / "config.json").is_file())
            raise ModelError(f"unknown built-in model {text!r}; available: {', '.join(known)}")
        return folder
    folder = Path(text).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ModelError(f"{folder}: no config.json (expected a Hugging Face-format model folder)")
    return folder


def ensure_weights(folder: Path) -> None:
    """A GGUF file's folder converted head first gets its weights, or waits for the process
    converting them (`plora.models.gguf.ensure_weights`); its problem is a ModelError like
    any other folder's. Nothing for any other folder."""
    from plora.models.gguf import GGUFError
    from plora.models.gguf import ensure_weights as gguf_ensure_weights

    try:
        gguf_ensure_weights(folder)
    except GGUFError as e:
        raise ModelError(str(e)) from None


def read_model_info(path: str | Path, family: str = "auto") -> ModelInfo:
    """Read config.json (transformers 4.x or 5.x spelling); refuse what plora cannot build."""
    folder = resolve_model_path(path)
    cfg_file = folder / "config.json"
    try:
        cfg: dict[str, Any] = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{cfg_file}: not a readable JSON file ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    where = str(cfg_file)
    model_type = cfg.get("model_type", "")
    if family == "auto":
        if model_type not in FAMILIES:
            raise ModelError(
                f"{where}: model_type {model_type!r} is not supported "
                f"(supported: {', '.join(sorted(FAMILIES))}); set model.family explicitly"
            )
        family = FAMILIES[model_type][0]
    fam = get_family(family)
    try:
        options = fam.read(cfg, where)
        heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return ModelInfo(
            path=folder,
            family=family,
            vocab_size=int(cfg["vocab_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            embed_dim=dim,
            head_dim=int(cfg.get("head_dim") or dim // heads),
            intermediate_dim=int(cfg["intermediate_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_base=rope_settings(cfg, where)["theta"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", fam.tie_default)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=cfg.get("pad_token_id"),
            options=options,
        )
    except KeyError as e:
        raise ModelError(f"{where}: missing {e.args[0]!r}") from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ModelError):
            raise
        raise ModelError(f"{where}: {e}") from None


def shape_folder(shape) -> Path:
    """A config-only folder for a `ModelShape`, kept in plora's cache (PLORA_CACHE_DIR)."""
    from plora.settings import settings

    root = settings().cache_dir / "shapes" / shape.name
    if not (root / "config.json").is_file():
        write_shape_folder(shape, root)
    return root


def write_shape_folder(shape, out: str | Path) -> Path:
    """A model folder with only config.json and a byte-level tokenizer for a `ModelShape`.

    With `random_init` it builds a model of that shape without any weights on disk: what
    the profiler and the benchmarks need for models whose weights are not at hand.
    """
    from plora.data.dataset import char_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    family = "qwen2" if shape.name.startswith("qwen") else "llama"
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        "model_type": family,
        "vocab_size": shape.vocab,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0 if family == "qwen2" else 500000.0,
        "tie_word_embeddings": bool(shape.tied_embeddings) if family == "qwen2" else False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    char_tokenizer("".join(chr(b) for b in range(32, 127))).save(str(out / "tokenizer.json"))
    return out
