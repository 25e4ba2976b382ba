"""Where a leaving group's eval goes: the SmolLM2 sweep's final eval, profiled.

The SmolLM2 sweep (`sweeps/smollm2.yaml`: 200 arithmetic eval rows, loss and exact match of
6 greedy tokens) scores each leaving group of 12 adapters in 1.3-1.9 s on an H200, 10-16% of
its makespan. This builds that job's pack on a random-init model of SmolLM2-135M's shape
(Llama, 30 layers of 576, 9 query heads over 3 key-value heads, vocabulary 49,152) and the
built-in arithmetic task (the shape folder's tokenizer is about one token a character, so
its rows are about three times SmolLM2's 38 tokens: ``max_seq_len`` 192), then times the recipe's own final eval of 12 adapters (the first
run compiles and loads its kernels; the next ones are what a warm job pays), and profiles
one: the main thread under cProfile (where the host's time goes) and the GPU's kernels under
`torch.profiler`, with each metric's part (loss; prefill and decode of the generation).

    python scripts/profile_eval.py --out DIR

Writes DIR/eval_profile.json, DIR/eval_cprofile.txt and DIR/eval_kernels.txt.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

import torch

from plora.job.config import JobAdapter, JobConfig, JobData, JobEval, JobLora, JobModel, JobTraining
from plora.job.step_settings import CUDA_GRAPHS_ENV
from plora.models.families.targets import LLAMA_TARGETS
from plora.models.loading import write_shape_folder
from plora.models.shape import ModelShape
from plora.train.packed_lora import PackedLoRARecipe

#: SmolLM2-135M-Instruct's numbers (its config.json)
SMOLLM2 = ModelShape("smollm2-135m", 134_515_008, 576, 1536, 30, 9, 3, 64, 49152, 2, True)
#: ``--smoke``: the script's path on a CPU
SMOKE = ModelShape("smoke", 0, 64, 128, 2, 4, 2, 16, 512, 2, True)


def make_recipe(model_dir: Path, out: Path, adapters: int, eval_rows: int, smoke: bool) -> PackedLoRARecipe:
    ranks = [4, 16, 64]
    cfg = JobConfig(
        job_id="eval-profile",
        output_dir=out,
        device="cpu" if smoke else "cuda",
        model=JobModel(path=str(model_dir), max_seq_len=192, dtype="float32" if smoke else "bfloat16",
                       random_init=True),
        data=JobData(task="builtin:arithmetic", num_train=64, num_eval=eval_rows),
        lora=JobLora(targets=list(LLAMA_TARGETS), dropout=0.0),
        adapters=[JobAdapter(id=f"a{k}", rank=ranks[k % 3], alpha=float(ranks[k % 3]), learning_rate=1e-3,
                             batch_size=8, seed=k, steps=8) for k in range(adapters)],
        training=JobTraining(scheduler="constant", grad_clip=1.0),
        eval=JobEval(metrics=["loss", "exact_match"], max_new_tokens=6, max_eval_samples=eval_rows),
    )
    recipe = PackedLoRARecipe(cfg)
    recipe.setup()
    return recipe


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_parts(recipe: PackedLoRARecipe, slots: list[int]) -> dict[str, float]:
    """The eval's metrics one at a time: the loss alone, then the generation alone."""
    out = {}
    for name, metrics, new in (("loss", ["loss"], 0), ("exact_match", ["exact_match"], 6)):
        sync()
        t0 = time.perf_counter()
        recipe.evaluator.evaluate(slots, metrics=metrics, max_new_tokens=new)
        sync()
        out[name] = time.perf_counter() - t0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("eval-profile"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[CUDA_GRAPHS_ENV] = "off" if args.smoke else "on"
    if args.smoke:
        args.adapters, args.eval_rows, args.repeats = 3, 8, 1
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_dir = write_shape_folder(SMOKE if args.smoke else SMOLLM2, tmp / "model")
        recipe = make_recipe(model_dir, tmp / "out", args.adapters, args.eval_rows, args.smoke)
        slots = list(range(args.adapters))
        runs = []
        for _ in range(1 + args.repeats):
            sync()
            t0 = time.perf_counter()
            recipe.evaluator.final(slots)
            sync()
            runs.append(time.perf_counter() - t0)
        parts = timed_parts(recipe, slots)
        prof = cProfile.Profile()
        sync()
        prof.enable()
        recipe.evaluator.final(slots)
        sync()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(60)
        text.write("\n\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(40)
        (args.out / "eval_cprofile.txt").write_text(text.getvalue())
        kernels = {}
        if torch.cuda.is_available():
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as tp:
                recipe.evaluator.final(slots)
                sync()
            events = tp.key_averages()
            (args.out / "eval_kernels.txt").write_text(
                events.table(sort_by="self_device_time_total", row_limit=40) + "\n\n"
                + events.table(sort_by="cpu_time_total", row_limit=40))
            ks = [e for e in tp.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels = {"gpu_busy_s": sum(e.device_time for e in ks) / 1e6, "kernels": len(ks),
                       "syncs": sum(1 for e in tp.events() if e.name in ("cudaStreamSynchronize",
                                                                          "cudaDeviceSynchronize",
                                                                          "cudaMemcpyAsync"))}
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "adapters": args.adapters, "eval_rows": args.eval_rows, "first_s": runs[0], "warm_s": runs[1:],
              "parts_s": parts, **kernels}
    (args.out / "eval_profile.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
