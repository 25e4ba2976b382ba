"""Where varied rows' extra step time goes: the first-sweep benchmark's full pack, stepped
on fixed and on varied rows, each in the layouts a job may give them.

The first-sweep benchmark lays its fixed rows out padded (every row 250 tokens: one width)
and its varied rows (66-440 tokens, the same mean) flattened in balanced batches, the
sweep's own choice (`plora.cost.sweep_rows`). Their steps differ in two ways at once: the
rows' lengths, and the layout (padded rows attend through SDPA, flattened ones through the
flash varlen kernel). This steps the benchmark's 16-adapter pack (ranks 8-64, batch 4 and
2, the real recipe step replayed from CUDA graphs) on each (rows, layout) pair, so the two
are told apart, and reports per pair: step time, real and stepped tokens per step, real
tokens/s, and the GPU time per step of each kernel (torch.profiler), with the kernels whose
time differs most between pairs.

    python scripts/compare_row_layouts.py --out DIR
    python scripts/compare_row_layouts.py --out DIR --cases fixed:padded varied:balanced
    python scripts/compare_row_layouts.py --out DIR --cases fixed:padded varied:balanced varied:balanced:own-attention

Writes DIR/row_layouts.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packed_step import time_steps  # noqa: E402
from bench_rows import write_variant  # noqa: E402

from plora.job.config import JobAdapter, JobConfig, JobData, JobEval, JobLora, JobModel, JobTraining  # noqa: E402
from plora.job.step_settings import CUDA_GRAPHS_ENV  # noqa: E402
from plora.models.families.targets import LLAMA_TARGETS  # noqa: E402
from plora.models.loading import write_shape_folder  # noqa: E402
from plora.models.shape import ModelShape  # noqa: E402
from plora.train.heap import frozen_heap  # noqa: E402
from plora.train.packed.row_forward import RowsForward  # noqa: E402
from plora.train.packed_lora import PackedLoRARecipe  # noqa: E402

#: the benchmark's pack: ranks 8-64 twice, batch 4 then batch 2 (`bench_first_sweep.py`)
RANKS = [8, 8, 16, 16, 32, 32, 64, 64] * 2
BATCHES = [4] * 8 + [2] * 8
CASES = ["fixed:padded", "fixed:balanced", "varied:balanced", "varied:padded"]
#: ``--smoke``: two layers at width 64, for the script's path on a CPU
SMOKE = ModelShape("smoke", 0, 64, 128, 2, 4, 2, 16, 512, 2, True)


def make_recipe(model_dir: Path, train: Path, out: Path, layout: str, seq: int, dtype: str, rows: int,
                smoke: bool) -> PackedLoRARecipe:
    """The pack as a job of the benchmark's sweep would run it, on ``train``, in ``layout``."""
    cfg = JobConfig(
        job_id="layouts",
        output_dir=out,
        device="cpu" if smoke else "cuda",
        model=JobModel(path=str(model_dir), max_seq_len=seq, dtype=dtype, random_init=True),
        data=JobData(train=str(train)),
        lora=JobLora(targets=list(LLAMA_TARGETS), dropout=0.0),
        adapters=[JobAdapter(id=f"a{k}", rank=r, alpha=2.0 * r, learning_rate=1e-4, batch_size=b, seed=k,
                             steps=max(1, rows // b))
                  for k, (r, b) in enumerate(zip(RANKS, BATCHES))],
        training=JobTraining(scheduler="constant", grad_clip=1.0, row_layout=layout),
        eval=JobEval(metrics=[]),
    )
    recipe = PackedLoRARecipe(cfg)
    recipe.setup()
    return recipe


def kernel_times(recipe: PackedLoRARecipe, steps: int, first: int) -> dict[str, float]:
    """GPU milliseconds per step of each kernel (name cut to 80 characters) over ``steps``."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    active = list(recipe.runs)
    with frozen_heap(), torch.profiler.profile(activities=acts) as prof:
        for i in range(steps):
            recipe.train_step(active, first + i)
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name[:80]] = out.get(e.name[:80], 0.0) + e.device_time / 1e3 / steps
    return out


def run_case(case: str, model_dir: Path, data: Path, tmp: Path, args) -> dict:
    rows, layout, *how = case.split(":")
    recipe = make_recipe(model_dir, data / f"train-{rows}.jsonl", tmp / case.replace(":", "-"), layout, args.seq,
                         args.dtype, args.rows, args.smoke)
    if how == ["own-attention"]:  # each attention's own forward: torchtune's expand and copies
        for layer in recipe.pm.model.layers:
            if isinstance(layer.attn.__dict__.get("forward"), RowsForward):
                del layer.attn.forward
    real0, stepped0 = recipe.stepper.real_tokens, recipe.stepper.stepped_tokens
    every: list[float] = []
    times = time_steps(recipe, args.warmup, args.steps, every=every)
    n = args.warmup + args.steps
    real = (recipe.stepper.real_tokens - real0) / n
    stepped = (recipe.stepper.stepped_tokens - stepped0) / n
    med = statistics.median(times)
    out = {"case": case, "step_ms": med * 1e3, "first_steps_ms": [t * 1e3 for t in every[:args.warmup]],
           "real_tokens_per_step": real, "stepped_tokens_per_step": stepped, "padding": 1 - real / stepped,
           "real_tokens_per_s": real / med, "stepped_tokens_per_s": stepped / med}
    if torch.cuda.is_available() and args.profile_steps:
        out["kernels_ms"] = kernel_times(recipe, args.profile_steps, n + 1)
        out["gpu_ms_per_step"] = sum(out["kernels_ms"].values())
    print(json.dumps({k: v for k, v in out.items() if k != "kernels_ms"}), flush=True)
    del recipe
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def kernel_diff(a: dict, b: dict, top: int = 25) -> list[dict]:
    """The kernels whose GPU time per step differs most between cases ``a`` and ``b``."""
    ka, kb = a.get("kernels_ms", {}), b.get("kernels_ms", {})
    rows = [{"kernel": k, a["case"]: ka.get(k, 0.0), b["case"]: kb.get(k, 0.0),
             "diff_ms": kb.get(k, 0.0) - ka.get(k, 0.0)} for k in set(ka) | set(kb)]
    return sorted(rows, key=lambda r: -abs(r["diff_ms"]))[:top]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cases", nargs="+", default=CASES,
                    help="rows:layout pairs (fixed|varied : padded|balanced|flat), :own-attention for "
                         "torchtune's attention forward on flattened rows (`plora.train.packed.row_forward`)")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, a few steps: the script's path only")
    ap.add_argument("--out", type=Path, default=Path("row-layouts"))
    args = ap.parse_args()
    if args.smoke:
        args.seq, args.rows, args.dtype, args.warmup, args.steps = 128, 32, "float32", 1, 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[CUDA_GRAPHS_ENV] = "off" if args.smoke else "on"
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        model_dir = write_shape_folder(SMOKE if args.smoke else ModelShape.preset(args.shape), tmp / "model")
        for variant in ("fixed", "varied"):
            write_variant(tmp, variant, rows=args.rows, eval_samples=4, row_chars=48 if args.smoke else 250,
                          answer_chars=8 if args.smoke else 48, seq=args.seq)
        results = [run_case(case, model_dir, tmp, tmp, args) for case in args.cases]
    base = results[0]
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "shape": args.shape, "results": results,
               "vs_first": {r["case"]: base["real_tokens_per_s"] / r["real_tokens_per_s"] for r in results},
               "kernel_diffs": {r["case"]: kernel_diff(base, r) for r in results[1:]}}
    (args.out / "row_layouts.json").write_text(json.dumps(summary, indent=1))
    print(f"\n{'case':18} {'step ms':>8} {'real tok':>9} {'stepped':>9} {'pad':>6} {'real tok/s':>11} "
          f"{'per real token vs ' + base['case']:>28}")
    for r in results:
        print(f"{r['case']:18} {r['step_ms']:>8.2f} {r['real_tokens_per_step']:>9.0f} "
              f"{r['stepped_tokens_per_step']:>9.0f} {r['padding']:>6.3f} {r['real_tokens_per_s']:>11.0f} "
              f"{summary['vs_first'][r['case']]:>28.3f}")
    for case, diffs in summary["kernel_diffs"].items():
        print(f"\nkernels, {base['case']} -> {case} (ms per step)")
        for d in diffs[:15]:
            print(f"  {d['diff_ms']:+8.3f}  {d[base['case']]:8.3f} -> {d[case]:8.3f}  {d['kernel']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
