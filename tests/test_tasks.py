"""Built-in tasks and the shipped tiny base model (plora/assets/tiny-llama)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import plora
from plora.data.tasks import (
    ALPHABET,
    BUILTIN_TASKS,
    PRETRAIN_TASKS,
    iter_examples,
    load_builtin_task,
    split_of,
)

ASSET = Path(plora.__file__).parent / "assets" / "tiny-llama"
MAX_TOKENS = 24  # bos + input + output + eos must stay short for the CPU demo


#: the letter tasks of the tiny model (one operator character each); the word tasks are tested below
LETTER_TASKS = sorted(n for n, info in BUILTIN_TASKS.items() if info.op)
WORD_TASKS = sorted(n for n, info in BUILTIN_TASKS.items() if not info.op)


def _payload(ex: dict, name: str) -> str:
    op = BUILTIN_TASKS[name].op
    assert ex["input"].endswith(op)
    return ex["input"][: -len(op)]


@pytest.mark.parametrize("name", sorted(BUILTIN_TASKS))
def test_deterministic_and_seeded(name: str) -> None:
    n = min(50, BUILTIN_TASKS[name].default_num_eval)
    a = load_builtin_task(name, "eval", n, seed=0)
    assert a == load_builtin_task(name, "eval", n, seed=0)
    assert load_builtin_task(name, "eval", n // 2, seed=0) == a[: n // 2]
    assert load_builtin_task(name, "eval", n, seed=1) != a


@pytest.mark.parametrize("name", LETTER_TASKS)
def test_splits_are_disjoint(name: str) -> None:
    train = load_builtin_task(name, "train")
    evals = load_builtin_task(name, "eval")
    assert len(train) == BUILTIN_TASKS[name].default_num_train
    assert len(evals) == BUILTIN_TASKS[name].default_num_eval
    tr = {_payload(ex, name) for ex in train}
    ev = {_payload(ex, name) for ex in evals}
    assert len(tr) == len(train) and len(ev) == len(evals)  # distinct within a split
    assert not tr & ev
    assert all(split_of(p) == "train" for p in tr) and all(split_of(p) == "eval" for p in ev)


def test_eval_payloads_never_seen_by_any_pretraining_task() -> None:
    """The split is by payload across tasks: shift's eval strings are new to the base model."""
    shift_eval = {_payload(ex, "shift") for ex in load_builtin_task("shift", "eval")}
    for name in PRETRAIN_TASKS:
        stream = iter_examples(name, "train", seed=0)
        seen = {_payload(next(stream), name) for _ in range(2000)}
        assert not seen & shift_eval


def test_shift_format() -> None:
    for ex in load_builtin_task("shift", "train", 500) + load_builtin_task("shift", "eval"):
        payload = _payload(ex, "shift")
        assert 2 <= len(payload) <= 5 and set(payload) <= set(ALPHABET)
        assert ex["output"] == payload[1:] + payload[0]
        assert 2 + len(ex["input"]) + len(ex["output"]) <= MAX_TOKENS
    assert load_builtin_task("shift", "eval", 1, seed=3)[0]["input"].endswith("+")


def test_pretraining_mixture_excludes_shift_and_ops_are_unique() -> None:
    assert "shift" not in PRETRAIN_TASKS
    assert set(PRETRAIN_TASKS) <= set(BUILTIN_TASKS)
    ops = [BUILTIN_TASKS[n].op for n in LETTER_TASKS]
    assert len(set(ops)) == len(ops) and all(len(op) == 1 and op not in ALPHABET for op in ops)
    semantics = {
        "copy": lambda p: p,
        "reverse": lambda p: p[::-1],
        "sort": lambda p: "".join(sorted(p)),
        "count": lambda p: str(len(p)),
        "range": lambda p: ALPHABET[ALPHABET.index(p[0]) : ALPHABET.index(p[1]) + 1],
    }
    for name in PRETRAIN_TASKS:
        for ex in load_builtin_task(name, "train", 20):
            assert ex["output"] == semantics[name](_payload(ex, name))
            assert 2 + len(ex["input"]) + len(ex["output"]) <= MAX_TOKENS


@pytest.mark.parametrize("name", WORD_TASKS)
def test_word_task_splits_are_disjoint(name: str) -> None:
    train = load_builtin_task(name, "train")
    evals = load_builtin_task(name, "eval")
    tr, ev = {ex["input"] for ex in train}, {ex["input"] for ex in evals}
    assert len(tr) == len(train) == BUILTIN_TASKS[name].default_num_train
    assert len(ev) == len(evals) == BUILTIN_TASKS[name].default_num_eval
    assert not tr & ev and all(split_of(p) == "eval" for p in ev)
    assert all(ex["input"].endswith("\n") and "\n" not in ex["output"] and ex["output"] for ex in train + evals)


def test_arithmetic_answers_follow_the_story() -> None:
    import re

    gains = ("buys", "finds", "gets", "wins", "is given")
    for ex in load_builtin_task("arithmetic", "train", 300):
        story = ex["input"].split(". How many")[0]
        start = int(re.match(r"\w+ has (\d+) ", story).group(1))
        count = start
        for clause in re.split(r", then |, | and then ", story)[1:]:
            n = int(re.search(r"(\d+)", clause).group(1))
            count += n if clause.startswith(gains) else -n
        assert ex["output"] == str(count) and count >= 0, ex
    assert load_builtin_task("arithmetic", "eval", 1)[0]["input"].startswith(
        tuple(f"{n} has " for n in ("Tom", "Anna", "Ravi", "Mia", "Lucas", "Sofia", "Omar", "Emma", "Kenji", "Lena",
                                     "Ben", "Zoe", "Ali", "Nora", "Pablo", "Ivy", "Sam", "Chloe", "Yuki", "Leo")))


def test_sentiment_labels_follow_the_words() -> None:
    from plora.data.tasks import SENTIMENT_LABELS

    rows = load_builtin_task("sentiment", "train", 600)
    assert {ex["output"] for ex in rows} == set(SENTIMENT_LABELS)
    for ex in rows:
        review = ex["input"].split("Review: ")[1]
        assert (" but " in review) == (ex["output"] == "mixed")


def test_verdict_labels_count_the_good_points() -> None:
    import re

    from plora.data.tasks import _BAD, _GOOD, VERDICT_LABELS

    rows = load_builtin_task("verdict", "train", 800)
    assert {ex["output"] for ex in rows} == set(VERDICT_LABELS)
    for ex in rows:
        review = ex["input"].split("Review: ")[1]
        points = re.findall(r"was (not )?(\w+)", review)
        assert len(points) == 3, review
        good = sum((word in _GOOD) != bool(neg) for neg, word in points)
        assert all(word in _GOOD + _BAD for _, word in points)
        assert ex["output"] == VERDICT_LABELS[good], ex
    assert not {ex["input"] for ex in rows} & {ex["input"] for ex in load_builtin_task("verdict", "eval", 200)}


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown built-in task"):
        load_builtin_task("nope", "train")
    with pytest.raises(ValueError, match="split"):
        load_builtin_task("shift", "test")
    with pytest.raises(ValueError, match="distinct"):
        load_builtin_task("range", "eval", 500)
    assert load_builtin_task("shift", "train", 0) == []


# --- the shipped base model -------------------------------------------------------------


def test_asset_files_and_config() -> None:
    names = {p.name for p in ASSET.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    } <= names
    assert sum(p.stat().st_size for p in ASSET.iterdir()) < 3_000_000
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is False and not cfg.get("rope_scaling")
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 0)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim >= 16 and head_dim % 2 == 0 and cfg.get("head_dim", head_dim) == head_dim
    from safetensors import safe_open

    with safe_open(str(ASSET / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert "model.layers.0.self_attn.q_proj.weight" in keys and "lm_head.weight" in keys


def test_tokenizer_round_trip() -> None:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((ASSET / "config.json").read_text())
    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert [tok.token_to_id(t) for t in ("<pad>", "<bos>", "<eos>", "<unk>")] == [0, 1, 2, 3]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(ASSET / "tokenizer.json"))
    for ex in load_builtin_task("shift", "eval", 20) + load_builtin_task("count", "eval", 5):
        for text in (ex["input"], ex["output"]):
            ids = tok.encode(text, add_special_tokens=False).ids
            assert len(ids) == len(text) and 3 not in ids  # one token per character, no unk
            assert tok.encode(text).ids == [1] + ids  # <bos> first, as the model was trained
            assert tok.decode(ids) == text
            assert hf.encode(text, add_special_tokens=False) == ids and hf.decode(ids) == text
            assert hf.encode(text) == [1] + ids
    assert tok.decode([1] + tok.encode("ab+").ids + [2], skip_special_tokens=True) == "ab+"


@pytest.fixture(scope="module")
def base_model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM.from_pretrained(str(ASSET)).eval()


def _greedy_exact_match(model, examples: list[dict], max_new_tokens: int = 16) -> float:
    """Greedy decoding after the tokenized input ([bos]+enc(input)) until eos (left-padded batch)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    prompts = [tok.encode(ex["input"]).ids for ex in examples]  # the tokenizer puts <bos> first
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )[:, width:].tolist()
    hits = 0
    for ex, row in zip(examples, out):
        row = row[: row.index(2)] if 2 in row else row
        hits += tok.decode(row, skip_special_tokens=True) == ex["output"]
    return hits / len(examples)


def test_base_model_cannot_shift_but_knows_its_pretraining(base_model) -> None:
    assert _greedy_exact_match(base_model, load_builtin_task("shift", "eval")) <= 0.1
    assert _greedy_exact_match(base_model, load_builtin_task("copy", "eval", 100)) >= 0.9
    assert _greedy_exact_match(base_model, load_builtin_task("reverse", "eval", 100)) >= 0.9


def test_loss_only_sequence_layout(base_model) -> None:
    """The fine-tuning layout ([bos]+input+output+[eos], loss on output+eos) runs as is."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET / "tokenizer.json"))
    ex = load_builtin_task("copy", "eval", 1)[0]
    inp, out = tok.encode(ex["input"], add_special_tokens=False).ids, tok.encode(ex["output"], add_special_tokens=False).ids
    ids = torch.tensor([[1] + inp + out + [2]])
    labels = torch.tensor([[-100] * (1 + len(inp)) + out + [2]])
    with torch.no_grad():
        loss = base_model(input_ids=ids, labels=labels).loss
    assert torch.isfinite(loss) and loss.item() < 1.0


def test_task_rows_are_pinned() -> None:
    """A built-in task's rows are fixed for good (they are the demo's, and what every earlier
    run trained on): its seed does not follow where the module lives."""
    first = load_builtin_task("shift", "train", 2000)[:2]
    assert [(r["input"], r["output"]) for r in first] == [("sxn+", "xns"), ("rql+", "qlr")]
