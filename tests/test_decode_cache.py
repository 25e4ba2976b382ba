"""Greedy generation through a decode cache: each row's prompt runs once, each new token
alone; the answers are those of re-running every row in full at each new token."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from conftest import job_config
from plora.results import evaluate as ev
from plora.results import generate as gen
from plora.train.packed.decode_cache import DecodeCache
from plora.train.packed.varlen_attention import RowAttention, _RowAttentionCall
from plora.train.packed_lora import PackedLoRARecipe

ADAPTERS = [
    {"id": "a0", "rank": 4, "alpha": 8.0, "learning_rate": 5e-3, "batch_size": 2, "steps": 6, "seed": 0},
    {"id": "a1", "rank": 8, "alpha": 16.0, "learning_rate": 1e-2, "batch_size": 2, "steps": 6, "seed": 1},
]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    rng = random.Random(3)
    rows = []
    for _ in range(80):
        s = "".join(rng.choice("abcdef") for _ in range(rng.randint(2, 14)))
        rows.append({"input": s + ">", "output": s[::-1][: rng.randint(1, 6)]})
    d = tmp_path_factory.mktemp("decode-data")
    (d / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:64]))
    (d / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows[64:]))
    return {"train": d / "train.jsonl", "eval": d / "eval.jsonl"}


@pytest.fixture(scope="module")
def trained(tiny_model, data, tmp_path_factory):
    """A pack of two adapters after a few steps (their B no longer zero), set up for eval."""
    recipe = PackedLoRARecipe(job_config(tiny_model, data, tmp_path_factory.mktemp("decode-run"), ADAPTERS))
    recipe.setup()
    recipe.pm.model.eval()
    with torch.no_grad():
        for layer in recipe.pm.layers.values():  # stand-ins for trained adapters
            layer.bt_all.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(1))
    return recipe


def _full_causal(q, k, v, lengths):
    """Each row's causal attention over its own tokens ([1, H, T, D], GQA heads expanded)."""
    outs, start = [], 0
    for n in lengths:
        sl = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], is_causal=True))
        start += n
    return torch.cat(outs, dim=2)


def test_a_decode_step_attends_as_the_whole_row_would():
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    q_per_kv = heads // kv_heads
    lengths = [3, 7, 1, 5]
    capacity = 9
    full = [n + 2 for n in lengths]  # each row with two new tokens

    def expanded(t):  # what torchtune's attention passes: kv heads repeated q_per_kv times
        return t.unsqueeze(2).expand(1, kv_heads, q_per_kv, t.shape[2], dim).flatten(1, 2)

    q = [torch.randn(1, heads, n, dim) for n in full]
    k = [torch.randn(1, kv_heads, n, dim) for n in full]
    v = [torch.randn(1, kv_heads, n, dim) for n in full]
    want = _full_causal(torch.cat(q, 2), expanded(torch.cat(k, 2)), expanded(torch.cat(v, 2)), full)
    ends = torch.tensor(full).cumsum(0).tolist()

    state = RowAttention()
    call = _RowAttentionCall(state, original=None, q_per_kv=q_per_kv)
    cache = DecodeCache(len(lengths), capacity, torch.device("cpu"))
    state.cache = cache
    cache.prefill(lengths)

    def take(ts, offset, counts):
        return torch.cat([t[:, :, offset[i] : offset[i] + counts[i]] for i, t in enumerate(ts)], dim=2)

    zero = [0] * len(lengths)
    with state.rows(lengths):
        out = call(take(q, zero, lengths), expanded(take(k, zero, lengths)), expanded(take(v, zero, lengths)))
    starts = [e - n for e, n in zip(ends, full)]
    torch.testing.assert_close(out, torch.cat([want[:, :, s : s + n] for s, n in zip(starts, lengths)], 2))
    for step in range(2):
        pos = [n + step for n in lengths]
        cache.decode(torch.tensor(pos))
        one = [1] * len(lengths)
        got = call(take(q, pos, one), expanded(take(k, pos, one)), expanded(take(v, pos, one)))
        torch.testing.assert_close(got, torch.cat([want[:, :, s + p : s + p + 1] for s, p in zip(starts, pos)], 2))


def test_a_cache_refuses_what_does_not_fit():
    cache = DecodeCache(2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        cache.prefill([3, 5])
    with pytest.raises(ValueError, match="rows and capacity"):
        DecodeCache(0, 4, torch.device("cpu"))
    cache.prefill([1, 2])
    with pytest.raises(ValueError, match="expects 3"):
        cache.store(object(), torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), 1)
    cache.store(object(), torch.zeros(1, 2, 16, 8), torch.zeros(1, 2, 16, 8), 1)  # a trailing padding row
    cache.decode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="expects 2"):
        cache.store(object(), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 1)


@pytest.mark.parametrize("max_new_tokens, max_seq_len", [(6, 64), (5, 12)])
def test_cached_generation_gives_the_answers_of_full_rows(trained, max_new_tokens, max_seq_len):
    """Rows of varied lengths, two adapters and the base model, rows that stop at once, at
    a stop token midway, at ``max_new_tokens`` or at ``max_seq_len`` (12 cuts the longest)."""
    recipe = trained
    tok = recipe.tok
    prompts = [tok.prompt_ids(ex["input"]) for ex in recipe.eval_examples[:8]]
    assert len({len(p) for p in prompts}) > 3
    device = torch.device("cpu")
    with torch.no_grad():
        plain = gen.generate_without_cache(recipe.pm, prompts * 2, [0, 1], 8, tok, max_new_tokens, max_seq_len,
                                           device)
        cached = gen.greedy_generate(recipe.pm, prompts * 2, [0, 1], 8, tok, max_new_tokens, max_seq_len, device)
        base = gen.greedy_generate(recipe.pm, prompts, [None], 8, tok, max_new_tokens, max_seq_len, device)
        base_plain = gen.generate_without_cache(recipe.pm, prompts, [None], 8, tok, max_new_tokens, max_seq_len,
                                                device)
    assert cached == plain and base == base_plain
    assert any(cached) and len({len(a) for a in cached}) > 1


def test_short_prompts_flattened_with_a_padding_row_decode_as_full_rows(trained):
    """Prompts shorter in all than a flattened batch's smallest size: the batch ends in a
    padding row, which the cache leaves out."""
    tok = trained.tok
    prompts = [tok.prompt_ids(s) for s in ("ab>", "c>", "fed>")]
    assert sum(map(len, prompts)) < 16
    with torch.no_grad():
        plain = gen.generate_without_cache(trained.pm, prompts, [1], 3, tok, 4, 64, torch.device("cpu"))
        cached = gen.greedy_generate(trained.pm, prompts, [1], 3, tok, 4, 64, torch.device("cpu"))
    assert cached == plain


def test_cached_generation_stops_rows_at_their_stop_tokens(trained, monkeypatch):
    """A token the adapters often emit made a stop token: rows end at different steps, the
    others decode on, and each answer is still the full rows' one."""
    recipe = trained
    tok = recipe.tok
    prompts = [tok.prompt_ids(ex["input"]) for ex in recipe.eval_examples[:8]]
    with torch.no_grad():
        first = gen.generate_without_cache(recipe.pm, prompts, [0], 8, tok, 6, 64, torch.device("cpu"))
    ids = [tok.encode(a) for a in first]
    seconds = [t[1] for t in ids if len(t) > 1]
    assert seconds, "the adapter's answers are too short to stop midway"
    stop = max(set(seconds), key=seconds.count)
    monkeypatch.setattr(tok, "stop_ids", set(tok.stop_ids) | {stop})
    with torch.no_grad():
        plain = gen.generate_without_cache(recipe.pm, prompts, [0], 8, tok, 6, 64, torch.device("cpu"))
        cached = gen.greedy_generate(recipe.pm, prompts, [0], 8, tok, 6, 64, torch.device("cpu"))
    assert cached == plain
    assert len({len(a) for a in cached}) > 1 and any(len(a) < 6 for a in cached)


def test_generated_metrics_through_the_cache_equal_those_without(trained, monkeypatch):
    recipe = trained
    args = dict(metrics=["exact_match"], max_new_tokens=6, max_seq_len=64, device=torch.device("cpu"))
    samples, examples = recipe.eval_samples, recipe.eval_examples
    with torch.no_grad():
        cached = ev.evaluate_adapters(recipe.pm, [0, 1], samples, examples, recipe.tok, **args)
        monkeypatch.setattr(ev, "greedy_generate", gen.generate_without_cache)
        plain = ev.evaluate_adapters(recipe.pm, [0, 1], samples, examples, recipe.tok, **args)
    assert cached == plain


def test_widest_pieces_cost_their_rows_times_their_widest():
    assert ev.split_pieces([2, 3, 3, 5, 8], max_tokens=10, max_rows=8, widest=True) == [(0, 3), (3, 4), (4, 5)]
    assert ev.split_pieces([2, 3, 3, 5, 8], max_tokens=100, max_rows=2, widest=True) == [(0, 2), (2, 4), (4, 5)]
    assert ev.split_pieces([40], max_tokens=10, max_rows=8, widest=True) == [(0, 1)]  # a wide row alone
    assert ev.split_pieces([], max_tokens=10, max_rows=8, widest=True) == []


def test_a_decode_cache_is_counted_only_where_rows_are_cached(trained):
    per_token = gen.decode_cache_bytes(trained.pm)
    # 2 layers, 2 kv heads of 16, keys and values, float32
    assert per_token == 2 * 2 * 2 * 16 * 4


# ------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_generation_on_the_gpu_gives_the_answers_of_full_rows(tiny_model, data, tmp_path, dtype):
    """On CUDA the prefill runs through the varlen kernel (bfloat16) or per-row attention
    (float32), the decode through masked attention: float32 answers are the full rows' ones;
    bfloat16's may differ where rounding flips a near tie."""
    cfg = job_config(tiny_model, data, tmp_path, ADAPTERS, device="cuda")
    cfg["model"]["dtype"] = dtype
    recipe = PackedLoRARecipe(cfg)
    recipe.setup()
    recipe.pm.model.eval()
    with torch.no_grad():
        for layer in recipe.pm.layers.values():
            layer.bt_all.normal_(0.0, 0.05, generator=torch.Generator(device="cuda").manual_seed(1))
    tok = recipe.tok
    prompts = [tok.prompt_ids(ex["input"]) for ex in recipe.eval_examples[:16]]
    device = torch.device("cuda")
    with torch.no_grad():
        plain = gen.generate_without_cache(recipe.pm, prompts * 2, [0, 1], 16, tok, 6, 64, device)
        cached = gen.greedy_generate(recipe.pm, prompts * 2, [0, 1], 16, tok, 6, 64, device)
    same = sum(a == b for a, b in zip(plain, cached)) / len(plain)
    assert same == 1.0 if dtype == "float32" else same >= 0.8, (same, plain, cached)
