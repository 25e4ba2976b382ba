from __future__ import annotations

import json

import pandas as pd
import pytest

from plora.data.dataset import IGNORE_INDEX, AdapterStream, DataError, Sample, collate, read_examples


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


def test_length_bucketed_streams_draw_from_one_bucket_per_step_whatever_the_batch_size():
    import random

    rng = random.Random(0)
    lengths = [rng.randint(16, 440) for _ in range(512)]
    order = sorted(range(512), key=lambda i: (lengths[i], i))
    bucket_of = {i: k * 8 // 512 for k, i in enumerate(order)}  # 8 buckets of 64 rows, shortest first
    small, large = (AdapterStream(512, seed=s, lengths=lengths, buckets=8) for s in (1, 2))
    assert small.buckets == large.buckets == 8
    seen_small, seen_large = [], []
    for step in range(128):
        b2, b4 = small.next(2), large.next(4)
        seen_small += b2
        seen_large += b4
        # both adapters' rows at this step come from the same length bucket
        assert {bucket_of[i] for i in b2} == {bucket_of[i] for i in b4} == {step % 8}
    assert sorted(seen_large) == list(range(512))  # a whole epoch, each row once
    seen_small += sum((small.next(2) for _ in range(128)), [])
    assert sorted(seen_small) == list(range(512))

    # seeded, and a resumed stream goes on as the uninterrupted one
    a = AdapterStream(512, seed=5, lengths=lengths, buckets=8)
    b = AdapterStream(512, seed=5, lengths=lengths, buckets=8)
    for _ in range(150):
        a.next(4)
    state = a.state_dict()
    c = AdapterStream(512, seed=5, lengths=lengths, buckets=8)
    c.load_state_dict(state)
    for _ in range(150):
        b.next(4)
    assert [c.next(4) for _ in range(20)] == [a.next(4) for _ in range(20)] == [b.next(4) for _ in range(20)]
    with pytest.raises(DataError, match="length buckets"):
        AdapterStream(512, seed=5).load_state_dict(state)
    assert AdapterStream(512, seed=5, lengths=lengths, buckets=1).buckets == 1  # a plain shuffle


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
