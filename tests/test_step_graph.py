"""Steps replayed from CUDA graphs: when they are used, how batches are padded for them,
and (on a GPU) that a job trained from graphs equals the same job trained eagerly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import job_config
from plora.data.dataset import Sample, collate
from plora.train.packed_lora import PackedLoRARecipe
from plora.train.step_graph import WIDTH_MULTIPLE, padded_width
from plora.job.step_settings import CUDA_GRAPHS_ENV, graphs_wanted

CUDA = torch.device("cuda")


def test_graphs_are_for_one_cuda_device_without_recomputation(monkeypatch):
    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    assert not graphs_wanted("auto", torch.device("cpu"), tp=False, activation_checkpointing=False)
    assert not graphs_wanted("on", torch.device("cpu"), tp=False, activation_checkpointing=False)
    assert graphs_wanted(None, CUDA, tp=False, activation_checkpointing=False)
    assert not graphs_wanted("auto", CUDA, tp=True, activation_checkpointing=False)
    assert not graphs_wanted("auto", CUDA, tp=False, activation_checkpointing=True)
    assert not graphs_wanted("off", CUDA, tp=False, activation_checkpointing=False)
    monkeypatch.setenv(CUDA_GRAPHS_ENV, "0")
    assert not graphs_wanted("on", CUDA, tp=False, activation_checkpointing=False)


def test_a_bad_setting_names_the_field(monkeypatch):
    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    with pytest.raises(ValueError, match="cuda_graphs"):
        graphs_wanted("sometimes", CUDA, tp=False, activation_checkpointing=False)


def test_widths_fall_on_a_few_values_never_past_the_longest_allowed():
    assert padded_width(1, 512) == WIDTH_MULTIPLE
    assert padded_width(WIDTH_MULTIPLE, 512) == WIDTH_MULTIPLE
    assert padded_width(WIDTH_MULTIPLE + 1, 512) == 2 * WIDTH_MULTIPLE
    assert padded_width(500, 512) == 512
    assert padded_width(40, 48) == 48
    assert padded_width(60, 40) == 60  # never narrower than the batch

    # a padded batch takes the narrowest held graph it fits, or a width of its own
    from plora.data.dataset import Sample
    from plora.train.packed.step_batch import build_step_batch

    def rows(*lengths):
        return [Sample(list(range(1, n + 1)), [-100] * (n - 2) + [5, 6]) for n in lengths]

    a = build_step_batch(rows(100, 30), [1, 1], 0, flat=False, fixed=True, max_width=512)
    b = build_step_batch(rows(300, 30), [1, 1], 0, flat=False, fixed=True, held=[a.shape], max_width=512)
    assert a.shape[1] == 128 and b.shape[1] == 320
    c = build_step_batch(rows(20, 60), [1, 1], 0, flat=False, fixed=True, held=[b.shape, a.shape], max_width=512)
    assert c.shape == a.shape  # fits both: the narrower
    d = build_step_batch(rows(200, 60), [1, 1], 0, flat=False, fixed=True, held=[b.shape, a.shape], max_width=512)
    assert d.shape == b.shape


def test_collate_pads_to_a_given_width_and_refuses_a_short_one():
    samples = [Sample([5, 6, 7], [-100, 6, 7]), Sample([8, 9], [-100, 9])]
    tokens, labels = collate(samples, pad_id=0, width=6)
    assert tokens.shape == labels.shape == (2, 6)
    assert tokens[1].tolist() == [8, 9, 0, 0, 0, 0] and labels[1].tolist() == [-100, 9, -100, -100, -100, -100]
    with pytest.raises(ValueError, match="width 2"):
        collate(samples, pad_id=0, width=2)


ADAPTERS = [
    dict(id="a", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=2, seed=1, steps=9),
    dict(id="b", rank=16, alpha=16.0, learning_rate=1e-3, batch_size=3, seed=2, steps=6),
    dict(id="c", rank=40, alpha=40.0, learning_rate=2e-3, batch_size=1, seed=3, steps=12),
]


def _losses(job_dir) -> dict[tuple[str, int], float]:
    import json

    rows = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    return {(r["adapter"], r["adapter_step"]): r["loss"] for r in rows if "loss" in r}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replayed_job_equals_the_eager_job(tiny_model, reverse_data, tmp_path, monkeypatch):
    """Adapters finish at different steps: the pack's graph is captured once, and the
    compositions left after b and then a leave replay it with their vacant slots padded
    (3 steps each, wasting less than a capture would cost).

    The kernels' float32 atomics make two GPU runs differ in the last bits even in one
    mode, and AdamW's first steps turn a near-zero gradient's noise into a full ±lr move
    of that element: so the check is the loss of every adapter at every step (a stale or
    misplaced input would change those at once) and the weights in the mean."""
    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    # a new key's first step eager and no side lane: what this test is about (the graph
    # covering the packs that drain); the defaults are `test_the_side_lane_job_equals_the_eager_job`'s
    monkeypatch.setenv("PLORA_CAPTURE_FIRST", "0")
    monkeypatch.setenv("PLORA_OVERLAP", "0")
    weights, recipes, losses = {}, {}, {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        cfg = job_config(tiny_model, reverse_data, out, ADAPTERS, device="cuda")
        cfg["training"] = dict(cfg["training"], cuda_graphs=mode, length_buckets=1)  # one order in both modes
        recipe = PackedLoRARecipe(cfg)
        summary = recipe.run()
        assert set(summary["adapters"].values()) == {"done"}
        recipes[mode] = recipe
        losses[mode] = _losses(recipe.job_dir)
        weights[mode] = {a["id"]: load_file(str(out / "adapters" / a["id"] / "adapter_model.safetensors"))
                         for a in ADAPTERS}
    graphs = recipes["on"].graphs
    assert recipes["off"].graphs is None
    assert graphs is not None and graphs.enabled and graphs.captures == 1
    assert graphs.replays == 12 - 1 and graphs.counts.covered_steps == 6  # only the first step ran eagerly
    assert losses["on"].keys() == losses["off"].keys() and len(losses["on"]) == sum(a["steps"] for a in ADAPTERS)
    for key, value in losses["off"].items():
        assert losses["on"][key] == pytest.approx(value, rel=1e-4), key
    for a in ADAPTERS:
        for name, t in weights["off"][a["id"]].items():
            diff = (t - weights["on"][a["id"]][name]).abs()
            assert float(diff.mean()) <= 1e-3 * float(t.abs().mean()) + 1e-7, (a["id"], name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_length_buckets_replay_a_graph_per_width_from_one_pool(tiny_model, tmp_path, monkeypatch):
    """Padded rows of 5-240 tokens drawn from 4 length buckets: each composition replays one
    graph per width (sharing one memory pool), and the job equals the eager one."""
    import json
    import random

    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    rng = random.Random(3)
    rows = []
    for _ in range(120):
        s = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 118)))
        rows.append({"input": s + ">", "output": s[::-1]})
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:100]))
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[100:]))
    data = {"train": tmp_path / "train.jsonl", "eval": tmp_path / "eval.jsonl"}
    adapters = [dict(a, steps=n) for a, n in zip(ADAPTERS, (16, 12, 24))]
    recipes, losses = {}, {}
    for mode in ("off", "on"):
        cfg = job_config(tiny_model, data, tmp_path / mode, adapters, device="cuda")
        cfg["model"] = dict(cfg["model"], max_seq_len=256)
        cfg["training"] = dict(cfg["training"], cuda_graphs=mode, row_layout="padded", length_buckets=4)
        recipes[mode] = PackedLoRARecipe(cfg)
        assert set(recipes[mode].run()["adapters"].values()) == {"done"}
        losses[mode] = _losses(recipes[mode].job_dir)
    graphs = recipes["on"].graphs
    assert graphs is not None and graphs.enabled and graphs.replays > 0
    assert 2 <= graphs.captures <= 3 * 4 + 3  # a few widths per composition, not one per step
    assert graphs.replays + graphs.counts.eager_steps == 24
    for key, value in losses["off"].items():
        assert losses["on"][key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_refilled_slot_replays_the_packs_graph_and_reads_its_new_scale(tiny_model, reverse_data, tmp_path,
                                                                         monkeypatch):
    """c is pruned after step 3 and e (c's rank and batch size, another alpha) takes its
    slot: the pack replays the graph captured before, e's scale read from the segment
    metadata written in place, and every loss equals the eager job's."""
    from plora.train import hooks
    from plora.job.config import JobAdapter
    from plora.job.control import request

    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    monkeypatch.setenv("PLORA_CAPTURE_FIRST", "0")  # the counts below are those of an eager first step
    a = dict(id="a", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=2, seed=21, steps=6, warmup_steps=2)
    c = dict(id="c", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=2, seed=22, steps=12, warmup_steps=2)
    e = dict(id="e", rank=4, alpha=2.0, learning_rate=2e-3, batch_size=2, seed=24, steps=5, warmup_steps=1)

    def swap(recipe, step):
        if step == 3:
            request(recipe.job_dir, prune=["c"], join=[JobAdapter(**e)])

    recipes, losses = {}, {}
    for mode in ("off", "on"):
        cfg = job_config(tiny_model, reverse_data, tmp_path / mode, [a, c], device="cuda")
        cfg["training"] = dict(cfg["training"], cuda_graphs=mode, length_buckets=1)
        recipes[mode] = PackedLoRARecipe(cfg)
        with hooks.installed("after_step", swap):
            summary = recipes[mode].run()
        assert summary["adapters"] == {"a": "done", "c": "pruned", "e": "done"} and summary["joined"] == {"e": 4}
        losses[mode] = _losses(recipes[mode].job_dir)
    graphs = recipes["on"].graphs
    assert graphs.enabled and graphs.captures == 1 and graphs.counts.eager_steps == 1
    assert graphs.counts.releases == 0  # the evals after a and c left kept the graph
    assert losses["on"].keys() == losses["off"].keys()
    for key, value in losses["off"].items():
        assert losses["on"][key] == pytest.approx(value, rel=1e-4), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_side_lane_job_equals_the_eager_job(tiny_model, reverse_data, tmp_path, monkeypatch):
    """With the defaults (a key captured at its first step, the side lane on): (a, c) is
    captured ahead on the lane while (a, b, c) replays; c alone, 3 steps, replays (a, c)'s
    graph with a's slot vacant (cheaper than a capture of its own); every step replays, the
    leaving adapters are scored on the lane's stream; every loss and every eval score equals
    the eager job's. (Measured on an H200.)"""
    import json

    monkeypatch.delenv(CUDA_GRAPHS_ENV, raising=False)
    monkeypatch.delenv("PLORA_CAPTURE_FIRST", raising=False)
    monkeypatch.delenv("PLORA_OVERLAP", raising=False)
    recipes, losses, scores = {}, {}, {}
    for mode in ("off", "on"):
        out = tmp_path / mode
        cfg = job_config(tiny_model, reverse_data, out, ADAPTERS, device="cuda")
        cfg["training"] = dict(cfg["training"], cuda_graphs=mode, length_buckets=1)
        recipes[mode] = PackedLoRARecipe(cfg)
        summary = recipes[mode].run()
        assert set(summary["adapters"].values()) == {"done"}
        losses[mode] = _losses(recipes[mode].job_dir)
        scores[mode] = {a["id"]: json.loads((out / "adapters" / a["id"] / "metrics.json").read_text())["eval_loss"]
                        for a in ADAPTERS}
    assert recipes["off"].lane is None
    counts = recipes["on"].graphs.counts
    assert counts.ahead == 1 and counts.captures == 2 and counts.eager_steps == 0 and counts.covered_steps == 3
    assert counts.replays == 12
    assert losses["on"].keys() == losses["off"].keys()
    for key, value in losses["off"].items():
        assert losses["on"][key] == pytest.approx(value, rel=1e-4), key
    for k, value in scores["off"].items():
        assert scores["on"][k] == pytest.approx(value, rel=1e-3), k


def test_rows_are_priced_as_the_layout_lays_them_out():
    from plora.data.row_layout import priced_row_tokens, rows_flattened

    assert rows_flattened("auto", graphed=False) and rows_flattened("flat", graphed=True)
    assert not rows_flattened("auto", graphed=True) and not rows_flattened("padded", graphed=False)
    # flattened: a row costs its real tokens; padded: the width its step pads to
    lengths = [66, 100, 200, 250, 300, 438]
    assert priced_row_tokens("auto", graphed=False, lengths=lengths, max_seq_len=512) == sum(lengths) / 6
    assert priced_row_tokens("auto", graphed=True, lengths=lengths, max_seq_len=512, length_buckets=1) == 448
    assert priced_row_tokens("padded", graphed=False, lengths=[250, 252], max_seq_len=512, length_buckets=1) == 256
    assert priced_row_tokens("auto", graphed=True, lengths=[90, 100], max_seq_len=100, length_buckets=1) == 100
    # in three length buckets: (66, 100) pad to 128, (200, 250) to 256, (300, 438) to 448
    assert priced_row_tokens("auto", graphed=True, lengths=lengths, max_seq_len=512, length_buckets=3) == (
        (128 + 256 + 448) * 2 / 6)
