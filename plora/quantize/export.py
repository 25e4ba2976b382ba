"""What an adapter trained on a quantized base says of it.

The adapter itself is an ordinary PEFT adapter (its weights in the model's dtype): PEFT's
`LoraConfig` has no field for its base's quantization (an unknown key in
``adapter_config.json`` draws a warning at every load), so the note sits beside it, in
`NOTE_FILE`, in the terms of `transformers.BitsAndBytesConfig` where they match: the base
to load it on for the same numbers is the model in 4-bit NF4 with double quantization.
A merged export merges into the unquantized base weights of the model folder, and has no
note: it is a full-precision model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plora.quantize.cost import NF4_BLOCK, NF4_SCALER_BLOCK, check_quantize

#: the note's file name, beside ``adapter_config.json``
NOTE_FILE = "base_quantization.json"


def base_note(quantize: str) -> dict[str, Any]:
    """The note of an adapter trained on a base held as ``quantize`` says."""
    method = check_quantize(quantize)
    return {
        "quant_method": method,
        "bits": 4,
        "library": "torchao",
        "block_size": NF4_BLOCK,
        "scaler_block_size": NF4_SCALER_BLOCK,
        "double_quant": True,
        "quantized_modules": "every linear of every decoder block (embeddings, norms and LM head unquantized)",
        # the same settings as transformers' bitsandbytes config names them
        "load_in_4bit": True,
        "bnb_4bit_quant_type": method,
        "bnb_4bit_use_double_quant": True,
    }


def write_base_note(adapter_dir: str | Path, quantize: str | None) -> Path | None:
    """Write `NOTE_FILE` into an adapter folder (nothing for an unquantized base)."""
    if not quantize:
        return None
    path = Path(adapter_dir) / NOTE_FILE
    path.write_text(json.dumps(base_note(quantize), indent=2) + "\n")
    return path


def read_base_note(adapter_dir: str | Path) -> dict[str, Any] | None:
    """An adapter folder's note, or None (its base was not quantized)."""
    path = Path(adapter_dir) / NOTE_FILE
    return json.loads(path.read_text()) if path.is_file() else None
