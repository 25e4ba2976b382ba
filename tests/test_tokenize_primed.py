"""Rows tokenized with their texts encoded ahead in one batch (`TextTokenizer.primed`) are
the rows tokenized one text at a time."""

from __future__ import annotations

import contextlib
import json

from plora.data.dataset import TextTokenizer, tokenize_split


def _examples(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_primed_rows_equal_rows_encoded_one_by_one(tiny_model, reverse_data, monkeypatch):
    tok = TextTokenizer(tiny_model, eos_id=0, pad_id=0)
    examples = _examples(reverse_data["train"]) + [{"input": "", "output": "x"}, {"input": "ab", "output": "ab"}]
    primed, _ = tokenize_split(examples, tok, 64)
    seen: list[int] = []
    real = TextTokenizer.encode_many
    monkeypatch.setattr(TextTokenizer, "encode_many", lambda self, texts: seen.append(len(texts)) or real(self, texts))
    monkeypatch.setattr(TextTokenizer, "primed", lambda self, texts: contextlib.nullcontext())
    alone, _ = tokenize_split(examples, tok, 64)
    assert seen == []  # one by one
    assert [(s.tokens, s.labels) for s in primed] == [(s.tokens, s.labels) for s in alone]


def test_priming_ends_with_its_block(tiny_model):
    tok = TextTokenizer(tiny_model, eos_id=0, pad_id=0)
    with tok.primed(["hello world", "abc"]):
        inside = tok.encode("hello world")
        inside.append(-1)  # a caller's list is its own
        assert tok.encode("hello world") == inside[:-1]
    assert tok._primed == {} and tok.encode("hello world") == inside[:-1]
