"""Real-looking training rows for the benchmarks that sweep on a JSONL file of their own.

Shared by ``bench_real_data.py`` and ``bench_streaming.py`` so that both measure the same
rows: plain sentences of common words, about one token a character under the shape
folders' tokenizers, so a row's length in characters is its length in tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

_WORDS = ("market", "river", "winter", "council", "station", "garden", "letter", "morning",
          "village", "engine", "history", "report", "question", "doctor", "teacher", "family",
          "summer", "harbor", "bridge", "window", "problem", "answer", "number", "system", "quiet",
          "bright", "early", "heavy", "simple", "careful", "local", "public", "recent", "strong",
          "open", "final", "ready")


def sentence_text(rng: random.Random, chars: int) -> str:
    """Plain sentences of about ``chars`` characters."""
    out: list[str] = []
    length = 0
    while length < chars:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 11))]
        s = " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", "!"])
        out.append(s)
        length += len(s) + 1
    return " ".join(out)[:chars].rstrip()


def make_rows(n: int, variant: str, *, row_chars: int, answer_chars: int, in_min: int, in_max: int,
              seed: int) -> list[dict]:
    """Rows whose text is about one token a character under the shape folder's tokenizer."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        if variant == "fixed":
            prompt = row_chars - answer_chars
        else:
            prompt = rng.randint(in_min, in_max)
        rows.append({"input": sentence_text(rng, prompt), "output": sentence_text(rng, answer_chars)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_variant(data_dir: Path, variant: str, *, rows: int, eval_samples: int, row_chars: int, answer_chars: int,
                  seq: int) -> tuple[Path, Path]:
    """train-VARIANT.jsonl and eval-VARIANT.jsonl in ``data_dir``, as bench_real_data writes
    them: the varied rows' mean length matches the fixed ones', and none is cut by ``seq``."""
    in_max = 2 * (row_chars - answer_chars) - 16
    kw = {"row_chars": row_chars, "answer_chars": answer_chars, "in_min": 16,
          "in_max": min(in_max, seq - answer_chars - 4)}
    train, evals = data_dir / f"train-{variant}.jsonl", data_dir / f"eval-{variant}.jsonl"
    write_jsonl(train, make_rows(rows, variant, seed=1, **kw))
    write_jsonl(evals, make_rows(eval_samples, variant, seed=2, **kw))
    return train, evals
