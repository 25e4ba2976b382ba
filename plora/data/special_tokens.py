"""The special tokens a model's own tokenizer puts around a text, and those that end an answer.

An adapter only scores for its users what it scored for plora if both feed the model the same
ids: trained on rows that start with ``<bos>``, it answers nothing when ordinary
`transformers` code (``tokenizer(prompt)``, ``generate``) prompts it without one, and the
other way round. So plora frames a plain or instruction row exactly as the model's tokenizer
frames a text: with the special tokens of ``tokenizer.json``'s post-processor (Llama 3's
``<|begin_of_text|>`` template; Qwen's and SmolLM2's, which add nothing), and none where it
has no post-processor. That is what transformers 5 does: it drops ``add_bos_token`` and
``add_eos_token`` from ``tokenizer_config.json`` whenever the folder has a ``tokenizer.json``
(the shipped demo model says ``add_bos_token: false`` and has no post-processor: no bos).

Chat rows are not framed: the chat template writes its own special tokens, and
``apply_chat_template`` tokenizes its text without adding any.

Generation stops, as ``generate`` does, at any of the model's end tokens: the
``eos_token_id`` of ``generation_config.json`` (one id or a list), else of ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["Framing", "framing", "stop_ids"]


@dataclass(frozen=True)
class Framing:
    """The ids the tokenizer puts before and after a text it encodes on its own."""

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def framing(tokenizer: "Tokenizer") -> Framing:
    """The special tokens ``tokenizer``'s post-processor puts before and after a text."""
    encoding = tokenizer.encode("a", add_special_tokens=True)
    inside = [i for i, s in enumerate(encoding.sequence_ids) if s is not None]
    if not inside:  # the text itself vanished: nothing to tell prefix from suffix by
        return Framing(tuple(encoding.ids))
    return Framing(tuple(encoding.ids[: inside[0]]), tuple(encoding.ids[inside[-1] + 1:]))


def stop_ids(model_dir: str | Path, eos_id: int) -> frozenset[int]:
    """The ids that end a generated answer: the model's end tokens, ``eos_id`` among them."""
    folder = Path(model_dir)
    ids: set[int] = {eos_id}
    for name in ("generation_config.json", "config.json"):
        value = _json(folder / name).get("eos_token_id")
        if value is None:
            continue
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
        break
    return frozenset(ids)
