"""Rows of varied length in batches of nearly equal tokens (`plora.data.balanced_stream`): every row
once an epoch, an order of the adapter's own, one step shape for all of an adapter's steps,
packed still equal to alone."""

from __future__ import annotations

import random
import statistics

import pytest
import torch

from conftest import adapter_weights, job_config
from plora.data.balanced_stream import BalancedStream, balanced_batches
from plora.data.dataset import AdapterStream, Sample
from plora.train.packed.step_batch import build_step_batch
from plora.train.packed_lora import PackedLoRARecipe
from plora.data.row_layout import bucketed_row_tokens, rows_flattened

_RNG = random.Random(3)
LENGTHS = [_RNG.randint(66, 440) for _ in range(512)]


def test_batches_have_nearly_equal_tokens_and_every_row_once():
    rows = list(range(40))
    batches = balanced_batches(rows, LENGTHS, 4)
    assert sorted(i for b in batches for i in b) == rows and all(len(b) == 4 for b in batches)
    sums = [sum(LENGTHS[i] for i in b) for b in batches]
    assert max(sums) - min(sums) <= max(LENGTHS[:40])  # a random split is far wider
    short = balanced_batches(list(range(10)), LENGTHS, 4)
    assert [len(b) for b in short].count(2) == 1 and sorted(i for b in short for i in b) == list(range(10))


@pytest.mark.parametrize("bs", [2, 4, 8])
def test_a_stream_sees_every_row_each_epoch_in_balanced_batches(bs):
    stream = BalancedStream(len(LENGTHS), seed=7, lengths=LENGTHS, batch_size=bs)
    steps = len(LENGTHS) // bs
    epoch = [stream.next(bs) for _ in range(steps)]
    assert all(len(b) == bs for b in epoch)
    assert sorted(i for b in epoch for i in b) == list(range(len(LENGTHS)))  # each row once
    sums = [sum(LENGTHS[i] for i in b) for b in epoch]
    mean = statistics.fmean(sums)
    plain = AdapterStream(len(LENGTHS), seed=7)
    random_sums = [sum(LENGTHS[i] for i in plain.next(bs)) for _ in range(steps)]
    assert max(sums) <= 1.08 * mean < max(random_sums)
    # a segment sized for the largest batch wastes a few percent, not what padding does
    assert max(sums) / mean < bucketed_row_tokens(LENGTHS, 8, 512) / statistics.fmean(LENGTHS)


def test_a_small_set_still_sees_every_row_once_an_epoch():
    """Fewer rows than a group: groups end with their epoch."""
    lengths = LENGTHS[:100]
    stream = BalancedStream(len(lengths), seed=2, lengths=lengths, batch_size=4)
    for _ in range(3):
        epoch = [i for _ in range(25) for i in stream.next(4)]
        assert sorted(epoch) == list(range(100))
    odd = BalancedStream(10, seed=2, lengths=lengths[:10], batch_size=4)  # 10 rows, batches of 4
    seen = [i for _ in range(5) for i in odd.next(4)]  # two epochs: a batch crosses each boundary
    assert sorted(seen) == sorted(list(range(10)) * 2)


@pytest.mark.parametrize("bs", [2, 4])
def test_later_epochs_are_balanced_as_the_first(bs):
    """An epoch that ends on a batch boundary starts the next with a whole group, not a lone
    batch of two random rows (which set every later segment's size, and priced balanced
    batches out of the sweeps they suit)."""
    stream = BalancedStream(len(LENGTHS), seed=7, lengths=LENGTHS, batch_size=bs)
    steps = len(LENGTHS) // bs
    sums = [sum(LENGTHS[i] for i in stream.next(bs)) for _ in range(3 * steps)]
    mean = statistics.fmean(sums)
    assert max(sums) <= 1.08 * mean
    epochs = [sums[e * steps:(e + 1) * steps] for e in range(3)]
    assert max(max(e) for e in epochs[1:]) <= 1.08 * statistics.fmean(epochs[0])


def test_the_order_is_the_adapters_own_and_resumes_mid_group():
    a = BalancedStream(len(LENGTHS), seed=5, lengths=LENGTHS, batch_size=4)
    b = BalancedStream(len(LENGTHS), seed=5, lengths=LENGTHS, batch_size=4)
    other = BalancedStream(len(LENGTHS), seed=6, lengths=LENGTHS, batch_size=4)
    first = [a.next(4) for _ in range(70)]
    assert first == [b.next(4) for _ in range(70)] and first != [other.next(4) for _ in range(70)]
    state = a.state_dict()
    ahead = a.max_batch_tokens(300)
    after = [a.next(4) for _ in range(300)]
    assert ahead == max(sum(LENGTHS[i] for i in batch) for batch in after)
    resumed = BalancedStream(len(LENGTHS), seed=5, lengths=LENGTHS, batch_size=4)
    resumed.load_state_dict(state)
    assert [resumed.next(4) for _ in range(300)] == after
    with pytest.raises(ValueError, match="asked for 3 rows"):
        a.next(3)


def test_one_step_shape_holds_every_batch_of_a_balanced_pack():
    """With each adapter's largest batch to come as floors, every step of the pack takes the
    same flattened shape: one capture a composition."""
    samples = [Sample(list(range(n)), [-100] * (n - 8) + list(range(8))) for n in LENGTHS]
    streams = [BalancedStream(len(samples), seed=s, lengths=LENGTHS, batch_size=bs) for s, bs in ((1, 2), (2, 4), (3, 2))]
    steps = 60
    label_counts = [sum(1 for t in s.labels[1:] if t != -100) for s in samples]
    floors = ([st.max_batch_tokens(steps) for st in streams], [st.max_batch_tokens(steps, label_counts) for st in streams])
    shapes, real, stepped = set(), 0, 0
    held = ()
    for _ in range(steps):
        rows = [st.next(st.batch_size) for st in streams]
        batch = build_step_batch([samples[i] for r in rows for i in r], [len(r) for r in rows], 0, flat=True,
                                 fixed=True, held=held, max_width=512, floors=floors)
        shapes.add(batch.shape)
        held = (batch.shape,)
        real += batch.real_tokens
        stepped += batch.num_tokens
    assert len(shapes) == 1
    assert stepped / real < 1.08


def test_balanced_rows_are_flattened_everywhere():
    assert rows_flattened("balanced", graphed=True) and rows_flattened("balanced", graphed=False)
    assert not rows_flattened("auto", graphed=True)


BALANCED = [  # batch sizes 1..4, one unstable: each trains as it would alone
    dict(id="unstable", rank=1, alpha=32.0, learning_rate=2e-2, batch_size=3, seed=31, steps=8),
    dict(id="r8", rank=8, alpha=16.0, learning_rate=1e-3, batch_size=2, seed=32, steps=9),
    dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=1, seed=33, steps=7),
    dict(id="r4", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=4, seed=34, steps=6),
]


def test_balanced_packs_equal_alone_bit_for_bit(tiny_model, reverse_data, tmp_path):
    training = {"scheduler": "cosine", "grad_clip": 1.0, "weight_decay": 0.01, "row_layout": "balanced"}
    packed = PackedLoRARecipe(job_config(tiny_model, reverse_data, tmp_path / "packed", BALANCED, training=training))
    summary = packed.run()
    assert set(summary["adapters"].values()) <= {"done", "diverged"}
    assert all(isinstance(r.stream, BalancedStream) for r in packed.runs)
    for a in (BALANCED[0], BALANCED[3]):
        alone = tmp_path / a["id"]
        PackedLoRARecipe(job_config(tiny_model, reverse_data, alone, [a], training=training)).run()
        pw, aw = adapter_weights(tmp_path / "packed", a["id"]), adapter_weights(alone, a["id"])
        assert max(float(v.abs().max()) for v in pw.values()) > 1e-3
        for k in pw:
            assert torch.equal(pw[k], aw[k]), (a["id"], k)


def test_a_graphed_sweep_of_varied_rows_resolves_to_balanced_and_prices_it():
    from types import SimpleNamespace

    from plora.data.balanced_stream import balanced_row_tokens
    from plora.cost.sweep_rows import sweep_row_layout
    from plora.data.row_layout import priced_row_tokens

    spec = SimpleNamespace(training=SimpleNamespace(row_layout="auto"), model=SimpleNamespace(max_seq_len=512))
    assert sweep_row_layout(spec, graphed=True, lengths=LENGTHS) == "balanced"
    # the benchmark's sweep: batch sizes 2 and 4, every adapter one epoch or more
    assert sweep_row_layout(spec, graphed=True, lengths=LENGTHS, batch_sizes=[2, 4] * 8) == "balanced"
    assert sweep_row_layout(spec, graphed=True, lengths=[250, 251, 252] * 50) == "auto"  # fixed rows: padded
    assert sweep_row_layout(spec, graphed=False, lengths=LENGTHS) == "auto"  # eager steps: flat already
    # batch size 1 balances nothing (each step holds an adapter's longest row): padded buckets win
    assert sweep_row_layout(spec, graphed=True, lengths=LENGTHS, batch_sizes=[1, 1]) == "auto"
    mean = statistics.fmean(LENGTHS)
    price = balanced_row_tokens(LENGTHS)
    assert mean < price < 1.15 * mean
    assert price < priced_row_tokens("auto", graphed=True, lengths=LENGTHS, max_seq_len=512, length_buckets=8)


def _dealt_by_scanning(rows, lengths, batch_size):
    """The deal as first written: each row, longest first, into the emptiest batch with room
    (ties: the first), found by looking at every batch."""
    n = len(rows)
    k = -(-n // batch_size)
    room = [batch_size] * k
    if n % batch_size:
        room[-1] = n % batch_size
    batches, totals = [[] for _ in range(k)], [0] * k
    for i in sorted(rows, key=lambda r: (-int(lengths[r]), r)):
        j = min((b for b in range(k) if len(batches[b]) < room[b]), key=lambda b: (totals[b], b))
        batches[j].append(int(i))
        totals[j] += int(lengths[i])
    return batches


def test_the_heap_deals_the_batches_the_scan_dealt():
    """The deal keeps its batches on a heap now; every batch is the one the scan made (rows
    with equal lengths included: ties go to the first batch, as before)."""
    import random

    from plora.data.balanced_stream import balanced_batches

    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 300)
        lengths = [rng.choice([rng.randint(1, 400), 16, 32]) for _ in range(n + 5)]
        rows = rng.sample(range(n + 5), n)
        b = rng.choice([1, 2, 3, 4, 7, 8, 16])
        assert balanced_batches(rows, lengths, b) == _dealt_by_scanning(rows, lengths, b)
