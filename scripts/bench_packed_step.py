"""Tokens/s of a packed training step (forward, backward, AdamW) on a random-init model.

What packing is worth: K adapters at batch size 1 each, packed, against one adapter at
batch size K on the same model (the most packing can give: the same rows, one adapter).
Each variant runs the real recipe step (`PackedLoRARecipe.train_step`), on the Triton
kernels and on the torch reference path, replayed from a CUDA graph and eagerly
(``--modes``: backend+graph or backend alone).

    python scripts/bench_packed_step.py --shape qwen2.5-0.5b --seq 256 --adapters 16 --out DIR

``--varied``: rows of varied length (uniform between seq/8 and seq tokens, the loss on
their last ``--answer`` tokens) instead of fixed-length rows with the loss everywhere; the
table then also reports real (non-padding) tokens/s, and ``--layouts flat,padded`` compares
rows flattened without padding against rows padded to the pack's longest.

Writes DIR/packed_step.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from plora.models.families.targets import LLAMA_TARGETS
from plora.models.shape import ModelShape
from plora.data.dataset import IGNORE_INDEX, Sample
from plora.train.heap import frozen_heap
from plora.job.config import JobAdapter, JobConfig, JobData, JobEval, JobLora, JobModel, JobTraining, SyntheticRows
from plora.models.loading import write_shape_folder
from plora.train.packed_lora import PackedLoRARecipe
from plora.job.step_settings import CUDA_GRAPHS_ENV as GRAPHS_ENV

ALL_LINEAR = list(LLAMA_TARGETS)


def make_recipe(model_dir: Path, out: Path, ranks: Sequence[int], batch_size: int | Sequence[int], seq: int,
                dtype: str) -> PackedLoRARecipe:
    """A packed job of one adapter per rank in ``ranks``, on synthetic data, that never ends
    (set up, ready for `train_step`); ``batch_size``, one for all or one per adapter."""
    sizes = [batch_size] * len(ranks) if isinstance(batch_size, int) else list(batch_size)
    cfg = JobConfig(
        job_id="bench",
        output_dir=out,
        device="cuda" if torch.cuda.is_available() else "cpu",
        model=JobModel(path=str(model_dir), max_seq_len=seq, dtype=dtype, random_init=True),
        data=JobData(synthetic=SyntheticRows(seq_len=seq, num_samples=256)),
        lora=JobLora(targets=ALL_LINEAR, dropout=0.0),
        adapters=[JobAdapter(id=f"a{k}", rank=r, alpha=2.0 * r, learning_rate=1e-4, batch_size=sizes[k],
                             seed=k, steps=10**6)
                  for k, r in enumerate(ranks)],
        training=JobTraining(scheduler="constant", grad_clip=1.0),
        eval=JobEval(metrics=[]),
    )
    recipe = PackedLoRARecipe(cfg)
    recipe.setup()
    return recipe


def varied_samples(count: int, seq: int, vocab: int, answer: int, seed: int = 0) -> list[Sample]:
    """Random rows of varied length (seq/8 .. seq tokens), the loss on the last ``answer``."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, seq // 8), seq + 1, (count,), generator=gen).tolist()
    out = []
    for n in lengths:
        row = torch.randint(4, vocab, (n,), generator=gen).tolist()
        cut = max(1, n - answer)
        out.append(Sample(row, [IGNORE_INDEX] * cut + row[cut:]))
    return out


def time_steps(recipe: PackedLoRARecipe, warmup: int, steps: int, every: list[float] | None = None) -> list[float]:
    """The timed steps' seconds, after ``warmup`` steps; ``every`` gets every step's, warm-up included."""
    active = [r for r in recipe.runs]
    times = []
    with frozen_heap():  # as the recipe's own loop runs its steps
        for i in range(warmup + steps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            recipe.train_step(active, i)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            took = time.perf_counter() - t0
            if every is not None:
                every.append(took)
            if i >= warmup:
                times.append(took)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--modes", default="triton+graph,triton,torch",
                    help="kernel backend, +graph to replay steps from CUDA graphs")
    ap.add_argument("--varied", action="store_true", help="rows of varied length, loss on their answers only")
    ap.add_argument("--answer", type=int, default=48, help="--varied: label tokens at the end of each row")
    ap.add_argument("--layouts", default="flat", help="flat (no padding), padded, or both: flat,padded")
    ap.add_argument("--out", type=Path, default=Path("bench-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shape = ModelShape.preset(args.shape)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_folder(shape, Path(tmp) / "model")
        variants = [("packed", args.adapters, 1), ("one adapter", 1, args.adapters)]
        for mode, layout in [(m, lay) for m in args.modes.split(",") for lay in args.layouts.split(",")]:
            backend, _, graph = mode.partition("+")
            os.environ["PLORA_KERNELS"] = backend
            os.environ[GRAPHS_ENV] = "on" if graph else "off"
            for name, k, bs in variants:
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                recipe = make_recipe(model_dir, Path(tmp) / "out", [args.rank] * k, bs, args.seq, args.dtype)
                if args.varied:
                    recipe.rows.samples = varied_samples(256, args.seq, shape.vocab, args.answer)
                if layout == "padded":
                    recipe.rows.row_attention = recipe.stepper.row_attention = None  # rows padded to the pack's longest
                real0 = recipe.real_tokens
                times = time_steps(recipe, args.warmup, args.steps)
                real_per_step = (recipe.real_tokens - real0) / (args.warmup + args.steps)
                med = statistics.median(times)
                tokens = real_per_step if args.varied else k * bs * args.seq
                rows.append({
                    "backend": f"{mode} {layout}" if args.layouts != "flat" else mode, "variant": name,
                    "adapters": k, "batch_size": bs, "rank": args.rank, "seq": args.seq, "step_ms": med * 1e3,
                    "tokens_per_s": tokens / med, "real_tokens_per_s": real_per_step / med,
                    "varied": args.varied,
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
                })
                print(json.dumps(rows[-1]), flush=True)
                del recipe
    ref = {r["backend"]: r["tokens_per_s"] for r in rows if r["variant"] == "one adapter"}
    for r in rows:
        r["vs_one_adapter_same_backend"] = r["tokens_per_s"] / ref[r["backend"]]
        r["vs_one_adapter_triton"] = r["tokens_per_s"] / ref.get("triton", ref[r["backend"]])
    meta = {
        "shape": args.shape, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "rows": rows,
    }
    (args.out / "packed_step.json").write_text(json.dumps(meta, indent=2))
    print(f"\n{args.shape} seq {args.seq} rank {args.rank} on {meta['device']}")
    print(f"{'path':20} {'variant':12} {'K':>3} {'bs':>3} {'step ms':>9} {'tokens/s':>10} {'real tok/s':>10} "
          f"{'vs 1×bs' + str(args.adapters):>10} {'mem GiB':>8}")
    for r in rows:
        mem = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        print(f"{r['backend']:20} {r['variant']:12} {r['adapters']:>3} {r['batch_size']:>3} {r['step_ms']:>9.2f} "
              f"{r['tokens_per_s']:>10.0f} {r['real_tokens_per_s']:>10.0f} {r['vs_one_adapter_same_backend']:>10.2f} "
              f"{mem:>8}")


if __name__ == "__main__":
    main()
