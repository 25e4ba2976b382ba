"""Datasets, tokenization and the per-adapter batch streams of a packed job.

Each adapter draws its micro-batches from its own seeded order of the training set, which
depends on nothing but its seed: that is what makes a packed adapter see exactly the data it
would see trained alone.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

IGNORE_INDEX = -100
SUPPORTED_SUFFIXES = (".json", ".jsonl", ".csv", ".parquet")


class DataError(ValueError):
    """A data file or column that cannot be used; the message names it."""


def read_examples(path: str | Path, input_column: str = "input", output_column: str = "output") -> list[dict]:
    """Rows of a JSON/JSONL/CSV/parquet file as `{"input", "output"}` dicts."""
    import pandas as pd

    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        frame = pd.read_json(path, lines=True)
    elif suffix == ".json":
        raw = json.loads(path.read_text())
        frame = pd.DataFrame(raw["data"] if isinstance(raw, dict) and "data" in raw else raw)
    elif suffix == ".csv":
        frame = pd.read_csv(path, dtype=str, keep_default_na=False)
    elif suffix == ".parquet":
        frame = pd.read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (use {', '.join(SUPPORTED_SUFFIXES)})")
    for column in (input_column, output_column):
        if column not in frame.columns:
            raise DataError(f"{path}: no column {column!r} (columns: {', '.join(map(str, frame.columns))})")
    if len(frame) == 0:
        raise DataError(f"{path}: no rows")
    return [
        {"input": str(i), "output": str(o)}
        for i, o in zip(frame[input_column].tolist(), frame[output_column].tolist())
    ]


def synthetic_samples(count: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[Sample]:
    """Random token rows of exactly `seq_len`, loss on every token: what profiling and
    throughput benchmarks train on, where only shapes matter."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randint(4, vocab_size, (count, seq_len), generator=gen).tolist()
    return [Sample(r, r) for r in rows]


def load_split(data_cfg: dict, split: str) -> list[dict]:
    """The train or eval examples a data config names (a built-in task or files)."""
    task = data_cfg.get("task")
    if task:
        from plora.tasks import load_builtin_task

        n = data_cfg.get("num_train" if split == "train" else "num_eval")
        return load_builtin_task(str(task).removeprefix("builtin:"), split, n, seed=0)
    path = data_cfg.get(split)
    if not path:
        if split == "eval":
            return []
        raise DataError(f"data.{split}: no file given")
    return read_examples(path, data_cfg.get("input_column", "input"), data_cfg.get("output_column", "output"))


def char_tokenizer(chars: str):
    """A one-token-per-character `tokenizers.Tokenizer` with ids pad 0, bos 1, eos 2, unk 3:
    the tokenizer of config-only shape folders and of test models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


class TextTokenizer:
    """A `tokenizer.json` tokenizer with the model's bos/eos/pad ids (from config.json)."""

    def __init__(self, model_dir: str | Path, bos_id: int | None, eos_id: int | None, pad_id: int | None):
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise DataError(f"{model_dir}: no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))
        if eos_id is None:
            raise DataError(f"{model_dir}: config.json gives no eos_token_id")
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def prompt_ids(self, text: str) -> list[int]:
        return ([self.bos_id] if self.bos_id is not None else []) + self.encode(text)


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    labels: list[int]


def tokenize_examples(examples: Sequence[dict], tok: TextTokenizer, max_seq_len: int) -> list[Sample]:
    """Prompt + answer + eos; the loss is on the answer and eos only."""
    out = []
    for ex in examples:
        prompt = tok.prompt_ids(ex["input"])
        answer = tok.encode(ex["output"]) + [tok.eos_id]
        tokens = (prompt + answer)[:max_seq_len]
        labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_seq_len]
        out.append(Sample(tokens, labels))
    return out


class AdapterStream:
    """An endless, seeded sequence of sample indices: one fresh permutation per epoch."""

    def __init__(self, num_samples: int, seed: int):
        if num_samples <= 0:
            raise DataError("the training set is empty")
        self.num_samples = num_samples
        self.seed = seed
        self._epoch = 0
        self._order: np.ndarray = self._permutation(0)
        self._pos = 0

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next(self, count: int) -> list[int]:
        taken: list[int] = []
        while len(taken) < count:
            if self._pos == self.num_samples:
                self._epoch += 1
                self._order, self._pos = self._permutation(self._epoch), 0
            take = min(count - len(taken), self.num_samples - self._pos)
            taken.extend(int(i) for i in self._order[self._pos : self._pos + take])
            self._pos += take
        return taken

    def state_dict(self) -> dict[str, int]:
        """Where the stream is (a resumed job goes on from here, not from the start)."""
        return {"epoch": self._epoch, "pos": self._pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._epoch, self._pos = int(state["epoch"]), int(state["pos"])
        self._order = self._permutation(self._epoch)


def collate(samples: Sequence[Sample], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded tokens and labels, ``width`` wide (default: the longest row). Right
    padding keeps every real position's causal context identical whatever the batch's
    width, so padding cannot change an adapter."""
    longest = max(len(s.tokens) for s in samples)
    if width is None:
        width = longest
    elif width < longest:
        raise ValueError(f"collate: width {width} is shorter than the longest row ({longest})")
    tokens = torch.full((len(samples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for i, s in enumerate(samples):
        tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
        labels[i, : len(s.labels)] = torch.tensor(s.labels)
    return tokens, labels

