from __future__ import annotations

import json

import pandas as pd
import pytest

from plora.data import IGNORE_INDEX, AdapterStream, DataError, Sample, collate, read_examples


def test_stream_is_seeded_and_covers_each_epoch():
    a, b = AdapterStream(10, seed=3), AdapterStream(10, seed=3)
    first = a.next(7) + a.next(3)
    assert first == b.next(10)
    assert sorted(first) == list(range(10))
    second = a.next(10)
    assert sorted(second) == list(range(10)) and second != first
    assert AdapterStream(10, seed=4).next(10) != first


def test_stream_crosses_epochs_inside_a_batch():
    s = AdapterStream(4, seed=0)
    got = s.next(6)
    assert sorted(got[:4]) == [0, 1, 2, 3] and len(got) == 6


def test_collate_right_pads():
    tokens, labels = collate([Sample([1, 5, 6], [IGNORE_INDEX, 5, 6]), Sample([1, 7], [IGNORE_INDEX, 7])], pad_id=0)
    assert tokens.tolist() == [[1, 5, 6], [1, 7, 0]]
    assert labels.tolist() == [[IGNORE_INDEX, 5, 6], [IGNORE_INDEX, 7, IGNORE_INDEX]]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_read_examples_formats(tmp_path, suffix):
    rows = [{"q": "ab", "a": "ba"}, {"q": "cd", "a": "dc"}]
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    elif suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".csv":
        pd.DataFrame(rows).to_csv(path, index=False)
    else:
        pd.DataFrame(rows).to_parquet(path)
    assert read_examples(path, "q", "a") == [{"input": "ab", "output": "ba"}, {"input": "cd", "output": "dc"}]


def test_read_examples_names_missing_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"input": "x"}))
    with pytest.raises(DataError, match="no column 'output'"):
        read_examples(path)
