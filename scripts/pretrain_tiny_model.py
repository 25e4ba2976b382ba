"""Build the tiny base model that plora ships for its CPU demo (``plora/assets/tiny-llama``).

Why a model of our own: the demo and the tests must run offline on a laptop CPU in
minutes, yet show a real LoRA sweep in which the hyperparameters matter. No public
checkpoint is that small *and* one small step away from a task it cannot do yet, so we
pretrain one from scratch on the synthetic tasks of ``plora.data.tasks``.

Recipe (the defaults of this script; about 2-3 minutes on 2 idle CPU cores):

* Tokenizer: character level, built with ``tokenizers`` (a BPE model with an empty merge
  list, so every character is one token; ``Fuse`` decoder). Special tokens ``<pad>``=0,
  ``<bos>``=1, ``<eos>``=2, ``<unk>``=3, then a-z, 0-9, space and some punctuation
  (57 tokens). Its post-processor puts ``<bos>`` before a text, as Llama tokenizers do, so
  that ``tokenizer(prompt)`` gives what the model was trained on, ``[bos] + enc(input)``
  (``tokenizer_config.json`` says ``add_bos_token: true`` to match).
* Model: ``LlamaForCausalLM``, hidden 128, 2 layers, 4 heads of 32, 2 KV heads,
  intermediate 256, RoPE (theta 10000, no scaling), 64 positions, untied embeddings,
  fp32: 310k parameters, 1.2 MB.
* Data: the ``train`` split streams of ``plora.data.tasks.PRETRAIN_TASKS`` (copy, reverse, sort,
  count, range), mixed uniformly. The demo task ``shift`` ("+") is never shown.
* Sequence: ``[bos] + enc(input) + enc(output) + [eos]``, right-padded; the loss covers
  ``enc(output) + [eos]`` only, exactly like the fine-tuning recipe.
* Optimizer: AdamW (betas 0.9/0.98, weight decay 0.1 on matrices), batch 64, 5,000 steps,
  peak lr 3e-3, linear warm-up 200 steps then cosine decay to 10%, grad-norm clip 1.0,
  seed 0, one torch thread (``--threads``): tiny matmuls on several OpenMP threads are
  many times slower than on one.
* Label smoothing 0.1 and weight decay 0.1 are there for the demo, not for the pretraining
  score: without them the model is so sure of its answers (~13 nats of loss on a new
  operator) that fine-tuning spends most of its steps undoing that confidence, and LoRA
  needs several times more steps to learn ``shift``.
* At the end: greedy exact match on each task's eval split (about 1.0 on copy, reverse,
  sort and count, lower on range; ~0 on ``shift``), and the assets are written:
  config.json, generation_config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json, special_tokens_map.json.

Usage: ``python scripts/pretrain_tiny_model.py [--steps N] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from plora.data.tasks import PRETRAIN_TASKS, iter_examples, load_builtin_task  # noqa: E402

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD, BOS, EOS, UNK = 0, 1, 2, 3
CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789") + list(" =<>^#+-*/:?!.,@_")


def build_tokenizer():
    """Character-level tokenizer: one token per character, ``<bos>`` put before a text."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIALS)
    tok.decoder = decoders.Fuse()
    tok.post_processor = bos_first()
    return tok


def bos_first():
    """The post-processor that puts ``<bos>`` before each text (Llama's layout)."""
    from tokenizers import processors

    return processors.TemplateProcessing(single="<bos>:0 $A:0", pair="<bos>:0 $A:0 <bos>:1 $B:1",
                                         special_tokens=[("<bos>", BOS)])


def build_config(args: argparse.Namespace, vocab_size: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.max_pos,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        initializer_range=0.02,
    )


def encode_batch(tok, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 outside output+eos)."""
    rows, labels = [], []
    for ex in examples:
        inp = tok.encode(ex["input"], add_special_tokens=False).ids
        out = tok.encode(ex["output"], add_special_tokens=False).ids
        ids = [BOS] + inp + out + [EOS]
        rows.append(ids)
        labels.append([-100] * (1 + len(inp)) + out + [EOS])
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(r)] = 1
    return ids, mask, lab


@torch.no_grad()
def greedy_exact_match(model, tok, examples: list[dict], max_new_tokens: int = 16, batch_size: int = 256) -> float:
    """Greedy decoding after [bos]+enc(input), left-padded, until eos; exact string match."""
    model.eval()
    hits = 0
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        prompts = [[BOS] + tok.encode(ex["input"], add_special_tokens=False).ids for ex in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(chunk), width), PAD, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=PAD,
        )[:, width:]
        for ex, row in zip(chunk, gen.tolist()):
            if EOS in row:
                row = row[: row.index(EOS)]
            hits += tok.decode(row, skip_special_tokens=True) == ex["output"]
    return hits / max(len(examples), 1)


def write_assets(out: Path, model, tok, args: argparse.Namespace) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.bos_token_id = BOS
    model.generation_config.eos_token_id = EOS
    model.generation_config.pad_token_id = PAD
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 16
    model.save_pretrained(out, safe_serialization=True)
    # Keep config.json readable by loaders that predate `rope_parameters` (e.g. torchtune).
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rope_scaling", None)
    cfg["torch_dtype"] = "float32"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tok.save(str(out / "tokenizer.json"))
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,  # what tokenizer.json's post-processor does
        "add_eos_token": False,
        "model_max_length": args.max_pos,
        "padding_side": "right",
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "plora" / "assets" / "tiny-llama")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--max-pos", type=int, default=64)
    p.add_argument("--tasks", default=",".join(PRETRAIN_TASKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--log-every", type=int, default=250)
    args = p.parse_args(argv)

    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tasks = args.tasks.split(",")
    if "shift" in tasks:
        raise SystemExit("shift is the fine-tuning task; it must stay out of pretraining")

    tok = build_tokenizer()
    config = build_config(args, tok.get_vocab_size())
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  vocab {config.vocab_size}  tasks {tasks}", flush=True)

    streams = {t: iter_examples(t, "train", seed=args.seed) for t in tasks}
    mix = random.Random(args.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    t0 = time.time()
    running = 0.0
    for step in range(args.steps):
        batch = [next(streams[mix.choice(tasks)]) for _ in range(args.batch_size)]
        ids, mask, lab = encode_batch(tok, batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), lab[:, 1:].reshape(-1), ignore_index=-100,
            label_smoothing=args.label_smoothing,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running += loss.item()
        if (step + 1) % args.log_every == 0:
            el = time.time() - t0
            print(f"step {step + 1:5d}  loss {running / args.log_every:.4f}  {el:6.1f}s", flush=True)
            running = 0.0
            model.train()

    scores = {}
    for t in tasks:  # streams: small tasks (range) have few distinct eval payloads
        stream = iter_examples(t, "eval", seed=args.seed)
        scores[t] = greedy_exact_match(model, tok, [next(stream) for _ in range(200)])
    scores["shift"] = greedy_exact_match(model, tok, load_builtin_task("shift", "eval", 200))
    print("eval exact match: " + "  ".join(f"{t} {s:.3f}" for t, s in scores.items()), flush=True)
    model.eval()
    write_assets(args.out, model, tok, args)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB) in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
