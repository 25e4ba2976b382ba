"""Where the time of a packed training step goes: host (Python, dispatch, launches) or GPU.

Small packs are launch-bound: the GPU waits for the host to issue the step's kernels
(profiles put the floor at 150-250 ms per step on the 0.5B shape, whatever the tokens).
Replayed from a CUDA graph the host's part goes; what is left is the GPU's kernels and the
gaps between them. This times the step both ways, then traces a few steps of the real recipe step on a random-init model with
`torch.profiler` and reports, per step: wall time, the GPU's busy time (sum of kernel
times), the number of kernel launches (Triton and torch), and the operators and Python
functions with the most host time.

    python scripts/trace_packed_step.py --shape qwen2.5-0.5b --seq 256 --adapters 16 --ranks 8,16,32,64 --out DIR
    python scripts/trace_packed_step.py --adapters 16 --ranks 8,8,16,16,32,32,64,64 \
        --batch-sizes 4,4,4,4,4,4,4,4,2,2,2,2,2,2,2,2 --out DIR    # the first-sweep benchmark's full pack
    PLORA_LEAN_STEP=0 python scripts/trace_packed_step.py ...      # RoPE and RMSNorm as torchtune builds them

Writes DIR/trace_summary.json (with the kernels launched most per step, `kernels_by_launches`,
and a capture of the pack's graph timed with every kernel loaded, `capture`), DIR/host_ops.txt,
DIR/gpu_ops.txt (kernels by GPU time), DIR/capture_profile.txt (that capture's host time by
function) and a Chrome trace DIR/trace.json.gz.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packed_step import make_recipe, time_steps  # noqa: E402

from plora.job.step_settings import CUDA_GRAPHS_ENV as GRAPHS_ENV  # noqa: E402
from plora.settings import settings  # noqa: E402
from plora.models.shape import ModelShape  # noqa: E402
from plora.train.heap import frozen_heap  # noqa: E402
from plora.models.loading import write_shape_folder  # noqa: E402


#: the 0.5B shape's depth and adapted layers at tiny widths: its host work without its FLOPs
DEEP_TINY = ModelShape("deep-tiny", 0, 64, 128, 24, 4, 2, 16, 512, 2, True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b",
                    help="a ModelShape preset, or deep-tiny (the 0.5B's 24 layers at width 64: host work only, for CPUs)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--ranks", default="32", help="ranks, cycled over the adapters")
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--batch-sizes", default=None, help="batch sizes, cycled over the adapters (instead of --batch-size)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("trace-out"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cycle = [int(r) for r in args.ranks.split(",")]
    ranks = [cycle[i % len(cycle)] for i in range(args.adapters)]
    sizes: int | list[int] = args.batch_size
    if args.batch_sizes:
        size_cycle = [int(b) for b in args.batch_sizes.split(",")]
        sizes = [size_cycle[i % len(size_cycle)] for i in range(args.adapters)]
    cuda = torch.cuda.is_available()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_folder(DEEP_TINY if args.shape == "deep-tiny" else ModelShape.preset(args.shape),
                                       Path(tmp) / "model")
        graphed: list[float] = []
        first_steps: list[float] = []  # every graphed step, warm-up included (the first captures)
        capture: dict = {}
        if cuda:  # the step as a job runs it: replayed from a CUDA graph
            os.environ[GRAPHS_ENV] = "on"
            recipe = make_recipe(model_dir, Path(tmp) / "graph-out", ranks, sizes, args.seq, args.dtype)
            graphed = time_steps(recipe, args.warmup, max(args.steps, 10), every=first_steps)
            capture = _time_capture(recipe, args.out)  # a capture with every kernel loaded, its host time profiled
            del recipe
            torch.cuda.empty_cache()
        os.environ[GRAPHS_ENV] = "off"
        recipe = make_recipe(model_dir, Path(tmp) / "out", ranks, sizes, args.seq, args.dtype)
        plain = time_steps(recipe, args.warmup, args.steps)
        active = list(recipe.runs)
        with frozen_heap():
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            with torch.profiler.profile(activities=acts, with_stack=False, record_shapes=False) as prof:
                for i in range(args.steps):
                    recipe.train_step(active, 100 + i)
                if cuda:
                    torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="self_cpu_time_total", row_limit=40)
    (args.out / "host_ops.txt").write_text(table + "\n")
    if cuda:
        (args.out / "gpu_ops.txt").write_text(events.table(sort_by="self_device_time_total", row_limit=60) + "\n")
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_busy_us = sum(e.device_time for e in kernels) if cuda else 0.0
    launches = [e for e in prof.events() if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                       "cudaLaunchKernelExC")]
    summary = {
        "shape": args.shape, "seq": args.seq, "ranks": ranks, "batch_sizes": sizes,
        "lean_step": settings().lean_step,  # PLORA_LEAN_STEP: RoPE in one node per call, fused RMSNorm
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "step_ms": statistics.median(plain) * 1e3,
        "graph_step_ms": statistics.median(graphed) * 1e3 if graphed else None,
        "graph_first_steps_ms": [t * 1e3 for t in first_steps[:args.warmup + 1]],
        "capture": capture,
        "kernels_by_launches": _kernels_by_launches(kernels, args.steps),
        "top_kernels": _top_kernels(kernels, args.steps),
        "gpu_busy_ms_per_step": gpu_busy_us / 1e3 / args.steps,
        "kernels_per_step": len(kernels) / args.steps,
        "launch_calls_per_step": len(launches) / args.steps,
        "launch_host_ms_per_step": sum(e.cpu_time_total for e in launches) / 1e3 / args.steps,
    }
    (args.out / "trace_summary.json").write_text(json.dumps(summary, indent=2))
    raw = args.out / "trace.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    print(table)
    print(json.dumps(summary, indent=2))
    return 0


def _time_capture(recipe, out: Path) -> dict:
    """The pack's graph dropped and captured again, with everything loaded: what a composition's
    first step costs beyond a replay (the host issuing the step once under capture, the graph's
    instantiation). Its host time by function goes to DIR/capture_profile.txt."""
    import cProfile
    import io
    import pstats
    import time

    active = list(recipe.runs)
    with frozen_heap():
        recipe.graphs.drop()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        recipe.train_step(active, 10_000)
        torch.cuda.synchronize()
        prof.disable()
        took = time.perf_counter() - t0
        t0 = time.perf_counter()
        recipe.train_step(active, 10_001)
        torch.cuda.synchronize()
        replay = time.perf_counter() - t0
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(45)
    stats = io.StringIO()
    pstats.Stats(prof, stream=stats).sort_stats("tottime").print_stats(30)
    (out / "capture_profile.txt").write_text(text.getvalue() + "\n\n" + stats.getvalue())
    return {"capture_step_ms": took * 1e3, "replay_after_ms": replay * 1e3, "how": recipe.graphs.last_run}


def _kernel_rows(kernels: list, steps: int) -> list[dict]:
    """Per kernel name (cut to 90 characters): its GPU time and launches per step, and the
    mean time of one launch."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    return [{"kernel": name, "ms_per_step": sum(t) / 1e3 / steps, "launches_per_step": len(t) / steps,
             "us_each": sum(t) / len(t)} for name, t in by_name.items()]


def _kernels_by_launches(kernels: list, steps: int, top: int = 40) -> list[dict]:
    """The kernels launched most per step: where a step's fixed cost, its count of launches,
    comes from."""
    return sorted(_kernel_rows(kernels, steps), key=lambda r: -r["launches_per_step"])[:top]


def _top_kernels(kernels: list, steps: int, top: int = 25) -> list[dict]:
    """The kernels with the most GPU time per step."""
    return sorted(_kernel_rows(kernels, steps), key=lambda r: -r["ms_per_step"])[:top]


if __name__ == "__main__":
    raise SystemExit(main())
