"""How many length buckets a sweep's graphed jobs draw their rows from (`auto_length_buckets`)."""

from __future__ import annotations

import random

from conftest import tiny_space_file
from plora.data.row_layout import AUTO_LENGTH_BUCKETS, auto_length_buckets, bucketed_row_tokens


def _varied(n: int = 512, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(16, 388) + 50 for _ in range(n)]


def test_rows_of_one_length_need_no_buckets():
    assert auto_length_buckets([250] * 512, 512, steps=256, compositions=2) == 1


def test_varied_rows_are_bucketed_and_the_count_costs_least():
    lengths = _varied()
    b = auto_length_buckets(lengths, 512, steps=256, compositions=2)
    assert 1 < b <= AUTO_LENGTH_BUCKETS
    cost = lambda k: (256 + 4.0 * k * 2) * bucketed_row_tokens(lengths, k, 512)  # noqa: E731
    assert all(cost(b) <= cost(k) for k in range(1, AUTO_LENGTH_BUCKETS + 1))


def test_each_shape_costs_captures_so_short_jobs_take_fewer_buckets():
    lengths = _varied()
    short = auto_length_buckets(lengths, 512, steps=8, compositions=4)
    long = auto_length_buckets(lengths, 512, steps=5000, compositions=1)
    assert short < long


def test_a_sweep_resolves_auto_once_for_every_job(tmp_path):
    from plora.cost.sweep_rows import sweep_length_buckets
    from plora.spec.loading import load_spec

    spec = load_spec(tiny_space_file(
        tmp_path, name="b", num_train=16, lora=None,
        space={"strategy": "list", "configs": [{"rank": 2, "alpha": 4, "learning_rate": 1e-2, "batch_size": 4}]}))
    assert sweep_length_buckets(spec, {"a": 4}, graphed=False) == "auto"  # eager jobs: a plain shuffle
    resolved = sweep_length_buckets(spec, {"a": 400, "b": 200}, graphed=True)
    assert isinstance(resolved, int) and 1 <= resolved <= AUTO_LENGTH_BUCKETS
