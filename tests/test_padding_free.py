"""Packed steps without padding, the LM head only where labels are, evals that cannot lose
training.

Rows are flattened into one sequence (each with its own positions and attention), so an
adapter's step runs the same operations on the same shapes whatever its pack-mates: packed
equals alone bit for bit on CPU in float32, even for a configuration that amplifies every
rounding difference (rank 1, alpha 32, lr 2e-2).
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import adapter_weights, job_config
from plora.results import evaluate as ev
from plora.train import hooks
from plora.data.dataset import IGNORE_INDEX, Sample, collate
from plora.train.packed.head_loss import adapter_mean_losses, final_hidden, head_loss_sum
from plora.train.packed.rows import MIN_TOKENS, flatten_rows, held_sizes, padded_label_parts
from plora.train.packed.step_batch import build_step_batch
from plora.train.packed.varlen_attention import install_row_attention, row_attention
from plora.train import evaluator, packed_lora
from plora.train.packed_lora import PackedLoRARecipe

#: padded and flattened rows attend through different SDPA shapes (a row alone, or padded
#: to the widest row), so they round differently; AdamW's first steps turn that noise of a
#: near-zero gradient element into up to ±lr moves. The weights (~0.1) then differ by a few
#: 1e-6 (tests/test_packed.py explains its 2e-6 for the same effect); a real mistake moves
#: them by ~lr (1e-3 and more).
PADDED_ATOL = 1e-5

MIXED = [  # six adapters, batch sizes 1..6, one unstable
    dict(id="unstable", rank=1, alpha=32.0, learning_rate=2e-2, batch_size=5, seed=21, steps=10),
    dict(id="r8", rank=8, alpha=16.0, learning_rate=1e-3, batch_size=3, seed=22, steps=8),
    dict(id="r2", rank=2, alpha=4.0, learning_rate=1e-2, batch_size=1, seed=23, steps=10),
    dict(id="r4", rank=4, alpha=8.0, learning_rate=3e-3, batch_size=4, seed=24, steps=7),
    dict(id="r16", rank=16, alpha=16.0, learning_rate=2e-3, batch_size=2, seed=25, steps=5),
    dict(id="r3", rank=3, alpha=6.0, learning_rate=5e-3, batch_size=6, seed=26, steps=6),
]


@pytest.fixture(scope="module")
def mixed_data(tmp_path_factory) -> dict:
    """String reversal with rows of 3 to 26 tokens."""
    rng = random.Random(1)
    rows = []
    for _ in range(200):
        s = "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 12)))
        rows.append({"input": s + ">", "output": s[::-1]})
    d = tmp_path_factory.mktemp("mixed")
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:180]))
    (d / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[180:]))
    return {"train": d / "train.jsonl", "eval": d / "eval.jsonl"}


def _metrics(out, adapter_id):
    return json.loads((out / "adapters" / adapter_id / "metrics.json").read_text())


@pytest.fixture(scope="module")
def mixed_run(tiny_model, mixed_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed-packed")
    summary = PackedLoRARecipe(job_config(tiny_model, mixed_data, out, MIXED)).run()
    assert set(summary["adapters"].values()) == {"done"}
    return out


# ------------------------------------------------------------------ layout
def test_flatten_rows_positions_targets_and_label_parts():
    a = Sample([1, 5, 6, 2], [IGNORE_INDEX, IGNORE_INDEX, 6, 2])
    b = Sample([1, 7, 2], [IGNORE_INDEX, 7, 2])
    c = Sample([1, 8, 9, 10, 2], [IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX, 10, 2])
    flat = flatten_rows([a, b, c], [2, 1], pad_id=0)
    assert flat.tokens.tolist() == [[1, 5, 6, 2, 1, 7, 2, 1, 8, 9, 10, 2] + [0] * (MIN_TOKENS - 12)]
    assert flat.positions[0, :12].tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4]
    assert flat.row_lengths == [4, 3, 5, MIN_TOKENS - 12]  # the trailing row fills up to MIN_TOKENS
    assert flat.segment_tokens == [7, 5] and flat.real_tokens == 12
    assert flat.cu_seqlens().tolist() == [0, 4, 7, 12, MIN_TOKENS]
    # position p predicts the label at p + 1 of the same row; never across rows
    assert flat.labels.index.tolist() == [1, 2, 4, 5, 9, 10]
    assert flat.labels.targets.tolist() == [6, 2, 7, 2, 10, 2]
    assert flat.labels.sizes == [4, 2] and flat.labels.counts == [4, 2]


def test_fixed_sizes_pad_each_segment_and_label_part_and_only_grow():
    a = Sample([1, 5, 6, 2], [IGNORE_INDEX, IGNORE_INDEX, 6, 2])
    b = Sample([1, 7, 2], [IGNORE_INDEX, 7, 2])
    first = build_step_batch([a, b], [1, 1], 0, flat=True, fixed=True)
    assert first.shape == ("flat", (64, 64), (64, 64))
    assert first.segment_tokens == [64, 64] and first.row_lengths == [4, 60, 3, 61]
    assert first.labels.targets.tolist().count(IGNORE_INDEX) == 128 - 4
    again = build_step_batch([b, a], [1, 1], 0, flat=True, fixed=True, held=first.shape)
    assert again.shape == first.shape  # fits the held graph: same shapes
    assert held_sizes([70, 3], [64, 64]) == [128, 64]
    assert held_sizes([3, 3], [128, 64]) == [128, 64]
    with pytest.raises(ValueError, match="no padding row"):
        flatten_rows([a], [1], 0, segment_sizes=[4])


def test_padded_label_parts_match_the_flattened_ones():
    rows = [Sample([1, 5, 6, 2], [IGNORE_INDEX, 5, 6, 2]), Sample([1, 7, 2], [IGNORE_INDEX, 7, 2])]
    _, labels = collate(rows, pad_id=0)
    parts = padded_label_parts(labels, [1, 1])
    assert parts.index.tolist() == [0, 1, 2, 4, 5] and parts.targets.tolist() == [5, 6, 2, 7, 2]
    assert parts.sizes == [3, 2]


# ------------------------------------------------------------------ model pieces
def _recipe(tiny_model, mixed_data, tmp_path, adapters=MIXED[:3]):
    recipe = PackedLoRARecipe(job_config(tiny_model, mixed_data, tmp_path, adapters))
    recipe.setup()
    return recipe


def test_row_attention_equals_padded_rows_and_each_row_alone(tiny_model, mixed_data, tmp_path):
    recipe = _recipe(tiny_model, mixed_data, tmp_path)
    model, rows = recipe.pm.model, recipe.row_attn
    assert rows is row_attention(model) and install_row_attention(model) is rows
    samples = recipe.train_samples[:5]
    tokens, _ = collate(samples, recipe.tok.pad_id)
    with torch.no_grad():
        padded = final_hidden(model, tokens)
        flat = flatten_rows(samples, [5], recipe.tok.pad_id)
        with rows.rows(flat.row_lengths):
            h = final_hidden(model, flat.tokens, flat.positions)[0]
        start = 0
        for i, s in enumerate(samples):
            n = len(s.tokens)
            torch.testing.assert_close(h[start : start + n], padded[i, :n], rtol=1e-5, atol=1e-5)
            alone = flatten_rows([s], [1], recipe.tok.pad_id)
            with rows.rows(alone.row_lengths):
                h1 = final_hidden(model, alone.tokens, alone.positions)[0]
            assert torch.equal(h1[:n], h[start : start + n])  # whatever the other rows
            start += n
    assert not rows.active


@pytest.mark.parametrize("chunk", [1, 3, 10_000])
def test_chunked_loss_equals_the_full_loss_in_value_and_gradient(tiny_model, mixed_data, tmp_path, chunk):
    recipe = _recipe(tiny_model, mixed_data, tmp_path)
    model = recipe.pm.model
    samples, rows = recipe.train_samples[:6], [2, 1, 3]
    tokens, labels = collate(samples, recipe.tok.pad_id)
    full_h = final_hidden(model, tokens).detach().requires_grad_(True)
    want = ev.per_adapter_loss(model.output(full_h).float(), labels, rows)
    torch.stack(want).sum().backward()
    parts = padded_label_parts(labels, rows)
    h = full_h.detach().clone().requires_grad_(True)
    got = adapter_mean_losses(model.output, h.reshape(-1, h.shape[-1]), parts, chunk)
    torch.stack(got).sum().backward()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h.grad, full_h.grad, rtol=1e-5, atol=1e-7)
    assert float(full_h.grad.abs().max()) > 0
    with torch.no_grad():  # eval: the same sum without the gradient
        s = head_loss_sum(model.output, h.reshape(-1, h.shape[-1])[parts.index[:5]], parts.targets[:5], chunk)
    assert torch.isfinite(s)


@pytest.mark.parametrize("tied", [False, True])
def test_final_hidden_feeds_the_models_own_head(tied):
    """A tied head (torchtune's `TiedLinear`, not a module) and a plain one: the head is
    called as the model would call it, and put back."""
    from torchtune.models.qwen2 import qwen2

    torch.manual_seed(0)
    model = qwen2(vocab_size=50, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, intermediate_dim=32,
                  max_seq_len=32, tie_word_embeddings=tied)
    head = model.output
    rows = install_row_attention(model)
    tokens = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        want = model(tokens)
        h = final_hidden(model, tokens)
        assert model.output is head
        torch.testing.assert_close(head(h).float(), want)
        flat = flatten_rows([Sample(t, t) for t in tokens.tolist()], [1, 1], 0, min_tokens=40)  # > max_seq_len
        with rows.rows(flat.row_lengths):
            hf = final_hidden(model, flat.tokens, flat.positions)[0]
        assert model.max_seq_len == 32
        torch.testing.assert_close(head(hf[7:14]).float(), want[1], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ training
def test_packed_equals_alone_bit_for_bit_with_mixed_lengths(mixed_run, tiny_model, mixed_data, tmp_path):
    for a in (MIXED[0], MIXED[2]):  # the unstable one, and one of batch size 1
        alone = tmp_path / a["id"]
        PackedLoRARecipe(job_config(tiny_model, mixed_data, alone, [a])).run()
        packed_w, alone_w = adapter_weights(mixed_run, a["id"]), adapter_weights(alone, a["id"])
        assert max(float(v.abs().max()) for v in packed_w.values()) > 1e-3  # it trained
        for k in packed_w:
            assert torch.equal(packed_w[k], alone_w[k]), (a["id"], k, float((packed_w[k] - alone_w[k]).abs().max()))
        pm, am = _metrics(mixed_run, a["id"]), _metrics(alone, a["id"])
        assert pm["eval_loss"] == am["eval_loss"] and pm["train_loss"] == am["train_loss"], a["id"]


def test_padding_free_steps_equal_padded_steps(mixed_run, tiny_model, mixed_data, tmp_path, monkeypatch):
    monkeypatch.setattr(packed_lora, "install_row_attention", lambda model: None)
    stable = [a for a in MIXED if a["id"] != "unstable"]
    recipe = PackedLoRARecipe(job_config(tiny_model, mixed_data, tmp_path, stable))
    seen = []
    with hooks.installed("after_step", lambda recipe, step: seen.append(recipe.real_tokens)):
        recipe.run()
    assert recipe.row_attn is None
    for a in stable:
        flat_w, padded_w = adapter_weights(mixed_run, a["id"]), adapter_weights(tmp_path, a["id"])
        diff = max(float((flat_w[k] - padded_w[k]).abs().max()) for k in flat_w)
        assert diff <= PADDED_ATOL, (a["id"], diff)
        assert _metrics(tmp_path, a["id"])["eval_loss"] == pytest.approx(_metrics(mixed_run, a["id"])["eval_loss"],
                                                                         rel=1e-5)
    assert seen and seen == sorted(seen)


def _padded_run(tiny_model, mixed_data, out, adapters, buckets):
    """A padded-rows job; the tokens each step pads its rows to, and the recipe."""
    training = {"scheduler": "cosine", "grad_clip": 1.0, "weight_decay": 0.01, "row_layout": "padded",
                "length_buckets": buckets}
    recipe = PackedLoRARecipe(job_config(tiny_model, mixed_data, out, adapters, training=training))
    recipe.setup()
    original, padded = recipe.rows.step_batch, []

    def spy(samples, rows, graphed, *rest):
        batch = original(samples, rows, graphed, *rest)
        assert batch.tokens.shape[1] == max(len(s.tokens) for s in samples)  # the step's longest row
        padded.append(batch.tokens.numel())
        return batch

    recipe.rows.step_batch = spy
    try:
        recipe.train()
    finally:
        recipe.cleanup()
    return padded, recipe


def test_length_bucketed_padded_packs_equal_alone(tiny_model, mixed_data, tmp_path):
    """Rows drawn from length buckets (`training.length_buckets`, on by default only in
    CUDA-graph steps): a pack of batch sizes 1-6 pads each step to the longest row of one
    bucket, far less than of the whole data, and each adapter still trains as it does alone
    with the same buckets."""
    stable = [a for a in MIXED if a["id"] != "unstable"]
    bucketed, recipe = _padded_run(tiny_model, mixed_data, tmp_path / "packed", stable, 4)
    assert all(r.stream.buckets == 4 for r in recipe.runs)
    plain, _ = _padded_run(tiny_model, mixed_data, tmp_path / "plain", stable, 1)
    assert len(plain) == len(bucketed) and sum(bucketed) < 0.8 * sum(plain)
    for a in (stable[0], stable[1]):  # batch sizes 3 and 1
        alone = tmp_path / a["id"]
        _padded_run(tiny_model, mixed_data, alone, [a], 4)
        packed_w, alone_w = adapter_weights(tmp_path / "packed", a["id"]), adapter_weights(alone, a["id"])
        diff = max(float((packed_w[k] - alone_w[k]).abs().max()) for k in packed_w)
        assert diff <= PADDED_ATOL, (a["id"], diff)


# ------------------------------------------------------------------ eval
def test_eval_pieces_follow_the_budget():
    assert ev.split_pieces([5, 5, 5, 5], max_tokens=10, max_rows=100) == [(0, 2), (2, 4)]
    assert ev.split_pieces([5, 50, 5], max_tokens=10, max_rows=100) == [(0, 1), (1, 2), (2, 3)]
    assert ev.split_pieces([1] * 5, max_tokens=100, max_rows=2) == [(0, 2), (2, 4), (4, 5)]
    assert ev._groups(16, piece_tokens=100, piece_rows=10, budget=450, batch_rows=1000) == 4
    assert ev._groups(16, piece_tokens=1000, piece_rows=10, budget=450, batch_rows=1000) == 1


def _oom_when(monkeypatch, too_big):
    """Eval forwards whose (adapters, rows) ``too_big`` says run out of memory, as on a GPU."""
    real = ev.eval_loss_piece
    calls = []

    def piece(pm, adapters, samples, *a, **k):
        calls.append((len(adapters), len(samples)))
        if too_big(len(adapters), len(samples)):
            raise torch.OutOfMemoryError("injected out-of-memory")
        return real(pm, adapters, samples, *a, **k)

    monkeypatch.setattr(ev, "eval_loss_piece", piece)
    return calls


EVAL_ADAPTERS = [dict(a, steps=3) for a in MIXED[1:5]]


@pytest.fixture(scope="module")
def eval_run(tiny_model, mixed_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("eval-ref")
    PackedLoRARecipe(job_config(tiny_model, mixed_data, out, EVAL_ADAPTERS)).run()
    return out


def test_eval_out_of_memory_retries_with_fewer_adapters_and_loses_none(eval_run, tiny_model, mixed_data, tmp_path,
                                                                       monkeypatch):
    calls = _oom_when(monkeypatch, lambda adapters, rows: adapters > 1)
    summary = PackedLoRARecipe(job_config(tiny_model, mixed_data, tmp_path, EVAL_ADAPTERS)).run()
    assert set(summary["adapters"].values()) == {"done"}
    assert any(n > 1 for n, _ in calls) and any(n == 1 for n, _ in calls)  # it ran out, and retried
    for a in EVAL_ADAPTERS:
        got, want = _metrics(tmp_path, a["id"]), _metrics(eval_run, a["id"])
        assert got["status"] == "done" and got["eval_loss"] == want["eval_loss"], a["id"]  # the same sums
        for k, v in adapter_weights(eval_run, a["id"]).items():
            assert torch.equal(adapter_weights(tmp_path, a["id"])[k], v)


def test_eval_out_of_memory_retries_down_to_single_rows(eval_run, tiny_model, mixed_data, tmp_path, monkeypatch):
    calls = _oom_when(monkeypatch, lambda adapters, rows: adapters * rows > 1)
    summary = PackedLoRARecipe(job_config(tiny_model, mixed_data, tmp_path, EVAL_ADAPTERS)).run()
    assert set(summary["adapters"].values()) == {"done"}
    assert (1, 1) in calls
    for a in EVAL_ADAPTERS:  # smaller pieces: the same tokens summed in another order
        assert _metrics(tmp_path, a["id"])["eval_loss"] == pytest.approx(_metrics(eval_run, a["id"])["eval_loss"],
                                                                         rel=1e-5)


def test_an_eval_that_cannot_fit_one_row_still_leaves_the_weights(tiny_model, mixed_data, tmp_path, monkeypatch):
    _oom_when(monkeypatch, lambda adapters, rows: True)
    with pytest.raises(torch.OutOfMemoryError):
        PackedLoRARecipe(job_config(tiny_model, mixed_data, tmp_path, EVAL_ADAPTERS[:2])).run()
    # the first adapter to finish was saved before its eval ran out of memory
    first = min(EVAL_ADAPTERS[:2], key=lambda a: a["steps"])
    assert (tmp_path / "adapters" / first["id"] / "adapter_model.safetensors").is_file()


def test_weights_are_copied_before_the_eval_and_written_before_their_result(tiny_model, mixed_data, tmp_path,
                                                                           monkeypatch):
    """A leaving group's weights are copied to the host before its eval runs and written
    while it runs (`AdapterWriter`): what the pack's weights become meanwhile (here the
    eval zeroes them, as a refilled slot would) does not reach the files, and no adapter's
    metrics.json is there before its weights."""
    results_seen = []
    adapters = [dict(a, steps=2) for a in MIXED[1:3]]

    def evaluate(pm, indices, *a, **k):
        for idx in indices:
            results_seen.append((tmp_path / "adapters" / adapters[idx]["id"] / "metrics.json").is_file())
        with torch.no_grad():
            for layer in pm.layers.values():
                layer.a_all.zero_()
                layer.bt_all.zero_()
        return [{"eval_loss": 1.0} for _ in indices]

    monkeypatch.setattr(evaluator, "evaluate_adapters", evaluate)
    PackedLoRARecipe(job_config(tiny_model, mixed_data, tmp_path, adapters)).run()
    assert results_seen == [False, False]
    for a in adapters:
        folder = tmp_path / "adapters" / a["id"]
        weights = adapter_weights(tmp_path, a["id"])
        assert all(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_A" in k)  # the copy, not the zeros
        assert any(float(v.abs().max()) > 0 for k, v in weights.items() if "lora_B" in k)  # trained 2 steps
        assert (folder / "metrics.json").stat().st_mtime_ns >= (folder / "adapter_model.safetensors").stat().st_mtime_ns


def test_generation_flattened_equals_padded(tiny_model, mixed_data, tmp_path):
    recipe = _recipe(tiny_model, mixed_data, tmp_path)
    recipe.pm.model.eval()
    prompts = [recipe.tok.prompt_ids(ex["input"]) for ex in recipe.eval_examples[:4]]
    args = (recipe.tok, 6, 64, torch.device("cpu"))
    with torch.no_grad():
        flat = ev.greedy_generate(recipe.pm, prompts * 2, [0, 2], 4, *args)
        rows = recipe.pm.model._plora_row_attention
        del recipe.pm.model._plora_row_attention  # no row attention: padded rows
        try:
            padded = ev.greedy_generate(recipe.pm, prompts * 2, [0, 2], 4, *args)
        finally:
            recipe.pm.model._plora_row_attention = rows
    assert flat == padded and any(flat)


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_kernel_equals_per_row_attention_on_gpu():
    from plora.train.packed.varlen_attention import RowAttention, _per_row, _RowAttentionCall

    if not RowAttention.graph_safe(torch.device("cuda"), torch.bfloat16):
        pytest.skip("this torch has no varlen attention kernel")
    lengths = [5, 17, 3, 40, 1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 4, sum(lengths), 64, device="cuda", generator=gen, dtype=torch.bfloat16)
               for _ in range(3))
    state = RowAttention()
    call = _RowAttentionCall(state, original=None)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device="cuda")
    with state.rows(lengths, cu, max(lengths)):
        got = call(q, k, v).float()
    want = _per_row(q.float(), k.float(), v.float(), lengths, 0.0)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["flat", "balanced"])
def test_graph_replayed_flattened_steps_equal_eager_ones_in_bf16(tiny_model, mixed_data, tmp_path, layout):
    """Rows of varied length in bf16: flattened, through the varlen kernel, replayed from
    CUDA graphs whose segment sizes only grow (balanced: sized once for every step, one
    capture a pack composition); the losses follow the eager run's."""
    adapters = [dict(a, learning_rate=1e-3) for a in MIXED[1:4]]
    losses = {}
    for mode in ("off", "on"):
        cfg = job_config(tiny_model, mixed_data, tmp_path / mode, adapters, device="cuda")
        cfg["model"] = dict(cfg["model"], dtype="bfloat16")
        # one data order in both modes: "auto" length buckets are on only in graph steps
        cfg["training"] = dict(cfg["training"], cuda_graphs=mode, length_buckets=1, row_layout=layout)
        recipe = PackedLoRARecipe(cfg)
        assert set(recipe.run()["adapters"].values()) == {"done"}
        rows = [json.loads(line) for line in (recipe.job_dir / "metrics.jsonl").read_text().splitlines()]
        losses[mode] = {(r["adapter"], r["adapter_step"]): r["loss"] for r in rows if "loss" in r}
        if mode == "on":
            assert recipe.graphs is not None and recipe.graphs.replays > 0
            if layout == "balanced":  # one shape a composition: its first step eager, then one capture
                compositions = len(recipe.clock.phases)
                assert recipe.graphs.captures <= compositions, (recipe.graphs.captures, compositions)
    assert losses["on"].keys() == losses["off"].keys()
    for key, value in losses["off"].items():
        assert losses["on"][key] == pytest.approx(value, rel=5e-2, abs=5e-2), key


def test_row_layout_setting_chooses_flat_or_padded_rows(tiny_model, mixed_data, tmp_path):
    """``training.row_layout``: auto is flat outside graph-replayed steps, padded inside them;
    padded and flat force their layout."""
    recipe = _recipe(tiny_model, mixed_data, tmp_path)
    samples, rows = recipe.train_samples[:3], [1, 1, 1]
    assert recipe.rows.step_batch(samples, rows, graphed=False).flat
    recipe.rows.row_layout = "padded"
    assert not recipe.rows.step_batch(samples, rows, graphed=False).flat
    recipe.rows.row_layout = "flat"
    assert recipe.rows.step_batch(samples, rows, graphed=False).flat
