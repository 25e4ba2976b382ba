"""How long the GPU waits for the host between a job's replayed steps.

A job's loop replays a step's CUDA graph, waits for it, reads its report, keeps the books
and lays out the next step's batch before it replays again; while the host does all that
the GPU is idle. This times, for a pack on a random-init model, the recipe's own steps
(`PackedLoRARecipe.train_step`, as the job's loop runs them) against the same graph replayed
back to back with nothing between: the difference per step is that idle gap. It also splits
a step's host time into the wait for the GPU and the rest.

    python scripts/step_gap.py --out DIR                       # the first-sweep benchmark's packs
    python scripts/step_gap.py --packs full --varied --out DIR # rows of varied length

Writes DIR/step_gap.json and prints one line per pack.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_packed_step import make_recipe, varied_samples  # noqa: E402

from plora.job.step_settings import CUDA_GRAPHS_ENV as GRAPHS_ENV  # noqa: E402
from plora.models.loading import write_shape_folder  # noqa: E402
from plora.models.shape import ModelShape  # noqa: E402
from plora.train import packed_step  # noqa: E402
from plora.train.heap import frozen_heap  # noqa: E402

#: the first-sweep benchmark's packs: all 16 adapters, then the batch-2 half that trains on
PACKS = {
    "full": ([8, 8, 16, 16, 32, 32, 64, 64] * 2, [4] * 8 + [2] * 8),
    "drain": ([8, 8, 16, 16, 32, 32, 64, 64], [2] * 8),
}


def measure(recipe, steps: int, warmup: int) -> dict:
    """The recipe's steps timed as the job's loop runs them, then its held graph replayed alone."""
    waits: list[float] = []
    read_back = packed_step._read_back

    def timed_read_back(out):
        t0 = time.perf_counter()
        got = read_back(out)
        waits.append(time.perf_counter() - t0)
        return got

    active = list(recipe.runs)
    with frozen_heap():
        for i in range(warmup):
            recipe.train_step(active, i)
        torch.cuda.synchronize()
        packed_step._read_back = timed_read_back
        try:
            t0 = time.perf_counter()
            for i in range(steps):
                recipe.train_step(active, warmup + i)
            torch.cuda.synchronize()
            loop_s = time.perf_counter() - t0
        finally:
            packed_step._read_back = read_back
        held = [h for h in recipe.graphs._held.values() if h.graph is not None]
        graph = held[-1].graph
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        torch.cuda.synchronize()
        replay_s = time.perf_counter() - t0
    loop_ms, replay_ms = loop_s / steps * 1e3, replay_s / steps * 1e3
    wait_ms = sum(waits) / len(waits) * 1e3
    return {"loop_ms": loop_ms, "replay_ms": replay_ms, "gap_ms": loop_ms - replay_ms,
            "host_ms_outside_wait": loop_ms - wait_ms, "wait_ms": wait_ms,
            "wait_ms_median": statistics.median(waits) * 1e3, "last_run": recipe.graphs.last_run}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen2.5-0.5b")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--packs", default="full,drain")
    ap.add_argument("--varied", action="store_true", help="also rows of varied length (seq/8..seq tokens)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("gap-out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("step_gap.py times replayed CUDA graphs: it needs a GPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ[GRAPHS_ENV] = "on"
    shape = ModelShape.preset(args.shape)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_shape_folder(shape, Path(tmp) / "model")
        for name in args.packs.split(","):
            ranks, sizes = PACKS[name]
            for varied in ([False, True] if args.varied else [False]):
                recipe = make_recipe(model_dir, Path(tmp) / f"out-{name}-{varied}", ranks, sizes, args.seq, args.dtype)
                if varied:
                    recipe.rows.samples = varied_samples(512, args.seq, shape.vocab, 48)
                row = {"pack": name, "varied": varied, "adapters": len(ranks), "rows": sum(sizes),
                       **measure(recipe, args.steps, args.warmup)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                del recipe
                torch.cuda.empty_cache()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": args.shape, "rows": rows}
    (args.out / "step_gap.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
